# One command for the demo, one for the tests. Both build .venv on their own.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test plan bench venv clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch first, so the dependency range never pulls a CUDA build
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvxferd demo

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

plan: $(STAMP)
	$(VENV)/bin/kvxferd plan --prefill configs/models/llama-3.1-8b.tp2.json --decode configs/models/llama-3.1-8b.tp1.json

bench: $(STAMP)
	$(VENV)/bin/kvxferd bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis

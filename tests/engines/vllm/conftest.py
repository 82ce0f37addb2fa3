"""The vLLM tests run in their own venv (`make test-vllm`); elsewhere they are skipped whole."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

pytest.importorskip("vllm", reason="vLLM is installed in .venv-vllm only: run `make test-vllm`")

# helpers beside these tests, and the project's e2e helpers one level up
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[2]))

"""SGLang adapter tests: run in .venv-sglang (``make test-sglang``), never in the main suite.

The import-only torchvision stand-in (see shims/torchvision/__init__.py for why) goes on
sys.path before anything imports sglang. SGLang's plugins are loaded the way its
scheduler does (``load_plugins()``), through kvxferd's installed entry point.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest

SHIMS = str(Path(__file__).parent / "shims")
if SHIMS not in sys.path:
    sys.path.insert(0, SHIMS)

warnings.filterwarnings("ignore", message="Only CUDA")  # sglang's quantization modules, at import
warnings.filterwarnings("ignore", message="Triton is not supported")

sglang = pytest.importorskip("sglang", reason="run these in .venv-sglang: make test-sglang")

from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()

from e2e_util import Node, module_cluster  # noqa: E402
from transport_util import ONLY_NIXL  # noqa: E402

# a prefill rank retries its bootstrap registration this long (SGLang starts the server beside it)
os.environ.setdefault("KVXFERD_SGLANG_BOOTSTRAP_WAIT_S", "5")
os.environ.setdefault("KVXFERD_SGLANG_CALL_TIMEOUT_S", "2")


@pytest.fixture(scope="module")
def cluster(request):
    """A prefill daemon and a decode daemon, real processes on loopback, shared by a module."""
    yield from module_cluster(request, "pd", "dd")


@pytest.fixture(scope="module")
def nixl_cluster(request):
    """The same two daemons accepting NIXL alone, for the modules whose transfers run on each
    transport (``transport_util.daemons``); started only where a test asks for them."""
    yield from module_cluster(request, Node("pd", env=ONLY_NIXL), Node("dd", env=ONLY_NIXL))


@pytest.fixture(autouse=True)
def no_shm_leak():
    """Every shared-memory file a test made is gone when it ends."""
    before = {p for p in os.listdir("/dev/shm") if p.startswith("kvxferd-sglang")}
    yield
    after = {p for p in os.listdir("/dev/shm") if p.startswith("kvxferd-sglang")}
    assert after <= before, f"shared-memory files left behind: {sorted(after - before)}"


@pytest.fixture(scope="session")
def gloo():
    """A one-process gloo group, so SGLang's own poll reducers (poll_and_all_reduce*) run."""
    import torch.distributed as dist

    from kvxferd.tools.sim import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()

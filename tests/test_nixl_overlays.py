"""A rank whose regions lie over each other (vLLM's hybrid models: the sliding-window group
reuses the full-attention group's memory) registers with NIXL and leaves again without harm.

NIXL's deregistration of a range registered twice in one call crashes the process; the
transport registers each range once. Run in a child process, so a crash shows as its exit
status, not as the end of the test run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nixl_util import NIXL_MISSING
from transport_util import ONLY_NIXL

SCRIPT = r"""
from types import SimpleNamespace
import torch
from kvxferd.lifecycle.inbox import Inbox
from kvxferd.transport.nixl.transport import NixlTransport

t = NixlTransport("overlay", Inbox(lambda entry: None), timeout_s=5, max_header_bytes=1 << 16)
full = torch.zeros(1 << 16, dtype=torch.uint8)
regions = {(layer, kind): SimpleNamespace(flat=full, nbytes=full.numel(), layer=layer, kind=kind)
           for layer in range(2) for kind in ("kv", "swa0.kv")}  # every region the same memory
rank = SimpleNamespace(id="hybrid/tp0/pp0", role="prefill", regions=regions)  # registered whatever engine memory says
t.register_rank(rank)
assert t.registrations()
t.deregister_rank(rank)
t.close()
print("clean")
"""


def test_a_rank_whose_regions_overlay_registers_and_leaves_nixl_cleanly():
    if NIXL_MISSING:
        pytest.skip(f"NIXL unusable here: {NIXL_MISSING}")
    import os
    env = {**os.environ, **{k: v for k, v in ONLY_NIXL.items() if k.startswith("UCX_")}}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("clean"), (out.returncode, out.stderr[-2000:])

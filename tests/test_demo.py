"""`kvxferd demo`, the README's main command, end to end as a real command."""

from __future__ import annotations

import json
import subprocess
import sys

from pathlib import Path

import pytest

from nixl_util import NIXL_MISSING


#: every transport and mode docs/TESTING.md documents for `kvxferd demo` (local copies are always
#: direct, so `--transport local --mode staged` is refused: its own test below)
TRANSPORTS = ("local", "tcp", "nixl")
MODES = ("auto", "direct", "staged")
COMBINATIONS = [pytest.param(t, m, marks=pytest.mark.skipif(t == "nixl" and bool(NIXL_MISSING),
                                                            reason=f"NIXL: {NIXL_MISSING}"))
                for t in TRANSPORTS for m in MODES if (t, m) != ("local", "staged")]


def test_the_combinations_are_the_documented_ones():
    """The demo test runs what docs/TESTING.md documents: a transport or mode added there is run here."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "TESTING.md").read_text()
    assert f"kvxferd demo --transport {'|'.join(TRANSPORTS)} --mode {'|'.join(MODES)}" in text


@pytest.mark.parametrize("transport, mode", COMBINATIONS)
def test_demo_verifies_every_request(transport, mode):
    out = subprocess.run([sys.executable, "-m", "kvxferd", "demo", "--requests", "5", "--transport", transport,
                          "--mode", mode, "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["requests"] == 5 and summary["failed"] == 0 and summary["verified"] is True
    assert summary["bytes"] > 0 and summary["seconds"] > 0
    # the bytes the prefill daemon reports sending are exactly the requests' KV bytes
    assert summary["bytes_by_transport"] == {transport: float(summary["bytes"])}
    # the daemons' own figures, from their metrics, apart from the oracle's time
    daemon, oracle = summary["daemon"], summary["oracle"]
    assert daemon["sent_bytes"] == float(summary["bytes"]) and daemon["requests"] == 5
    assert daemon["chunks"] >= 5 * 2 and daemon["chunk_s"] > 0  # two prefill ranks write every request
    assert daemon["gbps_per_thread"] > 0 and daemon["chunk_p50_ms_le"] <= daemon["chunk_p99_ms_le"]
    assert oracle["fill_s"] > 0 and oracle["check_s"] > 0
    chunks = summary["chunks_by_transport_mode_why"]
    assert sum(chunks.values()) == daemon["chunks"]
    if mode != "auto":  # an explicit mode is honoured for every chunk of host memory
        assert summary["bytes_by_transport_mode"] == {f"{transport}/{mode}": float(summary["bytes"])}
        assert {k for k, v in chunks.items() if v} == {f"{transport}/{mode}/plan"}


def test_local_staged_is_refused_naming_the_fix():
    out = subprocess.run([sys.executable, "-m", "kvxferd", "demo", "--requests", "1", "--transport", "local",
                          "--mode", "staged"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "local copies are always direct" in out.stderr and "--mode direct or auto" in out.stderr

"""`kvxferd demo`, the README's main command, end to end as a real command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nixl_util import NIXL_MISSING


@pytest.mark.parametrize("transport, mode", [
    ("tcp", "auto"), ("local", "direct"),
    pytest.param("nixl", "staged", marks=pytest.mark.skipif(bool(NIXL_MISSING), reason=f"NIXL: {NIXL_MISSING}"))])
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
    if mode != "auto":
        assert summary["bytes_by_transport_mode"] == {f"{transport}/{mode}": float(summary["bytes"])}

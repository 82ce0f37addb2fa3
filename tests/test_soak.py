"""``kvxferd soak``, CI-sized: the real command, its invariants read from its JSON summary.

A short soak (75 s, a third of it warm-up: about 90 s in all with its start and settling, so
it fits the suite's CI budget) with every pair losing an engine rank mid-request
and the prefill daemon SIGKILLed and restarted once, over tcp and NIXL (NIXL where it starts
here). The test reads the figures and checks them itself rather than trusting the
summary's verdict: every request terminal, every done request byte-exact, nothing written
outside a destination, and each daemon's counts back to the baseline. No wall-clock figure
is asserted. (Stopped by SIGTERM, or killed by SIGKILL, the soak leaves no process and no
file behind: tests/test_tool_signals.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvxferd.tools.soak import EXACT, TOLERANCES

DURATION_S = 75
WARMUP_S = 25


def _exact(value):
    """NIXL registrations of staging slots stay with the pool (bounded): not compared."""
    return {k: v for k, v in value.items() if k != "staging_slots"} if isinstance(value, dict) else value


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    out = tmp_path_factory.mktemp("soak") / "soak.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVXFERD_")}
    proc = subprocess.run([sys.executable, "-m", "kvxferd", "soak", "--duration", str(DURATION_S),
                           "--warmup", str(WARMUP_S), "--kill-rate", "1", "--pairs", "1", "--json", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    result["_rc"] = proc.returncode
    result["_stdout"] = proc.stdout
    return result


@pytest.mark.timeout(1000)
def test_every_request_ends_and_every_done_request_is_byte_exact(summary):
    req = summary["requests"]
    assert req["issued"] > req["issued_in_warmup"] > 0, req  # traffic before and after the baseline
    assert req["terminal"] == req["issued"] == sum(req["by_outcome"].values()), req
    assert req["done_verified"] == req["by_outcome"].get("done", 0) > 0, req
    assert summary["wrong_bytes"] == 0 and summary["bytes_outside_destinations"] == 0, summary["violations"]
    assert req["chunked"] > 0 and req["tp_mismatched"] > 0, req
    # the faults happened: engine ranks killed mid-request, the prefill daemon a new process
    assert summary["engine_kills"] > 0
    assert any(k.startswith("engine_killed:") for k in req["by_outcome"]), req["by_outcome"]
    restart = summary["daemon_restart"]
    assert restart["old_incarnation"] != restart["new_incarnation"], restart
    # both transports carried bytes after the restart (NIXL where it starts here; the summary says which)
    assert summary["sent_bytes_since_restart_by_transport"].get("tcp", 0) > 0
    if summary["nixl"] == "used":
        assert summary["sent_bytes_since_restart_by_transport"].get("nixl", 0) > 0
        assert req["by_transport"]["nixl"].get("done", 0) > 0
    else:
        assert summary["nixl"].startswith("skipped"), summary["nixl"]


@pytest.mark.timeout(1000)
def test_daemons_are_back_to_their_baseline(summary):
    for name, d in summary["daemons"].items():
        b, e = d["baseline"], d["end"]
        assert e["kv_cache_maps"] == 0, (name, e["kv_cache_mapped"])  # no departed engine's cache stays mapped
        assert e["requests"] == {} and e["ranks"] == 0 and e["inflight_metric"] == 0, (name, e)
        for key in EXACT:
            assert _exact(e[key]) == _exact(b[key]), (name, key, b[key], e[key])
        for key, (slack, _why) in TOLERANCES.items():
            assert e[key] <= b[key] + slack, (name, key, b[key], e[key])
        assert e["peers"] == b["peers"], (name, b["peers"], e["peers"])
    assert summary["violations"] == [] and summary["ok"] and summary["_rc"] == 0, summary["violations"]


@pytest.mark.timeout(1000)
def test_nothing_of_the_run_is_left(summary):
    run_dir = summary["run_dir"]
    assert not Path(run_dir).exists()
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if run_dir.encode() in cmdline.read_bytes():
                left.append(cmdline.parent.name)
        except OSError:
            continue
    assert not left, f"processes of the soak's run dir still running: {left}"

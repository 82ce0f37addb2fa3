"""``kvxferd bench --quick --json`` runs end to end and reports a well-formed result.

Only the shape is checked (keys, types, the verified flag), never a speed: speeds depend
on the machine and on whatever else runs on it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# generous bounds: the bench must finish on a slow, busy machine too (they catch hangs, not slowness)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

RATIO_KEYS = ("tcp_vs_socket", "local_vs_memcpy", "tp_mismatch_vs_matched", "nixl_vs_raw_nixl",
              "vs_nixl_ucx_tcp", "vs_mooncake_tcp")


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@pytest.fixture(scope="module")
def report() -> dict:
    proc = subprocess.run([sys.executable, "-m", "kvxferd", "bench", "--quick", "--json"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"bench exited {proc.returncode}\n{proc.stderr[-3000:]}"
    assert proc.stderr.strip(), "progress lines are expected on stderr"
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, f"--json prints exactly one JSON object, got {len(lines)} lines"
    return json.loads(lines[0])


def test_top_level_shape(report: dict) -> None:
    assert report["verified"] is True
    assert report["quick"] is True
    assert isinstance(report["rows"], list) and report["rows"]
    assert isinstance(report["ratios"], dict)
    assert isinstance(report["targets"], list)
    assert isinstance(report["machine"]["cores"], int)


def test_rows(report: dict) -> None:
    groups = set()
    for row in report["rows"]:
        assert isinstance(row["name"], str) and row["name"]
        groups.add(row["group"])
        if row.get("skipped") is not None:
            assert isinstance(row["skipped"], str) and row["skipped"], row
            continue
        measured = [k for k in ("gbps", "p50_ms", "requests_per_s", "ms") if row.get(k) is not None]
        assert measured, f"row {row['name']!r} has no measurement and no skip reason"
        for k in measured:
            assert _number(row[k]) and row[k] > 0, (row["name"], k, row[k])
        if row.get("p50_ms") is not None:
            assert _number(row["p99_ms"]) and row["p99_ms"] >= row["p50_ms"]
        if row["group"] in ("kvxferd", "latency", "rate"):
            assert row["verified"] is True, row
            assert row["transport"] in ("local", "tcp", "nixl")
            assert row["mode"] in ("direct", "staged")
        if row["group"] == "kvxferd":
            assert _number(row["gbps"]) and _number(row["bytes"])
    assert {"limit", "kvxferd", "latency", "rate", "planner", "peer"} <= groups
    transports = {(r["transport"], r["mode"]) for r in report["rows"] if r["group"] == "kvxferd"}
    assert {("local", "direct"), ("tcp", "direct"), ("tcp", "staged")} <= transports


def test_ratios_and_targets(report: dict) -> None:
    ratios = report["ratios"]
    for key in RATIO_KEYS:
        assert key in ratios, key
        assert ratios[key] is None or (_number(ratios[key]) and ratios[key] > 0), (key, ratios[key])
    for key in ("tcp_vs_socket", "local_vs_memcpy", "tp_mismatch_vs_matched"):
        assert _number(ratios[key]), f"{key} should be measured in the quick run"
    for t in report["targets"]:
        assert set(t) >= {"target", "value", "goal", "met"}
        assert t["met"] in (True, False, None)


@pytest.mark.parametrize("engine", ["nixl", "mooncake"])
def test_peer_engine_rows_move_verified_bytes_where_installed(engine: str) -> None:
    """The peer rows the ratios compare against run for real (the target checks every byte)."""
    from kvxferd import bench

    gbps, why = (bench.nixl_raw if engine == "nixl" else bench.mooncake_tcp)(4 << 20, 1)
    if why == "not installed":
        pytest.skip(f"{engine} is not installed here (make venv installs it)")
    if why and "libibverbs" in why:
        pytest.skip(f"{engine} cannot load the system library libibverbs1 ({why}); .ci/run installs it")
    assert why is None, why
    assert _number(gbps) and gbps > 0

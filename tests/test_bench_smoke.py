"""``kvxferd bench --smoke --json --plot``: the bench's machinery end to end, a well-formed
result, a plot of every target, and the same plot and table again from the saved run.

Only the shape is checked (keys, types, the verified flag, what the plot draws), never a
speed: speeds depend on the machine and on whatever else runs on it. The smoke run's
payloads are far below steady state, so it must give no throughput ratio; the rules that
give ratios at steady state are checked on made-up rows in tests/test_bench_report.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

# generous bounds: the bench must finish on a slow, busy machine too (they catch hangs, not slowness)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RATIO_KEYS = ("tcp_vs_socket", "tcp_vs_socket_streams", "local_vs_memcpy", "local_vs_shm_copy",
              "tp_mismatch_vs_matched", "tp_mismatch_vs_matched_local", "nixl_sliced_vs_matched",
              "nixl_vs_raw_nixl", "vs_nixl_ucx_tcp", "vs_mooncake_tcp")
SVG = "{http://www.w3.org/2000/svg}"


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvxferd", "bench", *args], capture_output=True, text=True,
                          timeout=800)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory holding the run's JSON (run.json) and plot (run.svg)."""
    d = tmp_path_factory.mktemp("bench")
    proc = bench("--smoke", "--json", "--plot", str(d / "run.svg"))
    assert proc.returncode == 0, f"bench exited {proc.returncode}\n{proc.stderr[-3000:]}"
    assert proc.stderr.strip(), "progress lines are expected on stderr"
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, f"--json prints exactly one JSON object, got {len(lines)} lines"
    (d / "run.json").write_text(lines[0])
    return d


@pytest.fixture(scope="module")
def report(saved: Path) -> dict:
    return json.loads((saved / "run.json").read_text())


def test_top_level_shape(report: dict) -> None:
    assert report["verified"] is True
    assert report["size"] == "smoke" and report["quick"] is True
    assert isinstance(report["rows"], list) and report["rows"]
    assert isinstance(report["ratios"], dict)
    assert isinstance(report["targets"], list) and report["targets"]
    assert isinstance(report["machine"]["cores"], int)


def test_latency_rows_break_down_by_hop(report: dict) -> None:
    """Each latency row carries the medians of its hops, stamped by the engine and both daemons
    on one clock; the hops on the way to the decode engine's event follow one another causally
    (each stamp is taken after the one before it happened), so none is negative."""
    from kvxferd.tools.bench.hops import CRITICAL, SEGMENTS
    rows = [r for r in report["rows"] if r["group"] == "latency" and not r.get("skipped")]
    assert rows, "the smoke run has a latency row"
    for row in rows:
        hops = row["extra"]["hops_us"]
        assert hops["requests"] >= 1, row["name"]
        for name, _a, _b in SEGMENTS[:CRITICAL]:
            assert _number(hops[name]) and hops[name] >= 0, (row["name"], name, hops)


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
            assert row["extra"]["checked_requests"] >= 1  # the oracle compared some requests' bytes
        if row["group"] == "kvxferd":
            assert _number(row["gbps"]) and _number(row["bytes"])
            # read from the source daemon's chunk counters: its chunks moved on the row's transport
            assert row["extra"]["moved"].split("/")[0] == row["transport"], row
            assert _number(row["extra"]["fragments_per_chunk"]) and row["extra"]["fragments_per_chunk"] >= 1, row
        if row["group"] == "kvxferd" and row["extra"].get("integrity"):  # its plain rounds ran between
            assert _number(row["extra"]["gbps_off"]) and len(row["extra"]["vs_off_rounds"]) >= 1, row
            assert row["extra"]["integrity_checked_chunks"] >= row["requests"], row  # its checked rounds were
    assert {"limit", "kvxferd", "latency", "rate", "planner", "peer"} <= groups
    assert any(r["extra"].get("integrity") == "full" for r in report["rows"] if r["group"] == "kvxferd")
    transports = {(r["transport"], r["mode"]) for r in report["rows"] if r["group"] == "kvxferd"}
    assert {("local", "direct"), ("tcp", "direct"), ("tcp", "staged")} <= transports


def test_no_ratio_below_steady_state(report: dict) -> None:
    """Smoke payloads are 8 MiB: no ratio to a limit, and each row and target says why."""
    assert set(RATIO_KEYS) <= set(report["ratios"])
    assert all(report["ratios"][k] is None for k in RATIO_KEYS), report["ratios"]
    for row in report["rows"]:
        if row["group"] == "kvxferd" and not row.get("skipped"):
            assert row["vs_limit"] is None and "below" in row["extra"]["no_ratio"], row
    for t in report["targets"]:
        assert set(t) >= {"target", "value", "goal", "met", "goal_value", "higher_is_better", "unit"}
        if t["value"] is None:
            assert t["met"] is None and t["note"], t
        else:
            assert t["met"] is (t["value"] >= t["goal_value"] if t["higher_is_better"] else
                                t["value"] <= t["goal_value"]), t
    measured = {t["target"].split(" (")[0] for t in report["targets"] if t["value"] is not None}
    assert {"one_page_p50_over_wire_ms", "one_page_p99_over_p50", "small_requests_per_s",
            "daemon_cpu_us_per_request", "plan_128k_ms"} <= measured


def test_plot_draws_every_target(report: dict, saved: Path) -> None:
    root = ET.parse(saved / "run.svg").getroot()
    assert root.tag == f"{SVG}svg"
    texts = [t.text or "" for t in root.iter(f"{SVG}text")]
    bars = [r for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    for t in report["targets"]:
        assert t["target"] in texts, t["target"]
    assert len(bars) == sum(t["value"] is not None for t in report["targets"])
    assert sum(x.startswith("n/a") for x in texts) == sum(t["value"] is None for t in report["targets"])
    colors = {"#2e7d32": True, "#c62828": False}
    drawn = [colors[b.get("fill")] for b in bars]
    assert drawn == [t["met"] for t in report["targets"] if t["value"] is not None]


def test_saved_run_prints_and_plots_the_same(report: dict, saved: Path) -> None:
    again = saved / "again.svg"
    proc = bench("--from-json", str(saved / "run.json"), "--plot", str(again))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert again.read_bytes() == (saved / "run.svg").read_bytes()
    for row in report["rows"]:
        assert row["name"] in proc.stdout
    assert "bytes verified: yes" in proc.stdout


def test_plot_refuses_a_format_it_cannot_write(saved: Path) -> None:
    proc = bench("--from-json", str(saved / "run.json"), "--plot", str(saved / "run.png"))
    assert proc.returncode == 2 and ".svg" in proc.stderr
    assert not (saved / "run.png").exists()


@pytest.mark.parametrize("engine", ["nixl", "mooncake"])
def test_peer_engine_rows_move_verified_bytes_where_installed(engine: str) -> None:
    """The peer rows the ratios compare against run for real (the target checks every byte)."""
    from kvxferd.tools.bench import peers

    gbps, why = (peers.nixl_raw if engine == "nixl" else peers.mooncake_tcp)(4 << 20, 1)
    if why == "not installed":
        pytest.skip(f"{engine} is not installed here (make venv installs it)")
    if why and "libibverbs" in why:
        pytest.skip(f"{engine} cannot load the system library libibverbs1 ({why}); .ci/run installs it")
    assert why is None, why
    assert _number(gbps) and gbps > 0

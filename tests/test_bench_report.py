"""The bench's ratio and target rules and its plot, on made-up rows (no processes, no timing).

A ratio to a limit is given only for payloads that reach steady state, is the kvxferd
figure over the limit measured for it, and a target is met on the side its goal says.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from kvxferd.tools.bench.model import MiB, STEADY_BYTES, TARGETS, Row, Workload
from kvxferd.tools.bench.plot import render_svg, share_of_goal
from kvxferd.tools.bench.report import compute, render_table, targets_report
from kvxferd.tools.bench.scenarios import build_scenarios, headline_workload, tp_workloads


def _rows(wl: Workload, tp: list[Workload], gbps: dict[str, float]) -> list[Row]:
    n = wl.nbytes
    rows = [Row("limit memcpy", "limit", bytes=n, gbps=20.0, extra={"limit": "memcpy"}),
            Row("limit socket", "limit", bytes=n, gbps=4.0, extra={"limit": "socket"}),
            Row("local direct", "kvxferd", bytes=n, gbps=gbps["local"], verified=True, transport="local",
                mode="direct", workload=wl.label, extra={"adjacent_limit_gbps": 16.0}),
            Row("tcp direct", "kvxferd", bytes=n, gbps=gbps["tcp"], verified=True, transport="tcp", mode="direct",
                workload=wl.label)]
    for w, v in zip(tp[1:], (gbps["tp21"], gbps["tp12"])):
        rows.append(Row(f"tcp direct {w.label}", "kvxferd", bytes=w.nbytes, gbps=v, verified=True, transport="tcp",
                        mode="direct", workload=w.label))
    return rows


def test_quick_sizes_reach_steady_state_and_smoke_sizes_do_not():
    for size, steady in (("quick", True), ("full", True), ("smoke", False)):
        throughput = [s for s in build_scenarios(size) if s.kind == "throughput"]
        assert throughput
        assert all((s.workload.nbytes >= STEADY_BYTES) is steady for s in throughput), size
        assert (headline_workload(size).nbytes >= STEADY_BYTES) is steady


def test_ratios_at_steady_state_read_the_limit_measured_for_the_row():
    wl = headline_workload("quick")
    tp = tp_workloads("quick")
    ratios = compute(_rows(wl, tp, {"local": 8.0, "tcp": 3.0, "tp21": 2.7, "tp12": 2.4}), wl, tp)
    assert ratios["local_vs_memcpy"] == 0.5  # over the adjacent 16 GB/s, not the 20 of the limit row
    assert ratios["tcp_vs_socket"] == 0.75
    assert ratios["tp_mismatch_vs_matched"] == 0.8  # the slower mismatched plan, 2.4 / 3.0
    assert ratios["tcp_vs_socket_streams"] is None  # 128 MiB: below the multi-stream comparison's sizes


def test_small_payloads_give_no_ratio_and_say_why():
    wl = Workload("8B", 64)
    assert wl.nbytes == 8 * MiB
    tp = tp_workloads("smoke")
    rows = _rows(wl, tp, {"local": 8.0, "tcp": 3.0, "tp21": 2.7, "tp12": 2.4})
    ratios = compute(rows, wl, tp)
    assert ratios["local_vs_memcpy"] is None and ratios["tcp_vs_socket"] is None
    assert ratios["tp_mismatch_vs_matched"] is None
    assert all(r.vs_limit is None and "below" in r.extra["no_ratio"] for r in rows if r.group == "kvxferd")
    assert "n/a (small)" in render_table(rows)
    local = [t for t in targets_report(rows, ratios) if t["target"].startswith("local_vs_memcpy")]
    assert local and all(t["value"] is None and t["met"] is None and "below" in t["note"] for t in local)


def test_one_request_targets_read_the_round_trip_of_the_same_bytes_and_the_daemons_cpu():
    """A tcp latency row is read beyond the raw round trip of its own payload, a local one beyond
    nothing; without that round trip the target says so instead of reading the wrong one."""
    rows = [Row("limit tcp round trip 8 KiB", "limit", bytes=8 * 1024, p50_ms=0.02, p99_ms=0.05,
                extra={"limit": "round_trip"}),
            Row("limit tcp round trip 2 MiB", "limit", bytes=2 * MiB, p50_ms=0.3, p99_ms=0.7,
                extra={"limit": "round_trip"}),
            Row("latency 1 page tcp tiny", "latency", bytes=8 * 1024, p50_ms=0.9, p99_ms=1.8, transport="tcp",
                workload="tiny 16"),
            Row("latency 1 page tcp 8B", "latency", bytes=2 * MiB, p50_ms=0.7, p99_ms=2.8, transport="tcp",
                workload="8B 16"),
            Row("latency 1 page tcp 70B", "latency", bytes=5 * MiB, p50_ms=0.4, p99_ms=0.5, transport="tcp",
                workload="70B 16"),
            Row("latency 1 page local tiny", "latency", bytes=8 * 1024, p50_ms=0.45, p99_ms=0.6, transport="local",
                workload="tiny 16"),
            Row("small requests tcp tiny batch client", "rate", requests_per_s=3400.0, transport="tcp",
                extra={"client": "batch", "daemon_cpu_ms_per_request": 0.344}),
            Row("small requests local tiny sync client", "rate", requests_per_s=1300.0, transport="local",
                extra={"client": "sync"})]
    got = {t["target"]: t for t in targets_report(rows, {})}
    assert got["one_page_p50_over_wire_ms (tcp, tiny)"]["value"] == 0.88
    assert got["one_page_p50_over_wire_ms (tcp, tiny)"]["met"] is False
    assert got["one_page_p50_over_wire_ms (tcp, 8B)"]["value"] == 0.4
    assert got["one_page_p50_over_wire_ms (tcp, 8B)"]["met"] is True
    no_trip = got["one_page_p50_over_wire_ms (tcp, 70B)"]
    assert no_trip["value"] is None and no_trip["met"] is None and "5 MiB" in no_trip["note"]
    assert got["one_page_p50_over_wire_ms (local, tiny)"]["value"] == 0.45
    assert got["one_page_p99_over_p50 (tcp, 8B)"]["value"] == 4.0
    assert got["one_page_p99_over_p50 (tcp, 8B)"]["met"] is False
    assert got["one_page_p99_over_p50 (tcp, tiny)"]["met"] is True
    cpu = got["daemon_cpu_us_per_request (tcp pair, batch client)"]
    assert cpu["value"] == 344 and cpu["met"] is False and cpu["goal"] == "<= 200 us"
    assert got["daemon_cpu_us_per_request (one daemon, sync client)"]["value"] is None
    assert got["small_requests_per_s (tcp pair, batch client)"]["met"] is False


@pytest.mark.parametrize("name, value, met, share", [
    ("tcp_vs_socket", 0.95, True, 0.95 / 0.9), ("tcp_vs_socket", 0.5, False, 0.5 / 0.9),
    ("one_page_p50_over_wire_ms", 0.25, True, 2.0), ("one_page_p50_over_wire_ms", 2.0, False, 0.25),
    ("daemon_cpu_us_per_request", 400.0, False, 0.5),
    ("small_requests_per_s_pair", 1000.0, False, 0.2)])
def test_targets_are_met_on_the_side_their_goal_says(name, value, met, share):
    t = TARGETS[name]
    assert t.met(value) is met
    entry = {"target": name, "value": value, "goal": t.describe(), "met": t.met(value), "goal_value": t.goal,
             "higher_is_better": t.higher_is_better, "unit": t.unit}
    assert share_of_goal(entry) == pytest.approx(share)


def test_plot_has_one_bar_per_measured_target_and_a_note_for_the_others():
    targets = [{"target": "a > b", "value": 2.0, "goal": ">= 1x", "met": True, "goal_value": 1.0,
                "higher_is_better": True, "unit": "x"},
               {"target": "latency", "value": 9.0, "goal": "<= 1 ms", "met": False, "goal_value": 1.0,
                "higher_is_better": False, "unit": "ms"},
               {"target": "ratio", "value": None, "goal": ">= 1x", "met": None, "goal_value": 1.0,
                "higher_is_better": True, "unit": "x", "note": "payload below 128 MiB"}]
    svg = render_svg({"targets": targets, "machine": {"cores": 2, "cpu": "x"}, "verified": True, "size": "quick"})
    assert svg == render_svg({"targets": targets, "machine": {"cores": 2, "cpu": "x"}, "verified": True,
                              "size": "quick"})
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    bars = [r for r in root.iter(f"{ns}rect") if r.find(f"{ns}title") is not None]
    assert [b.get("fill") for b in bars] == ["#2e7d32", "#c62828"]
    widths = [float(b.get("width")) for b in bars]
    assert widths[0] > widths[1] > 0  # 2x the goal against 1/9 of it
    texts = [t.text for t in root.iter(f"{ns}text")]
    assert "a > b" in texts and "n/a: payload below 128 MiB" in texts


def test_a_tcp_latency_row_reads_the_raw_round_trip_of_its_own_payload():
    page, tiny = 2 * MiB, 8192
    rows = [Row("limit tcp round trip 2 procs 2 MiB", "limit", bytes=page, p50_ms=1.5, p99_ms=2.0,
                extra={"limit": "round_trip"}),
            Row("limit tcp round trip 2 procs 8 KiB", "limit", bytes=tiny, p50_ms=0.05, p99_ms=0.1,
                extra={"limit": "round_trip"}),
            Row("latency 1 page tcp 8B", "latency", bytes=page, p50_ms=3.0, p99_ms=5.0, transport="tcp",
                verified=True),
            Row("latency 1 page tcp tiny", "latency", bytes=tiny, p50_ms=0.5, p99_ms=1.0, transport="tcp",
                verified=True),
            Row("latency 1 page local 8B", "latency", bytes=page, p50_ms=1.0, p99_ms=2.0, transport="local",
                verified=True)]
    compute(rows, Workload("8B", 1024), tp_workloads("quick"))
    assert (rows[2].vs_limit, rows[2].limit) == (0.5, "round trip")  # 1.5 ms raw over 3.0 ms
    assert rows[3].vs_limit == 0.1
    assert rows[4].vs_limit is None  # no socket in a local request
    assert "0.50 round trip" in render_table(rows)


def test_a_row_with_integrity_on_is_read_against_the_same_row_off_and_never_as_the_headline():
    wl = headline_workload("quick")
    tp = tp_workloads("quick")
    rows = _rows(wl, tp, {"local": 8.0, "tcp": 3.0, "tp21": 2.7, "tp12": 2.4})
    rows.append(Row("tcp direct integrity full", "kvxferd", bytes=wl.nbytes, gbps=2.4, verified=True, transport="tcp",
                    mode="direct", workload=wl.label, extra={"integrity": "full"}))
    rows.append(Row("local direct integrity full", "kvxferd", bytes=wl.nbytes, gbps=9.0, verified=False,
                    transport="local", mode="direct", workload=wl.label, extra={"integrity": "full"}))
    rows.append(Row("tcp direct integrity sampled", "kvxferd", bytes=wl.nbytes, gbps=2.7, verified=True,
                    transport="tcp", mode="direct", workload=wl.label, extra={"integrity": "sampled"}))
    ratios = compute(rows, wl, tp)
    assert ratios["tcp_vs_socket"] == 0.75  # the plain row's 3.0 over the socket's 4.0, not the checked row's
    got = {t["target"]: t for t in targets_report(rows, ratios)}
    tcp = got[f"integrity_full_vs_off (tcp direct {wl.label})"]
    assert tcp["value"] == 0.8 and tcp["met"] is True and tcp["goal"] == ">= 0.75x"
    local = got[f"integrity_full_vs_off (local direct {wl.label})"]  # its bytes were not verified: no figure
    assert local["value"] is None and local["met"] is None and "verified" in local["note"]
    sampled = got[f"integrity_sampled_vs_off (tcp direct {wl.label})"]  # its own, stricter goal
    assert sampled["value"] == 0.9 and sampled["met"] is False and sampled["goal"] == ">= 0.95x"


def test_a_row_whose_plain_rounds_ran_between_its_checked_ones_reads_against_them():
    """An integrity row that ran its plain rounds on the same daemons between its checked ones
    reads its throughput over theirs, not its best round against another row's; below steady
    state it reads nothing."""
    wl = headline_workload("quick")
    tp = tp_workloads("quick")
    rows = _rows(wl, tp, {"local": 8.0, "tcp": 3.0, "tp21": 2.7, "tp12": 2.4})
    rows.append(Row("tcp direct integrity full", "kvxferd", bytes=wl.nbytes, gbps=2.4, verified=True, transport="tcp",
                    mode="direct", workload=wl.label,
                    extra={"integrity": "full", "gbps_off": 2.6, "vs_off_rounds": [0.85, 0.9, 0.95],
                           "vs_off": 0.9}))
    small = Workload("8B", 64)
    rows.append(Row("tcp direct integrity sampled", "kvxferd", bytes=small.nbytes, gbps=2.7, verified=True,
                    transport="tcp", mode="direct", workload=small.label,
                    extra={"integrity": "sampled", "gbps_off": 2.7, "vs_off_rounds": [1.0], "vs_off": 1.0}))
    got = {t["target"]: t for t in targets_report(rows, compute(rows, wl, tp))}
    assert got[f"integrity_full_vs_off (tcp direct {wl.label})"]["value"] == 0.9  # not 2.4 / 3.0
    assert got[f"integrity_sampled_vs_off (tcp direct {small.label})"]["value"] is None


def test_an_integrity_rows_ratio_weighs_every_round_by_its_time():
    """The checked rounds' throughput over the plain rounds' taken whole: 8 requests in 4 s plain
    against 8 in 5 s checked read 0.8, whatever the single rounds read."""
    from kvxferd.tools.bench.engine_layout import Layout, interleaved
    cfg = {"workload": {"model": "8B", "tokens": 64}, "window": 2, "requests": 8, "verify": 1, "tag": "t", "seed": 1}
    got = interleaved(Layout(cfg), plain=[(4, 1.0), (4, 3.0)], checked=[(4, 3.0), (4, 2.0)])
    assert got["vs_off"] == 0.8 and got["vs_off_rounds"] == [0.333, 1.5]
    assert got["gbps_off"] == round(4 / 1.0 * Workload("8B", 64).nbytes / 1e9, 3)

"""From rows to what a reader reads: ratios to limits and peers, targets met or missed, the table.

Pure functions of the rows, so a saved run (``--json``) renders the same as a live one.
"""

from __future__ import annotations

from typing import Any, Callable

from . import hops
from .model import STEADY_BYTES, STREAMS_BYTES, TARGETS, Row, Workload, size_label


def _find_row(rows: list[Row], pred: Callable[[Row], bool]) -> Row | None:
    return next((r for r in rows if pred(r)), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def steady(row: Row) -> bool:
    """Whether a throughput row's payload is large enough for a ratio (:data:`STEADY_BYTES`)."""
    return bool(row.bytes) and row.bytes >= STEADY_BYTES


def _limit_of(row: Row, limits: dict[tuple[Any, Any], float | None], peer_at: Callable[..., float | None]
              ) -> tuple[str, float | None]:
    if row.transport == "nixl":
        return "raw nixl", peer_at("nixl", row.bytes)
    kind = "memcpy" if row.transport == "local" else "socket"
    return kind, row.extra.get("adjacent_limit_gbps") or limits.get((kind, row.bytes))


def _row_ratios(rows: list[Row], limits: dict[tuple[Any, Any], float | None],
                peer_at: Callable[..., float | None]) -> None:
    """``vs_limit`` and ``vs_peer`` of every verified kvxferd row at steady state; the others say why not."""
    peers = [r for r in rows if r.group == "peer" and r.gbps]
    for r in rows:
        if r.group != "kvxferd" or not r.gbps or not r.verified:
            continue
        r.limit, lim = _limit_of(r, limits, peer_at)
        if not steady(r):
            r.extra["no_ratio"] = f"payload {size_label(r.bytes or 0)} is below {size_label(STEADY_BYTES)}"
            continue
        r.vs_limit = _ratio(r.gbps, lim)
        same = [p.gbps for p in peers if p.bytes == r.bytes] or [p.gbps for p in peers]
        r.vs_peer = _ratio(r.gbps, max(same)) if same else None


def _latency_ratios(rows: list[Row]) -> None:
    """A tcp latency row against the raw socket's round trip of the same payload: raw p50 over
    kvxferd's p50 (1.0: as fast as a bare socket; like the throughput ratios, higher is better)."""
    trips = {r.bytes: r for r in rows if r.group == "limit" and r.extra.get("limit") == "round_trip"}
    for r in rows:
        trip = trips.get(r.bytes)
        if r.group == "latency" and r.transport == "tcp" and r.p50_ms and trip is not None and trip.p50_ms:
            r.limit, r.vs_limit = "round trip", round(trip.p50_ms / r.p50_ms, 3)


def _integrity_ratios(rows: list[Row], plain: list[Row]) -> None:
    """A row with integrity on against the same requests with it off: ``extra.vs_integrity_off``,
    its checked rounds' throughput over that of the plain rounds run between them on the same
    daemons (``vs_off``); a row run without them (an older report) reads against the row of the
    same name with integrity off. Absent where either is missing or failed."""
    for r in rows:
        if r.group == "kvxferd" and r.extra.get("integrity") and r.verified and r.gbps:
            if r.extra.get("vs_off") and steady(r):
                r.extra["vs_integrity_off"] = r.extra["vs_off"]
                continue
            same = _find_row(plain, lambda x: (x.transport, x.mode, x.workload) == (r.transport, r.mode, r.workload))
            if same is not None:
                r.extra["vs_integrity_off"] = _ratio(r.gbps, same.gbps)


def compute(rows: list[Row], headline: Workload, tp_workloads: list[Workload]) -> dict[str, Any]:
    """The run's ratios (None where a row is missing, failed, or too small to say)."""
    limits = {(r.extra.get("limit"), r.bytes): r.gbps for r in rows if r.group == "limit"}

    def peer_at(name: str, nbytes: int | None) -> float | None:
        r = _find_row(rows, lambda x: x.group == "peer" and x.extra.get("peer") == name and x.bytes == nbytes)
        return r.gbps if r else None

    _row_ratios(rows, limits, peer_at)
    _latency_ratios(rows)
    ok = [r for r in rows if r.group == "kvxferd" and r.verified and r.gbps and steady(r)
          and not r.extra.get("integrity")]  # the rows with integrity on are read only against their own
    _integrity_ratios(rows, ok)

    def best(transport: str, wl: Workload, mode: str | None = None) -> float | None:
        vals = [r.gbps for r in ok if r.transport == transport and r.workload == wl.label
                and (mode is None or r.mode == mode)]
        return max(vals) if vals else None  # type: ignore[type-var]

    def head(transport: str) -> Row | None:
        return _find_row(ok, lambda r: r.transport == transport and r.mode == "direct" and r.workload == headline.label)

    def tp_ratio(transport: str) -> float | None:
        """The slowest mismatched plan over the matched one (each at its best mode)."""
        matched = [w for w in tp_workloads if w.p_tp == w.d_tp]
        worst = [best(transport, w) for w in tp_workloads if w.p_tp != w.d_tp]
        m = best(transport, matched[0]) if matched else None
        if not m or not worst or any(v is None for v in worst):
            return None
        return _ratio(min(v for v in worst if v is not None), m)

    tcp_row, local_row = head("tcp"), head("local")
    tcp_head = tcp_row.gbps if tcp_row else None
    hb = headline.nbytes
    streams = limits.get(("socket_streams", hb)) if hb >= STREAMS_BYTES else None
    nixl, mooncake = peer_at("nixl", hb), peer_at("mooncake", hb)
    return {
        # against the limit measured right before the scenario (same machine state)
        "tcp_vs_socket": tcp_row.vs_limit if tcp_row else None,
        "tcp_vs_socket_streams": _ratio(tcp_head, streams),
        "local_vs_memcpy": local_row.vs_limit if local_row else None,
        "local_vs_shm_copy": _ratio(local_row.gbps if local_row else None, limits.get(("shm_shared", hb))),
        "tp_mismatch_vs_matched": tp_ratio("tcp"),
        "tp_mismatch_vs_matched_local": tp_ratio("local"),
        "nixl_sliced_vs_matched": tp_ratio("nixl"),
        "nixl_vs_raw_nixl": _ratio(best("nixl", headline), nixl),
        "vs_nixl_ucx_tcp": _ratio(tcp_head, nixl),
        "vs_mooncake_tcp": _ratio(tcp_head, mooncake),
    }


def _target(out: list[dict[str, Any]], key: str, label: str, value: float | None, note: str | None = None) -> None:
    t = TARGETS[key]
    entry = {"target": label, "value": value, "goal": t.describe(), "met": t.met(value), "goal_value": t.goal,
             "higher_is_better": t.higher_is_better, "unit": t.unit}
    if value is None and note:
        entry["note"] = note
    out.append(entry)


def targets_report(rows: list[Row], ratios: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target of the run with its figure: one line each, never asserted."""
    out: list[dict[str, Any]] = []
    steady_note = f"no verified row of {size_label(STEADY_BYTES)} or more"
    tp_note = f"needs the matched and every TP-mismatched row, {size_label(STEADY_BYTES)} or more"
    _target(out, "tcp_vs_socket", "tcp_vs_socket", ratios.get("tcp_vs_socket"), steady_note)
    _target(out, "tcp_vs_socket_streams", "tcp_vs_socket_streams", ratios.get("tcp_vs_socket_streams"),
            f"needs the headline tcp row at {size_label(STREAMS_BYTES)} or more (full run)")
    _target(out, "tp_mismatch_vs_matched", "tp_mismatch_vs_matched", ratios.get("tp_mismatch_vs_matched"), tp_note)
    _target(out, "tp_mismatch_vs_matched", "tp_mismatch_vs_matched (local)", ratios.get("tp_mismatch_vs_matched_local"),
            tp_note + " (local TP rows: full run)")
    _target(out, "nixl_sliced_vs_matched", "nixl_sliced_vs_matched", ratios.get("nixl_sliced_vs_matched"),
            tp_note + " over NIXL (full run, NIXL installed)")
    for r in rows:
        if r.group == "kvxferd" and r.transport == "local" and r.mode == "direct" and r.verified:
            _target(out, "local_vs_memcpy", f"local_vs_memcpy ({r.workload})", r.vs_limit, r.extra.get("no_ratio"))
    trips = {r.bytes: r.p50_ms for r in rows if r.group == "limit" and r.extra.get("limit") == "round_trip"}
    for r in rows:
        if r.group == "latency" and r.p50_ms is not None:
            where = f"({r.transport}, {(r.workload or '').split()[0]})"
            wire = 0.0 if r.transport == "local" else trips.get(r.bytes)
            _target(out, "one_page_p50_over_wire_ms", f"one_page_p50_over_wire_ms {where}",
                    None if wire is None else round(r.p50_ms - wire, 3),
                    f"needs the raw round trip of {size_label(r.bytes or 0)} from the same run")
            _target(out, "one_page_p99_over_p50", f"one_page_p99_over_p50 {where}",
                    round(r.p99_ms / r.p50_ms, 2) if r.p99_ms and r.p50_ms else None, "no p99 in this row")
    for r in rows:
        if r.group == "rate" and r.requests_per_s is not None:
            pair = r.transport != "local"
            where = f"({'tcp pair' if pair else 'one daemon'}, {r.extra.get('client', 'sync')} client)"
            _target(out, "small_requests_per_s_pair" if pair else "small_requests_per_s_local",
                    f"small_requests_per_s {where}", round(r.requests_per_s))
            cpu = r.extra.get("daemon_cpu_ms_per_request")
            _target(out, "daemon_cpu_us_per_request", f"daemon_cpu_us_per_request {where}",
                    None if cpu is None else round(cpu * 1e3), "the daemons' CPU was not read in this row")
    for r in rows:
        if r.group == "kvxferd" and r.extra.get("integrity"):
            name = f"integrity_{r.extra['integrity']}_vs_off"
            _target(out, name, f"{name} ({r.transport} {r.mode} {r.workload})",
                    r.extra.get("vs_integrity_off"), "needs this row and the same row with integrity off, both verified")
    for r in rows:
        if r.group == "planner" and r.ms is not None and r.extra.get("headline"):
            _target(out, "plan_128k_ms", "plan_128k_ms", round(r.ms, 3))
    for r in rows:
        if r.group == "fleet" and not r.skipped and not r.error:
            _fleet_targets(out, r)
    for r in rows:
        if r.group == "qos" and r.mode == "qos" and not r.error:
            _qos_targets(out, r)
    return out


def _qos_targets(out: list[dict[str, Any]], r: Row) -> None:
    """The QoS goals a QoS row reads (the fifo rows beside them are today's figure, not read)."""
    e, where = r.extra, f"({r.transport})"
    if e.get("kind") == "under_bulk":
        _target(out, "qos_p99_vs_idle", f"qos_p99_vs_idle {where}", e.get("vs_idle_p99"))
        _target(out, "qos_p99_over_idle_ms", f"qos_p99_over_idle_ms {where}", e.get("over_idle_p99_ms"))
        _target(out, "qos_bulk_vs_alone", f"qos_bulk_vs_alone {where}", e.get("bulk_vs_alone"),
                "no bulk request completed while the chat requests ran")
        deadline = e.get("deadline") or {}
        ok = deadline.get("code") == "deadline"
        _target(out, "qos_deadline_fail_ms", f"qos_deadline_fail_ms {where}", deadline.get("ms") if ok else None,
                f"the probe ended {deadline.get('state')} ({deadline.get('code')}), not failed deadline")
    elif e.get("kind") == "weights":
        ratio = e.get("ratio")
        _target(out, "qos_weights_3_to_1_error", f"qos_weights_3_to_1_error {where}",
                None if ratio is None else round(abs(ratio / 3.0 - 1.0), 3), "the weight-1 instance moved nothing")
    elif e.get("kind") == "flood":
        _target(out, "qos_flood_bulk_vs_floor", f"qos_flood_bulk_vs_floor {where}", e.get("vs_floor"),
                "no bulk request completed during the flood")


def _fleet_targets(out: list[dict[str, Any]], r: Row) -> None:
    """The fleet goals a fleet row reads: idle cost per link kind, or the storm's time."""
    where = f"({r.extra['links']} {r.extra['kind'].replace('_', ' ')})"
    if r.extra["kind"] == "storm":
        _target(out, "fleet_storm_s", f"fleet_storm_s {where}", r.extra["storm_s"])
        return
    cpu = "fleet_dead_cpu_pct" if r.extra["kind"] == "dead_sources" else "fleet_idle_cpu_pct"
    _target(out, cpu, f"{cpu} {where}", r.extra["cpu_pct"])
    _target(out, "fleet_status_p99_ms", f"fleet_status_p99_ms {where}", r.p99_ms)
    _target(out, "fleet_fds_per_link", f"fleet_fds_per_link {where}", r.extra["fds_per_link"])
    _target(out, "fleet_rss_growth_mib", f"fleet_rss_growth_mib {where}", r.extra["rss_growth_mib"])


def _cells(r: Row) -> tuple[str, ...]:
    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    other = ""
    if r.requests_per_s is not None:
        other = f"{r.requests_per_s:,.0f} req/s"
    elif r.group == "fleet" and "cpu_pct" in r.extra:
        other = (f"{r.extra['cpu_pct']:.1f}% core, {r.extra['fds_per_link']:.2f} fd/link, "
                 f"+{r.extra['rss_growth_mib']:.1f} MiB")
    elif r.ms is not None:
        other = f"{r.ms:.2f} ms"
    elif r.group == "qos":
        other = _qos_cell(r.extra)
    if r.moved_as and r.group == "kvxferd" and r.moved_as != r.mode:
        other = (other + " " if other else "") + f"moved {r.moved_as}"
    if r.transport == "nixl" and r.extra.get("fragments_per_chunk") is not None:  # descriptors per WRITE'd chunk
        other = (other + " " if other else "") + f"{r.extra['fragments_per_chunk']:,.1f} desc/chunk"
    if r.extra.get("first_attempt_error"):
        other = (other + " " if other else "") + "retried"
    check = ("skipped: " + r.skipped) if r.skipped else (
        "-" if r.verified is None else "yes" if r.verified else "FAILED")
    lim = f"{r.vs_limit:.2f} {r.limit}" if r.vs_limit is not None else "n/a (small)" if r.extra.get("no_ratio") else "-"
    noise = r.extra.get("others_cpu_pct")
    return (r.name, size_label(r.bytes) if r.bytes else "-", f(r.gbps, ".2f"), lim, f(r.vs_peer, ".2f"),
            f(r.p50_ms, ".3f"), f(r.p99_ms, ".3f"), other, "-" if noise is None else f"{noise:.0f}%", check)


def _qos_cell(e: dict[str, Any]) -> str:
    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    if e.get("kind") == "under_bulk":
        d = e.get("deadline") or {}
        return (f"p99 {f(e.get('vs_idle_p99'), '.2f')}x idle (+{f(e.get('over_idle_p99_ms'), '.1f')} ms), bulk "
                f"{f(e.get('bulk_vs_alone'), '.2f')}x alone, 1 ms budget: {d.get('code') or d.get('state')} in "
                f"{f(d.get('ms'), '.2f')} ms (send {f(d.get('call_ms'), '.2f')} ms; the call reached the daemon's "
                f"loop in {f(d.get('reach_ms'), '.2f')} ms, which told the failure {f(d.get('decided_ms'), '.2f')} ms "
                "after)")
    if e.get("kind") == "weights":
        return f"bytes {f(e.get('ratio'), '.2f')} : 1"
    if e.get("kind") == "flood":
        return f"bulk {f(e.get('vs_floor'), '.2f')}x its floor"
    return ""


def render_table(rows: list[Row]) -> str:
    head = ("scenario", "bytes/req", "GB/s", "x limit", "x peer", "p50 ms", "p99 ms", "other", "others' CPU",
            "bytes ok")
    lines = [head] + [_cells(r) for r in rows]
    widths = [max(len(str(x[c])) for x in lines) for c in range(len(head))]
    out = []
    for i, ln in enumerate(lines):
        out.append("  ".join(str(c).ljust(widths[j]) if j in (0, 7, 9) else str(c).rjust(widths[j])
                             for j, c in enumerate(ln)).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _hop_lines(rows: list[Row]) -> list[str]:
    """Each latency row's per-hop medians (``daemon.hop_trace``), under the table."""
    out = [f"{r.name}: {hops.render(r.extra['hops_us'])}" for r in rows if r.extra.get("hops_us")]
    return out + [""] if out else []


def render_text(report: dict[str, Any], rows: list[Row]) -> str:
    """The whole human-readable report: header, table, ratios, targets, the verdict on the bytes."""
    m = report["machine"]
    copy = m.get("copy_path") or {}
    copies = "" if not copy else "native copies, " if copy.get("path") == "native" else \
        f"TORCH copies (several times slower: {copy.get('reason')}), "
    lines = [f"kvxferd bench ({report.get('size') or ('quick' if report['quick'] else 'full')}) on {m['cores']} "
             f"cores, {m['cpu']}, {copies}{report['seconds']:.0f}s", "", render_table(rows), "",
             *_hop_lines(rows),
             "ratios: " + "  ".join(f"{k}={'-' if v is None else v}" for k, v in report["ratios"].items()),
             "targets:"]
    for t in report["targets"]:
        met = "n/a" if t["met"] is None else "met" if t["met"] else "MISSED"
        why = f"  ({t['note']})" if t.get("note") else ""
        lines.append(f"  {t['target']:<52} {'-' if t['value'] is None else t['value']!s:>10}  goal "
                     f"{t['goal']:<18} {met}{why}")
    verdict = "yes" if report["verified"] else "NO - some scenario moved wrong bytes or failed"
    lines.append(f"\nbytes verified: {verdict}")
    return "\n".join(lines)

"""One bench run: limits, peers, kvxferd scenarios, the planner; then ratios and targets.
``main`` is ``kvxferd bench``."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from .limits import memcpy_limit, shm_limit, socket_limit, socket_round_trip
from .machine import Noise, machine, wait_quiet
from .model import STREAMS_BYTES, GiB, Row, Scenario, say, size_label
from .peers import mooncake_tcp, nixl_raw, nixl_unavailable
from .plan_timing import planner_bench
from .report import compute, targets_report
from .scenarios import DaemonPool, build_scenarios, headline_workload, run_with_retry, select, tp_workloads


def _data_connections() -> int:
    """Data connections a daemon opens per peer by default: the multi-stream limit's N."""
    from ...ops.config import PeerSection
    return PeerSection().data_connections


def _limit_rows(sizes: list[int], size: str) -> list[Row]:
    rows = []
    full = size == "full"
    streams = _data_connections()
    for nbytes in sizes:
        repeats = {"full": max(5, min(20, -(-8 * GiB // nbytes))), "quick": max(5, min(64, -(-GiB // nbytes))),
                   "smoke": 3}[size]
        if full:
            wait_quiet(10.0)
        say(f"limits at {size_label(nbytes)} (best of {repeats})")
        measures: list[tuple[str, str, Any]] = [
            ("memcpy", "memcpy 1 thread", lambda: memcpy_limit(nbytes, repeats)),
            ("socket", "tcp socket 2 procs", lambda: socket_limit(nbytes, repeats))]
        if nbytes >= STREAMS_BYTES and streams > 1:
            measures.append(("socket_streams", f"tcp socket {streams} streams 2 procs",
                             lambda: socket_limit(nbytes, repeats, streams)))
        for key, label, fn in measures:
            with Noise() as noise:
                gbps = fn()
            rows.append(Row(f"limit {label} {size_label(nbytes)}", "limit", bytes=nbytes, gbps=gbps,
                            extra={"limit": key, "others_cpu_pct": noise.pct,
                                   **({"streams": streams} if key == "socket_streams" else {})}))
        with Noise() as noise:
            shm = shm_limit(nbytes, repeats)
        for key, label in (("shm_private", "shm->private"), ("shm_shared", "shm->shm")):
            rows.append(Row(f"limit {label} copy 2 procs {size_label(nbytes)}", "limit", bytes=nbytes,
                            gbps=shm[key.split("_")[1]], extra={"limit": key, "others_cpu_pct": noise.pct}))
        for r in rows[-len(measures) - 2:]:
            say(f"  {r.name}: {r.gbps:.2f} GB/s")
    return rows


def _round_trip_rows(sizes: list[int], size: str) -> list[Row]:
    """The raw socket's round trip at each one-page latency payload: what the latency rows are read against."""
    rows = []
    repeats = {"full": 400, "quick": 200, "smoke": 20}[size]
    for nbytes in sizes:
        with Noise() as noise:
            p50, p99 = socket_round_trip(nbytes, repeats)
        rows.append(Row(f"limit tcp round trip 2 procs {size_label(nbytes)}", "limit", bytes=nbytes, p50_ms=p50,
                        p99_ms=p99, extra={"limit": "round_trip", "others_cpu_pct": noise.pct}))
        say(f"  {rows[-1].name}: p50 {p50:.3f} ms, p99 {p99:.3f} ms")
    return rows


def _peer_rows(sizes: list[int], size: str) -> list[Row]:
    rows = []
    for nbytes in sizes:
        repeats = 5 if size == "full" else 3
        for name, fn in (("peer nixl ucx-tcp", nixl_raw), ("peer mooncake tcp", mooncake_tcp)):
            if size == "smoke":  # nothing to compare with; tests/test_bench_smoke.py runs them on their own
                rows.append(Row(f"{name} {size_label(nbytes)}", "peer", bytes=nbytes, skipped="not run in a smoke run",
                                extra={"peer": name.split()[1]}))
                continue
            say(f"{name} {size_label(nbytes)}")
            with Noise() as noise:
                try:
                    gbps, why = fn(nbytes, repeats)
                except Exception as exc:  # noqa: BLE001
                    gbps, why = None, f"error: {type(exc).__name__}: {exc}"[:300]
            rows.append(Row(f"{name} {size_label(nbytes)}", "peer", bytes=nbytes, gbps=gbps, skipped=why,
                            extra={"peer": name.split()[1], **({"others_cpu_pct": noise.pct} if gbps else {})}))
            if gbps:
                say(f"  {rows[-1].name}: {gbps:.2f} GB/s")
    return rows


def _planner_rows(size: str) -> list[Row]:
    runs = {"full": 9, "quick": 3, "smoke": 1}[size]
    say("planner: 128k tokens, 80 layers")
    if size == "full":
        wait_quiet(10.0)
    rows = []
    for p_tp, d_tp, headline_row in ((4, 2, True), (1, 1, False)):
        with Noise() as noise:
            res = planner_bench(runs, p_tp, d_tp)
        rows.append(Row(f"planner 128k tokens 80 layers tp{p_tp}>{d_tp} page16", "planner", ms=res["ms"],
                        extra={"segments": res["segments"], "writers": res["writers"], "headline": headline_row,
                               "mode": res["mode"], "best_ms": round(res["best_ms"], 3), "runs": runs,
                               "others_cpu_pct": noise.pct}))
        say(f"  {rows[-1].name}: median {res['ms']:.2f} ms, best {res['best_ms']:.2f} ms "
            f"({res['segments']} segments)")
    return rows


def _fleet_rows(size: str) -> list[Row]:
    """One real daemon among fake peer daemons (:mod:`kvxferd.tools.fleet`): idle cost with live
    and dead links, and a handshake storm, at each fleet size."""
    from ..fleet import measure
    rows = []
    for links in {"full": (100, 1000), "quick": (100,), "smoke": (5,)}[size]:
        wait_quiet(10.0 if size == "full" else 0.0)
        idle_s = {"full": 20.0, "quick": 10.0, "smoke": 0.5}[size]
        say(f"fleet: {links} peer daemons of each kind, {idle_s:g} s idle readings")
        with Noise() as noise:
            try:
                rep = measure(links, idle_s, say=say)
            except Exception as exc:  # noqa: BLE001 - one size failing leaves the others' rows
                rows.append(Row(f"fleet {links} links", "fleet", error=f"{type(exc).__name__}: {exc}"[:500]))
                say(f"  fleet {links} links: {rows[-1].error}")
                continue
        if rep.errors:
            rows.append(Row(f"fleet {links} links", "fleet", error="; ".join(rep.errors)[:500]))
            continue
        for kind, role in (("live_sources", "decode"), ("dead_sources", "decode-dead"),
                           ("live_decodes", "prefill")):
            got, base = getattr(rep, kind), rep.baseline[role]
            rows.append(Row(f"fleet idle {links} {kind.replace('_', ' ')}", "fleet", p50_ms=got.status_p50_ms,
                            p99_ms=got.status_p99_ms, extra={
                                "kind": kind, "links": links, "cpu_pct": got.cpu_pct, "listed": got.peers_listed,
                                "fds_per_link": round((got.fds - base.fds) / links, 2),
                                "rss_growth_mib": round(got.rss_mib - base.rss_mib, 1),
                                "baseline_cpu_pct": base.cpu_pct, "others_cpu_pct": noise.pct}))
        rows.append(Row(f"fleet storm {links} handshakes", "fleet", ms=round(rep.storm_s * 1000, 1),
                        extra={"kind": "storm", "links": links, "storm_s": rep.storm_s,
                               "answers": rep.storm_answers, "others_cpu_pct": noise.pct}))
        for r in rows[-4:]:
            say(f"  {r.name}: {r.p50_ms or '-'} / {r.p99_ms or '-'} ms status, {r.extra}")
    return rows


def _kvxferd_rows(scenarios: list[Scenario], size: str, seed: int) -> list[Row]:
    """Every scenario's row, in scenario order; grouped by daemon configuration to reuse daemons."""
    results: dict[int, Row] = {}
    no_nixl = nixl_unavailable()
    for sc in scenarios:
        if sc.transport == "nixl" and no_nixl:
            results[sc.order] = Row(sc.name, "kvxferd", bytes=sc.workload.nbytes, transport="nixl", mode=sc.mode,
                                    workload=sc.workload.label, skipped=no_nixl)
    root = Path(tempfile.mkdtemp(prefix="kvxferd-bench-"))
    pool = DaemonPool(root, recycle_bytes=(8 * GiB) if size == "full" else (4 * GiB))
    try:
        for sc in sorted(scenarios, key=lambda s: (s.transport, s.mode, s.engine_memory, s.order)):
            if sc.order not in results:
                results[sc.order] = run_with_retry(sc, pool, seed, size)
    finally:
        pool.stop()
        shutil.rmtree(root, ignore_errors=True)
    rows = [results[s.order] for s in scenarios]
    if size != "full":
        rows.append(Row("kvxferd nixl (full run only)", "kvxferd", transport="nixl", mode="direct",
                        skipped=no_nixl or "full run only"))
    return rows


def run_all(size: str, only: str | None = None, seed: int = 1) -> tuple[dict[str, Any], list[Row]]:
    """The report (what ``--json`` prints) and its rows."""
    t_all = time.perf_counter()
    scenarios = select(build_scenarios(size), only)
    headline = headline_workload(size)
    sizes = sorted({s.workload.nbytes for s in scenarios if s.kind == "throughput" and s.transport != "nixl"})
    say(f"{size} run: {len(scenarios)} kvxferd scenarios, limits at {', '.join(size_label(s) for s in sizes)}, "
        f"{os.cpu_count()} cores")
    rows = _limit_rows(sizes, size)
    rows += _round_trip_rows(sorted({s.workload.nbytes for s in scenarios if s.kind == "latency"
                                     and s.transport == "tcp"}), size)
    if sizes or not only:  # peer engines compare throughput: pointless when --only picked none
        rows += _peer_rows([headline.nbytes] if headline.nbytes in sizes or not sizes else [sizes[0]], size)
    rows += _kvxferd_rows(scenarios, size, seed)
    if not only or re.search(only, "planner"):
        rows += _planner_rows(size)
    if (not only and size != "smoke") or (only and re.search(only, "fleet")):
        rows += _fleet_rows(size)
    qos_transports = [t for t in ("local", "tcp", "nixl") if only and re.search(only, f"qos {t}")]
    if (not only and size == "full") or qos_transports:
        from .qos import qos_rows
        rows += qos_rows(size, seed, tuple(qos_transports) if 0 < len(qos_transports) < 3 else None)
    ratios = compute(rows, headline, tp_workloads(size))
    verified = all(r.verified for r in rows if r.group in ("kvxferd", "latency", "rate", "qos") and not r.skipped)
    report = {"quick": size != "full", "size": size, "machine": machine(),
              "seconds": round(time.perf_counter() - t_all, 1), "verified": verified,
              "rows": [r.to_dict() for r in rows], "ratios": ratios, "targets": targets_report(rows, ratios),
              "headline": headline.label}
    return report, rows


def load_report(path: str) -> tuple[dict[str, Any], list[Row]]:
    """A run saved with ``--json``; its ratios and targets computed again, by this version's rules."""
    report = json.loads(Path(path).read_text())
    rows = [Row.from_dict(d) for d in report["rows"]]
    size = report.get("size") or ("quick" if report.get("quick") else "full")
    report["ratios"] = compute(rows, headline_workload(size), tp_workloads(size))
    report["targets"] = targets_report(rows, report["ratios"])
    report["rows"] = [r.to_dict() for r in rows]
    return report, rows

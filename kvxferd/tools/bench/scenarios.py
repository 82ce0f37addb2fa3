"""Which kvxferd scenarios a run measures (full, quick, smoke), and how one is run: daemons
from a pool, one engine process, the daemons' CPU and the bytes checked."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .. import launch, procstats
from . import hops
from .limits import memcpy_limit, socket_limit
from .machine import children_cpu, machine_busy, others_pct, proc_cpu, wait_quiet
from .model import STEADY_BYTES, GiB, MiB, Row, Scenario, Workload, say, size_label

class _Adder:
    """Builds the scenario list: default request counts and windows from the payload size."""

    def __init__(self, size: str) -> None:
        self.size = size
        self.out: list[Scenario] = []

    def __call__(self, kind: str, transport: str, mode: str, wl: Workload, requests: int | None = None,
                 window: int | None = None, verify: int = 2, client: str = "sync", integrity: str = "off",
                 engine_memory: str = "exposed") -> None:
        if requests is None:
            budget = {"full": 6 * GiB, "quick": 1536 * MiB, "smoke": 48 * MiB}[self.size]
            requests = max(6 if self.size == "full" else 4, min(64, -(-budget // wl.nbytes)))
        if window is None:
            window = 2 if wl.nbytes >= GiB else 3 if wl.nbytes >= 384 * MiB else 4
        rounds = 3
        if integrity != "off":  # plain and checked rounds in turn: twice the requests in twice the rounds
            requests, rounds = 2 * requests, 6
        if kind == "throughput":
            name = f"{transport} {mode} {wl.label}" + (f" integrity {integrity}" if integrity != "off" else "") + (
                " private" if transport == "nixl" and engine_memory == "private" else "")
        elif kind == "latency":
            name = f"latency 1 page {transport} {wl.model}"
        else:
            name = f"small requests {transport} {wl.model} {client} client"
        self.out.append(Scenario(name, kind, transport, mode, wl, requests, window, verify, len(self.out), client,
                                 integrity, rounds, engine_memory))


def _full(add: _Adder) -> None:
    modes = ("direct", "staged")
    for tokens in (1024, 4096, 16384):
        wl = Workload("8B", tokens)
        add("throughput", "local", "direct", wl)
        if tokens == 4096:
            add("throughput", "local", "staged", wl)
        for m in modes:
            add("throughput", "tcp", m, wl)
    for wl in (Workload("8B", 1024, p_page=1, d_page=1), Workload("8B", 4096, d_page=32),
               Workload("8B", 1024, d_page=1), Workload("MLA", 4096)):
        add("throughput", "local", "direct", wl)
        for m in modes:
            add("throughput", "tcp", m, wl)
    for wl in tp_workloads("full"):
        for t in ("local", "tcp"):
            for m in modes:
                add("throughput", t, m, wl)
    # kvxferd's NIXL transport (UCX over TCP), next to the raw NIXL agent row; sliced plans
    # (TP mismatch: head slices) against the matched plan of the same model
    # (in-place WRITEs into the decode pages: peer.nixl_engine_memory = "exposed"), and the same
    # plans with the decode daemon's default, "private": every chunk through its landing ring
    add("throughput", "nixl", "direct", Workload("8B", 4096))
    add("throughput", "nixl", "direct", Workload("70B", 2048))
    for p_tp, d_tp in ((2, 1), (1, 2)):
        for m in modes:
            add("throughput", "nixl", m, Workload("70B", 2048, p_tp, d_tp))
    for wl in (Workload("8B", 4096), Workload("70B", 2048), Workload("70B", 2048, 2, 1)):
        add("throughput", "nixl", "direct" if wl.p_tp == wl.d_tp else "staged", wl, engine_memory="private")
    # vLLM's GPU layouts over NIXL: token-major (NHD_kv) and head-major pages (HND_kv), matched and sliced
    for layout in ("NHD_kv", "HND_kv"):
        for p_tp, d_tp in ((1, 1), (2, 1)):
            add("throughput", "nixl", "direct", Workload("70B", 2048, p_tp, d_tp, layout=layout))
    # integrity "sampled" and "full" beside the same rows without it: what checking costs
    for t, m, wl in (("local", "direct", Workload("8B", 4096)), ("tcp", "direct", Workload("8B", 4096)),
                     ("tcp", "staged", Workload("70B", 2048, 2, 1)), ("nixl", "direct", Workload("8B", 4096)),
                     ("nixl", "staged", Workload("70B", 2048, 2, 1))):
        for integrity in ("sampled", "full"):
            add("throughput", t, m, wl, integrity=integrity)
    for t in ("local", "tcp"):
        for model in ("8B", "tiny"):
            add("latency", t, "direct", Workload(model, 16), requests=400, window=1, verify=1)
    for t in ("local", "tcp"):
        for client in ("sync", "batch", "async"):
            add("rate", t, "direct", Workload("tiny", 16), requests=4000, window=64, client=client)


def _quick(add: _Adder) -> None:
    """Only the rows the printed ratios and targets read, at a payload that reaches steady
    state (:data:`~.model.STEADY_BYTES`): 8B 1k, 128 MiB a request, also for the TP rows (the
    matched plan is the headline row itself), so the limits are measured at one size."""
    headline = headline_workload("quick")
    for t, m in (("local", "direct"), ("tcp", "direct"), ("tcp", "staged")):
        add("throughput", t, m, headline)
    for wl in tp_workloads("quick")[1:]:
        add("throughput", "tcp", "direct", wl)
    for t in ("local", "tcp"):
        for integrity in ("sampled", "full"):
            add("throughput", t, "direct", headline, integrity=integrity)
    for t, model in (("local", "8B"), ("tcp", "8B"), ("tcp", "tiny"), ("nixl", "8B")):
        add("latency", t, "direct", Workload(model, 16), requests=100, window=1, verify=1)
    for t, client in (("local", "sync"), ("local", "batch"), ("tcp", "sync"), ("tcp", "batch"), ("tcp", "async")):
        add("rate", t, "direct", Workload("tiny", 16), requests=1000, window=64, client=client)


def _smoke(add: _Adder) -> None:
    """The machinery only: one row of each kind, payloads far below steady state (no ratios)."""
    wl = Workload("8B", 64)
    for t, m in (("local", "direct"), ("tcp", "direct"), ("tcp", "staged")):
        add("throughput", t, m, wl)
    add("throughput", "tcp", "direct", Workload("8B", 64, 1, 2))  # one rank feeds two: head slices
    add("throughput", "tcp", "direct", wl, integrity="full")  # plain and checked rounds in turn
    add("latency", "tcp", "direct", Workload("tiny", 16), requests=20, window=1, verify=1)
    for client in ("sync", "batch", "async"):
        add("rate", "tcp", "direct", Workload("tiny", 16), requests=200, window=16, client=client)


def build_scenarios(size: str) -> list[Scenario]:
    add = _Adder(size)
    {"full": _full, "quick": _quick, "smoke": _smoke}[size](add)
    return add.out


def headline_workload(size: str) -> Workload:
    """The workload the single-figure ratios (tcp vs socket, local vs memcpy) read."""
    return {"full": Workload("8B", 4096), "quick": Workload("8B", 1024), "smoke": Workload("8B", 64)}[size]


def tp_workloads(size: str) -> list[Workload]:
    """The matched plan, then the TP-mismatched ones of the same model and length, that the
    TP ratios (mismatched vs matched, over tcp, local and NIXL) read."""
    model, tokens = {"full": ("70B", 2048), "quick": ("8B", 1024), "smoke": ("8B", 64)}[size]
    return [Workload(model, tokens, p, d) for p, d in ((1, 1), (2, 1), (1, 2))]


class DaemonPool:
    """Daemons for one (transport, mode) at a time, restarted when they held too much memory.

    A daemon keeps the mappings of ranks that unregistered for a while, so they are recycled
    once the bytes registered through them pass ``recycle_bytes``.
    """

    def __init__(self, root: Path, recycle_bytes: int) -> None:
        from ..sim import Cluster
        self.cluster = Cluster(root=root)
        self.recycle_bytes = recycle_bytes
        self.key: tuple[str, str, str] | None = None
        self.prefill: Any = None
        self.decode: Any = None
        self.held = 0
        self.count = 0

    def get(self, transport: str, mode: str, nbytes: int, engine_memory: str = "exposed") -> tuple[Any, Any]:
        if self.key != (transport, mode, engine_memory) or self.held + nbytes > self.recycle_bytes:
            self.stop()
            env = {"KVXFERD_PEER_MODE": mode, "KVXFERD_DAEMON_LOG_LEVEL": "info", "KVXFERD_DAEMON_HOP_TRACE": "1024",
                   "KVXFERD_PEER_HEARTBEAT_INTERVAL_S": "1.0", "KVXFERD_PEER_PEER_TIMEOUT_S": "10"}
            if transport == "nixl":  # the same UCX setup as the raw NIXL peer row
                env.update(KVXFERD_PEER_TRANSPORT="nixl", UCX_TLS="tcp", UCX_NET_DEVICES="lo", NIXL_LOG_LEVEL="WARN",
                           KVXFERD_PEER_NIXL_ENGINE_MEMORY=engine_memory)
            self.count += 1
            say(f"starting {'one daemon' if transport == 'local' else 'a daemon pair'} (mode={mode})")
            self.prefill = self.cluster.daemon(f"b{self.count}-prefill", env=env)
            self.decode = self.prefill if transport == "local" else self.cluster.daemon(f"b{self.count}-decode",
                                                                                            env=env)
            self.key = (transport, mode, engine_memory)
            self.held = 0
        self.held += nbytes
        return self.prefill, self.decode

    def daemons(self) -> list[Any]:
        return list({id(x): x for x in (self.prefill, self.decode) if x is not None}.values())

    def logs(self) -> str:
        return "\n".join(d.log()[-1500:] for d in self.daemons())

    def stop(self) -> None:
        for d in self.daemons():
            d.stop()
        self.prefill = self.decode = None
        self.key = None


def chunk_counts(metrics_url: str) -> dict[str, float]:
    """Chunks the daemon moved so far, per ``transport/mode``."""
    samples = procstats.scrape(metrics_url, timeout=5, missing_ok=True)
    out: dict[str, float] = {}
    for name in ("sum", "count"):  # contiguous fragments (NIXL: descriptors) of every moved chunk
        if f"kvxferd_chunk_fragments_{name}" in samples:
            out[f"fragments/{name}"] = samples[f"kvxferd_chunk_fragments_{name}"]
    for transport in procstats.by_label(samples, "kvxferd_chunks_total", "transport"):
        for mode, n in procstats.by_label(samples, "kvxferd_chunks_total", "mode", transport=transport).items():
            out[f"{transport}/{mode}"] = n
    return out


def checked_chunks(metrics_url: str) -> float:
    """Chunks the daemon checked against their digests so far (integrity), every transport and digest."""
    return procstats.summed(procstats.scrape(metrics_url, timeout=5, missing_ok=True),
                            "kvxferd_integrity_checked_chunks_total")


def _tag(sc: Scenario) -> str:
    """Names the scenario's instances and cache files; unique per bench process, so its files can be
    told from those of another bench running beside it."""
    return f"b{os.getpid()}s{sc.order}"


def run_engine(cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one scenario's engine process; its result record. However this ends (timeout, a
    signal to the bench), the engine is stopped with SIGTERM first, so it unlinks its caches,
    and any cache file it could not unlink (killed) is removed here."""
    proc = launch.popen([sys.executable, "-m", "kvxferd.tools.bench.engine", json.dumps(cfg)],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        return json.loads(lines[-1]) if lines else {"error": f"engine exited {proc.returncode}: "
                                                             f"{stderr.strip()[-400:]}"}
    except subprocess.TimeoutExpired:
        return {"error": f"engine timed out after {timeout:.0f}s"}
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for path in Path("/dev/shm").glob(f"kvxferd-bench-{cfg['tag']}-*"):
            path.unlink(missing_ok=True)


def _adjacent_limit(sc: Scenario) -> float | None:
    """The limit measured right before the scenario, so that both see the same machine (only
    where a ratio will be read from it)."""
    if sc.kind != "throughput" or sc.transport not in ("local", "tcp") or sc.workload.nbytes < STEADY_BYTES:
        return None
    nbytes = sc.workload.nbytes
    reps = max(5, min(64, -(-GiB // nbytes)))
    return memcpy_limit(nbytes, reps) if sc.transport == "local" else socket_limit(nbytes, reps)


class _Cpu:
    """CPU the daemons, the engine and other processes used while one scenario ran."""

    def __init__(self, daemons: dict[str, Any]) -> None:
        self.daemons = daemons
        self.t = time.perf_counter()
        self.cpu0 = {k: proc_cpu(d.proc.pid) for k, d in daemons.items()}
        self.busy0, self.child0, self.own0 = machine_busy(), children_cpu(), time.process_time()

    def record(self, row: Row, moved_requests: int) -> None:
        wall = time.perf_counter() - self.t
        daemon_cpu = {k: round(proc_cpu(d.proc.pid) - self.cpu0[k], 3) for k, d in self.daemons.items()}
        engine_cpu = children_cpu() - self.child0
        ours = sum(daemon_cpu.values()) + engine_cpu + (time.process_time() - self.own0)
        row.extra["daemon_cpu_s"] = daemon_cpu
        row.extra["engine_cpu_s"] = round(engine_cpu, 3)
        # CPU time other processes on this machine took while the scenario ran: noise to read with the row
        row.extra["others_cpu_pct"] = others_pct(machine_busy() - self.busy0, ours, wall)
        row.extra["daemon_cpu_ms_per_request"] = round(sum(daemon_cpu.values()) / moved_requests * 1e3, 3)
        if row.group == "kvxferd" and row.bytes:
            row.extra["daemon_cpu_s_per_gb"] = round(sum(daemon_cpu.values()) / (moved_requests * row.bytes / 1e9), 3)


def run_scenario(sc: Scenario, pool: DaemonPool, seed: int, timeout: float, quiet_wait: float = 0.0) -> Row:
    wl = sc.workload
    # an integrity row's checked instance asks for its mode at register: the daemons stay off,
    # and its plain rounds run on them between its checked ones (engine_layout.Layout)
    pairs = 2 if sc.integrity != "off" else 1
    pd, dd = pool.get(sc.transport, sc.mode, pairs * wl.nbytes * (sc.window + sc.verify + 1), sc.engine_memory)
    before, checked_before = chunk_counts(pd.metrics_url), checked_chunks(dd.metrics_url)
    waited = wait_quiet(quiet_wait) if quiet_wait > 0 else 0.0
    adjacent = _adjacent_limit(sc)
    cfg = {"workload": asdict(wl), "window": sc.window, "requests": sc.requests, "verify": sc.verify,
           "gate": sc.gate, "seed": seed, "tag": _tag(sc), "client": sc.client, "rounds": sc.rounds,
           "stamps": sc.kind == "latency", **({"integrity": sc.integrity} if sc.integrity != "off" else {}),
           "prefill_socket": pd.socket_path, "decode_socket": dd.socket_path,
           "source_address": None if sc.transport == "local" else pd.address}
    row = Row(sc.name, {"throughput": "kvxferd", "latency": "latency", "rate": "rate"}[sc.kind],
              bytes=wl.nbytes, transport=sc.transport, mode=sc.mode, workload=wl.label, requests=sc.requests,
              extra={**({"client": sc.client} if sc.kind == "rate" else {}),
                     **({"integrity": sc.integrity} if sc.integrity != "off" else {})})
    t = time.perf_counter()
    cpu = _Cpu({"prefill": pd, "decode": dd} if dd is not pd else {"daemon": pd})
    res = run_engine(cfg, timeout)
    cpu.record(row, pairs * (sc.requests + sc.window + sc.verify))
    if adjacent is not None:
        row.extra["adjacent_limit_gbps"] = round(adjacent, 3)
    if waited:
        row.extra["waited_for_quiet_s"] = waited
    _record_moved(row, before, chunk_counts(pd.metrics_url))
    if sc.integrity != "off":  # the checked rounds were checked: the decode daemon says how many chunks
        row.extra["integrity_checked_chunks"] = checked_chunks(dd.metrics_url) - checked_before
    _record_result(row, res, sc, pool)
    if res.get("engine_ns") and not row.error:
        row.extra["hops_us"] = _hops(res["engine_ns"], pd, dd)
    say(f"  {sc.name}: {_value(row)}  bytes {'ok' if row.verified else 'FAILED'}  ({time.perf_counter() - t:.1f}s)"
        + (f"  error: {row.error[:200]}" if row.error else ""))
    return row


def _hops(engine_ns: dict[str, list[int]], pd: Any, dd: Any) -> dict[str, Any]:
    """The latency row's per-hop medians: the engine's stamps against both daemons' (``status``)."""
    return hops_from_daemons({rid: (ns[0], ns[1]) for rid, ns in engine_ns.items()}, pd.socket_path, dd.socket_path)


def hops_from_daemons(engine: dict[str, tuple[int, int]], prefill_socket: str, decode_socket: str) -> dict[str, Any]:
    """Per-hop medians of the engine's (send, done) stamps against both daemons' own (``status``;
    one socket for both sides: a local row's one daemon holds both)."""
    from ...sdk.client import EngineClient

    def stamps_of(path: str) -> dict[str, Any]:
        with EngineClient(path, timeout=30) as client:
            return client.status().get("hops", {})

    source = stamps_of(prefill_socket)
    decode = source if decode_socket == prefill_socket else stamps_of(decode_socket)
    return hops.breakdown(engine, source, decode)


def _record_moved(row: Row, before: dict[str, float], after: dict[str, float]) -> None:
    """How the daemon moved the scenario's chunks (transport/mode), from its chunk counters."""
    chunks = after.get("fragments/count", 0.0) - before.get("fragments/count", 0.0)
    if chunks > 0:
        row.extra["fragments_per_chunk"] = round((after["fragments/sum"] - before.get("fragments/sum", 0.0)) / chunks, 1)
    moved = [k for k in sorted(after) if after[k] - before.get(k, 0.0) > 0 and not k.startswith("fragments/")]
    row.moved_as = "+".join(k.split("/", 1)[1] for k in moved) if moved else None
    row.extra["moved"] = "+".join(moved) if moved else None
    if row.transport == "nixl" and moved and not all(k.startswith("nixl/") for k in moved):
        row.error = ((row.error or "") + f" configured for nixl but chunks moved as {row.extra['moved']}").strip()


def _record_result(row: Row, res: dict[str, Any], sc: Scenario, pool: DaemonPool) -> None:
    """The engine's result into the row; daemons that saw a failure are not reused."""
    row.verified = bool(res.get("verified"))
    if res.get("error") or res.get("failures"):
        row.error = (res.get("error") or "") + (f" failures: {res['failures'][:3]}" if res.get("failures") else "")
        row.error = row.error.strip()[:600]
        logs = pool.logs().strip()
        if logs:
            row.extra["daemon_log_tail"] = logs[-1200:]
        pool.stop()
    if res.get("bad_bytes"):
        row.extra["bad_bytes"] = res["bad_bytes"]
        row.verified = False
        row.error = ((row.error or "") + f" {res['bad_bytes']} destination bytes differ from the oracle").strip()
    row.seconds = res.get("seconds")
    row.extra.update({k: res[k] for k in ("setup_s", "warmup_s", "check_s", "checked_requests", "gbps_overall",
                                          "gbps_rounds", "rps_rounds", "gbps_off", "gbps_rounds_off", "vs_off_rounds",
                                          "vs_off") if k in res})
    if sc.kind == "throughput":
        row.gbps = res.get("gbps")
    if sc.kind == "rate":
        row.requests_per_s = res.get("requests_per_s")
    row.p50_ms = res.get("p50_ms")
    row.p99_ms = res.get("p99_ms")


def _value(row: Row) -> str:
    return (f"{row.gbps:.2f} GB/s" if row.gbps else f"{row.requests_per_s:,.0f} req/s" if row.requests_per_s
            else f"p50 {row.p50_ms:.3f} ms" if row.p50_ms else "-")


def run_with_retry(sc: Scenario, pool: DaemonPool, seed: int, size: str) -> Row:
    """A scenario that failed without moving a wrong byte (a timeout on a busy machine, a daemon
    that did not answer) runs once more on fresh daemons; both attempts are reported."""
    timeout = 900 if size == "full" else 300
    say(f"run {sc.name}: {sc.requests} x {size_label(sc.workload.nbytes)}, window {sc.window}")
    row = run_scenario(sc, pool, seed, timeout=timeout, quiet_wait=10.0 if size == "full" else 0.0)
    if row.error and not row.extra.get("bad_bytes"):
        say(f"  retrying {sc.name} once on fresh daemons")
        pool.stop()
        first = row
        row = run_scenario(sc, pool, seed, timeout=timeout, quiet_wait=10.0)
        row.extra["first_attempt_error"] = first.error
        if first.extra.get("daemon_log_tail"):
            row.extra["first_attempt_daemon_log"] = first.extra["daemon_log_tail"]
    return row


def select(scenarios: list[Scenario], only: str | None) -> list[Scenario]:
    """The scenarios whose name matches ``only`` (all without it)."""
    if not only:
        return scenarios
    rx = re.compile(only)
    return [s for s in scenarios if rx.search(s.name)]

"""``kvxferd bench --only qos``: a chat instance's one-page requests while a bulk instance keeps
the same daemons busy, with the daemons' QoS on and off (``qos.enabled``), in one run.

For each transport (``local``: one daemon; ``tcp`` and ``nixl``: two) and each policy, real daemons
start with ``qos.instances = ["chat*=latency", "bulkw3*=bulk:3", "bulk*=bulk", "flood*=latency",
"probe*=bulk"]``. The engine process (``python -m kvxferd.tools.bench.qos CONFIG_JSON``) drives
the chat instance; every other tenant runs in a process of its own, as another engine would (its
driver never holds the chat driver's interpreter lock). One phase after another:

- **idle**: the chat instance's one-page requests one at a time, paced at one every
  ``CHAT_PERIOD_S`` (at once when the one before took longer), nothing else moving (p50, p99);
- **bulk alone**: the bulk instance with three requests in flight (GB/s);
- **under bulk**: the chat requests again while the bulk instance keeps three in flight; the
  bulk instance's GB/s over the same seconds;
- **weights** (QoS only): two bulk instances weighted 3 and 1, each with eight requests in flight
  so both stay backlogged at the daemon: their bytes;
- **latency flood** (QoS only): a latency instance with 16 requests in flight against the bulk
  instance: bulk's GB/s against ``qos.bulk_floor`` of its GB/s alone;
- **deadline**: a bulk-class request with a 1 ms budget sent while the bulk backlog waits: the
  time from its ``send`` to its failure, and its code.

Every bulk and chat destination page set is checked against the byte oracle at the end (each
holds its last request's bytes), with the pages never written. Figures are printed, never
asserted (BENCHMARKS.md reads them against the issue's goals).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from typing import Any

from ..oracle import check_rank, untouched
from .engine_layout import Layout
from .model import Row, Workload, pct, say
from .scenarios import hops_from_daemons

#: the chat tenant's pace: one request every 20 ms (50/s), under every policy
CHAT_PERIOD_S = 0.02
QOS_INSTANCES = ["chat*=latency", "bulkw3*=bulk:3", "bulk*=bulk", "flood*=latency", "probe*=bulk"]


def _layout(tag: str, wl: Workload, window: int, cfg: dict[str, Any]) -> Layout:
    return Layout({"workload": wl.__dict__, "window": window, "requests": window, "verify": 0, "tag": tag,
                   "seed": cfg["seed"], "prefill_socket": cfg["prefill_socket"], "decode_socket": cfg["decode_socket"],
                   "source_address": cfg.get("source_address"), "gate": True})


class _Instance:
    """One instance pair's ranks, registered, and a driver that keeps ``window`` requests in flight."""

    def __init__(self, tag: str, wl: Workload, window: int, cfg: dict[str, Any]) -> None:
        from .engine_sync import SyncDriver

        class Counting(SyncDriver):
            """Notes when each request completed on every decode rank."""

            def landed(self, ev: dict[str, Any], pending: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
                info = super().landed(ev, pending)
                if info is not None:
                    done_at.append(time.perf_counter())
                return info

        done_at: list[float] = []
        self.done_at = done_at
        self.lay = _layout(tag, wl, window, cfg)
        self.ranks = self.lay.allocate()
        self.result: dict[str, Any] = {"failures": []}
        self.driver = Counting(self.lay, self.ranks, self.result)
        self.count = 0

    def plan(self, n: int) -> list[tuple[str, int | None]]:
        out = [(f"{self.lay.tag}-{self.count + i}", None) for i in range(n)]
        self.count += n
        return out

    def run(self, n: int) -> tuple[float, list[float]]:
        return self.driver.run(self.plan(n))

    def paced(self, n: int, period_s: float) -> list[float]:
        """``n`` requests, the k-th sent no earlier than ``k * period_s`` after the first (at once
        when the one before took longer): a tenant whose requests arrive at a rate of their own, the
        same whatever the daemons' policy, so its load on the host does not grow as QoS serves it
        faster. Each latency runs from its own send."""
        return self.driver.run(_Paced(self.plan(n), period_s))[1]  # type: ignore[arg-type]

    def keep_busy(self, stop: threading.Event, moved: list[tuple[float, int]]) -> None:
        """``window`` requests in flight, a new one as each completes, until ``stop``; then the
        ones in flight finish. Each request's (completion time, bytes) goes to ``moved``."""
        seen = len(self.done_at)
        self.driver.run(_Endless(self, stop))  # type: ignore[arg-type]
        moved.extend((t, self.lay.wl.nbytes) for t in self.done_at[seen:])

    def bad_bytes(self) -> int:
        lay, bad = self.lay, 0
        for r in self.ranks:
            if r.role == "decode":
                for s in lay.sets[:lay.window]:
                    bad += check_rank(r.cache, r.geometry, lay.key, s, lay.n)
                bad += untouched(r.cache, r.geometry, lay.spare)
        return bad

    def close(self) -> None:
        self.driver.close()
        for r in self.ranks:
            r.cache.close()


class _Endless:
    """A plan for the driver's ``run`` that goes on until ``stop``: from then on its length is the
    requests it gave out, so ``run`` issues no more and returns once those completed (a window
    never drains while the tenant is meant to be busy)."""

    def __init__(self, inst: _Instance, stop: threading.Event) -> None:
        self.inst, self.stop = inst, stop
        self.given: list[tuple[str, int | None]] = []

    def __len__(self) -> int:
        return len(self.given) if self.stop.is_set() else 1 << 40

    def __getitem__(self, i: int) -> tuple[str, int | None]:
        while len(self.given) <= i:
            self.given += self.inst.plan(1)
        return self.given[i]


class _Paced:
    """A plan for the driver's ``run`` whose k-th request is handed out no earlier than
    ``k * period_s`` after the first (the driver asks for it when it may send it)."""

    def __init__(self, plan: list[tuple[str, int | None]], period_s: float) -> None:
        self.plan, self.period_s = plan, period_s
        self.t0: float | None = None

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, i: int) -> tuple[str, int | None]:
        if self.t0 is None:
            self.t0 = time.perf_counter()
        wait = self.t0 + i * self.period_s - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return self.plan[i]


def _gbps(moved: list[tuple[float, int]], t0: float, t1: float) -> float | None:
    """Bytes of the rounds that ended inside [t0, t1], over the span from t0 to the last of them."""
    inside = [(t, n) for t, n in moved if t0 <= t <= t1]
    if not inside:
        return None
    return sum(n for _, n in inside) / (inside[-1][0] - t0) / 1e9


class _Tenant:
    """An instance driven from a process of its own, as another tenant's engine is: its driver
    never shares an interpreter lock with the chat requests being timed. ``busy`` keeps its window
    of requests in flight until ``stop``, which answers each request's (completion time, bytes)
    (``time.perf_counter`` reads the same monotonic clock in every process)."""

    def __init__(self, tag: str, wl: Workload, window: int, cfg: dict[str, Any]) -> None:
        import multiprocessing
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_tenant_main, args=(child, tag, wl.__dict__, window, cfg), daemon=True)
        self.proc.start()
        child.close()

    def ready(self) -> None:
        answer = self.conn.recv()
        if answer != "ready":
            raise RuntimeError(f"tenant failed to start: {answer}")

    def busy(self) -> None:
        self.conn.send("busy")

    def stop(self) -> list[tuple[float, int]]:
        self.conn.send("stop")
        return self.conn.recv()

    def close(self) -> dict[str, Any]:
        try:
            self.conn.send("close")
            return self.conn.recv() if self.conn.poll(600) else {"error": "no answer"}
        except (OSError, EOFError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            self.proc.join(60)
            if self.proc.is_alive():
                self.proc.kill()


def _tenant_main(conn: Any, tag: str, wl: dict[str, Any], window: int, cfg: dict[str, Any]) -> None:
    import torch
    torch.set_num_threads(1)
    inst = None
    try:
        inst = _Instance(tag, Workload(**wl), window, cfg)
        inst.run(window)  # warm-up: every destination set written once
        conn.send("ready")
        stop, thread, moved = threading.Event(), None, []
        while True:
            cmd = conn.recv()
            if cmd == "busy":
                stop.clear()
                moved = []
                thread = threading.Thread(target=inst.keep_busy, args=(stop, moved), daemon=True)
                thread.start()
            elif cmd == "stop":
                stop.set()
                if thread is not None:
                    thread.join(600)
                conn.send(moved)
            else:
                conn.send({"bad_bytes": inst.bad_bytes(), "failures": inst.result["failures"][:5]})
                return
    except Exception as exc:  # noqa: BLE001 - reported to the engine process
        conn.send({"error": f"{type(exc).__name__}: {exc}"[:500]})
    finally:
        if inst is not None:
            inst.close()


def _deadline_probe(probe: _Instance) -> dict[str, Any]:
    """One bulk-class request with a 1 ms budget: the time from its send to its failure event."""
    drv, lay = probe.driver, probe.lay
    (req, _), = probe.plan(1)
    for r in drv.decode:
        r.client.expect(r.rid, req, source_instance=lay.pinst, source_address=lay.source_address,
                        pages=lay.sets[0], num_tokens=lay.n)
    drv.wait_known(req)
    p = drv.prefill[0]
    t0, sent_ns = time.perf_counter(), time.monotonic_ns()
    p.client.send(p.rid, req, pages=lay.src_pages, start=0, end=lay.n, last=True, budget_ms=1.0)
    call_ms = (time.perf_counter() - t0) * 1e3  # the send's own round trip to the daemon
    end = time.monotonic() + 60
    while time.monotonic() < end:
        for ev in drv.events(100):
            if ev.get("request_id") == req and ev.get("rank_id") == p.rid:
                out = {"ms": round((time.perf_counter() - t0) * 1e3, 3), "call_ms": round(call_ms, 3),
                       "state": ev.get("state"), "code": ev.get("code"), "reason": (ev.get("reason") or "")[:300]}
                # the daemon's own stamps (daemon.hop_trace): the call reaching its loop, and the failure
                # leaving for the engine; the monotonic clock is the host's, one for every process
                hops = p.client.status().get("hops", {}).get(req, {})
                if "send_in" in hops and "told_prefill" in hops:
                    out["reach_ms"] = round((hops["send_in"] - sent_ns) / 1e6, 3)
                    out["decided_ms"] = round((hops["told_prefill"] - hops["send_in"]) / 1e6, 3)
                return out
    return {"ms": None, "call_ms": round(call_ms, 3), "state": "no event", "code": None, "reason": ""}


def engine_main(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    torch.set_num_threads(1)
    out: dict[str, Any] = {"verified": False}
    chat_wl, bulk_wl = Workload(**cfg["chat"]), Workload(**cfg["bulk"])
    insts: dict[str, _Instance] = {}
    tenants: dict[str, _Tenant] = {}
    try:
        tenants["bulk"] = _Tenant("bulk", bulk_wl, 3, cfg)
        if cfg["qos"]:
            # deep windows: both stay backlogged at the daemon, so the shares are the scheduler's
            tenants["bulk2"] = _Tenant("bulk2", bulk_wl, 8, cfg)
            tenants["bulkw3"] = _Tenant("bulkw3", bulk_wl, 8, cfg)
            tenants["flood"] = _Tenant("flood", chat_wl, 16, cfg)
        insts["chat"] = _Instance("chat", chat_wl, 1, cfg)
        insts["probe"] = _Instance("probe", chat_wl, 1, cfg)
        for inst in insts.values():  # warm-up: every destination set written once
            inst.run(inst.lay.window)
        for tenant in tenants.values():
            tenant.ready()
        n, seconds, period = cfg["chat_requests"], cfg["seconds"], cfg["chat_period_s"]
        chat, bulk = insts["chat"], tenants["bulk"]
        out["idle"] = _latencies(chat.paced(n, period))
        bulk.busy()
        t0 = time.perf_counter()
        time.sleep(seconds)
        out["bulk_alone_gbps"] = _gbps(bulk.stop(), t0, time.perf_counter())
        bulk.busy()
        time.sleep(0.2)  # the bulk window is full before the first chat request
        chat.driver.stamping, chat.driver.stamps = True, {}  # where a chat request's time goes under bulk
        t0 = time.perf_counter()
        loaded = chat.paced(n, period)
        t1 = time.perf_counter()
        chat.driver.stamping = False
        out["under_bulk_hops_us"] = hops_from_daemons(chat.driver.stamps, cfg["prefill_socket"], cfg["decode_socket"])
        out["under_bulk"] = _latencies(loaded)
        out["chat_rate"] = round(n / (t1 - t0), 1)  # requests/s the chat tenant got through under bulk
        out["deadline"] = _deadline_probe(insts["probe"])
        out["bulk_during_gbps"] = _gbps(bulk.stop(), t0, t1)  # None: no bulk request completed while chat ran
        if cfg["qos"]:
            heavy, light = tenants["bulkw3"], tenants["bulk2"]
            heavy.busy()
            light.busy()
            time.sleep(0.5)  # both backlogged
            t0 = time.perf_counter()
            time.sleep(seconds)
            t1 = time.perf_counter()
            got = [sum(b for t, b in tenant.stop() if t0 <= t <= t1) for tenant in (heavy, light)]
            out["weights"] = {"bytes_w3": got[0], "bytes_w1": got[1],
                              "ratio": round(got[0] / got[1], 3) if got[1] else None}
            flood = tenants["flood"]
            bulk.busy()
            flood.busy()
            t0 = time.perf_counter()
            time.sleep(seconds)
            t1 = time.perf_counter()
            moved_f, moved_b = flood.stop(), bulk.stop()
            out["flood"] = {"bulk_gbps": _gbps(moved_b, t0, t1), "flood_gbps": _gbps(moved_f, t0, t1)}
        ends = {tag: tenant.close() for tag, tenant in tenants.items()}
        tenants.clear()
        errors = [f"{tag}: {end['error']}" for tag, end in ends.items() if end.get("error")]
        if errors:
            raise RuntimeError("; ".join(errors))
        failures = [f for inst in insts.values() for f in inst.result["failures"]]
        failures += [f for end in ends.values() for f in end["failures"]]
        # the probe's deadline failure is what it measures, not a failure of the run
        failures = [f for f in failures if not str(f.get("request_id", "")).startswith("probe-") or
                    f.get("code") != "deadline"]
        out["failures"] = failures[:5]
        out["bad_bytes"] = sum(inst.bad_bytes() for inst in insts.values()) + sum(e["bad_bytes"] for e in ends.values())
        out["verified"] = out["bad_bytes"] == 0 and not failures
    except Exception as exc:  # noqa: BLE001 - the orchestrator reports it as a failed row
        out["error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        for tenant in tenants.values():
            tenant.close()
        for inst in insts.values():
            inst.close()
    return out


def _latencies(values: list[float]) -> dict[str, Any]:
    return {"p50_ms": pct(values, 0.5) * 1e3, "p90_ms": pct(values, 0.9) * 1e3, "p99_ms": pct(values, 0.99) * 1e3,
            "slowest_ms": sorted(round(x * 1e3, 2) for x in values)[-5:]}


# -- the orchestrator ------------------------------------------------------------------------------
def _run_policy(transport: str, qos: bool, size: str, seed: int) -> dict[str, Any]:
    from ..sim import Cluster
    toml = (f'[qos]\nenabled = {"true" if qos else "false"}\n'
            f'instances = {json.dumps(QOS_INSTANCES)}\n')
    # daemon.hop_trace: the chat requests' hops under bulk and the deadline probe's, from the daemons' stamps
    env = {"KVXFERD_DAEMON_HOP_TRACE": "1024"}
    if transport == "nixl":  # the bench's other NIXL rows' setup
        env.update({"KVXFERD_PEER_TRANSPORT": "nixl", "UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"})
    cluster = Cluster()
    try:
        a = cluster.daemon("qos-a", extra_toml=toml, env=env)
        b = a if transport == "local" else cluster.daemon("qos-b", extra_toml=toml, env=env)
        tokens = {"full": 2048, "quick": 512, "smoke": 64}[size]
        cfg = {"seed": seed, "qos": qos, "chat": Workload("8B", 16).__dict__, "bulk": Workload("8B", tokens).__dict__,
               "chat_requests": {"full": 400, "quick": 150, "smoke": 10}[size], "chat_period_s": CHAT_PERIOD_S,
               "seconds": {"full": 8.0, "quick": 4.0, "smoke": 0.5}[size],
               "prefill_socket": a.socket_path, "decode_socket": b.socket_path,
               "source_address": None if transport == "local" else a.address}
        proc = subprocess.run([sys.executable, "-m", "kvxferd.tools.bench.qos", json.dumps(cfg)],
                              capture_output=True, text=True, timeout=1800)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            return {"error": f"engine exited {proc.returncode}: {proc.stderr[-400:]}"}
        return json.loads(lines[-1])
    finally:
        cluster.close()


def qos_rows(size: str, seed: int = 1, transports: tuple[str, ...] | None = None) -> list[Row]:
    """Rows for each transport (all three; NIXL where installed, not in a smoke run) and policy."""
    from .peers import nixl_unavailable
    rows: list[Row] = []
    if transports is None:
        transports = ("local", "tcp") if size == "smoke" else ("local", "tcp", "nixl")
    for transport in transports:
        if transport == "nixl" and (why := nixl_unavailable()):
            rows.append(Row("qos nixl", "qos", transport="nixl", skipped=why))
            continue
        got = {}
        for policy in ("fifo", "qos"):
            say(f"qos {transport}: {policy}")
            got[policy] = res = _run_policy(transport, policy == "qos", size, seed)
            name = f"qos {transport} {policy}"
            if res.get("error"):
                rows.append(Row(f"{name} chat under bulk", "qos", transport=transport, error=res["error"]))
                continue
            idle, loaded = res["idle"], res["under_bulk"]
            alone, during = res.get("bulk_alone_gbps"), res.get("bulk_during_gbps")
            rows.append(Row(f"{name} chat idle", "qos", transport=transport, mode=policy, p50_ms=idle["p50_ms"],
                            p99_ms=idle["p99_ms"], verified=res["verified"], workload="8B 16 (one page)"))
            rows.append(Row(f"{name} chat under bulk", "qos", transport=transport, mode=policy,
                            p50_ms=loaded["p50_ms"], p99_ms=loaded["p99_ms"], verified=res["verified"],
                            workload="8B 16 (one page)", extra={
                                "kind": "under_bulk", "vs_idle_p99": round(loaded["p99_ms"] / idle["p99_ms"], 2),
                                "chat_per_s": res.get("chat_rate"),
                                "over_idle_p99_ms": round(loaded["p99_ms"] - idle["p99_ms"], 2),
                                "bulk_alone_gbps": alone, "bulk_during_gbps": during,
                                "bulk_vs_alone": round(during / alone, 3) if alone and during else None,
                                "deadline": res["deadline"], "bad_bytes": res.get("bad_bytes"),
                                "hops_us": res.get("under_bulk_hops_us"),
                                "failures": res.get("failures")}))
            if policy == "qos":
                w, f = res.get("weights") or {}, res.get("flood") or {}
                rows.append(Row(f"{name} bulk weights 3:1", "qos", transport=transport, mode=policy,
                                verified=res["verified"], extra={"kind": "weights", **w}))
                floor = 0.1 * alone if alone else None
                rows.append(Row(f"{name} bulk under a latency flood", "qos", transport=transport, mode=policy,
                                gbps=f.get("bulk_gbps"), verified=res["verified"], extra={
                                    "kind": "flood", **f, "floor_gbps": floor,
                                    "vs_floor": round(f["bulk_gbps"] / floor, 2) if floor and f.get("bulk_gbps") else None}))
            for r in rows[-(4 if policy == "qos" else 2):]:
                say(f"  {r.name}: p50 {r.p50_ms or '-'} p99 {r.p99_ms or '-'} gbps {r.gbps or '-'} {r.extra}")
    return rows


if __name__ == "__main__":
    from .engine import process_main
    sys.exit(process_main(engine_main, "usage: python -m kvxferd.tools.bench.qos CONFIG_JSON  "
                                       "(run it with `kvxferd bench --only qos`)"))

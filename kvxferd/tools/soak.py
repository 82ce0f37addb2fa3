"""``kvxferd soak``: a long mixed run with churn and faults, then everything back to baseline.

Real processes on loopback: one prefill daemon and two decode daemons, one reached over tcp
and one over NIXL (skipped, and said so, where NIXL cannot start here). Instance pairs
(a prefill instance on the prefill daemon, a decode instance on a decode daemon) come and
go with varied geometries (TP mismatched, page sizes mismatched, PP, MLA); each moves
requests of varied lengths, some chunked, a few at a time, then leaves. Engine ranks are
SIGKILLed mid-request and started again; the prefill daemon is SIGKILLed once and started
again on the same ports.

Every decode rank checks its pages against the byte oracle when a request is done, and
before a decode instance leaves, the pages no request ever used must still hold the canary.

The baseline is measured once every pair of the warm-up has left and the daemons are idle
(thread pools, allocator arenas and caches have grown by then); the same figures are
measured at the end, after the last pair left. A violation is: a request with no terminal
outcome, a byte wrong in a request reported done, a byte written outside a destination, a
request entry left, or a daemon figure not back to its baseline (see :data:`TOLERANCES`).
The summary is one JSON object; the exit code is 1 on any violation.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..model.geometry import InstanceSpec, RankGeometry
from ..ops.signals import deferred
from . import procstats
from .sim import Cluster, DaemonProc, Worker

NUM_PAGES = 128
POOL_PAGES = 96  # pages [POOL_PAGES, NUM_PAGES) are never a destination: they must keep the canary
MAX_TOKENS = 60
WINDOW = 4  # requests in flight per pair
TERMINAL_S = 180.0  # a request with no outcome this long after it was issued is stuck (phase timeouts: 20 s each)
AFTER_RESTART_S = 120.0  # how much longer a phase with the restart may run for every transport to carry a request
SETTLE_S = 120.0  # how long the end waits for quarantined rings and dropped agents to go
CONFIG = ("[timeouts]\nbootstrap_s = 20.0\nwaiting_for_input_s = 20.0\ntransfer_s = 20.0\ndrain_grace_s = 1.0\n"
          "handshake_retry_s = 0.2\n")
UCX_ENV = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp", "UCX_MODULES": "^ib"}

#: How far a figure may be from its baseline at the end, and why. Counts of things the daemon
#: holds for instances, requests and peers must come back exactly; process-wide figures may
#: move by what a warm process legitimately grows by.
TOLERANCES: dict[str, tuple[int, str]] = {
    "rss_kb": (64 * 1024, "glibc arenas and free lists, Python and torch caches keep memory freed objects "
                          "used; a leak per request or per instance would pass it over thousands of them"),
    "fds": (4, "ZeroMQ's reaper and I/O threads open eventfds lazily"),
    "maps": (32, "each new thread stack or malloc arena is 2 mappings; pools grow threads on demand"),
}

_BASE = dict(attention="mha", num_layers=4, total_kv_heads=4, head_dim=16, dtype="bfloat16", page_size=4,
             tp_size=1, pp_size=1)


def _spec(**kw: Any) -> InstanceSpec:
    d = {**_BASE, **kw}
    if d["attention"] == "mla":
        d.pop("total_kv_heads")
    return InstanceSpec(**d)


#: (name, prefill spec, decode spec): the geometries instances take in turn
CASES: list[tuple[str, InstanceSpec, InstanceSpec]] = [
    ("tp1-tp1", _spec(), _spec()),
    ("tp2-tp1 head slices", _spec(tp_size=2), _spec()),
    ("tp1-tp2 page4-page8", _spec(), _spec(tp_size=2, page_size=8)),
    ("pp2-pp1 page4-page16", _spec(pp_size=2), _spec(page_size=16)),
    ("mla tp2-tp1", _spec(attention="mla", head_dim=64, tp_size=2), _spec(attention="mla", head_dim=64)),
]


@dataclass
class Request:
    rid: str
    pair: "Pair"
    n: int
    chunked: bool
    src: list[int]
    dst: list[int]
    issued: float
    epoch: int  # the prefill daemon's incarnation count when it was issued (0: before the restart)
    waiting: dict[int, str] = field(default_factory=dict)  # id(worker) -> role, events still due
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)  # roles of ranks killed while it was in flight


class Tally:
    """Outcomes of every request, shared by the pair threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.issued = 0
        self.by_outcome: dict[str, int] = {}
        self.by_transport: dict[str, dict[str, int]] = {}
        #: outcomes by transport of requests issued after the prefill daemon's restart: what a "no byte
        #: moved since the restart" finding is read against
        self.after_restart: dict[str, dict[str, int]] = {}
        self.done_verified = 0
        self.chunked = 0
        self.tp_mismatched = 0
        self.violations: list[str] = []
        self.wrong_bytes = 0
        self.outside_bytes = 0
        self.engine_kills = 0
        self.instances = 0
        self.register_retries = 0
        self.tokens = 0

    def done_after_restart(self, transports: list[str]) -> bool:
        with self.lock:
            return all(self.after_restart.get(t, {}).get("done", 0) > 0 for t in transports)

    def violation(self, what: str) -> None:
        with self.lock:
            if len(self.violations) < 200:
                self.violations.append(what)

    def outcome(self, req: Request) -> None:
        decode = [e for role, e in req.events if role == "decode"]
        wrong = sum(int(e.get("mismatched_bytes") or 0) for e in decode if e.get("state") == "done")
        codes = sorted({str(e.get("code") or e.get("state")) for e in decode
                        if not (e.get("event") == "finished" and e.get("state") == "done")})
        if decode and not codes and not req.killed:
            key = "done"
        elif req.killed:  # what the surviving decode ranks said (none left: the killed one was the decode side)
            said = "+".join(codes) or ("done" if decode else "-")
            key = f"engine_killed:{'+'.join(sorted(set(req.killed)))}/decode {said}"
        else:
            key = "failed:" + "+".join(codes or ["?"])
        with self.lock:
            self.by_outcome[key] = self.by_outcome.get(key, 0) + 1
            t = self.by_transport.setdefault(req.pair.transport, {})
            t[key] = t.get(key, 0) + 1
            if req.epoch > 0:
                t = self.after_restart.setdefault(req.pair.transport, {})
                t[key] = t.get(key, 0) + 1
            if key == "done" and not wrong:
                self.done_verified += 1
            if wrong:
                self.wrong_bytes += wrong
        if wrong:
            self.violation(f"request {req.rid} ({req.pair.case}, {req.pair.transport}) reported done with "
                           f"{wrong} wrong bytes: {decode}")


class Pages:
    def __init__(self, rng: random.Random) -> None:
        self.free = list(range(POOL_PAGES))
        rng.shuffle(self.free)

    def take(self, k: int) -> list[int] | None:
        if len(self.free) < k:
            return None
        out, self.free = self.free[:k], self.free[k:]
        return out

    def give(self, pages: list[int]) -> None:
        self.free.extend(pages)


class Pair:
    """A prefill instance and a decode instance, their requests, kills and departure."""

    def __init__(self, soak: "Soak", seq: int, transport: str, case: tuple[str, InstanceSpec, InstanceSpec],
                 requests: int) -> None:
        self.soak = soak
        self.seq = seq
        self.transport = transport
        self.case, self.pspec, self.dspec = case
        self.requests = requests
        self.rng = random.Random(f"{soak.seed}-{seq}")
        self.name = f"{soak.tag}-{seq}"
        self.prefill: list[Worker] = []
        self.decode: list[Worker] = []
        self.inflight: dict[str, Request] = {}
        self.src = Pages(self.rng)
        self.dst = Pages(self.rng)
        self.epoch = -1  # the prefill daemon's incarnation count its engines registered with

    # -- engines ------------------------------------------------------------------
    def _start(self, daemon: DaemonProc, role: str, spec: InstanceSpec, ranks: list[tuple[int, int]] | None = None
               ) -> list[Worker]:
        coords = ranks or [(tp, pp) for pp in range(spec.pp_size) for tp in range(spec.tp_size)]
        workers = []
        for tp, pp in coords:
            workers.append(self.soak.worker(daemon, f"{self.name}-{role[0]}", role,
                                            RankGeometry(spec, tp, pp, NUM_PAGES)))
        return workers

    def start(self) -> None:
        self.soak.p_ready.wait()
        self.epoch = self.soak.p_epoch
        self.prefill = self._start(self.soak.prefill_daemon, "prefill", self.pspec)
        self.decode = self._start(self.soak.decode_daemons[self.transport], "decode", self.dspec)
        with self.soak.tally.lock:
            self.soak.tally.instances += 2

    def workers(self) -> list[Worker]:
        return self.prefill + self.decode

    # -- requests -----------------------------------------------------------------
    def issue(self, i: int) -> bool:
        n = self.rng.randint(1, MAX_TOKENS)
        src = self.src.take(-(-n // self.pspec.page_size))
        dst = self.dst.take(-(-n // self.dspec.page_size))
        if src is None or dst is None:
            self.src.give(src or [])
            self.dst.give(dst or [])
            return False
        chunks = None
        if n >= 4 and self.rng.random() < 0.5:
            cuts = sorted(self.rng.sample(range(1, n), min(n - 1, self.rng.randint(1, 3))))
            bounds = [0, *cuts, n]
            chunks = [[bounds[k], bounds[k + 1]] for k in range(len(bounds) - 1)]
        rid = f"{self.name}-r{i}"
        req = Request(rid, self, n, chunks is not None, src, dst, time.monotonic(), self.epoch)
        req.waiting = {id(w): w.role for w in self.workers()}
        self.inflight[rid] = req
        expect_first = self.rng.random() < 0.7
        groups = [self.decode, self.prefill] if expect_first else [self.prefill, self.decode]
        for group in groups:
            for w in group:
                if w.role == "decode":
                    self._command(w, req, cmd="expect", request_id=rid, pages=dst, n=n,
                                  source_instance=self.prefill[0].instance,
                                  source_address=self.soak.prefill_daemon.address)
                else:
                    self._command(w, req, cmd="send", request_id=rid, pages=src, n=n, chunks=chunks)
        tally = self.soak.tally
        with tally.lock:
            tally.issued += 1
            tally.chunked += chunks is not None
            tally.tp_mismatched += self.pspec.tp_size != self.dspec.tp_size
            tally.tokens += n
        return True

    def _command(self, w: Worker, req: Request, **cmd: Any) -> None:
        try:
            w.command(**cmd)
        except OSError:  # the engine was killed: its part of the request is over
            self._gone(w, req)

    def _gone(self, w: Worker, req: Request) -> None:
        if req.waiting.pop(id(w), None) is not None and w.role not in req.killed:
            req.killed.append(w.role)

    def poll(self) -> bool:
        """Collect the engines' events; finish requests all of whose ranks reported."""
        progressed = False
        for w in self.workers():
            while not w.events.empty():
                ev = w.events.get_nowait()
                progressed = True
                if ev.get("event") == "exit":
                    for req in list(self.inflight.values()):
                        self._gone(w, req)
                    continue
                req = self.inflight.get(ev.get("request_id") or "")
                if req is None or ev.get("event") not in ("finished", "error"):
                    continue
                if req.waiting.pop(id(w), None) is not None:
                    req.events.append((w.role, ev))
        now = time.monotonic()
        for rid, req in list(self.inflight.items()):
            if not req.waiting:
                self.soak.tally.outcome(req)
                self.src.give(req.src)
                self.dst.give(req.dst)
                del self.inflight[rid]
            elif now - req.issued > TERMINAL_S:
                self.soak.tally.violation(f"request {rid} ({self.case}, {self.transport}) not terminal "
                                          f"{TERMINAL_S:.0f} s after it was issued: waiting for "
                                          f"{sorted(req.waiting.values())}, got {req.events}")
                self.src.give(req.src)
                self.dst.give(req.dst)
                del self.inflight[rid]
        return progressed

    def kill_one(self) -> None:
        """SIGKILL one engine rank of this pair mid-request, then start it again (same instance, same rank)."""
        role = self.rng.choice(["prefill", "decode"])
        group = self.prefill if role == "prefill" else self.decode
        k = self.rng.randrange(len(group))
        victim = group[k]
        victim.kill()
        with self.soak.tally.lock:
            self.soak.tally.engine_kills += 1
        for req in self.inflight.values():
            self._gone(victim, req)
        epoch = self.epoch
        self.drain()  # the other ranks' outcomes first: the rank is back only for the next requests
        daemon = self.soak.prefill_daemon if role == "prefill" else self.soak.decode_daemons[self.transport]
        if role == "prefill" and (epoch != self.epoch or self.epoch != self.soak.p_epoch):
            return  # the prefill daemon restarted meanwhile: restart_prefill_side() replaced (or replaces) them all
        spec = self.pspec if role == "prefill" else self.dspec
        g = victim.geometry
        [replacement] = self._start(daemon, role, spec, [(g.tp_rank, g.pp_rank)])
        group[k] = replacement

    def restart_prefill_side(self) -> None:
        """The prefill daemon is a new process: these engines lost it, so they go and come back."""
        for w in self.prefill:
            w.kill()
            for req in self.inflight.values():
                self._gone(w, req)
        self.soak.p_ready.wait()
        self.epoch = self.soak.p_epoch
        self.drain()  # the decode ranks' outcomes of what was in flight
        self.prefill = self._start(self.soak.prefill_daemon, "prefill", self.pspec)

    def drain(self) -> None:
        """Wait for the outcomes of what is in flight; the prefill ranks' outcomes of requests at a daemon
        that was killed never come, so a restart seen here replaces the prefill side first."""
        while self.inflight:
            if self.epoch != self.soak.p_epoch:
                self.restart_prefill_side()
                continue
            if not self.poll():
                time.sleep(0.01)

    def leave(self) -> None:
        """Finish what is in flight, check the pages no request used, and go (engines exit)."""
        self.drain()
        never = list(range(POOL_PAGES, NUM_PAGES))
        for w in self.decode:
            if w.proc.poll() is not None:
                continue
            try:
                w.command(cmd="untouched", pages=never)
                deadline = time.monotonic() + 60
                while True:
                    ev = w.next_event(max(0.1, deadline - time.monotonic()))
                    if ev.get("event") == "untouched":
                        bad = int(ev["bad_bytes"])
                        if bad:
                            with self.soak.tally.lock:
                                self.soak.tally.outside_bytes += bad
                            self.soak.tally.violation(f"{bad} bytes written outside any destination in "
                                                      f"decode rank {w.rank_id} ({self.case}, {self.transport})")
                        break
                    if ev.get("event") == "exit":
                        break
            except Exception as exc:  # noqa: BLE001 - a check that could not run is a violation too
                self.soak.tally.violation(f"canary check of {w.rank_id} failed: {exc!r}")
        for w in self.workers():
            w.close()

    def run(self) -> None:
        self.start()
        i = 0
        kill_at = self.rng.randrange(2, self.requests) if self.rng.random() < self.soak.kill_rate else -1
        # a pair that started runs its requests to the end (engines start slowly on a busy machine: a phase's
        # end only keeps new pairs from starting)
        while i < self.requests or self.inflight:
            if self.epoch != self.soak.p_epoch:
                self.restart_prefill_side()
            while i < self.requests and len(self.inflight) < WINDOW and self.issue(i):
                i += 1
                if i == kill_at:
                    self.kill_one()
            if not self.poll():
                time.sleep(0.005)
        self.leave()


class Soak:
    def __init__(self, duration: float, seed: int, transports: list[str], pairs_per_transport: int,
                 kill_rate: float, warmup: float, progress: Any) -> None:
        self.duration = duration
        self.seed = seed
        self.transports = transports
        self.pairs_per_transport = pairs_per_transport
        self.kill_rate = kill_rate
        self.warmup = warmup
        self.progress = progress or (lambda line: None)
        self.tag = f"soak{os.getpid()}"
        self.cluster = Cluster()
        self.tally = Tally()
        self.p_ready = threading.Event()
        self.p_epoch = 0
        self.seq = 0
        self.seq_lock = threading.Lock()
        self.rng = random.Random(seed)
        self.workers_lock = threading.Lock()
        self.all_workers: list[Worker] = []
        self.closing = False
        self.prefill_daemon: DaemonProc
        self.decode_daemons: dict[str, DaemonProc] = {}
        self.restarted: dict[str, Any] = {}
        self.starting: list[threading.Thread] = []  # daemons being started: close() waits for them

    def worker(self, daemon: DaemonProc, instance: str, role: str, geometry: RankGeometry) -> Worker:
        """A registered engine rank; a rank started again right after its predecessor was killed may be
        refused until the daemon noticed the death, so registration is tried again for a while."""
        deadline = time.monotonic() + 120
        while True:
            with self.workers_lock:  # close() kills every engine started before it, and no engine starts after
                if self.closing:
                    raise RuntimeError("the soak is stopping")
                w = Worker(daemon, instance, role, geometry, wait=False)
                self.all_workers.append(w)
            try:
                w.wait_registered()
                return w
            except Exception as exc:  # noqa: BLE001 - refused (or the daemon is restarting): try again
                w.kill()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{instance} {role} rank never registered: {exc}") from exc
                with self.tally.lock:
                    self.tally.register_retries += 1
                time.sleep(0.5)

    def start_daemons(self) -> None:
        nixl_env = {**UCX_ENV, "KVXFERD_PEER_TRANSPORT": "nixl"}
        p = self.cluster.daemon("soak-p", extra_toml=CONFIG, start=False)
        wanted = [(p, nixl_env if "nixl" in self.transports else {})]
        for t in self.transports:
            d = self.cluster.daemon(f"soak-d{t}", extra_toml=CONFIG, start=False)
            self.decode_daemons[t] = d
            wanted.append((d, nixl_env if t == "nixl" else {}))
        self.envs = {d.name: env for d, env in wanted}
        self.starting = [threading.Thread(target=d.start, args=(env or None,)) for d, env in wanted]
        for t in self.starting:
            t.start()
        for t in self.starting:
            t.join()
        for d, _ in wanted:
            if d.proc is None or d.proc.poll() is not None:
                raise RuntimeError(f"daemon {d.name} did not start: {d.log()[-2000:]}")
        self.prefill_daemon = p
        self.p_ready.set()

    def daemons(self) -> list[DaemonProc]:
        return [self.prefill_daemon, *self.decode_daemons.values()]

    def restart_prefill_daemon(self) -> None:
        d = self.prefill_daemon
        old = status(d)["incarnation"]
        self.p_ready.clear()
        t0 = time.monotonic()
        d.signal(signal.SIGKILL)
        d.proc.wait()
        self.p_epoch += 1
        d.start(self.envs[d.name] or None)
        new = status(d)["incarnation"]
        self.restarted = {"daemon": d.name, "old_incarnation": old, "new_incarnation": new,
                          "down_s": round(time.monotonic() - t0, 2), "at_s": round(time.monotonic() - self.t0, 1)}
        self.p_ready.set()
        self.progress(f"restarted {d.name}: incarnation {old} -> {new}")

    # -- phases -------------------------------------------------------------------
    def run_phase(self, seconds: float, restart_at: float | None = None) -> None:
        """Pair slots run pairs one after another until ``seconds`` pass; then every pair leaves."""
        stop = threading.Event()
        errors: list[BaseException] = []

        def slot(transport: str) -> None:
            try:
                while not stop.is_set():
                    with self.seq_lock:
                        self.seq += 1
                        seq = self.seq
                        case = CASES[self.rng.randrange(len(CASES))]
                        requests = self.rng.randint(12, 40)
                    Pair(self, seq, transport, case, requests).run()
            except BaseException as exc:  # noqa: BLE001 - reported by the phase
                errors.append(exc)
                stop.set()

        threads = [threading.Thread(target=slot, args=(t,), daemon=True)
                   for t in self.transports for _ in range(self.pairs_per_transport)]
        for t in threads:
            t.start()
        started = time.monotonic()
        restarted = restart_at is None
        while not stop.is_set():
            elapsed = time.monotonic() - started
            if not restarted and elapsed >= restart_at:
                self.restart_prefill_daemon()
                restarted = True
            # on a slow machine the pairs in flight at the restart may take the rest of the phase to recover:
            # the phase goes on (boundedly) until every transport finished a request at the new daemon
            if elapsed >= seconds and (restart_at is None or self.tally.done_after_restart(self.transports)
                                       or elapsed >= seconds + AFTER_RESTART_S):
                break
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        for d in self.daemons():
            while True:
                st = status(d)
                if not st["requests"] and not st["ranks"]:
                    break
                if time.monotonic() > deadline:
                    self.tally.violation(f"{d.name} still holds requests {st['requests']} and "
                                         f"{len(st['ranks'])} ranks after every instance left")
                    break
                time.sleep(0.1)

    def run(self) -> dict[str, Any]:
        self.t0 = time.monotonic()
        self.start_daemons()
        nixl_skipped = ""
        self.progress(f"daemons up; warm-up {self.warmup:.0f} s")
        self.run_phase(self.warmup)
        self.wait_idle()
        time.sleep(1.0)
        baseline = {d.name: measure(d) for d in self.daemons()}
        warm_issued = self.tally.issued
        main = max(1.0, self.duration - self.warmup)
        self.progress(f"baseline taken; soak {main:.0f} s, prefill daemon restarted at {0.4 * main:.0f} s")
        samples: list[dict[str, Any]] = []
        sampler_stop = threading.Event()

        def sample() -> None:
            while not sampler_stop.wait(max(5.0, main / 60)):
                row: dict[str, Any] = {"t": round(time.monotonic() - self.t0, 1)}
                for d in self.daemons():
                    try:
                        row[d.name] = procstats.rss_kb(d.proc.pid)
                    except (OSError, RuntimeError):
                        row[d.name] = None
                samples.append(row)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        self.run_phase(main, restart_at=0.4 * main)
        sampler_stop.set()
        self.wait_idle()
        end, settle_s = self.settle(baseline)
        return self.summary(baseline, end, settle_s, samples, warm_issued, nixl_skipped)

    def settle(self, baseline: dict[str, dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], float]:
        """The end figures, once they are back (retired rings and dropped agents go after a grace time)."""
        started = time.monotonic()
        while True:
            end = {d.name: measure(d) for d in self.daemons()}
            if not compare(baseline, end) or time.monotonic() - started > SETTLE_S:
                return end, round(time.monotonic() - started, 1)
            time.sleep(1.0)

    def summary(self, baseline: dict[str, Any], end: dict[str, Any], settle_s: float, samples: list[dict[str, Any]],
                warm_issued: int, nixl_skipped: str) -> dict[str, Any]:
        t = self.tally
        violations = list(t.violations) + compare(baseline, end)
        violations += self.leftovers()
        terminal = sum(t.by_outcome.values())
        if terminal != t.issued:
            violations.append(f"{t.issued} requests issued, {terminal} with an outcome")
        sent = procstats.by_label(procstats.scrape(self.prefill_daemon.metrics_url), "kvxferd_sent_bytes_total",
                                  "transport")
        for tr in self.transports:
            if not sent.get(tr):
                violations.append(f"no byte moved over {tr} since the restart ({sent}); outcomes of requests "
                                  f"issued since: {t.after_restart.get(tr, {})}")
        return {
            "requested_duration_s": self.duration, "duration_s": round(time.monotonic() - self.t0, 1),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "run_dir": str(self.cluster.root),
            "warmup_s": self.warmup, "seed": self.seed,
            "transports": self.transports, "nixl": self.nixl_note,
            "requests": {"issued": t.issued, "issued_in_warmup": warm_issued, "terminal": terminal,
                         "done_verified": t.done_verified, "by_outcome": dict(sorted(t.by_outcome.items())),
                         "by_transport": t.by_transport, "by_transport_after_restart": t.after_restart,
                         "chunked": t.chunked, "tp_mismatched": t.tp_mismatched, "tokens": t.tokens},
            "wrong_bytes": t.wrong_bytes, "bytes_outside_destinations": t.outside_bytes,
            "instances": t.instances, "engine_kills": t.engine_kills, "register_retries": t.register_retries,
            "daemon_restart": self.restarted,
            "sent_bytes_since_restart_by_transport": sent,
            "daemons": {name: {"baseline": baseline[name], "end": end[name]} for name in baseline},
            "settle_s": settle_s, "tolerances": {k: {"slack": v[0], "why": v[1]} for k, v in TOLERANCES.items()},
            "rss_kb_samples": samples, "cases": [c[0] for c in CASES],
            "violations": violations, "ok": not violations,
        }

    def leftovers(self) -> list[str]:
        """Engine processes still alive, or kvxferd files of this run in /dev/shm (checked after close)."""
        out = []
        with self.workers_lock:
            alive = [w.proc.pid for w in self.all_workers if w.proc.poll() is None]
        if alive:
            out.append(f"engine processes still running after every instance left: {alive}")
        shm = [n for n in os.listdir("/dev/shm") if n.startswith(f"kvxferd-{self.tag}")] \
            if os.path.isdir("/dev/shm") else []
        if shm:
            out.append(f"files left in /dev/shm: {shm}")
        return out

    def close(self, keep_logs: bool = False) -> list[str]:
        """Stop everything; what outlived it (processes, files, the run dir) is a violation. ``keep_logs``:
        the run dir stays with the daemons' logs (a failed soak), named in the summary."""
        with self.workers_lock:
            self.closing = True
            workers = list(self.all_workers)
        for t in self.starting:  # stopped while daemons started: each is stopped once it runs
            if t.is_alive():
                t.join()
        for w in workers:
            if w.proc.poll() is None:
                w.kill()
        pids = [d.proc.pid for d in self.cluster.daemons.values() if d.proc is not None]
        self.cluster.workers = []
        self.cluster.close(keep_root=keep_logs)
        out = []
        time.sleep(0.2)
        for pid in pids:
            if _alive(pid):
                out.append(f"daemon process {pid} still running")
        for n in (os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []):
            if n.startswith(f"kvxferd-{self.tag}"):
                out.append(f"/dev/shm/{n} left")
                Path("/dev/shm", n).unlink(missing_ok=True)
        if self.cluster.root.exists() and not keep_logs:
            out.append(f"run dir {self.cluster.root} left")
            shutil.rmtree(self.cluster.root, ignore_errors=True)
        return out

    nixl_note = ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def status(d: DaemonProc) -> dict[str, Any]:
    from ..sdk.client import EngineClient
    with EngineClient(d.socket_path, timeout=30) as client:
        return client.status()


def measure(d: DaemonProc) -> dict[str, Any]:
    """One daemon's figures: from /proc, its metrics endpoint (a real HTTP scrape) and its status."""
    assert d.proc is not None
    pid = d.proc.pid
    maps, kv_maps = procstats.mappings(pid)
    m = procstats.scrape(d.metrics_url)
    st = status(d)
    tr = st.get("transports") or {}
    landing = tr.get("landing") or {}
    return {"pid": pid, "rss_kb": procstats.rss_kb(pid), "fds": procstats.open_fds(pid), "maps": maps,
            "kv_cache_maps": len(kv_maps), "kv_cache_mapped": sorted(set(kv_maps)), "threads": procstats.threads(pid),
            "requests": st["requests"], "ranks": len(st["ranks"]),
            "registered_ranks_metric": procstats.summed(m, "kvxferd_registered_ranks"),
            "inflight_metric": procstats.summed(m, "kvxferd_inflight_requests"),
            "staging_slots_in_use": procstats.summed(m, "kvxferd_staging_slots_in_use"),
            "staging_bytes_in_use": procstats.summed(m, "kvxferd_staging_bytes_in_use"),
            "peers": sorted(f"{p['side']}:{p['state']}" for p in st["peers"]),
            "landing_rings": landing.get("rings"), "landing_bytes_held": landing.get("bytes_held"),
            "credits_out": sum((tr.get("credits_out") or {}).values()),
            "nixl_registrations": tr.get("registrations"), "nixl": tr.get("nixl"),
            "transfers": procstats.by_label(m, "kvxferd_transfers_total", "outcome")}


#: figures that must come back exactly (after the settle time)
EXACT = ("requests", "ranks", "registered_ranks_metric", "inflight_metric", "staging_slots_in_use",
         "staging_bytes_in_use", "landing_rings", "landing_bytes_held", "credits_out", "nixl_registrations")
#: NIXL registrations of staging slots stay with the pool for good (bounded by limits.staging_bytes): reported only
GROWS_TO_A_BOUND = ("staging_slots", "device_staging_pools")


def _exact(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if k not in GROWS_TO_A_BOUND}
    return value


def compare(baseline: dict[str, dict[str, Any]], end: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    for name, b in baseline.items():
        e = end[name]
        if e["kv_cache_maps"]:  # every instance left: no engine's KV cache may stay mapped
            out.append(f"{name}: {e['kv_cache_maps']} mappings of departed engines' KV caches "
                       f"({', '.join(e['kv_cache_mapped'])}) with {e['ranks']} ranks registered")
        for key in EXACT:
            if _exact(e.get(key)) != _exact(b.get(key)):
                out.append(f"{name}: {key} {b.get(key)} at baseline, {e.get(key)} at the end")
        for key, (slack, why) in TOLERANCES.items():
            if e[key] > b[key] + slack:
                out.append(f"{name}: {key} {b[key]} at baseline, {e[key]} at the end (more than {slack} over: "
                           f"beyond {why})")
        if e["peers"] != b["peers"]:
            out.append(f"{name}: peers {b['peers']} at baseline, {e['peers']} at the end")
    return out


def run_soak(duration: float, seed: int = 1, transports: list[str] | None = None, pairs_per_transport: int = 2,
             kill_rate: float = 0.3, warmup: float | None = None, progress: Any = None) -> dict[str, Any]:
    wanted = list(transports or ["tcp", "nixl"])
    note = ""
    if "nixl" in wanted:
        from ..transport.nixl.api import available
        ok, why = available()
        if not ok:
            wanted.remove("nixl")
            note = f"skipped: NIXL cannot be imported here ({why})"
    soak = Soak(duration, seed, wanted, pairs_per_transport, kill_rate,
                warmup if warmup is not None else min(120.0, max(20.0, 0.15 * duration)), progress)
    soak.nixl_note = note or ("used" if "nixl" in wanted else "not asked for")
    summary: dict[str, Any] = {}
    try:
        summary = soak.run()
    except Exception as exc:  # noqa: BLE001 - a soak that could not go on is a violation, with what it saw
        t = soak.tally
        summary = {"aborted": f"{type(exc).__name__}: {exc}", "run_dir": str(soak.cluster.root),
                   "requests": {"issued": t.issued, "by_outcome": dict(sorted(t.by_outcome.items()))},
                   "wrong_bytes": t.wrong_bytes, "engine_kills": t.engine_kills, "instances": t.instances,
                   "violations": [*t.violations, f"the soak stopped: {type(exc).__name__}: {exc}"]}
    finally:
        with deferred():  # SIGTERM now would cut the cleanup short: it ends the soak once this is done
            left = soak.close(keep_logs=bool(summary.get("violations")))
        if summary:
            summary["violations"] += left
            summary["ok"] = not summary["violations"]
    return summary


def main(args: Any) -> int:
    from ..ops.signals import cleanup_on_signals
    progress = None if args.json else (lambda line: print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True))
    transports = args.transports.split(",") if args.transports else None
    with cleanup_on_signals():  # SIGTERM/SIGINT/SIGHUP: stop the daemons and engines, remove their files
        summary = run_soak(args.duration, args.seed, transports, args.pairs, args.kill_rate, args.warmup, progress)
    text = json.dumps(summary, indent=None if args.json else 2, default=str)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(text)
    return 0 if summary.get("ok") else 1

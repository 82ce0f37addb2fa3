"""The bench engine with one :class:`EngineClient` per rank: a window of requests in flight,
every rank's events read off its socket as they come. The ``sync`` client makes its calls one
at a time; the ``batch`` client sends the new requests of each turn in one batched call per
rank (``expect_many`` / ``send_many``)."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from .engine_layout import Layout, Rank, failure, finish, interleaved, split_rounds, summary


def _raise_refused(outcomes: list[Any]) -> None:
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome


class SyncDriver:
    def __init__(self, lay: Layout, ranks: list[Rank], result: dict[str, Any]) -> None:
        import zmq

        from ...sdk.client import EngineClient
        self.lay, self.ranks, self.result = lay, ranks, result
        self.failures: list[dict[str, Any]] = result["failures"]
        for r in ranks:
            r.client = EngineClient(lay.socket_of(r), timeout=60)
            r.rid = r.client.register(lay.instance_of(r), r.role, r.geometry, r.cache.descriptors(),
                                      integrity=lay.integrity_of(r))
        self.prefill = [r for r in ranks if r.role == "prefill"]
        #: the decode ranks requests go to now: the plain instance's, or an integrity row's checked one's
        self.decode_of = {checked: [r for r in ranks if r.role == "decode" and r.checked == checked]
                          for checked in (False, True)}
        self.decode = self.decode_of[False]
        self.by_rid = {r.rid: r for r in ranks}
        self.poller = zmq.Poller()
        for r in ranks:
            self.poller.register(r.client.sock, zmq.POLLIN)
        self.prefill_done: dict[str, int] = {}
        #: the "batch" client: a turn's new requests go out in one call per rank
        self.batched = lay.cfg.get("client") == "batch"
        #: latency rows: each request's send and done on the host's monotonic clock (the daemons'
        #: hop stamps use it too), for the per-hop breakdown
        self.stamping = bool(lay.cfg.get("stamps"))
        self.sent_ns: dict[str, int] = {}
        self.stamps: dict[str, tuple[int, int]] = {}

    def events(self, timeout_ms: int) -> list[dict[str, Any]]:
        """Events the clients hold already, else those that arrive within ``timeout_ms``."""
        import zmq

        from ...sdk.client import MAX_REPLY
        from ...wire import protocol
        out: list[dict[str, Any]] = []
        for r in self.ranks:
            while r.client.events:
                out.append(r.client.events.pop(next(iter(r.client.events))))
        if out:
            return out
        ready = dict(self.poller.poll(timeout_ms))
        for r in (r for r in self.ranks if r.client.sock in ready):
            while True:
                try:
                    raw = r.client.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = protocol.decode(raw, MAX_REPLY)
                if msg.get("op") == "event":
                    out.append(msg)
        return out

    def wait_known(self, req: str) -> None:
        """Latency is timed from ``send``: first let the prefill side learn the destination."""
        from ...sdk.client import DaemonError
        deadline = time.monotonic() + 30
        for r in self.prefill:
            while True:
                try:
                    r.client.call("poll", rank_id=r.rid, request_id=req)
                    break
                except DaemonError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.0002)

    def issue(self, req: str, set_idx: int) -> float:
        lay = self.lay
        for r in self.decode:
            r.client.expect(r.rid, req, source_instance=lay.pinst, source_address=lay.source_address,
                            pages=lay.sets[set_idx], num_tokens=lay.n)
        if lay.cfg["gate"]:
            self.wait_known(req)
        t_send = time.perf_counter()
        if self.stamping:
            self.sent_ns[req] = time.monotonic_ns()
        for r in self.prefill:
            r.client.send(r.rid, req, pages=lay.src_pages, start=0, end=lay.n, last=True, aux=b"tok")
        return t_send

    def issue_many(self, reqs: list[tuple[str, int]]) -> float:
        """Every new request of a turn in one batched call per rank (``expect_many``, ``send_many``)."""
        lay = self.lay
        for r in self.decode:
            _raise_refused(r.client.expect_many(r.rid, [
                {"request_id": req, "source_instance": lay.pinst, "source_address": lay.source_address,
                 "pages": lay.sets[set_idx], "num_tokens": lay.n} for req, set_idx in reqs]))
        if lay.cfg["gate"]:
            for req, _ in reqs:
                self.wait_known(req)
        t_send = time.perf_counter()
        if self.stamping:
            self.sent_ns.update((req, time.monotonic_ns()) for req, _ in reqs)
        for r in self.prefill:
            _raise_refused(r.client.send_many(r.rid, [
                {"request_id": req, "pages": lay.src_pages, "start": 0, "end": lay.n, "last": True, "aux": b"tok"}
                for req, _ in reqs]))
        return t_send

    def landed(self, ev: dict[str, Any], pending: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
        """The pending request this event completes (every decode rank done), if any."""
        rank = self.by_rid.get(ev.get("rank_id"))
        req = ev.get("request_id")
        if rank is None:
            return None
        if ev.get("state") != "done":
            self.failures.append(failure(ev))
        if rank.role == "prefill":
            self.prefill_done[req] = self.prefill_done.get(req, 0) + 1
            return None
        info = pending.get(req)
        if info is None:
            return None
        info["left"].discard(rank.rid)
        return pending.pop(req) if not info["left"] else None

    def run(self, plan: list[tuple[str, int | None]], stall_s: float = 120.0,
            checked: bool = False) -> tuple[float, list[float]]:
        """Every request of ``plan``, ``window`` at a time, to the plain decode instance or the
        checked one; (first send to last done, latencies)."""
        self.decode = self.decode_of[checked]
        free = deque(range(self.lay.window))
        pending: dict[str, dict[str, Any]] = {}
        latencies: list[float] = []
        first = last = None
        i = done = 0
        last_progress = time.monotonic()
        while done < len(plan):
            turn: list[tuple[str, int, bool]] = []
            while i < len(plan) and len(pending) + len(turn) < self.lay.window:
                req, fixed = plan[i]
                turn.append((req, fixed if fixed is not None else free.popleft(), fixed is None))
                i += 1
            if turn and self.batched:
                t_send = self.issue_many([(req, set_idx) for req, set_idx, _ in turn])
                times = [t_send] * len(turn)
            else:
                times = [self.issue(req, set_idx) for req, set_idx, _ in turn]
            for (req, set_idx, rotating), t_send in zip(turn, times):
                first = first if first is not None else t_send
                pending[req] = {"set": set_idx, "rotating": rotating, "t": t_send,
                                "left": {r.rid for r in self.decode}}
            for ev in self.events(200):
                info = self.landed(ev, pending)
                if info is None:
                    continue
                last = time.perf_counter()
                latencies.append(last - info["t"])
                if self.stamping and ev.get("request_id") in self.sent_ns:
                    self.stamps[ev["request_id"]] = (self.sent_ns.pop(ev["request_id"]), time.monotonic_ns())
                if info["rotating"]:
                    free.append(info["set"])
                done += 1
                last_progress = time.monotonic()
            if time.monotonic() - last_progress > stall_s:
                raise TimeoutError(f"no request finished for {stall_s:.0f}s; {len(pending)} pending")
        return ((last or 0.0) - (first or 0.0)), latencies

    def missing_prefill(self, want: list[str], wait_s: float = 60.0) -> int:
        """Prefill-side done events not seen (each prefill rank reports every request once)."""
        expected = len(want) * len(self.prefill)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and sum(self.prefill_done.get(q, 0) for q in want) < expected:
            for ev in self.events(200):
                self.landed(ev, {})
        return expected - sum(self.prefill_done.get(q, 0) for q in want)

    def close(self) -> None:
        for r in self.ranks:
            if r.client is None:
                continue
            try:
                if r.rid:
                    r.client.unregister(r.rid)
            except Exception:  # noqa: BLE001 - the daemon may be gone
                pass
            r.client.close()


def drive_sync(lay: Layout, ranks: list[Rank], result: dict[str, Any], t_setup: float) -> None:
    driver = None
    try:
        driver = SyncDriver(lay, ranks, result)
        result["setup_s"] = round(time.perf_counter() - t_setup, 3)
        t_warm = time.perf_counter()
        driver.run(lay.warmup_plan())
        if lay.integrity:
            driver.run(lay.checked_plan(lay.warmup_plan()), checked=True)
        lay.reset_checked(ranks)
        result["warmup_s"] = round(time.perf_counter() - t_warm, 3)
        if result["failures"]:
            raise RuntimeError("warm-up requests failed")
        plan = lay.timed_plan()
        driver.stamps.clear()  # the warm-up's are not the row's
        rounds, lat, plain = [], [], []
        for part in split_rounds(plan, lay.cfg.get("rounds", 1)):
            if lay.integrity:  # an integrity row: each checked round right after the same round plain
                seconds, _ = driver.run(part)
                plain.append((len(part), seconds))
                part = lay.checked_plan(part)
            seconds, part_lat = driver.run(part, checked=bool(lay.integrity))
            rounds.append((len(part), seconds))
            lat += part_lat
        result.update(summary(lay, rounds, lat))
        if lay.integrity:
            result.update(interleaved(lay, plain, rounds))
            plan = plan + lay.checked_plan(plan)
        if driver.stamping:
            result["engine_ns"] = {req: list(ns) for req, ns in driver.stamps.items()}
        finish(lay, ranks, result, driver.missing_prefill([req for req, _ in plan]))
    finally:
        if driver is not None:
            driver.close()
        else:  # registration failed part-way: close the clients that opened
            for r in ranks:
                if r.client is not None:
                    r.client.close()

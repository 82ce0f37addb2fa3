"""The data plane: chunk jobs on threads, reported back to the loop as lifecycle events.

Transports block; they run here, never on the event loop. Whatever a thread learns (a job
returned, a destination's accounting changed, a chunk was refused) reaches the lifecycle
core as an event posted with ``loop.call_soon_threadsafe``.

Which queued job a thread runs next is the QoS scheduler's choice
(:mod:`kvxferd.transport.scheduler`): latency-class work first with a floor of thread time kept
for bulk, instances weighted inside a class, the earliest deadline first inside an instance.
``qos.latency_threads`` threads of their own take latency work only, so a latency chunk never
waits for a thread behind bulk chunks already running. A job whose deadline cannot be met given
what is queued ahead of it (at the rate this transport's jobs have been moving) fails ``deadline``
at once, before a byte moves; one that waited past its deadline fails when its turn comes.

Small chunks travel together: a transport that can move several jobs in one go names a
batch key for each small job (tcp: the destination's data address; local: one key), and a
data thread takes the jobs queued right behind one of the same instance with that key, up to
``batch_jobs`` of them and ``BATCH_BYTES`` in all, in one hand-off. tcp sends them back to back
on one connection and reads their acknowledgements after
(:meth:`~kvxferd.transport.tcp.TcpTransport.send_many`); their outcomes come back to the loop in
one post.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable

from ..errors import KvxferError
from ..lifecycle import effects, events
from ..lifecycle.inbox import DestEntry
from ..lifecycle.jobs import Moved
from ..model.qos import CLASSES, LATENCY
from ..ops.hops import TRACE
from ..ops.metrics import Metrics
from .base import Transport, nice_this_thread
from .scheduler import Pick, Scheduler

log = logging.getLogger("kvxferd.data")

BATCH_BYTES = 4 << 20  # bytes of small chunks one hand-off carries at most
#: a chunk a transport can move without blocking (a local copy of host memory) this small runs on
#: the loop: a data thread's hand-off and the post back cost more than the copy (hop stamps of a
#: one-page local request: 140-160 us to reach a thread, for an 8 KiB copy)
INLINE_BYTES = 64 << 10
INLINE_BUDGET = 1 << 20  # bytes moved on the loop per loop turn at most; past it, jobs go to threads
#: how much the rate of the last job of a transport counts in its estimate (the rest: those before)
RATE_WEIGHT = 0.2
#: jobs smaller than this teach the rate estimate nothing (their time is overhead, not bytes)
RATE_MIN_BYTES = 256 << 10


def deadline_error(message: str) -> KvxferError:
    return KvxferError(message, code="deadline",
                       fix="recompute the request, or give it a longer budget (budget_ms)")


@dataclass
class _Queued:
    effect: effects.StartJob
    transport: Transport
    queued: float
    batched: bool  # the transport named a batch key for it: it goes through ``send_many``


@dataclass
class _Flow:
    """What one instance's work of one class is doing now (``status``)."""

    queued_jobs: int = 0
    queued_bytes: int = 0
    running: int = 0
    bytes: int = 0


class DataPlane:
    def __init__(self, threads: int, metrics: Metrics, dispatch: Callable[[Any], Any],
                 batch_jobs: int = 64, *, qos: bool = True, bulk_floor: float = 0.1,
                 latency_threads: int = 1, bulk_nice: int = 0) -> None:
        self.metrics = metrics
        self.dispatch = dispatch
        self.batch_jobs = max(1, batch_jobs)
        self.loop: asyncio.AbstractEventLoop | None = None  # set once the daemon's loop runs
        self._cond = threading.Condition()
        self._sched: Scheduler[_Queued] = Scheduler(bulk_floor, fifo=not qos)
        self.qos = qos
        self.latency_threads = latency_threads if qos else 0
        #: the shared threads' nice value, where a latency lane exists: the kernel then gives a latency
        #: copy the core over bulk copies running beside it (0: as the process)
        self.bulk_nice = bulk_nice if self.latency_threads else 0
        #: bytes per second one job of each transport has been moving (None until one moved enough)
        self._rates: dict[str, float] = {}
        self._flows: dict[tuple[str, str], _Flow] = {}  # (class, instance) -> what it is doing
        #: each data thread running a hand-off now: (the classes it may run, when it took it, its
        #: transport, its bytes); what a deadline estimate counts as ahead of a job when every lane
        #: that could take it is busy
        self._busy: dict[int, tuple[tuple[str, ...], float, str, int]] = {}
        self._closed = False
        self._posted_lock = threading.Lock()
        self._posted: list[Any] = []  # events from threads the loop has not taken yet
        self._inline_used = 0  # bytes moved on the loop this turn (reset at the turn's end)
        self._wake_due = False
        self.threads = threads
        self._started = False

    def _start_threads(self) -> None:
        """On the first job: an app that never moves a byte starts no thread. Daemon threads: a
        send blocked on a dead peer ends with the process instead of holding its exit."""
        self._started = True
        for i in range(self.threads):
            threading.Thread(target=self._work, args=(CLASSES,), name=f"kvxferd-data-{i}", daemon=True).start()
        for i in range(self.latency_threads):
            threading.Thread(target=self._work, args=((LATENCY,),), name=f"kvxferd-data-latency-{i}",
                             daemon=True).start()

    def post(self, event: Any) -> None:
        """From any thread: hand ``event`` to the lifecycle on the loop."""
        self._post_all([event])

    def _post_all(self, found: list[Any]) -> None:
        """Events posted while the loop has not yet taken the earlier ones join them: one wake-up
        of the loop for a burst, not one per event."""
        with self._posted_lock:
            self._posted.extend(found)
            if self._wake_due:
                return
            self._wake_due = True
        if self.loop is not None and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self._dispatch_posted)
                return
            except RuntimeError:  # closed in between: nobody takes events any more
                pass
        with self._posted_lock:
            self._posted.clear()
            self._wake_due = False

    def _dispatch_posted(self) -> None:
        with self._posted_lock:
            found, self._posted = self._posted, []
            self._wake_due = False
        for event in found:
            if TRACE.keep:
                if isinstance(event, events.JobFinished):
                    TRACE.mark(event.entry.request_id, "loop_job")
                elif isinstance(event, events.DestChanged) and event.entry.bytes_received:
                    TRACE.mark(event.entry.request_id, "loop_dest")  # bytes landed, not a chunk admitted
            try:
                self.dispatch(event)
            except Exception:  # noqa: BLE001 - one bad event must not drop the others of the burst
                log.exception("event=dispatch_failed what=%s", type(event).__name__)

    def start(self, effect: effects.StartJob, transport: Transport) -> None:
        if self._inline(effect, transport):
            return
        batch_key = getattr(transport, "batch_key", None)
        key: Hashable = batch_key(effect.job) if batch_key is not None else None
        now = time.monotonic()
        item = _Queued(effect, transport, now, key is not None)
        qos = effect.job.qos
        refused: KvxferError | None = None
        with self._cond:
            queued = not self._closed
            if queued:
                refused = self._admit(effect, qos, now)
            if queued and refused is None:
                self._sched.push(item, qos, effect.job.nbytes, (id(transport), key) if key is not None else None)
                flow = self._flow(qos.cls, qos.instance)
                flow.queued_jobs += 1
                flow.queued_bytes += effect.job.nbytes
                if not self._started:
                    self._start_threads()
                self._cond.notify_all()  # a latency job may be for a thread of its own
        if refused is not None:
            self.metrics.qos_deadline_failures.labels(qos.cls, "admission").inc()
            self._post_all([self._outcome(item, refused, 0.0)])
        elif not queued:
            self._post_all([self._outcome(item, None, 0.0)])

    def _admit(self, effect: effects.StartJob, qos: Any, now: float) -> KvxferError | None:
        """None if the job can be queued; a ``deadline`` error if, given the bytes the scheduler
        would serve before it at the rate this transport's jobs have been moving, it cannot
        finish by its deadline (no rate known yet: it is queued, and judged when its turn comes)."""
        if qos.deadline is None:
            return None
        rate = self._rates.get(effect.kind)
        if not rate:
            return None
        lanes = self.threads + (self.latency_threads if qos.cls == LATENCY else 0)
        ahead = self._sched.ahead_of(qos.cls)
        lane_free = self._lane_free_in(qos.cls, lanes, now)
        need = lane_free + (ahead / lanes + effect.job.nbytes) / rate
        if now + need <= qos.deadline:
            return None
        return deadline_error(
            f"request {effect.job.request_id!r} cannot land by its deadline: it needs about {need * 1e3:.1f} ms "
            f"({effect.job.nbytes} bytes, {ahead} bytes of class {qos.cls} or higher queued ahead, a thread free "
            f"for it in {lane_free * 1e3:.1f} ms, at {rate / 1e9:.2f} GB/s a {effect.kind} job) and "
            f"{max(qos.deadline - now, 0.0) * 1e3:.1f} ms are left")

    def _lane_free_in(self, cls: str, lanes: int, now: float) -> float:
        """Seconds until a data thread that may run ``cls`` is free (0 if one is now): the soonest
        end of the hand-offs running on such threads, each at its transport's rate (one whose rate
        is not known yet counts as ending at once: the estimate never refuses on a guess)."""
        running = [(started, kind, nbytes) for allowed, started, kind, nbytes in self._busy.values() if cls in allowed]
        if len(running) < lanes:
            return 0.0
        ends = [max(nbytes / rate - (now - started), 0.0) if (rate := self._rates.get(kind)) else 0.0
                for started, kind, nbytes in running]
        return min(ends, default=0.0)

    def _flow(self, cls: str, instance: str) -> _Flow:
        flow = self._flows.get((cls, instance))
        if flow is None:
            flow = self._flows[(cls, instance)] = _Flow()
        return flow

    def _inline(self, effect: effects.StartJob, transport: Transport) -> bool:
        """Move a small non-blocking job here, on the loop, within the turn's budget; whether it
        was. Its outcome is posted like a thread's, so the lifecycle sees the same order of events
        as from a data thread that finished at once."""
        job = effect.job
        can = getattr(transport, "runs_inline", None)
        if (self.loop is None or self._closed or job.nbytes > INLINE_BYTES or can is None or not can(job)
                or self._inline_used + job.nbytes > INLINE_BUDGET):
            return False
        if not self._inline_used:
            self.loop.call_soon(self._end_turn)
        self._inline_used += max(job.nbytes, 1)
        item = _Queued(effect, transport, time.monotonic(), False)
        deadline = job.qos.deadline
        if deadline is not None and item.queued > deadline:  # no byte moves for a request already late
            self.metrics.qos_deadline_failures.labels(job.qos.cls, "admission").inc()
            self._post_all([self._outcome(item, deadline_error(
                f"request {job.request_id!r} reached the data plane {(item.queued - deadline) * 1e3:.1f} ms after "
                "its deadline"), 0.0)])
            return True
        TRACE.mark(job.request_id, "data_start")
        try:
            outcome: Moved | BaseException = transport.send(job)
        except Exception as exc:  # noqa: BLE001 - the job reports it, as on a thread
            outcome = exc
        TRACE.mark(job.request_id, "data_end")
        self.metrics.qos_bytes.labels(job.qos.cls).inc(job.nbytes)
        self._post_all([self._outcome(item, outcome, time.monotonic() - item.queued)])
        return True

    def _end_turn(self) -> None:
        self._inline_used = 0

    def _take(self, allowed: tuple[str, ...]) -> tuple[Pick[_Queued], list[_Queued]] | None:
        """The scheduler's next jobs for a thread that runs ``allowed`` classes (as many as one
        hand-off carries), less those whose deadline passed while they waited (posted failed);
        None once closed."""
        while True:
            with self._cond:
                while (pick := self._sched.pop(allowed, self.batch_jobs, BATCH_BYTES)) is None:
                    if self._closed:
                        return None
                    self._cond.wait()
                now = time.monotonic()
                taken, late = [], []
                for item in pick.items:
                    qos = item.effect.job.qos
                    flow = self._flow(qos.cls, qos.instance)
                    flow.queued_jobs -= 1
                    flow.queued_bytes -= item.effect.job.nbytes
                    if qos.deadline is None or now <= qos.deadline:
                        flow.running += 1
                        taken.append(item)
                        continue
                    late.append(item)
                    if not (flow.running or flow.queued_jobs):
                        del self._flows[(qos.cls, qos.instance)]  # bounded by what is queued
                if taken:
                    self._busy[threading.get_ident()] = (allowed, now, taken[0].effect.kind,
                                                         sum(item.effect.job.nbytes for item in taken))
            if late:
                self.metrics.qos_deadline_failures.labels(pick.cls, "queue").inc(len(late))
                self._post_all([self._outcome(item, deadline_error(
                    f"request {item.effect.job.request_id!r} waited {(now - item.queued) * 1e3:.1f} ms in the "
                    f"{pick.cls} queue and its deadline passed {(now - item.effect.job.qos.deadline) * 1e3:.1f} ms "
                    "before its turn came"), 0.0) for item in late])
            if taken:
                return pick, taken

    def _work(self, allowed: tuple[str, ...]) -> None:
        if allowed != (LATENCY,):
            nice_this_thread(self.bulk_nice)
        while True:
            got = self._take(allowed)
            if got is None:
                return
            self._finished(*got, self._run(got[1]))
            # nothing of a finished job may stay referenced while the thread waits for the next:
            # its regions would keep a departed engine's KV cache mapped (the books are kept in a
            # call of their own, so no loop variable outlives it)
            del got

    def _finished(self, pick: Pick[_Queued], taken: list[_Queued], seconds: float) -> None:
        with self._cond:
            self._busy.pop(threading.get_ident(), None)
            self._sched.ran(pick, seconds)
            for item in taken:
                qos, nbytes = item.effect.job.qos, item.effect.job.nbytes
                flow = self._flow(qos.cls, qos.instance)
                flow.running -= 1
                flow.bytes += nbytes
                if not (flow.running or flow.queued_jobs):
                    del self._flows[(qos.cls, qos.instance)]  # bounded by what is queued

    def _learn_rate(self, kind: str, nbytes: int, seconds: float) -> None:
        if nbytes < RATE_MIN_BYTES or seconds <= 0:
            return
        rate = nbytes / seconds
        old = self._rates.get(kind)
        self._rates[kind] = rate if old is None else old + RATE_WEIGHT * (rate - old)

    def _run(self, taken: list[_Queued]) -> float:
        """Run one hand-off and post its outcomes; the seconds it took."""
        started = time.monotonic()
        queue_phase = self.metrics.phase_latency.labels("queue")
        for item in taken:
            queue_phase.observe(started - item.queued)
            qos = item.effect.job.qos
            self.metrics.qos_queue_seconds.labels(qos.cls).observe(started - item.queued)
        self.metrics.handoff_jobs.observe(len(taken))
        transport = taken[0].transport
        jobs = [item.effect.job for item in taken]
        if TRACE.keep:
            for job in jobs:
                TRACE.mark(job.request_id, "data_start")
        try:
            if taken[0].batched:  # even alone: a small chunk's frame leaves in one write
                outcomes: list[Moved | BaseException] = transport.send_many(jobs)  # type: ignore[attr-defined]
            else:
                outcomes = [transport.send(jobs[0])]
        except BaseException as exc:  # noqa: BLE001 - every job of the hand-off reports it
            outcomes = [exc] * len(jobs)
        seconds = time.monotonic() - started
        if TRACE.keep:
            for job in jobs:
                TRACE.mark(job.request_id, "data_end")
        self._learn_rate(taken[0].effect.kind, sum(job.nbytes for job in jobs), seconds)
        for job in jobs:
            self.metrics.qos_bytes.labels(job.qos.cls).inc(job.nbytes)
        self._post_all([self._outcome(item, outcome, seconds) for item, outcome in zip(taken, outcomes)])
        return seconds

    def describe(self) -> dict[str, Any]:
        """``status``: the policy, and per class and instance what is queued, running and moved."""
        with self._cond:
            flows = {f"{cls}/{instance}": dict(vars(flow)) for (cls, instance), flow in sorted(self._flows.items())}
            queued = {cls: dict(zip(("jobs", "bytes"), self._sched.queued(cls))) for cls in CLASSES}
        return {"policy": "qos" if self.qos else "fifo", "bulk_floor": self._sched.bulk_floor,
                "bulk_credit_s": round(self._sched.bulk_credit, 6), "latency_threads": self.latency_threads,
                "bulk_nice": self.bulk_nice,
                "queued": queued, "flows": flows,
                "rates_gbps": {kind: round(rate / 1e9, 3) for kind, rate in sorted(self._rates.items())}}

    @staticmethod
    def _outcome(item: _Queued, outcome: Moved | BaseException | None, seconds: float) -> events.JobFinished:
        """``outcome`` None: the job never ran (the daemon is stopping)."""
        e = item.effect
        if isinstance(outcome, BaseException):
            return events.JobFinished(e.entry, e.target, e.index, e.kind, None, 0.0, outcome)
        return events.JobFinished(e.entry, e.target, e.index, e.kind, outcome, 0.0 if outcome is None else seconds)

    # -- what receiving threads report -------------------------------------------------------------
    def dest_changed(self, entry: DestEntry) -> None:
        self.post(events.DestChanged(entry))

    def chunk_refused(self, entry: DestEntry, code: str, message: str) -> None:
        self.post(events.ChunkRefused(entry, code, message))

    def close(self) -> None:
        """Queued jobs end as cancelled (the lifecycle fails them); running ones finish."""
        with self._cond:
            self._closed = True
            dropped = self._sched.drain()
            self._flows.clear()
            self._cond.notify_all()
        if dropped:
            self._post_all([self._outcome(item, None, 0.0) for item in dropped])

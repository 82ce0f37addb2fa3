"""The data plane: chunk jobs on threads, reported back to the loop as lifecycle events.

Transports block; they run here, never on the event loop. Whatever a thread learns (a job
returned, a destination's accounting changed, a chunk was refused) reaches the lifecycle
core as an event posted with ``loop.call_soon_threadsafe``.

Small chunks travel together: a transport that can move several jobs in one go names a
batch key for each small job (tcp: the destination's data address; local: one key), and a
data thread takes every queued job of one key, up to ``batch_jobs`` of them and
``BATCH_BYTES`` in all, in one hand-off. tcp sends them back to back on one connection and
reads their acknowledgements after (:meth:`~kvxferd.transport.tcp.TcpTransport.send_many`);
their outcomes come back to the loop in one post. Keys take turns, so one busy peer does not
starve another.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Hashable

from ..lifecycle import effects, events
from ..lifecycle.inbox import DestEntry
from ..lifecycle.jobs import Moved
from ..ops.hops import TRACE
from ..ops.metrics import Metrics
from .base import Transport

log = logging.getLogger("kvxferd.data")

BATCH_BYTES = 4 << 20  # bytes of small chunks one hand-off carries at most
#: a chunk a transport can move without blocking (a local copy of host memory) this small runs on
#: the loop: a data thread's hand-off and the post back cost more than the copy (hop stamps of a
#: one-page local request: 140-160 us to reach a thread, for an 8 KiB copy)
INLINE_BYTES = 64 << 10
INLINE_BUDGET = 1 << 20  # bytes moved on the loop per loop turn at most; past it, jobs go to threads


@dataclass
class _Queued:
    effect: effects.StartJob
    transport: Transport
    queued: float
    batched: bool  # the transport named a batch key for it: it goes through ``send_many``


class DataPlane:
    def __init__(self, threads: int, metrics: Metrics, dispatch: Callable[[Any], Any],
                 batch_jobs: int = 64) -> None:
        self.metrics = metrics
        self.dispatch = dispatch
        self.batch_jobs = max(1, batch_jobs)
        self.loop: asyncio.AbstractEventLoop | None = None  # set once the daemon's loop runs
        self._cond = threading.Condition()
        self._queues: dict[Hashable, deque[_Queued]] = {}
        self._turns: deque[Hashable] = deque()  # keys with queued jobs, in turn order
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
            threading.Thread(target=self._work, name=f"kvxferd-data-{i}", daemon=True).start()

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
        item = _Queued(effect, transport, time.monotonic(), key is not None)
        key = (id(transport), key) if key is not None else object()  # a job of its own
        with self._cond:
            if self._closed:
                queued = None
            else:
                queued = self._queues.get(key)
                if queued is None:
                    queued = self._queues[key] = deque()
                    self._turns.append(key)
                queued.append(item)
                if not self._started:
                    self._start_threads()
                self._cond.notify()
        if queued is None:
            self._post_all([self._outcome(item, None, 0.0)])

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
        TRACE.mark(job.request_id, "data_start")
        try:
            outcome: Moved | BaseException = transport.send(job)
        except Exception as exc:  # noqa: BLE001 - the job reports it, as on a thread
            outcome = exc
        TRACE.mark(job.request_id, "data_end")
        self._post_all([self._outcome(item, outcome, time.monotonic() - item.queued)])
        return True

    def _end_turn(self) -> None:
        self._inline_used = 0

    def _take(self) -> list[_Queued] | None:
        """The next key's queued jobs (as many as one hand-off carries); None once closed."""
        with self._cond:
            while not self._turns:
                if self._closed:
                    return None
                self._cond.wait()
            key = self._turns.popleft()
            queued = self._queues[key]
            taken = [queued.popleft()]
            nbytes = taken[0].effect.job.nbytes
            while queued and len(taken) < self.batch_jobs:
                nbytes += queued[0].effect.job.nbytes
                if nbytes > BATCH_BYTES:
                    break
                taken.append(queued.popleft())
            if queued:
                self._turns.append(key)  # the rest waits its turn behind the other keys
            else:
                del self._queues[key]
            return taken

    def _work(self) -> None:
        while True:
            taken = self._take()
            if taken is None:
                return
            self._run(taken)
            # nothing of a finished job may stay referenced while the thread waits for the next:
            # its regions would keep a departed engine's KV cache mapped
            del taken

    def _run(self, taken: list[_Queued]) -> None:
        started = time.monotonic()
        queue_phase = self.metrics.phase_latency.labels("queue")
        for item in taken:
            queue_phase.observe(started - item.queued)
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
        self._post_all([self._outcome(item, outcome, seconds) for item, outcome in zip(taken, outcomes)])

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
            dropped = [item for queued in self._queues.values() for item in queued]
            self._queues.clear()
            self._turns.clear()
            self._cond.notify_all()
        if dropped:
            self._post_all([self._outcome(item, None, 0.0) for item in dropped])

"""The data plane: chunk jobs on threads, reported back to the loop as lifecycle events.

Transports block; they run here, never on the event loop. Whatever a thread learns (a job
returned, a destination's accounting changed, a chunk was refused) reaches the lifecycle
core as an event posted with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from .inbox import DestEntry
from .lifecycle import effects, events
from .metrics import Metrics
from .transport.base import ChunkJob, Moved, Transport


class DataPlane:
    def __init__(self, threads: int, metrics: Metrics, dispatch: Callable[[Any], Any]) -> None:
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="kvxferd-data")
        self.metrics = metrics
        self.dispatch = dispatch
        self.loop: asyncio.AbstractEventLoop | None = None  # set once the daemon's loop runs

    def post(self, event: Any) -> None:
        """From any thread: hand ``event`` to the lifecycle on the loop."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.dispatch, event)

    def start(self, effect: effects.StartJob, transport: Transport) -> None:
        queued = time.monotonic()
        fut = self.executor.submit(self._run, transport, effect.job, queued)
        fut.add_done_callback(lambda f: self._finished(effect, f))

    def _run(self, transport: Transport, job: ChunkJob, queued: float) -> tuple[Moved, float]:
        started = time.monotonic()
        self.metrics.phase_latency.labels("queue").observe(started - queued)
        moved = transport.send(job)
        return moved, time.monotonic() - started

    def _finished(self, effect: effects.StartJob, fut: Future[tuple[Moved, float]]) -> None:
        if fut.cancelled():
            error: BaseException | None = None
            moved, seconds = None, 0.0
        else:
            error = fut.exception()
            moved, seconds = fut.result() if error is None else (None, 0.0)
        self.post(events.JobFinished(effect.entry, effect.target, effect.index, effect.kind, moved, seconds, error))

    # -- what receiving threads report -------------------------------------------------------------
    def dest_changed(self, entry: DestEntry) -> None:
        self.post(events.DestChanged(entry))

    def chunk_refused(self, entry: DestEntry, code: str, message: str) -> None:
        self.post(events.ChunkRefused(entry, code, message))

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

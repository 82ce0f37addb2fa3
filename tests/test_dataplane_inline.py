"""Small jobs of a transport that never blocks run on the event loop, within a budget per turn.

The data plane is the unit here; the transport is a stand-in that records which thread ran each
job (the byte-exact local transfers through real daemons run in the e2e and local suites).
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from kvxferd.lifecycle import effects, events
from kvxferd.lifecycle.jobs import Moved
from kvxferd.model.qos import Qos
from kvxferd.ops.metrics import Metrics
from kvxferd.transport.dataplane import INLINE_BUDGET, INLINE_BYTES, DataPlane


class Recorder:
    """Runs each job at once and notes the thread; ``inline`` says whether it may run on the loop."""

    def __init__(self, inline: bool = True) -> None:
        self.inline = inline
        self.ran: dict[str, str] = {}

    def runs_inline(self, job) -> bool:
        return self.inline

    def send(self, job) -> Moved:
        if job.request_id == "bad":
            raise RuntimeError("copy failed")
        self.ran[job.request_id] = threading.current_thread().name
        return Moved(job.nbytes, 1, "direct")


def _start(plane: DataPlane, transport, request_id: str, nbytes: int) -> None:
    job = SimpleNamespace(request_id=request_id, nbytes=nbytes, qos=Qos())
    entry = SimpleNamespace(request_id=request_id)
    plane.start(effects.StartJob(job, "local", entry, None, 0), transport)


def _run(jobs: list[tuple[str, int]], transport) -> tuple[dict[str, str], list, str]:
    """Start the jobs in one loop turn; (thread per job, events dispatched, the loop's thread)."""
    finished: list = []
    plane = DataPlane(1, Metrics(), finished.append)

    async def main() -> str:
        plane.loop = asyncio.get_running_loop()
        for rid, nbytes in jobs:
            _start(plane, transport, rid, nbytes)
        while len(finished) < len(jobs):  # the data threads' posts come back on this loop
            await asyncio.sleep(0.01)
        return threading.current_thread().name

    loop_thread = asyncio.run(main())
    plane.close()
    return transport.ran, finished, loop_thread


def test_a_small_job_runs_on_the_loop_and_reports_like_a_thread():
    ran, finished, loop = _run([("small", 8 << 10), ("big", INLINE_BYTES + 1)], Recorder())
    assert ran["small"] == loop and ran["big"] != loop and ran["big"].startswith("kvxferd-data")
    assert sorted(e.entry.request_id for e in finished) == ["big", "small"]
    assert all(isinstance(e, events.JobFinished) and e.moved is not None for e in finished)


def test_a_transport_that_may_block_never_runs_on_the_loop():
    ran, _finished, loop = _run([("small", 1024)], Recorder(inline=False))
    assert ran["small"] != loop


def test_one_turn_moves_at_most_the_budget_on_the_loop():
    n = INLINE_BUDGET // INLINE_BYTES + 3
    ran, finished, loop = _run([(f"r{i}", INLINE_BYTES) for i in range(n)], Recorder())
    on_loop = [rid for rid, thread in ran.items() if thread == loop]
    assert len(on_loop) == INLINE_BUDGET // INLINE_BYTES and len(finished) == n


def test_a_failed_inline_job_reports_its_error():
    _ran, finished, _loop = _run([("bad", 1024)], Recorder())
    (ev,) = finished
    assert ev.moved is None and isinstance(ev.error, RuntimeError)

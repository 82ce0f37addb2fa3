"""The data plane under QoS, as a unit: which job a data thread runs next, the latency lane, and
deadlines refused at admission or failed in the queue. A stand-in transport that blocks until
released records the order jobs ran in (byte-exact transfers under QoS through real daemons run
in tests/test_e2e_qos.py)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from types import SimpleNamespace

from kvxferd.lifecycle import effects
from kvxferd.lifecycle.jobs import Moved
from kvxferd.model.qos import BULK, LATENCY, Qos
from kvxferd.ops.metrics import Metrics
from kvxferd.transport.dataplane import DataPlane

WAIT = 60.0  # seconds a test waits for a thread to reach a point: generous, never a measurement


class Gate:
    """A transport whose jobs named ``hold*`` block until released; records the order jobs ran."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.threads: dict[str, str] = {}
        self.nice: dict[str, int] = {}
        self.release = threading.Event()
        self.entered = threading.Event()

    def send(self, job) -> Moved:
        self.threads[job.request_id] = threading.current_thread().name
        self.nice[job.request_id] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        if job.request_id.startswith("hold"):
            self.entered.set()
            assert self.release.wait(WAIT)
        self.order.append(job.request_id)
        return Moved(job.nbytes, 1, "direct")


def _job(rid: str, nbytes: int, cls: str = BULK, instance: str = "i", weight: float = 1.0,
         deadline: float | None = None):
    return SimpleNamespace(request_id=rid, nbytes=nbytes, qos=Qos(cls, instance, weight, deadline))


class Plane:
    def __init__(self, **kw) -> None:
        self.finished: list = []
        self.plane = DataPlane(1, Metrics(), self.finished.append, **kw)
        self.gate = Gate()

    def start(self, job) -> None:
        self.plane.start(effects.StartJob(job, "tcp", SimpleNamespace(request_id=job.request_id), None, 0), self.gate)

    def run(self, script) -> None:
        async def main() -> None:
            self.plane.loop = asyncio.get_running_loop()
            await script(self)
        asyncio.run(main())
        self.plane.close()

    async def until(self, what) -> None:
        end = time.monotonic() + WAIT
        while not what():
            assert time.monotonic() < end, "timed out waiting"
            await asyncio.sleep(0.005)

    def outcome(self, rid: str):
        (found,) = [e for e in self.finished if e.entry.request_id == rid]
        return found


async def _hold_the_shared_thread(p: Plane, nbytes: int) -> None:
    """Jobs of this transport have moved 1 GiB/s, and the one shared thread now runs ``hold``."""
    p.plane._learn_rate("tcp", 1 << 30, 1.0)
    p.start(_job("hold", nbytes))
    assert await asyncio.to_thread(p.gate.entered.wait, WAIT)


def test_latency_work_goes_ahead_of_bulk_queued_before_it():
    p = Plane(latency_threads=0)

    async def script(p: Plane) -> None:
        p.start(_job("hold", 1 << 20))  # the one thread is busy with it
        assert await asyncio.to_thread(p.gate.entered.wait, WAIT)
        for i in range(3):
            p.start(_job(f"bulk{i}", 1 << 20))
        p.start(_job("chat", 4096, LATENCY, "chat"))
        p.gate.release.set()
        await p.until(lambda: len(p.finished) == 5)

    p.run(script)
    assert p.gate.order == ["hold", "chat", "bulk0", "bulk1", "bulk2"]


def test_fifo_keeps_arrival_order_whatever_the_class():
    p = Plane(latency_threads=0, qos=False)

    async def script(p: Plane) -> None:
        p.start(_job("hold", 1 << 20))
        assert await asyncio.to_thread(p.gate.entered.wait, WAIT)
        p.start(_job("bulk0", 1 << 20))
        p.start(_job("chat", 4096, LATENCY, "chat"))
        p.gate.release.set()
        await p.until(lambda: len(p.finished) == 3)

    p.run(script)
    assert p.gate.order == ["hold", "bulk0", "chat"]


def test_a_latency_job_runs_on_its_own_thread_while_bulk_holds_every_shared_one():
    p = Plane(latency_threads=1)

    async def script(p: Plane) -> None:
        p.start(_job("hold", 1 << 20))
        assert await asyncio.to_thread(p.gate.entered.wait, WAIT)
        p.start(_job("chat", 4096, LATENCY, "chat"))
        await p.until(lambda: "chat" in p.gate.order)  # done while "hold" still blocks the shared thread
        assert "hold" not in p.gate.order
        p.gate.release.set()
        await p.until(lambda: len(p.finished) == 2)

    p.run(script)
    assert p.gate.threads["chat"].startswith("kvxferd-data-latency") and p.gate.threads["hold"] == "kvxferd-data-0"


def test_the_shared_threads_run_at_the_bulk_nice_value_and_the_latency_lane_at_the_process_s():
    p = Plane(latency_threads=1, bulk_nice=7)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def script(p: Plane) -> None:
        p.start(_job("hold", 1 << 20))  # the shared thread is busy with it: chat goes to the lane
        assert await asyncio.to_thread(p.gate.entered.wait, WAIT)
        p.start(_job("chat", 4096, LATENCY, "chat"))
        await p.until(lambda: "chat" in p.gate.order)
        p.gate.release.set()
        await p.until(lambda: len(p.finished) == 2)

    p.run(script)
    assert p.gate.nice == {"hold": max(base, 7), "chat": base}, p.gate.nice
    assert p.plane.describe()["bulk_nice"] == 7
    assert DataPlane(1, Metrics(), print, latency_threads=0, bulk_nice=7).bulk_nice == 0  # no lane: no nice


def test_a_job_whose_deadline_passed_in_the_queue_fails_deadline_without_moving():
    p = Plane(latency_threads=0)

    async def script(p: Plane) -> None:
        p.start(_job("hold", 1 << 20))
        assert await asyncio.to_thread(p.gate.entered.wait, WAIT)
        p.start(_job("late", 4096, deadline=time.monotonic()))  # due at once: it cannot be served in time
        p.gate.release.set()
        await p.until(lambda: len(p.finished) == 2)

    p.run(script)
    late = p.outcome("late")
    assert late.moved is None and late.error.code == "deadline" and "waited" in str(late.error)
    assert "late" not in p.gate.order


def test_a_deadline_that_cannot_be_met_given_the_queue_is_refused_at_once():
    p = Plane(latency_threads=0)

    async def script(p: Plane) -> None:
        await _hold_the_shared_thread(p, 1 << 20)
        for i in range(4):
            p.start(_job(f"bulk{i}", 256 << 20))  # 1 GiB queued: about a second's work
        before = len(p.finished)
        p.start(_job("urgent", 1 << 20, deadline=time.monotonic() + 0.1))
        # refused inside the call: its outcome is posted before start returns, ahead of any job
        assert len(p.plane._posted) + len(p.finished) > before
        p.gate.release.set()
        await p.until(lambda: len(p.finished) == 6)

    p.run(script)
    urgent = p.outcome("urgent")
    assert urgent.error.code == "deadline" and "cannot land by its deadline" in str(urgent.error)
    assert "1073741824 bytes of class bulk or higher queued ahead" in str(urgent.error)
    assert "urgent" not in p.gate.order


def test_a_deadline_counts_the_work_running_on_every_thread_that_could_take_it():
    """Nothing queued, but the one shared thread runs a job of 256 GiB at 1 GiB/s: a bulk job due in
    WAIT seconds is refused at once (a thread frees in about four minutes); a latency job with the
    same deadline is not, for the latency lane is free."""
    p = Plane(latency_threads=1)

    async def script(p: Plane) -> None:
        await _hold_the_shared_thread(p, 256 << 30)  # minutes of work, running
        due = time.monotonic() + WAIT
        p.start(_job("urgent-bulk", 4096, deadline=due))
        p.start(_job("urgent-chat", 4096, LATENCY, "chat", deadline=due))
        await p.until(lambda: "urgent-chat" in p.gate.order)
        p.gate.release.set()
        await p.until(lambda: len(p.finished) == 3)

    p.run(script)
    bulk = p.outcome("urgent-bulk")
    assert bulk.error.code == "deadline" and "cannot land by its deadline" in str(bulk.error)
    assert "0 bytes of class bulk or higher queued ahead, a thread free for it in" in str(bulk.error)
    assert "urgent-bulk" not in p.gate.order
    assert p.outcome("urgent-chat").error is None


def test_status_names_the_policy_and_what_each_instance_has_queued():
    p = Plane(latency_threads=0)

    async def script(p: Plane) -> None:
        p.start(_job("hold", 1 << 20, instance="a"))
        assert await asyncio.to_thread(p.gate.entered.wait, WAIT)
        p.start(_job("b0", 4096, instance="b", weight=3.0))
        d = p.plane.describe()
        assert d["policy"] == "qos" and d["queued"]["bulk"] == {"jobs": 1, "bytes": 4096}
        assert d["flows"]["bulk/a"]["running"] == 1 and d["flows"]["bulk/b"]["queued_bytes"] == 4096
        p.gate.release.set()
        await p.until(lambda: len(p.finished) == 2)
        await p.until(lambda: not p.plane.describe()["flows"])  # nothing kept for instances gone idle

    p.run(script)


class _Job:
    """A job that can be watched with a weak reference (a finished job's regions must go)."""

    def __init__(self, rid: str, nbytes: int, cls: str = BULK) -> None:
        self.request_id, self.nbytes, self.qos = rid, nbytes, Qos(cls, "i")


def test_no_finished_job_stays_referenced_while_its_thread_waits_for_the_next():
    """A job holds its rank's regions: kept alive by a data thread's leftover variable, a departed
    engine's KV cache would stay mapped (the soak test's check, here on the unit)."""
    import gc
    import weakref

    p = Plane(latency_threads=1)
    refs = []

    async def script(p: Plane) -> None:
        for rid, cls in (("bulk", BULK), ("chat", LATENCY)):
            job = _Job(rid, 1 << 20, cls)
            refs.append(weakref.ref(job))
            p.start(job)
            del job
        p.gate.release.set()
        await p.until(lambda: len(p.finished) == 2)
        p.finished.clear()  # the events hold entries, not jobs; drop them anyway

        def gone() -> bool:
            gc.collect()
            return all(r() is None for r in refs)
        await p.until(gone)

    p.run(script)

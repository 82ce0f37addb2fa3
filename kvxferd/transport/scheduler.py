"""Which queued chunk job a data thread runs next: node-wide QoS, decided once for every transport.

Every engine on a node shares the daemon's data threads, so the order in which their chunk jobs
leave is the daemon's to choose. This module chooses, and only chooses (sans-I/O: no threads, no
clock of its own; :mod:`kvxferd.transport.dataplane` carries out):

- **Classes.** A job is ``latency`` (a chat request's few pages) or ``bulk``. Latency goes
  first, but bulk keeps a floor: while both classes wait, bulk is owed ``bulk_floor`` of the
  data threads' time, so a latency flood slows bulk to its floor and never stops it. Time, not
  bytes: a one-page job and a 256 MiB job cost the threads very differently per byte.
- **Instances inside a class** share by weight (start-time fair queueing over bytes): two
  backlogged instances weighted 3 and 1 get 3:1 of the bytes. An instance that was idle starts
  level with the others, with no credit banked for its idle time.
- **Inside an instance**, the earliest deadline goes first; without deadlines, first come first
  served.

With ``fifo`` the scheduler keeps the order jobs arrived in, whatever their class (what the daemon
did before QoS, kept for comparing the two in one run).

A job may also be *batched* with the jobs queued right behind it in its instance that share its
batch key (small tcp chunks to one data address leave in one write); :meth:`Scheduler.pop` takes
them together within the caller's limits.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Generic, Hashable, Iterable, TypeVar

from ..model.qos import BULK, CLASSES, LATENCY, Qos

T = TypeVar("T")


@dataclass(order=True)
class _Job(Generic[T]):
    deadline: float
    seq: int
    nbytes: int = field(compare=False)
    batch: Hashable = field(compare=False)  # None: never batched
    item: T = field(compare=False)


@dataclass
class _Flow(Generic[T]):
    """One instance's queued jobs within one class, and its place in the class's fair share."""

    weight: float
    heap: list[_Job[T]] = field(default_factory=list)
    tag: float = 0.0  # its virtual start: the flow with the lowest is served next


@dataclass(frozen=True)
class Pick(Generic[T]):
    """What :meth:`Scheduler.pop` hands a thread: the jobs, their class, and whether the other
    class was waiting when they were chosen (only such work moves the floor's books)."""

    cls: str
    items: list[T]
    contested: bool


@dataclass
class _Class(Generic[T]):
    flows: dict[str, _Flow[T]] = field(default_factory=dict)
    clock: float = 0.0  # virtual time: the tag of the flow served last
    jobs: int = 0
    nbytes: int = 0


class Scheduler(Generic[T]):
    def __init__(self, bulk_floor: float = 0.1, fifo: bool = False) -> None:
        if not 0.0 < bulk_floor < 1.0:
            raise ValueError(f"bulk_floor must lie in (0, 1), got {bulk_floor}")
        self.bulk_floor = bulk_floor
        self.fifo = fifo
        self._classes: dict[str, _Class[T]] = {c: _Class() for c in CLASSES}
        self._seq = itertools.count()
        #: seconds of thread time bulk is owed (>0: bulk goes next while both classes wait);
        #: earned by latency work run while bulk waited, spent by bulk work; forgotten whenever
        #: either class runs dry, so nothing is banked across idle periods
        self.bulk_credit = 0.0

    # -- queueing ----------------------------------------------------------------------------------
    def push(self, item: T, qos: Qos, nbytes: int, batch: Hashable = None) -> None:
        cls = BULK if self.fifo else qos.cls
        if cls not in self._classes:
            raise ValueError(f"qos class {cls!r} is not one of {CLASSES}")
        c = self._classes[cls]
        name = "" if self.fifo else qos.instance
        flow = c.flows.get(name)
        if flow is None:
            # an instance that was idle starts at the class's virtual time: level with the others
            flow = c.flows[name] = _Flow(max(qos.weight, 1e-9), tag=c.clock)
        deadline = math.inf if self.fifo or qos.deadline is None else qos.deadline
        heapq.heappush(flow.heap, _Job(deadline, next(self._seq), nbytes, batch, item))
        c.jobs += 1
        c.nbytes += nbytes

    def __len__(self) -> int:
        return sum(c.jobs for c in self._classes.values())

    def queued(self, cls: str) -> tuple[int, int]:
        """(jobs, bytes) of a class waiting."""
        c = self._classes[BULK if self.fifo else cls]
        return c.jobs, c.nbytes

    def ahead_of(self, cls: str) -> int:
        """Bytes that would be served before a new job of ``cls`` (at most: latency first, then
        bulk) on the shared threads: what a deadline estimate counts."""
        if self.fifo or cls == BULK:
            return sum(c.nbytes for c in self._classes.values())
        return self._classes[LATENCY].nbytes

    def drain(self) -> list[T]:
        """Every queued item, in no particular order; the scheduler is empty after."""
        out = [job.item for c in self._classes.values() for flow in c.flows.values() for job in flow.heap]
        self._classes = {c: _Class() for c in CLASSES}
        self.bulk_credit = 0.0
        return out

    # -- choosing ----------------------------------------------------------------------------------
    def next_class(self, allowed: Iterable[str] = CLASSES) -> str | None:
        """The class a thread that may run ``allowed`` classes serves next, or None (nothing queued)."""
        allowed = tuple(allowed)
        waiting = [c for c in CLASSES if c in allowed and self._classes[c].jobs]
        if self.fifo:
            return waiting[0] if waiting else None
        if not self._classes[LATENCY].jobs or not self._classes[BULK].jobs:
            self.bulk_credit = 0.0
        if len(waiting) < 2:
            return waiting[0] if waiting else None
        return BULK if self.bulk_credit > 0.0 else LATENCY

    def pop(self, allowed: Iterable[str] = CLASSES, max_jobs: int = 1, max_bytes: int = 0) -> Pick[T] | None:
        """The next job of an ``allowed`` class, with the jobs right behind it in its flow that
        share its batch key (``max_jobs`` and ``max_bytes`` in all; the first is taken whatever its size);
        None when no allowed class has work."""
        cls = self.next_class(allowed)
        if cls is None:
            return None
        other = self._classes[BULK if cls == LATENCY else LATENCY]
        contested = not self.fifo and other.jobs > 0
        c = self._classes[cls]
        name, flow = min(c.flows.items(), key=lambda kv: (kv[1].tag, kv[1].heap[0].seq))
        first = heapq.heappop(flow.heap)
        taken = [first]
        total = first.nbytes
        if first.batch is not None:
            while flow.heap and len(taken) < max_jobs:
                nxt = flow.heap[0]
                if nxt.batch != first.batch or total + nxt.nbytes > max_bytes:
                    break
                taken.append(heapq.heappop(flow.heap))
                total += nxt.nbytes
        c.clock = flow.tag
        flow.tag += total / flow.weight
        c.jobs -= len(taken)
        c.nbytes -= total
        if not flow.heap:
            del c.flows[name]
        return Pick(cls, [job.item for job in taken], contested)

    def ran(self, pick: Pick[T], seconds: float) -> None:
        """A thread ran ``pick`` for ``seconds``: the floor's books (call after every pop). Only
        work chosen while the other class waited counts: latency run while bulk waited earns bulk
        its share, bulk run while latency waited spends it."""
        if not pick.contested:
            return
        if pick.cls == BULK:
            self.bulk_credit -= seconds
        else:
            self.bulk_credit += seconds * self.bulk_floor / (1.0 - self.bulk_floor)

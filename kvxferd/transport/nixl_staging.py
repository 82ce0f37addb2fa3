"""Staged transfers over NIXL: landing rings on the decode side, credits on the prefill side.

A sliced plan (TP mismatch) cuts every token row into head slices of a few hundred bytes.
As one NIXL descriptor each, posting them costs more than moving them. Staged, the sender
gathers a block of tokens (every layer and kind of its writer) into one registered
staging slot and WRITEs it with one descriptor into a slot of the receiver's landing
ring. The WRITE's notification is an ordinary data header plus ``ring`` and ``slot``: the
receiver checks it like any chunk header, scatters the slot into the decode pages with
its own page table, and hands the slot back with a ``free`` notification.

- A **landing ring** belongs to one source daemon link: ``limits.nixl_landing_slots``
  slots of ``limits.staging_slot_bytes``, registered on its own so that a peer's remote
  key covers its ring and nothing else. All rings together stay within
  ``limits.nixl_landing_bytes``; a link that finds no room gets no ring and its sliced
  plans run direct (one descriptor per slice), which is slow but correct.
- The sender holds the ring's slots as **credits**. It writes only into a slot it holds
  and gets the slot back only from the receiver's ``free``, so a slot is never written
  while it is being scattered. A sender out of credits waits (back-pressure) within the
  transfer deadline.
- A ring is **retired** when its link goes down; its memory is kept for a quarantine
  period before it is freed, because a WRITE posted before the link went down can still
  land.

Everything here is bookkeeping and memory; the NIXL calls live in :mod:`.nixl`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import TransferError

#: a credit wait re-checks its abandon conditions (peer dead, shutdown) this often
CREDIT_POLL_S = 0.05


@dataclass(frozen=True)
class RingInfo:
    """What a sender needs to write into a landing ring; travels as a 5-int list."""

    ring: int  # id, unique per receiving daemon
    address: int  # base address of slot 0
    slot_bytes: int
    count: int
    device: int  # -1: host memory

    def to_wire(self) -> list[int]:
        return [self.ring, self.address, self.slot_bytes, self.count, self.device]

    @classmethod
    def from_wire(cls, value: list[int]) -> "RingInfo":
        return cls(*(int(v) for v in value))

    def slot_address(self, slot: int) -> int:
        return self.address + slot * self.slot_bytes


def block_tokens(slot_bytes: int, n_regions: int, slice_bytes: int) -> int:
    """Tokens of one writer that fit a slot: every region's slice of each token travels together."""
    per_token = n_regions * slice_bytes
    if per_token > slot_bytes:
        raise TransferError(f"one token of this writer ({n_regions} regions x {slice_bytes}-byte slices = "
                            f"{per_token} bytes) does not fit a staging slot of {slot_bytes} bytes",
                            field="limits.staging_slot_bytes", code="staging_too_small",
                            fix=f"raise limits.staging_slot_bytes to at least {per_token} on both daemons, "
                                "or use mode=direct")
    return slot_bytes // per_token


def sub_ranges(start: int, end: int, per_block: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into consecutive ranges of at most ``per_block`` tokens."""
    return [(lo, min(lo + per_block, end)) for lo in range(start, end, per_block)]


class LandingRing:
    """Decode side: the slots one source daemon link writes staged blocks into."""

    def __init__(self, ring: int, source: str, count: int, slot_bytes: int) -> None:
        self.ring = ring
        self.source = source  # control address of the source daemon
        self.count = count
        self.slot_bytes = slot_bytes
        self.buffer = torch.empty(count * slot_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self.agent = ""  # the source daemon's NIXL agent, once its handshake answer names it
        self.reg_descs: object = None  # the NIXL registration of ``buffer``
        self.metadata: bytes = b""  # partial agent metadata describing ``buffer`` only

    @property
    def nbytes(self) -> int:
        return self.count * self.slot_bytes

    @property
    def info(self) -> RingInfo:
        return RingInfo(self.ring, self.buffer.data_ptr(), self.slot_bytes, self.count, -1)

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        start = index * self.slot_bytes
        return self.buffer[start:start + nbytes]


class Credits:
    """Prefill side: the slots of one remote landing ring, and which of them this daemon holds."""

    def __init__(self, agent: str, info: RingInfo) -> None:
        self.agent = agent
        self.info = info
        self._free = list(range(info.count - 1, -1, -1))
        self._out: set[int] = set()
        self._cond = threading.Condition()

    @property
    def outstanding(self) -> int:
        with self._cond:
            return len(self._out)

    def acquire(self, deadline: float, abandoned: Callable[[], str]) -> int:
        """A free slot of the remote ring; waits for one until ``deadline`` or until ``abandoned`` says why not."""
        with self._cond:
            while not self._free:
                why = abandoned()
                if why:
                    raise TransferError(f"staged NIXL block abandoned while waiting for a landing slot: {why}",
                                        field="transport", code="peer_dead")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(f"no landing slot of {self.agent} came free within the transfer deadline "
                                        f"({self.info.count} slots, all written and not yet scattered)",
                                        field="limits.nixl_landing_slots", code="staging_timeout",
                                        fix="raise limits.nixl_landing_slots on the decode daemon, or check it "
                                            "is not overloaded")
                self._cond.wait(min(left, CREDIT_POLL_S))
            slot = self._free.pop()
            self._out.add(slot)
            return slot

    def release(self, slot: int) -> bool:
        """Give a slot back; False if this daemon did not hold it (a repeated or stray ``free``)."""
        with self._cond:
            if slot not in self._out:
                return False
            self._out.remove(slot)
            self._free.append(slot)
            self._cond.notify()
            return True


class LandingRings:
    """Decode side: one ring per source daemon link, bounded in total, with a quarantine for retired ones."""

    def __init__(self, slots_per_ring: int, slot_bytes: int, budget_bytes: int, quarantine_s: float,
                 register: Callable[[LandingRing], None], deregister: Callable[[LandingRing], None]) -> None:
        self.slots_per_ring = slots_per_ring
        self.slot_bytes = slot_bytes
        self.budget_bytes = budget_bytes
        self.quarantine_s = quarantine_s
        self._register = register
        self._deregister = deregister
        self._rings: dict[str, LandingRing] = {}  # by source daemon address
        self._retired: list[tuple[float, LandingRing]] = []
        self._next = 1
        self._lock = threading.Lock()

    @property
    def bytes_held(self) -> int:
        """Memory of live and quarantined rings: what counts against the budget."""
        with self._lock:
            return sum(r.nbytes for r in self._rings.values()) + sum(r.nbytes for _t, r in self._retired)

    def for_source(self, source: str) -> tuple[LandingRing | None, str]:
        """The ring of a source daemon link, created on first use; (None, why) when there is none."""
        self.sweep()
        with self._lock:
            ring = self._rings.get(source)
            if ring is not None:
                return ring, ""
            if self.slots_per_ring <= 0:
                return None, "limits.nixl_landing_slots is 0"
            size = self.slots_per_ring * self.slot_bytes
            held = sum(r.nbytes for r in self._rings.values()) + sum(r.nbytes for _t, r in self._retired)
            if held + size > self.budget_bytes:
                return None, (f"limits.nixl_landing_bytes ({self.budget_bytes}) is taken by "
                              f"{len(self._rings)} rings and {len(self._retired)} in quarantine")
            ring = LandingRing(self._next, source, self.slots_per_ring, self.slot_bytes)
            self._next += 1
        self._register(ring)  # raises if NIXL refuses: no ring then
        with self._lock:
            self._rings[source] = ring
        return ring, ""

    def by_agent(self, agent: str) -> LandingRing | None:
        with self._lock:
            for ring in self._rings.values():
                if ring.agent == agent:
                    return ring
        return None

    def bind(self, source: str, agent: str) -> None:
        """The source daemon's handshake answer named its agent: only that agent may use the ring."""
        with self._lock:
            ring = self._rings.get(source)
            if ring is not None:
                ring.agent = agent

    def retire(self, source: str) -> None:
        """The link went down: no new blocks; the memory stays until the quarantine ends."""
        with self._lock:
            ring = self._rings.pop(source, None)
            if ring is None:
                return
            ring.agent = ""
            self._retired.append((time.monotonic() + self.quarantine_s, ring))
        self._deregister(ring)

    def sweep(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._retired = [(t, r) for t, r in self._retired if t > now]

    def close(self) -> None:
        with self._lock:
            rings, self._rings = list(self._rings.values()), {}
        for ring in rings:
            self._deregister(ring)

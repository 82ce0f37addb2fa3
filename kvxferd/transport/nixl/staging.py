"""Staged transfers over NIXL: landing rings on the decode side, credits on the prefill side.

A sliced plan (TP mismatch) cuts every token row into head slices of a few hundred bytes.
As one NIXL descriptor each, posting them costs more than moving them. Staged, the sender
cuts a chunk's wire stream into blocks exactly as :func:`~kvxferd.datapath.staging.pack` does,
gathers each block into one registered staging slot and WRITEs it with one descriptor
into a slot of the receiver's landing ring. The WRITE's notification is the chunk's data
header plus ``ring``, ``slot``, ``block`` (its index) and ``pack`` (the block size): the
receiver checks the chunk like any other on its first block, derives the block's pieces
from the header, scatters them into the decode pages with its own page table, and hands
the slot back with a ``free`` notification. The chunk counts as received when its last
block is scattered, and its landed check (if any) passed (:class:`Assemblies`); the slot
goes back before that check reads the chunk's pages.

- A **landing ring** belongs to one source daemon link: ``limits.nixl_landing_slots``
  slots of ``limits.nixl_block_bytes``, registered on its own so that a peer's remote
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

Everything here is bookkeeping and memory; the NIXL calls live in :mod:`.transport`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ...errors import RequestError, TransferError
from ...lifecycle.inbox import DestEntry, Inbox, Sink
from ...datapath.staging import Piece, block_count, block_pieces, buffer, slices_per_slot

#: blocks one staged chunk may be cut into (bounds the receiver's bookkeeping per chunk)
MAX_BLOCKS = 1 << 20

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


class LandingRing:
    """Decode side: the slots one source daemon link writes staged blocks into."""

    def __init__(self, ring: int, source: str, count: int, slot_bytes: int, device: int = -1) -> None:
        self.ring = ring
        self.source = source  # control address of the source daemon
        self.count = count
        self.slot_bytes = slot_bytes
        self.device = device  # -1: host memory (pinned where CUDA is present); else the GPU it lives on
        self.buffer = buffer(count * slot_bytes, torch.device(f"cuda:{device}" if device >= 0 else "cpu"))
        self.agent = ""  # the source daemon's NIXL agent, once its handshake answer names it
        self.reg_descs: object = None  # the NIXL registration of ``buffer``
        self.metadata: bytes = b""  # partial agent metadata describing ``buffer`` only
        self._busy: set[int] = set()  # slots whose block is being scattered
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.count * self.slot_bytes

    @property
    def info(self) -> RingInfo:
        return RingInfo(self.ring, self.buffer.data_ptr(), self.slot_bytes, self.count, self.device)

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        start = index * self.slot_bytes
        return self.buffer[start:start + nbytes]

    def claim(self, index: int) -> bool:
        """Mark a slot as holding a block until it is scattered; False if it already does."""
        with self._lock:
            if index in self._busy:
                return False
            self._busy.add(index)
            return True

    def unclaim(self, index: int) -> None:
        with self._lock:
            self._busy.discard(index)


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

    def try_acquire(self) -> int | None:
        """A free slot of the remote ring, or None at once."""
        with self._cond:
            return self._take() if self._free else None

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
            return self._take()

    def _take(self) -> int:
        """Hold a free slot (the caller holds the lock and saw one)."""
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
    def ring_count(self) -> int:
        with self._lock:
            return len(self._rings)

    @property
    def quarantined(self) -> int:
        """Retired rings whose memory is still held: :meth:`sweep` frees them once their quarantine ends."""
        return len(self._retired)

    @property
    def bytes_registered(self) -> int:
        """Memory of live rings: what is registered with NIXL now (a retired ring is deregistered)."""
        with self._lock:
            return sum(r.nbytes for r in self._rings.values())

    @property
    def bytes_held(self) -> int:
        """Memory of live and quarantined rings: what counts against the budget."""
        with self._lock:
            return sum(r.nbytes for r in self._rings.values()) + sum(r.nbytes for _t, r in self._retired)

    def for_source(self, source: str, device: int = -1) -> tuple[LandingRing | None, str]:
        """The ring of a source daemon link, created on first use on ``device`` (the GPU of the
        decode ranks it lands for, -1: host); (None, why) when there is none. A link keeps the
        ring it got first."""
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
            ring = LandingRing(self._next, source, self.slots_per_ring, self.slot_bytes, device)
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


@dataclass
class Assembly:
    """One staged chunk on the decode side: its reserved token range and which blocks are in."""

    key: tuple[Any, ...]
    sink: Sink
    sender: str
    pack: int
    per_slot: int
    done: np.ndarray  # one flag per block: arrived (being scattered or scattered)
    busy: int = 0  # blocks being scattered now
    failed: bool = False
    regions: list[Any] = field(default_factory=list)
    #: its first block's header digest, which the inbox checked: every later block's header must be
    #: that header (the chunk's fields are the same in every block)
    header_digest: int | None = None


class Assemblies:
    """Decode side: staged chunks whose blocks are still arriving, shared by the scatter threads.

    The chunk's token range is reserved in the inbox when its first block (any block) arrives,
    and released as received only when every block is scattered, or as failed once no block
    of it is being scattered any more: an engine is never told about pages a thread still writes.
    """

    def __init__(self, inbox: Inbox) -> None:
        self.inbox = inbox
        self._open: dict[tuple[Any, ...], Assembly] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def start_block(self, header: dict[str, Any], dest_rank: str, sender: str,
                    check: Callable[[Sink], None]) -> tuple[Assembly, list[Piece]]:
        """Reserve block ``header['block']`` of its chunk; raise RequestError/TransferError if it may not land."""
        # a cache group's chunk (and a state part) is a writer of its own: the same token range of the
        # same prefill rank may be assembling for several groups at once
        key = (header["request_id"], dest_rank, tuple(header["src"]), header.get("group") or "",
               header.get("part") or 0, header["start"], header["end"])
        finish_failed: Sink | None = None
        try:
            with self._lock:
                asm = self._open.get(key)
                if asm is None:
                    # a trailer chunk's digests ride in its last block, which need not be the first in
                    sink = self.inbox.begin({k: v for k, v in header.items() if k != "digests"}
                                            if header.get("trailer") else header, dest_rank, transport="nixl")
                    try:
                        check(sink)
                        per_slot = slices_per_slot(sink.writer.slice_bytes, header["pack"])
                        regions = sink.regions()
                        n_blocks = block_count(len(regions), sink.dst_slots.size, per_slot)
                        if n_blocks > MAX_BLOCKS:
                            raise RequestError(f"chunk cut into {n_blocks} blocks of {header['pack']} bytes; at "
                                               f"most {MAX_BLOCKS} are accepted", field="pack",
                                               fix="pack staged blocks into the landing slot size")
                    except BaseException:
                        finish_failed = sink
                        raise
                    asm = Assembly(key, sink, sender, header["pack"], per_slot, np.zeros(n_blocks, dtype=bool),
                                   regions=regions, header_digest=header.get("header_digest"))
                    self._open[key] = asm
                else:
                    if asm.sender == sender and asm.header_digest is not None:
                        # from the chunk's own sender, a field its header digest covers that differs from the
                        # first block's (checked by the inbox) fails the request integrity
                        self.inbox.same_header(asm.sink, header, asm.header_digest, "nixl")
                    if asm.sender != sender or asm.pack != header["pack"] or asm.sink.last != header["last"] \
                            or asm.sink.nbytes != header["nbytes"] or asm.sink.trailer != bool(header.get("trailer")):
                        raise RequestError("block header disagrees with earlier blocks of its chunk (sender, pack, "
                                           "last, nbytes or trailer)", field="block",
                                           fix="send every block of a chunk alike")
                if asm.failed:
                    raise RequestError("chunk already failed", field="block", fix="abort and retry the request")
                k = header["block"]
                if not 0 <= k < asm.done.size or asm.done[k]:
                    raise RequestError(f"block {k} of a chunk of {asm.done.size} blocks is out of range or repeated",
                                       field="block", fix="send each block of a chunk once")
                if asm.sink.trailer and (k == asm.done.size - 1) != ("digests" in header):
                    raise RequestError(f"block {k} of a chunk of {asm.done.size} blocks whose digests trail "
                                       f"{'carries' if 'digests' in header else 'lacks'} them", field="digests",
                                       fix="send a trailer chunk's digests in its last block's header, and only there")
                if asm.sink.trailer and "digests" in header:
                    asm.sink.digests = header["digests"]
                asm.done[k] = True
                asm.busy += 1
        finally:
            if finish_failed is not None:
                self.inbox.finish(finish_failed, False)
        sink = asm.sink
        return asm, block_pieces(k, len(asm.regions), sink.dst_slots.size, asm.per_slot, sink.writer.slice_bytes)

    def end_block(self, asm: Assembly, ok: bool) -> bool | None:
        """A block is scattered (or failed): True when it completed its chunk, False when the chunk failed
        and is now released, None while blocks remain."""
        with self._lock:
            asm.busy -= 1
            asm.failed = asm.failed or not ok
            if asm.busy or not (asm.failed or asm.done.all()) or self._open.get(asm.key) is not asm:
                return None
            del self._open[asm.key]
        failed = self.inbox.finish(asm.sink, not asm.failed, "nixl")  # digests are checked in there
        return not asm.failed and failed is None

    def abandon(self, entry: DestEntry) -> int:
        """The request failed: its chunks end as failed, at once or when their last scatter returns."""
        released = []
        with self._lock:
            for key, asm in list(self._open.items()):
                if asm.sink.entry is entry:
                    asm.failed = True
                    if not asm.busy:
                        del self._open[key]
                        released.append(asm)
        for asm in released:
            self.inbox.finish(asm.sink, False)
        return len(released)

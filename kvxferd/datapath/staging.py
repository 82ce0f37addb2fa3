"""Staging: a bounded pool of contiguous slots, and how a chunk is packed into them.

In staged mode the sender gathers a chunk's head slices (all its layers and kinds) into
slots and sends each slot as one block; the receiver takes each block into a slot and
scatters it into the decode pages. The pool is the daemon's bound on staging memory:
a data thread that finds no free slot waits (back-pressure) until the transfer deadline.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import TransferError


@dataclass(frozen=True)
class Piece:
    """Tokens ``[lo, hi)`` of region ``region`` land at ``offset`` in the slot."""

    region: int
    lo: int
    hi: int
    offset: int


def pack(n_regions: int, n_tokens: int, slice_bytes: int, slot_bytes: int) -> list[list[Piece]]:
    """Split a chunk (regions x tokens x slice) into slot-sized blocks, in wire order.

    Wire order is region-major then token, so concatenating the blocks gives exactly the
    direct mode's byte stream.
    """
    per_slot = slices_per_slot(slice_bytes, slot_bytes)
    count = block_count(n_regions, n_tokens, per_slot)
    if count <= CACHED_BLOCKS:
        return [list(block) for block in _packed(n_regions, n_tokens, per_slot, slice_bytes)]
    return [block_pieces(k, n_regions, n_tokens, per_slot, slice_bytes) for k in range(count)]


#: chunks of up to this many blocks have their pieces cached per shape (a few hundred bytes each)
CACHED_BLOCKS = 4


@functools.lru_cache(maxsize=1024)
def _packed(n_regions: int, n_tokens: int, per_slot: int, slice_bytes: int) -> tuple[tuple[Piece, ...], ...]:
    """:func:`pack` of a small chunk, computed once per shape: a daemon moves the same few shapes
    over and over, and building the pieces cost more than moving them. Pieces are frozen, and
    every caller gets lists of its own."""
    return tuple(tuple(block_pieces(k, n_regions, n_tokens, per_slot, slice_bytes))
                 for k in range(block_count(n_regions, n_tokens, per_slot)))


def slices_per_slot(slice_bytes: int, slot_bytes: int) -> int:
    if slice_bytes > slot_bytes:
        raise TransferError(f"one token slice of {slice_bytes} bytes does not fit a staging slot of "
                            f"{slot_bytes} bytes", field="limits.staging_slot_bytes", code="staging_too_small",
                            fix="raise limits.staging_slot_bytes (tcp) or limits.nixl_block_bytes (NIXL), "
                                "or use mode=direct")
    return slot_bytes // slice_bytes


def block_count(n_regions: int, n_tokens: int, per_slot: int) -> int:
    return -(-n_regions * n_tokens // per_slot)


def block_pieces(k: int, n_regions: int, n_tokens: int, per_slot: int, slice_bytes: int) -> list[Piece]:
    """Block ``k`` of a chunk without building the others: slices ``[k * per_slot, (k + 1) * per_slot)``
    of the region-major sequence, cut at region boundaries. Both ends of a staged transfer
    compute it from the chunk header alone."""
    first = k * per_slot
    last = min(first + per_slot, n_regions * n_tokens)
    pieces = []
    at = first
    while at < last:
        region, lo = divmod(at, n_tokens)
        hi = min(n_tokens, lo + last - at)
        pieces.append(Piece(region, lo, hi, (at - first) * slice_bytes))
        at += hi - lo
    return pieces


def block_bytes(block: list[Piece], slice_bytes: int) -> int:
    return sum(p.hi - p.lo for p in block) * slice_bytes


class StagingPool:
    """At most ``total_bytes // slot_bytes`` slots, allocated on first use and kept."""

    def __init__(self, total_bytes: int, slot_bytes: int,
                 on_change: Callable[[int, int], None] | None = None,
                 on_wait: Callable[[], None] | None = None, device: str = "cpu") -> None:
        """``device``: where the slots live; host slots are pinned where CUDA is present, a
        ``cuda:N`` pool stages device regions on their own GPU (gather and scatter stay there)."""
        self.device = torch.device(device)
        self.slot_bytes = slot_bytes
        self.total_bytes = total_bytes
        self.capacity = max(1, total_bytes // slot_bytes)
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._in_use = 0
        self._cond = threading.Condition()
        self._on_change = on_change
        self._on_wait = on_wait

    @property
    def in_use(self) -> int:
        return self._in_use

    def sibling(self, slot_bytes: int) -> "StagingPool":
        """A pool of ``slot_bytes`` slots under the same byte bound, on the same device, counting
        its waits alike: a transport that moves larger blocks (NIXL) stages them in its own."""
        return StagingPool(self.total_bytes, slot_bytes, on_wait=self._on_wait,
                           device=str(self.device))

    def acquire(self, timeout: float) -> torch.Tensor:
        deadline = time.monotonic() + timeout
        with self._cond:
            waited = False
            while not self._free and self._allocated >= self.capacity:
                if not waited and self._on_wait:
                    self._on_wait()
                waited = True
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(f"no staging slot free within {timeout}s ({self.capacity} slots of "
                                        f"{self.slot_bytes} bytes, all busy)", field="limits.staging_bytes",
                                        code="staging_timeout",
                                        fix="raise limits.staging_bytes or lower concurrency")
                self._cond.wait(left)
            if self._free:
                slot = self._free.pop()
            else:
                slot = buffer(self.slot_bytes, self.device)
                self._allocated += 1
            self._in_use += 1
            self._changed()
            return slot

    def try_acquire(self) -> torch.Tensor | None:
        """A slot if one is free (or may still be allocated) right now, else None; never waits."""
        with self._cond:
            if not self._free and self._allocated >= self.capacity:
                return None
        return self.acquire(0.0)

    def try_acquire_spare(self) -> torch.Tensor | None:
        """A second slot for a thread that already holds one, only while more than half the
        pool stays available: a thread holding two must not starve the receivers that other
        daemons' senders wait on (both directions of a link share one pool)."""
        with self._cond:
            available = len(self._free) + self.capacity - self._allocated
            if available - 1 < -(-self.capacity // 2):
                return None
        return self.try_acquire()

    def release(self, slot: torch.Tensor) -> None:
        with self._cond:
            self._free.append(slot)
            self._in_use -= 1
            self._changed()
            self._cond.notify()

    def _changed(self) -> None:
        if self._on_change:
            self._on_change(self._in_use, self._in_use * self.slot_bytes)


def buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A staging buffer (a slot, a landing ring): on its GPU, or pinned host memory where CUDA is present."""
    if device.type == "cuda":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

"""What the prefill side has loaded of each decode daemon's NIXL agent, and when to load it anew.

NIXL keeps every memory descriptor it ever loaded for a remote agent (nixl-cu12 1.5.1:
``nixlRemoteSection::addDescList`` adds, nothing removes one short of
``remove_remote_agent``). A decode daemon deregisters a rank's regions when its engine goes
and maps the next engine's memory, often at the same virtual addresses; the next rank's
partial metadata then lands beside the stale descriptors. NIXL finds the descriptor for a
WRITE by a binary search that looks at one neighbour only, so a stale descriptor that starts
inside a newer, larger region hides it: ``initialize_xfer`` fails with
``NIXL_ERR_NOT_FOUND`` for every address past the stale one's start (and an identical range
keeps the old registration's remote key).

So each blob loaded is recorded with the address ranges it describes. When a new blob's
ranges overlap those of an earlier, different blob, the earlier one is stale (a decode
agent never holds two live registrations over the same bytes): the agent is removed and
every other blob is loaded again. Stale blobs that overlap nothing cannot be told from live
ones and stay loaded; they are harmless (no lookup of a live address can land on them), and
go with the agent when the peer goes.

The reload must not meet a WRITE to that agent in flight, so the data threads hold a
:class:`Gate` per agent while they post and wait, and the reload takes it alone; it runs on
the first data thread that needs the agent after the stale blob was seen, never on the
event loop. Pure bookkeeping and a lock; the NIXL calls live in :mod:`.transport`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from ...errors import TransferError


@dataclass(frozen=True)
class Loaded:
    """One metadata blob loaded for a remote agent and the ``[start, end)`` address ranges it describes."""

    blob: bytes
    ranges: tuple[tuple[int, int], ...]

    def overlaps(self, other: "Loaded") -> bool:
        return any(a < d and c < b for a, b in self.ranges for c, d in other.ranges)


def pair_blobs(metadata: Sequence[bytes], regions: Iterable[Sequence[Any]],
               landing: Sequence[int] | None = None) -> list[Loaded]:
    """Blobs with the ranges each describes, as the decode side sends them: one blob per rank
    named in ``regions`` (in the order the ranks first appear), then the landing ring's when a
    ring is offered. Any other count: every blob is taken to describe every range."""
    by_rank: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for row in regions:
        tp, pp, _layer, _kind, address, nbytes = row[:6]
        by_rank.setdefault((int(tp), int(pp)), []).append((int(address), int(address) + int(nbytes)))
    units = [tuple(r) for r in by_rank.values()]
    if landing is not None:
        _ring, address, slot_bytes, count = (int(v) for v in landing[:4])
        units.append(((address, address + slot_bytes * count),))
    if len(units) != len(metadata):
        everything = tuple(r for unit in units for r in unit)
        return [Loaded(bytes(md), everything) for md in metadata]
    return [Loaded(bytes(md), unit) for md, unit in zip(metadata, units)]


class RemoteBook:
    """The blobs loaded for one remote agent, and the reload a stale one calls for."""

    def __init__(self) -> None:
        self.loaded: list[Loaded] = []
        #: a stale blob is loaded: remove the agent and load :meth:`blobs` again, once no WRITE to it is in flight
        self.due = False
        self.reloads = 0

    def makes_stale(self, items: Sequence[Loaded]) -> bool:
        """Whether loading these blobs would make a loaded one stale (what :meth:`add` would say)."""
        fresh = [item for item in items if item not in self.loaded]
        return any(old.blob != new.blob and old.overlaps(new) for old in self.loaded for new in fresh)

    def add(self, items: Sequence[Loaded]) -> bool:
        """Record blobs just loaded; True when an earlier blob overlaps one of them (a reload is due)."""
        fresh = [item for item in items if item not in self.loaded]
        stale = [old for old in self.loaded if any(old.blob != new.blob and old.overlaps(new) for new in fresh)]
        self.loaded = [old for old in self.loaded if old not in stale] + fresh
        self.due = self.due or bool(stale)
        return bool(stale)

    def blobs(self) -> list[bytes]:
        """What a reload loads: every blob not made stale, in the order loaded."""
        return [item.blob for item in self.loaded]


class Gate:
    """Data threads writing to one remote agent share it; a reload of the agent takes it alone.
    A waiting reload stops new writers from entering, so it waits for the WRITEs in flight only."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._sharing = 0
        self._alone = False
        self._waiting = 0

    def enter(self, deadline: float) -> None:
        with self._cond:
            while self._alone or self._waiting:
                self._wait(deadline)
            self._sharing += 1

    def leave(self) -> None:
        with self._cond:
            self._sharing -= 1
            self._cond.notify_all()

    def enter_alone(self, deadline: float) -> None:
        with self._cond:
            self._waiting += 1
            try:
                while self._alone or self._sharing:
                    self._wait(deadline)
            finally:
                self._waiting -= 1
            self._alone = True

    def leave_alone(self) -> None:
        with self._cond:
            self._alone = False
            self._cond.notify_all()

    def _wait(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferError("timed out waiting for the NIXL metadata of a decode daemon to be reloaded",
                                field="timeouts.transfer_s", code="transfer_timeout",
                                fix="check the network path to the decode daemon (WRITEs to it do not complete)")
        self._cond.wait(min(left, 0.05))

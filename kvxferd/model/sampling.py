"""Which bytes of a request integrity checks: every slot (``full``) or a share (``sampled``).

Both ends of a chunk hash the same bytes, so the choice is a pure function of what both ends
know: the token positions of the chunk, a granule both sides' pages divide (the least common
multiple of their page sizes, so a packed page is never split), and the :class:`Sample` the
destination asked for in its expect. Granule ``g`` of a request is token ``g * granule`` on.

A decode daemon chooses a sampled request's granules page by page (:class:`PageLedger`): it
counts, for each page of each rank, the writes into it since its bytes were last checked, and a
request checks the granules that hold a page due. Every page is so checked on at least one of
every ``period`` writes into it, the first within its first ``period``, whichever requests
place it where: the guarantee is per page of a long-lived cache, not per token position. The
destination's expect names the chosen granules (:class:`Picks`, one bit each, per cache group);
each chunk's header names those of its own tokens.

A sample without picks checks granule ``g`` when ``(g + offset) % period == 0``: what a source
stricter than its destination sends of its own accord (its offset turning per request).

A pair of instances agrees a standing period at its handshake (:func:`stricter`, each side's
:meth:`Policy.standing`): every request of the pair is checked at least at that period
(:meth:`Policy.at_least` on the destination, :func:`to_send` on the source), so a side that
asked for checks at the handshake is never answered with fewer.

``full`` is the sample with period 1. A source that is stricter than its destination's ask sends
a sample that covers the ask (every granule the destination checks carries a digest), so the
stricter side of a pair always wins and the destination can always check what it asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

#: integrity modes, weakest first (a daemon's ``integrity.mode``, an instance's ask at register)
MODES = ("off", "sampled", "full")
#: the largest period a sample may have (one granule in this many): bounds the wire field
MAX_PERIOD = 1 << 16


@dataclass(frozen=True)
class Picks:
    """Granules chosen one by one: bit ``i`` of ``bits`` (least significant first) is granule
    ``first + i``; granules outside are not chosen."""

    first: int
    bits: bytes

    @classmethod
    def of(cls, first: int, mask: np.ndarray) -> "Picks":
        return cls(first, np.packbits(np.asarray(mask, dtype=bool), bitorder="little").tobytes())

    @property
    def count(self) -> int:
        """Granules the bits span."""
        return len(self.bits) * 8

    def mask(self, granules: np.ndarray) -> np.ndarray:
        i = np.asarray(granules, dtype=np.int64) - self.first
        inside = (i >= 0) & (i < self.count)
        out = np.zeros(i.shape, dtype=bool)
        j = i[inside]
        out[inside] = (np.frombuffer(self.bits, dtype=np.uint8)[j >> 3] >> (j & 7)) & 1 == 1
        return out

    def window(self, lo: int, hi: int) -> "Picks":
        """The picks of granules ``[lo, hi)`` (a chunk's)."""
        return Picks.of(lo, self.mask(np.arange(lo, hi)))

    def to_wire(self) -> list[Any]:
        return [self.first, self.bits]

    @classmethod
    def from_wire(cls, value: list[Any]) -> "Picks":
        return cls(int(value[0]), bytes(value[1]))


@dataclass(frozen=True)
class Sample:
    """The granules a request's (or a chunk's) digests cover: one in ``period``, those a cache
    group's :class:`Picks` name where it has them, else those ``g`` with
    ``(g + offset) % period == 0``."""

    period: int
    offset: int = 0
    picks: Mapping[str, Picks] | None = None  # per cache group ("": the default one)

    @property
    def full(self) -> bool:
        return self.period == 1

    def mask(self, group: str, granules: np.ndarray) -> np.ndarray:
        """Which of ``granules`` (of cache group ``group``) this checks."""
        granules = np.asarray(granules, dtype=np.int64)
        if self.full:
            return np.ones(granules.shape, dtype=bool)
        picks = self.picks.get(group) if self.picks else None
        if picks is not None:
            return picks.mask(granules)
        return (granules + self.offset) % self.period == 0

    def covers(self, asked: "Sample", group: str = "", granules: np.ndarray | None = None) -> bool:
        """Every granule ``asked`` checks, this checks too: of ``granules`` (a chunk's), or of every
        granule (samples without picks only)."""
        if self.full:
            return True
        if granules is None:
            assert not self.picks and not asked.picks, "samples with picks are compared over a chunk's granules"
            return asked.period % self.period == 0 and (asked.offset - self.offset) % self.period == 0
        return bool(np.all(self.mask(group, granules) | ~asked.mask(group, granules)))

    def for_chunk(self, group: str, lo: int, hi: int) -> "Sample":
        """What a chunk of granules ``[lo, hi)`` of ``group`` needs of this: its own picks only."""
        picks = self.picks.get(group) if self.picks else None
        return Sample(self.period, self.offset, None if picks is None else {group: picks.window(lo, hi)})

    def to_wire(self) -> list[Any]:
        if not self.picks:
            return [self.period, self.offset]
        return [self.period, self.offset, {g: p.to_wire() for g, p in self.picks.items()}]

    @classmethod
    def from_wire(cls, value: list[Any]) -> "Sample":
        period, offset = value[0], value[1]
        picks = {g: Picks.from_wire(p) for g, p in value[2].items()} if len(value) > 2 else None
        return cls(period, offset % period, picks)

    def describe(self) -> str:
        if self.full:
            return "full"
        how = "chosen page by page" if self.picks else f"offset {self.offset}"
        return f"one granule in {self.period} ({how})"


FULL = Sample(1)


def to_send(own: Sample | None, asked: Sample | None) -> Sample | None:
    """What a source's digests cover: what its destination asked for, or its own wish where that is
    stricter, chosen so that it still covers the ask."""
    if asked is None:
        return own
    if own is None or own.period >= asked.period:
        return asked
    if asked.picks:  # the ask's picks, and every granule of them the source's own rotation checks
        return Sample(own.period, own.offset, {
            g: Picks.of(p.first, p.mask(np.arange(p.first, p.first + p.count))
                        | ((np.arange(p.first, p.first + p.count) + own.offset) % own.period == 0))
            for g, p in asked.picks.items()})
    period = max(d for d in _divisors(asked.period) if d <= own.period)
    return Sample(period, asked.offset % period)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in small]


def granule(plan: Any, group: str) -> int:
    """Tokens one sampling granule of ``group`` spans between a plan's two sides (0: a state
    group's one slot, always checked whole). Both sides hold the same plan, so they agree."""
    if group and plan.prefill.group(group).per_request:
        return 0
    return math.lcm(plan.prefill.group_spec(group).page_size, plan.decode.group_spec(group).page_size)


def chosen(slots: np.ndarray, slot_tokens: int, start: int, granule_tokens: int, sample: Sample,
           group: str = "") -> np.ndarray:
    """The slots of a chunk of cache group ``group`` that begins at token ``start`` whose bytes
    ``sample`` checks, in slot order. ``slot_tokens``: tokens a slot holds on this side (1: token
    rows; a page: packed)."""
    if sample.full or granule_tokens == 0:
        return slots
    return slots[checked_slots(len(slots), slot_tokens, start, granule_tokens, sample, group)]


def checked_slots(n: int, slot_tokens: int, start: int, granule_tokens: int, sample: Sample,
                  group: str = "") -> np.ndarray:
    """Which of a chunk's ``n`` slots :func:`chosen` keeps, as a mask."""
    if sample.full or granule_tokens == 0:
        return np.ones(n, dtype=bool)
    index = np.arange(n, dtype=np.int64)
    first = start + index if slot_tokens == 1 else (start // slot_tokens + index) * slot_tokens
    return sample.mask(group, first // granule_tokens)


def granules_of(start: int, end: int, granule_tokens: int) -> tuple[int, int]:
    """The granules ``[lo, hi)`` a chunk of tokens ``[start, end)`` touches."""
    return start // granule_tokens, (max(end, start + 1) - 1) // granule_tokens + 1


def stricter(a: int | None, b: int | None) -> int | None:
    """The pair's period from both sides' standing ones: the shorter (None: off)."""
    return b if a is None else a if b is None else min(a, b)


def describe_period(period: int | None) -> str:
    """A standing period as ``status`` shows it."""
    return "off" if period is None else "full" if period == 1 else f"sampled 1/{period}"


def period_of(share: float) -> int:
    """The period that checks about ``share`` of a request's granules."""
    return max(1, min(MAX_PERIOD, round(1 / share)))


@dataclass
class Policy:
    """A daemon's integrity setting for its ranks, which an instance may raise at register."""

    mode: str = "off"
    period: int = 20  # sampled: one granule in this many
    turn: int = 0  # sampled: the offset of the next request's sample

    def sample(self, asked: str | None = None) -> Sample | None:
        """What one request's digests must cover at a rank of this daemon (``asked``: its instance's mode)."""
        period = self.standing(asked)
        if period is None:
            return None
        return self._turned(period)

    def standing(self, asked: str | None = None) -> int | None:
        """The period a side of a pair asks at its handshake for every request (None: off)."""
        mode = max(self.mode, asked or "off", key=MODES.index)
        if mode == "off":
            return None
        return 1 if mode == "full" else self.period

    def at_least(self, sample: Sample | None, period: int | None) -> Sample | None:
        """``sample``, or one of the pair's agreed ``period`` where that checks more."""
        if period is None or (sample is not None and sample.period <= period):
            return sample
        return self._turned(period)

    def _turned(self, period: int) -> Sample:
        if period == 1:
            return FULL
        self.turn += 1
        return Sample(period, self.turn % period)

    @property
    def share(self) -> float:
        """The share of each request's granules a sampled request checks."""
        return round(1 / self.period, 6)


class PageLedger:
    """A decode daemon's count, per rank, cache group and page, of the writes into the page since
    its bytes were last checked; a sampled request checks the granules that hold a page due.

    A page is due at its ``period``-th unchecked write. A page first seen starts at its id modulo
    ``period`` writes, so a fresh cache's pages fall due spread over ``period`` requests rather
    than all at once, and a request of consecutive pages checks about one in ``period``. A
    granule spanning several pages (the source's pages larger) is checked whole when one is due,
    and all its pages count as checked. Memory: two bytes per page ever written, per rank.
    """

    def __init__(self) -> None:
        self._unchecked: dict[tuple[str, str], np.ndarray] = {}

    def choose(self, rank: str, group: str, pages: np.ndarray, page_size: int, start: int, end: int,
               granule_tokens: int, period: int) -> Picks:
        """The granules of a request writing tokens ``[start, end)`` into ``pages`` (its page table
        of ``group`` from token 0) to check; the write is counted."""
        first, last = start // page_size, (end - 1) // page_size
        ids = np.asarray(pages[first:last + 1], dtype=np.int64)
        per = granule_tokens // page_size  # pages of this side in a granule
        lo, hi = first // per, last // per
        if ids.size == 0:
            return Picks.of(lo, np.zeros(0, dtype=bool))
        counts = self._counts(rank, group, int(ids.max()) + 1, period)
        of = np.arange(first, last + 1) // per - lo  # each page's granule, from lo
        due = np.bincount(of, weights=counts[ids] >= period - 1, minlength=hi - lo + 1) > 0
        checked = due[of]
        counts[ids] = np.where(checked, 0, np.minimum(counts[ids].astype(np.int64) + 1, np.iinfo(np.uint16).max))
        return Picks.of(lo, due)

    def undo(self, rank: str, group: str, pages: np.ndarray, page_size: int, start: int, end: int,
             granule_tokens: int, picks: Picks, period: int) -> None:
        """The write :meth:`choose` counted (same arguments, and the picks it returned) did not
        happen after all: its request failed, and its pages hold nothing an engine will read.
        Pages it was to check fall due at their next write; the others count one write less."""
        first, last = start // page_size, (end - 1) // page_size
        ids = np.asarray(pages[first:last + 1], dtype=np.int64)
        if ids.size == 0:
            return
        per = granule_tokens // page_size
        checked = picks.mask(np.arange(first, last + 1) // per)
        counts = self._counts(rank, group, int(ids.max()) + 1, period)
        before = counts[ids].astype(np.int64)
        counts[ids] = np.where(checked, np.maximum(before, period - 1), np.maximum(before - 1, 0))

    def _counts(self, rank: str, group: str, size: int, period: int) -> np.ndarray:
        counts = self._unchecked.get((rank, group))
        if counts is None or counts.size < size:
            grown = (np.arange(max(size, 2 * (0 if counts is None else counts.size))) % period).astype(np.uint16)
            if counts is not None:
                grown[:counts.size] = counts
            counts = self._unchecked[(rank, group)] = grown
        return counts

    def forget(self, rank: str) -> None:
        """A rank left: its pages are another engine's next time."""
        for key in [k for k in self._unchecked if k[0] == rank]:
            del self._unchecked[key]

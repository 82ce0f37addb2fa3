"""Which bytes of a request integrity checks: every slot (``full``) or a rotating share (``sampled``).

Both ends of a chunk hash the same bytes, so the choice is a pure function of what both ends
know: the token positions of the chunk, a granule both sides' pages divide (the least common
multiple of their page sizes, so a packed page is never split), and the :class:`Sample` the
destination asked for in its expect. Granule ``g`` of a request is checked when
``(g + offset) % period == 0``: one in ``period``. A decode daemon turns ``offset`` by one with
every request it receives, so ``period`` requests in a row check every token position once; a
physical page is checked when a request places it at a chosen position (a rotation over
positions, not a ledger per page).

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
from typing import Any

import numpy as np

#: integrity modes, weakest first (a daemon's ``integrity.mode``, an instance's ask at register)
MODES = ("off", "sampled", "full")
#: the largest period a sample may have (one granule in this many): bounds the wire field
MAX_PERIOD = 1 << 16


@dataclass(frozen=True)
class Sample:
    """One granule in ``period`` is checked: those ``g`` with ``(g + offset) % period == 0``."""

    period: int
    offset: int = 0

    @property
    def full(self) -> bool:
        return self.period == 1

    def covers(self, asked: "Sample") -> bool:
        """Every granule ``asked`` checks, this checks too."""
        return asked.period % self.period == 0 and (asked.offset - self.offset) % self.period == 0

    def to_wire(self) -> list[int]:
        return [self.period, self.offset]

    @classmethod
    def from_wire(cls, value: list[int]) -> "Sample":
        period, offset = value
        return cls(period, offset % period)

    def describe(self) -> str:
        return "full" if self.full else f"one granule in {self.period} (offset {self.offset})"


FULL = Sample(1)


def to_send(own: Sample | None, asked: Sample | None) -> Sample | None:
    """What a source's digests cover: what its destination asked for, or its own wish where that is
    stricter, chosen so that it still covers the ask."""
    if asked is None:
        return own
    if own is None or own.period >= asked.period:
        return asked
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


def chosen(slots: np.ndarray, slot_tokens: int, start: int, granule_tokens: int, sample: Sample) -> np.ndarray:
    """The slots of a chunk that begins at token ``start`` whose bytes ``sample`` checks, in slot
    order. ``slot_tokens``: tokens a slot holds on this side (1: token rows; a page: packed)."""
    if sample.full or granule_tokens == 0:
        return slots
    index = np.arange(len(slots), dtype=np.int64)
    first = start + index if slot_tokens == 1 else (start // slot_tokens + index) * slot_tokens
    return slots[(first // granule_tokens + sample.offset) % sample.period == 0]


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

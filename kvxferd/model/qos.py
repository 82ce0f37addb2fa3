"""Transfer classes, weights and deadlines: what a chunk job asks of the node's data threads.

The operator's word comes first: ``qos.instances`` gives an instance its class and its weight
inside the class (``"chat=latency"``, ``"batch-*=bulk:3"``). An instance the operator named may ask
a lower class for a request (a latency instance's background request as bulk) but never a higher
one; an instance with no entry takes ``qos.default_class`` and may ask either. Weights are the
operator's alone: a tenant cannot buy itself a larger share. (The scheduler that acts on these is
:mod:`kvxferd.transport.scheduler`.)
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Sequence

from ..errors import ConfigError

LATENCY = "latency"
BULK = "bulk"
CLASSES = (LATENCY, BULK)  # highest first
#: the largest weight an entry may give (shares are ratios: a bound keeps the arithmetic sane)
MAX_WEIGHT = 1000.0
#: the longest budget a request may give itself, in ms (a day: anything longer is no deadline)
MAX_BUDGET_MS = 86_400_000.0
#: the latest wall-clock deadline a request may give (Unix seconds; 2**32 is in the year 2106)
MAX_DEADLINE_AT = float(2**32)


def budget_s(budget_ms: float | None, deadline_at: float | None, wall_now: float) -> float | None:
    """Seconds from now to a request's deadline, from what its engine said: a budget in ms from
    the call, a wall-clock time (the node's clock), or both (the earlier holds); None: no deadline.
    A deadline already past is 0: the request fails ``deadline`` before a byte moves."""
    left = [budget_ms / 1000.0] if budget_ms is not None else []
    if deadline_at is not None:
        left.append(max(deadline_at - wall_now, 0.0))
    return min(left) if left else None


@dataclass(frozen=True)
class Qos:
    """What one chunk job asks of the scheduler."""

    cls: str = BULK
    instance: str = ""
    weight: float = 1.0
    deadline: float | None = None  # monotonic seconds by which the job must have run; None: none


@dataclass(frozen=True)
class Entry:
    pattern: str
    cls: str
    weight: float


@dataclass(frozen=True)
class QosPolicy:
    default_class: str = BULK
    entries: tuple[Entry, ...] = ()

    @classmethod
    def parse(cls, default_class: str, instances: Sequence[str]) -> "QosPolicy":
        """From ``qos.default_class`` and ``qos.instances``; raises ConfigError naming the entry."""
        if default_class not in CLASSES:
            raise ConfigError(f"qos.default_class must be one of {list(CLASSES)}, got {default_class!r}",
                              field="qos.default_class", fix=f"set it to {BULK!r} or {LATENCY!r}")
        entries = []
        for raw in instances:
            pattern, eq, rest = raw.partition("=")
            name, colon, weight_text = rest.partition(":")
            fix = 'write "instance=class" or "instance=class:weight", e.g. "chat=latency", "batch-*=bulk:3"'
            if not eq or not pattern.strip() or name.strip() not in CLASSES:
                raise ConfigError(f"qos.instances entry {raw!r}: the class must be one of {list(CLASSES)}",
                                  field="qos.instances", fix=fix)
            weight = 1.0
            if colon:
                try:
                    weight = float(weight_text)
                except ValueError:
                    weight = float("nan")
                if not 0.0 < weight <= MAX_WEIGHT:
                    raise ConfigError(f"qos.instances entry {raw!r}: the weight must lie in (0, {MAX_WEIGHT:g}], "
                                      f"got {weight_text!r}", field="qos.instances", fix=fix)
            entries.append(Entry(pattern.strip(), name.strip(), weight))
        return cls(default_class, tuple(entries))

    def entry_for(self, instance: str) -> Entry | None:
        """The first entry whose pattern matches ``instance`` (a DP rank ``x@dp1`` matches ``x``'s)."""
        base = instance.split("@dp", 1)[0]
        for entry in self.entries:
            if fnmatch.fnmatchcase(instance, entry.pattern) or fnmatch.fnmatchcase(base, entry.pattern):
                return entry
        return None

    def resolve(self, instance: str, asked: str | None) -> tuple[str, float]:
        """The class and weight a request of ``instance`` gets, having asked ``asked`` (None: the
        instance's default). An instance with an entry is held to its class at most."""
        entry = self.entry_for(instance)
        if entry is None:
            return (asked or self.default_class), 1.0
        if asked is None or CLASSES.index(asked) < CLASSES.index(entry.cls):
            return entry.cls, entry.weight
        return asked, entry.weight

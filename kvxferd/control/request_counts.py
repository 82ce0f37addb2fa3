"""Requests counted by state: for the daemon's ``status`` answer, and for the gauges Prometheus
reads (counted on demand, from its thread)."""

from __future__ import annotations

import time

from ..lifecycle import states
from ..lifecycle.core import Lifecycle
from ..lifecycle.inbox import Inbox


class StateCounts:
    """Requests per (side, state), counted when Prometheus asks (from its thread) and reused for
    the other label values of the same scrape. Counting on every state change instead made
    the control loop's work grow with the number of requests in flight."""

    def __init__(self, inbox: Inbox, life: Lifecycle) -> None:
        self.inbox = inbox
        self.life = life
        self._cache: tuple[float, dict[tuple[str, str], int]] | None = None

    def __call__(self) -> dict[tuple[str, str], int]:
        now = time.monotonic()
        cached = self._cache
        if cached is not None and now - cached[0] < 0.05:
            return cached[1]
        counts = {("decode", s): 0 for s in states.ACTIVE} | {("prefill", s): 0 for s in states.ACTIVE}
        for entry in self.inbox.all():
            if entry.state in states.ACTIVE:
                counts[("decode", entry.state)] += 1
        for src in list(self.life.sources.values()):  # one C-level copy: safe against the loop's changes
            if src.state in states.ACTIVE:
                counts[("prefill", src.state)] += 1
        self._cache = (now, counts)
        return counts


def by_state(inbox: Inbox, life: Lifecycle) -> dict[str, int]:
    """Every request here by ``side:state``, terminal ones included (``status`` shows them)."""
    counts: dict[str, int] = {}
    for entry in inbox.all():
        counts[f"decode:{entry.state}"] = counts.get(f"decode:{entry.state}", 0) + 1
    for src in life.sources.values():
        counts[f"prefill:{src.state}"] = counts.get(f"prefill:{src.state}", 0) + 1
    return counts

"""Timers: they read the clock and turn time into events (phase timeouts, fence deadlines),
liveness checks (engine processes, peer heartbeats) and systemd's watchdog."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from ..lifecycle import events
from ..lifecycle.registry import Rank, Registry
from ..ops import sdnotify

log = logging.getLogger("kvxferd.timers")

TICK_S = 0.1  # phase timeouts and fence deadlines
LIVENESS_S = 0.5  # engine processes


async def sweeper(registry: Registry, drop_rank: Callable[[Rank, str], None], dispatch: Callable[[Any], Any]) -> None:
    last_liveness = 0.0
    while True:
        await asyncio.sleep(TICK_S)
        now = time.monotonic()
        if now - last_liveness >= LIVENESS_S:
            last_liveness = now
            _engines_alive(registry, drop_rank)
        dispatch(events.Tick())


def _engines_alive(registry: Registry, drop_rank: Callable[[Rank, str], None]) -> None:
    # one call per check: its loop variables die with it, so none of them keeps a dropped
    # rank (and through it the engine's memory mapping) alive between checks
    for rank in registry:
        if rank.process is not None and not rank.process.alive():
            log.warning("event=engine_gone rank=%s pid=%d", rank.id, rank.process.pid)
            drop_rank(rank, f"engine process {rank.process.pid} of rank {rank.id} exited")


async def heartbeats(interval_s: float, beat: Callable[[float], None]) -> None:
    """``beat(now)`` every ``interval_s``: the daemon pings its peers and renews its announcements."""
    while True:
        beat(time.monotonic())
        await asyncio.sleep(interval_s)


async def watchdog() -> None:
    """``WATCHDOG=1`` every WatchdogSec/2 while the loop runs (own timer: heartbeats may be slower)."""
    interval = sdnotify.watchdog_interval()
    while interval:
        sdnotify.notify("WATCHDOG=1")
        await asyncio.sleep(interval)

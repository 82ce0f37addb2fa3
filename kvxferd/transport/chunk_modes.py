"""How one chunk leaves a prefill daemon, direct or staged, and why: one rule for every transport.

A pair's mode (``peer.mode``, or what ``auto`` planned for the pair) says how its chunks move.
Where the operator asked a mode outright (``peer.mode = "direct"`` or ``"staged"``: the route is
*pinned*) the daemon honours it for host memory, whatever the chunk looks like. Under ``auto`` it
decides per chunk: runs shorter than a staging slot is worth (head slices of a TP-mismatched plan,
one-token pages) cost more as one socket view or one NIXL descriptor each than gathered through a
slot. Pages on a GPU always go through the daemon's own device slot: moved in place they are read
or written as memory imported by CUDA IPC, which UCX and the socket layer move in software at a
fraction of the copy's speed (BENCHMARKS.md, GPU).

Each transport asks :func:`pick` with what it knows of the chunk and reports the answer in its
:class:`~kvxferd.lifecycle.jobs.Moved`; the prefill side counts it in
``kvxferd_chunks_total{transport, mode, why}``, which ``status`` and ``kvxferd demo`` read.
"""

from __future__ import annotations

from typing import Any

from .framing import SMALL_RUN

DIRECT = "direct"
STAGED = "staged"

#: the mode the pair's plan holds (asked outright, or what ``auto`` picked for the pair)
PLAN = "plan"
#: ``auto``: the chunk's byte runs are too short to move in place (many views or descriptors)
SHORT_RUNS = "short_runs"
#: pages on a GPU go through the daemon's own device slot, whatever the pair asked
DEVICE_MEMORY = "device_memory"
#: a chunk that would be staged found no landing ring at the decode daemon (NIXL): it is written in place
NO_LANDING_RING = "no_landing_ring"
#: the decode daemon exposes no engine memory (``peer.nixl_engine_memory = "private"``): every chunk
#: lands in its landing ring, whatever the pair asked
PRIVATE_DESTINATION = "private_destination"

WHYS = (PLAN, SHORT_RUNS, DEVICE_MEMORY, NO_LANDING_RING, PRIVATE_DESTINATION)


def short_slices(plan: Any, asked: str) -> int:
    """The smallest head slice of a plan that ``direct``, asked outright, will move as runs of their
    own although ``auto`` would stage them (0: none): what an operator should hear at the handshake."""
    if asked != DIRECT or not plan.sliced:
        return 0
    smallest = min(w.slice_bytes for d in plan.destinations for w in d.writers if not w.whole_rows)
    return smallest if smallest < SMALL_RUN else 0


def pick(plan_mode: str, pinned: bool, device_memory: bool, short_runs: bool,
         private_destination: bool = False) -> tuple[str, str]:
    """The mode one chunk moves in and why.

    ``plan_mode``: the pair's planned mode (``direct`` or ``staged``); ``pinned``: the operator
    asked that mode outright rather than ``auto``; ``device_memory``: either side's pages of this
    chunk are on a GPU; ``short_runs``: the chunk's runs are short enough that a slot beats
    moving them in place (each transport's own measure); ``private_destination``: the destination
    pages may not be written in place at all (a decode daemon that keeps its engines' memory
    private), so even an operator's ``direct`` stages."""
    if plan_mode == STAGED:
        return STAGED, PLAN
    if private_destination:
        return STAGED, PRIVATE_DESTINATION
    if device_memory:
        return STAGED, DEVICE_MEMORY
    if pinned:
        return DIRECT, PLAN
    if short_runs:
        return STAGED, SHORT_RUNS
    return DIRECT, PLAN

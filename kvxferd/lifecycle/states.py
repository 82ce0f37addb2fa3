"""Every state a request can be in at one rank, and every transition, as tables.

A request lives once per rank: a *destination* at each decode rank (:class:`~kvxferd.lifecycle.inbox.DestEntry`)
and a *source* at each prefill rank (:class:`~kvxferd.lifecycle.outbox.SrcEntry`). Their ``state`` is
written only through :func:`advance`, which refuses a transition these tables do not list.

Rules the tables rely on (the lifecycle core keeps them):

- **Who frees pages.** The daemon never frees engine pages; it tells the engine a terminal
  state, and from that moment the pages are the engine's again. So a terminal state is told
  only when the daemon will not touch the pages any more.
- **A failure is told only when no thread touches the pages.** A failed entry first records
  ``failure`` (and is ``closed``: nothing new is admitted), its receiving side is stopped,
  and the ``failed`` transition happens once ``inflight`` (data jobs reading or writing its
  pages) is back to zero.
- **The fence.** A destination written by one-sided WRITEs (NIXL) of a remote source cannot
  see writes in flight: after a failure it sends ``fence`` to the source and waits (up to
  ``timeouts.fence_s``) for ``fenced`` before it may turn ``failed``.
- **Aborts propagate once.** A failure at one side tells the other side of the same request
  (the decode ranks of a local route, or the peer daemon), and that side does not propagate
  back: propagation is a bounded worklist, not a recursion (see ``Lifecycle._fail``).
"""

from __future__ import annotations

from typing import Any

BOOTSTRAPPING = "bootstrapping"
WAITING = "waiting_for_input"
TRANSFERRING = "transferring"
DONE = "done"
FAILED = "failed"

ACTIVE = (BOOTSTRAPPING, WAITING, TRANSFERRING)
TERMINAL = (DONE, FAILED)


def timeout_code(state: str) -> str:
    """The failure code of a request that outstays its state's time limit. A bootstrap that runs
    out of time says ``bootstrap_timeout`` whether the sweeper or the bootstrap noticed first."""
    return "bootstrap_timeout" if state == BOOTSTRAPPING else f"{state}_timeout"

#: decode side, one destination: (state, event) -> next state
DEST: dict[tuple[str, str], str] = {
    # the plan with the source instance is known; the source daemon was told (peer expect)
    (BOOTSTRAPPING, "bound"): WAITING,
    # the source answered no_handshake (it restarted): handshake again, once, before any byte
    (WAITING, "rehandshake"): BOOTSTRAPPING,
    # a data thread admitted a chunk (the inbox records it under its lock; the core moves the state)
    (BOOTSTRAPPING, "chunk_admitted"): TRANSFERRING,
    (WAITING, "chunk_admitted"): TRANSFERRING,
    # every writer of the plan delivered a gap-free range ending at the same token, no job in flight
    **{(s, "complete"): DONE for s in ACTIVE},
    # failure recorded, no job in flight, no fence open
    **{(s, "failed"): FAILED for s in ACTIVE},
}

#: prefill side, one source: (state, event) -> next state
SRC: dict[tuple[str, str], str] = {
    # the plan is known from a decode side's expect (or the request's route, for a replica)
    (BOOTSTRAPPING, "bound"): WAITING,
    # the first chunk job was posted to a data thread
    (WAITING, "job_started"): TRANSFERRING,
    # every destination the plan gives the rank confirmed every chunk (one-sided ones: and said the
    # request landed whole), no job in flight
    **{(s, "complete"): DONE for s in ACTIVE},
    # failure recorded, no job in flight
    **{(s, "failed"): FAILED for s in ACTIVE},
}


class TransitionError(AssertionError):
    """A transition the tables do not list: a bug in the lifecycle, never a peer's doing."""


def advance(entry: Any, table: dict[tuple[str, str], str], event: str, now: float) -> str:
    """Move ``entry`` (anything with ``state`` and ``phase_since``) along ``table``."""
    new = table.get((entry.state, event))
    if new is None:
        raise TransitionError(f"no transition from {entry.state!r} on {event!r}")
    entry.state = new
    entry.phase_since = now
    return new


def mark_failed(entry: Any, code: str, message: str) -> bool:
    """Record a failure (first one wins) and close the entry to new chunks; False if it had ended
    or failed already. The ``failed`` transition comes later, once no job touches its pages."""
    if entry.state in TERMINAL or entry.failure is not None:
        return False
    entry.closed = True
    entry.failure = (code, message)
    return True


def may(entry: Any, table: dict[tuple[str, str], str], event: str) -> bool:
    return (entry.state, event) in table

"""Deadlines of the tcp data port's connections, and the cap on those not yet proven.

A socket timeout bounds one ``recv``: a peer that trickles a byte every few seconds passes
every one of them and holds its connection, and a thread, for as long as it trickles. So
what must arrive whole has a deadline of its own, which one thread (the reaper) enforces
for every connection by shutting the late ones down (their serving thread then sees the
connection end, fails what it was receiving and closes it):

- a new connection has ``proof_s`` to prove its link (:mod:`.tcp_proof`);
- a frame (header, payload, digests) has ``frame_s`` plus its size at ``min_rate`` bytes a
  second from its first byte on: slow enough for any real link, and a trickler is cut.

Connections not proven yet live on a cap of their own (``max_unproven``): past it the oldest
unproven one is closed, so a flood of idle or slow strangers churns among itself while a
proven peer, which proves itself in one round trip, gets in. Setting a deadline is a plain
attribute write on the data thread (no system call per chunk).
"""

from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

#: why the guard closed a connection (a bounded metric label each)
PROOF_DEADLINE = "proof_deadline"
FRAME_DEADLINE = "frame_deadline"
UNPROVEN_CAP = "unproven_cap"


@dataclass(frozen=True)
class Deadlines:
    """What a data connection gets: ``proof_s`` to prove itself, ``frame_s + nbytes / min_rate``
    for each frame, and at most ``max_unproven`` connections waiting to prove themselves."""

    proof_s: float = 5.0
    frame_s: float = 30.0
    min_rate: float = 1024.0 * 1024.0  # bytes a second
    max_unproven: int = 16

    def frame(self, nbytes: int) -> float:
        return self.frame_s + max(0, nbytes) / self.min_rate


class Watched:
    """One connection as the guard sees it; its serving thread sets the deadline."""

    __slots__ = ("conn", "peer", "deadline", "phase", "proven", "expired")

    def __init__(self, conn: socket.socket, peer: str, deadline: float) -> None:
        self.conn = conn
        self.peer = peer
        self.deadline: float | None = deadline  # None: no deadline now (idle between frames)
        self.phase = PROOF_DEADLINE
        self.proven = False
        self.expired = ""  # the reason the guard closed it, once it did


class ConnectionGuard:
    """Every live data connection's deadline; the reaper thread and the unproven cap."""

    def __init__(self, limits: Deadlines, on_closed: Callable[["Watched", str], None] | None = None) -> None:
        self.limits = limits
        self.on_closed = on_closed
        self._unproven: OrderedDict[socket.socket, Watched] = OrderedDict()  # oldest first
        self._all: dict[socket.socket, Watched] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.tick_s = max(0.05, min(0.5, limits.proof_s / 4, limits.frame_s / 4))
        self._thread = threading.Thread(target=self._reap, name="kvxferd-data-reaper", daemon=True)
        self._thread.start()

    def admit(self, conn: socket.socket, peer: str) -> Watched:
        """A new connection, unproven: on the cap (the oldest unproven one goes when it is full)."""
        watched = Watched(conn, peer, time.monotonic() + self.limits.proof_s)
        with self._lock:
            self._all[conn] = watched
            self._unproven[conn] = watched
            evicted = []
            while len(self._unproven) > self.limits.max_unproven:
                _, old = self._unproven.popitem(last=False)
                evicted.append(old)
        for old in evicted:
            self._expire(old, UNPROVEN_CAP)
        return watched

    def proven(self, watched: Watched) -> None:
        with self._lock:
            self._unproven.pop(watched.conn, None)
        watched.proven = True
        watched.deadline = None

    def frame_started(self, watched: Watched) -> float:
        """A frame's first bytes are in: its header gets ``frame_s``; returns the start."""
        now = time.monotonic()
        watched.phase = FRAME_DEADLINE
        watched.deadline = now + self.limits.frame_s
        return now

    def frame_size(self, watched: Watched, started: float, nbytes: int) -> None:
        """The header said how many bytes follow: the frame's whole deadline from its start."""
        watched.deadline = started + self.limits.frame(nbytes)

    def between_frames(self, watched: Watched) -> None:
        watched.deadline = None  # idle: the connection's idle timeout applies

    def forget(self, watched: Watched) -> None:
        with self._lock:
            self._all.pop(watched.conn, None)
            self._unproven.pop(watched.conn, None)

    @property
    def unproven(self) -> int:
        with self._lock:
            return len(self._unproven)

    def _expire(self, watched: Watched, reason: str) -> None:
        """Shut ``watched`` down for ``reason``; its serving thread returns at once and closes it."""
        with self._lock:
            if watched.expired:
                return
            watched.expired = reason
        try:
            watched.conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self.on_closed:
            self.on_closed(watched, reason)  # counted and logged by the server

    def _reap(self) -> None:
        while not self._stop.wait(self.tick_s):
            now = time.monotonic()
            with self._lock:
                late = [w for w in self._all.values() if w.deadline is not None and w.deadline < now]
            for watched in late:
                deadline = watched.deadline  # re-read: its thread may have moved on meanwhile
                if deadline is not None and deadline < now:
                    self._expire(watched, watched.phase)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

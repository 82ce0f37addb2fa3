"""The prefill side's remote NIXL agents: loading their metadata, reloading it when stale, dropping them.

A mixin of :class:`~.transport.NixlTransport` (it shares the transport's agent, lock and
tables): which blobs are stale and when to reload is decided in :mod:`.remote`; the
NIXL calls that load, reload and remove a remote agent are here.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ...errors import ProtocolError, TransferError
from ...model.geometry import InstanceSpec
from ...ops.logutil import q
from .api import NixlPeer
from .receive import _why
from .remote import Gate, RemoteBook, pair_blobs
from .staging import Credits, RingInfo

log = logging.getLogger("kvxferd.nixl")

RELEASE_SETTLE_S = 2.0  # a failed WRITE's data thread waits this long for NIXL to let go of it


class RemoteAgents:
    """Decode daemons' agents as this (prefill) daemon's data threads write to them."""

    agent: Any
    timeout_s: float
    _lock: threading.Lock
    _md_lock: threading.Lock
    _forget_at: dict[str, float]
    _loaded: set[str]
    _books: dict[str, RemoteBook]
    _gates: dict[str, Gate]
    _credits: dict[str, Credits]
    _unreleased: list[Any]

    def add_peer(self, agent: str, metadata: list[bytes], regions: list[list[Any]], spec: InstanceSpec,
                 landing: list[int] | None = None, private: bool = False) -> NixlPeer:
        """A decode agent as one route sees it; ``spec`` is the decode instance's; ``private``: it
        described no engine memory, only its landing ring (every chunk lands there)."""
        if private and regions:
            raise ProtocolError(f"NIXL agent {agent!r} says its engine memory is private yet describes "
                                f"{len(regions)} regions", field="nixl_regions",
                                fix="describe no engine region with nixl_private")
        self.load(agent, metadata, regions, landing)
        peer = NixlPeer(agent, spec)
        peer.private = private
        peer.update(regions)
        if landing is not None:
            info = RingInfo.from_wire(landing)
            with self._lock:
                credits = self._credits.get(agent)
                if credits is None or credits.info != info:  # a new ring: every slot of it is free
                    credits = self._credits[agent] = Credits(agent, info)
            peer.credits = credits
        return peer

    def load(self, agent: str, metadata: list[bytes], regions: list[list[Any]] | None = None,
             landing: list[int] | None = None) -> None:
        """Load a remote agent's metadata; ``regions`` and ``landing`` (the handshake's or expect's)
        say which addresses each blob describes, so a blob made stale by a newer one is noticed
        (see :mod:`.remote`).

        Blobs that make an earlier one stale are not loaded beside it: they wait for the reload
        the book now calls for. NIXL refuses a descriptor identical to a loaded one but for its
        remote key (a GPU region re-registered at the same address: CUDA IPC handles differ), and
        a refused load leaves the agent's connection half-loaded, failing every later load of it.
        """
        with self._lock:
            self._forget_at.pop(agent, None)  # back before it was dropped: keep it
        with self._md_lock:  # a reload in progress must neither remove these blobs nor miss them
            with self._lock:
                book = self._books.setdefault(agent, RemoteBook())
                self._gates.setdefault(agent, Gate())
            fresh = pair_blobs(metadata, regions or (), landing)
            if book.makes_stale(fresh):
                with self._lock:
                    stale = book.add(fresh)
            else:
                for md in metadata:
                    self._add(agent, md)
                with self._lock:
                    stale = book.add(fresh)
        if stale:
            log.info("event=nixl_remote_stale agent=%s blobs=%d reason=%s", q(agent), len(book.loaded),
                     q("newly described regions overlap regions of an earlier registration; the agent's "
                       "metadata is loaded anew before its next WRITE"))

    def _add(self, agent: str, md: bytes) -> None:
        """Load one blob of ``agent`` into NIXL, checking it is that agent's."""
        try:
            added = self.agent.add_remote_agent(md)
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"cannot load NIXL metadata of agent {agent!r}: {_why(exc)}",
                                field="nixl_md", fix="check both daemons run NIXL with a common backend")
        name = added.decode() if isinstance(added, bytes) else str(added)
        with self._lock:
            self._loaded.add(name)
        if name != agent:
            raise ProtocolError(f"NIXL metadata is of agent {name!r}, the handshake named {agent!r}",
                                field="nixl_md", fix="send the metadata of the agent named in nixl_agent")

    def _enter(self, agent: str, deadline: float) -> Gate | None:
        """Share the agent's gate for a job's WRITEs (returned, to leave); first reload the agent's
        metadata if a stale blob is loaded."""
        with self._lock:
            gate, book = self._gates.get(agent), self._books.get(agent)
        if gate is None or book is None:
            return None
        gate.enter(deadline)
        if not book.due:
            return gate
        gate.leave()
        gate.enter_alone(deadline)
        try:
            with self._md_lock:  # what is loaded meanwhile is in the book: the reload takes it along
                if book.due:
                    self._reload(agent, book.blobs(), book)  # raises with the reload still due
                    book.due = False
        finally:
            gate.leave_alone()
        gate.enter(deadline)
        return gate

    def _reload(self, agent: str, blobs: list[bytes], book: RemoteBook) -> None:
        """Remove the agent (every descriptor NIXL holds of it) and load its live blobs again; runs
        alone on the agent's gate, so no WRITE to it is in flight."""
        try:
            self.agent.remove_remote_agent(agent)
            for blob in blobs:
                self._add(agent, blob)
        except ProtocolError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"reloading the NIXL metadata of agent {agent!r} failed: {_why(exc)}",
                                field="nixl_md", fix="check the decode daemon is up; its next handshake "
                                                     "loads it again") from None
        book.reloads += 1
        log.info("event=nixl_remote_reloaded agent=%s blobs=%d reloads=%d", q(agent), len(blobs), book.reloads)

    def forget(self, agent: str) -> None:
        """A peer daemon went away: drop its remote agent (connections, metadata, landing credits)
        once no WRITE to it can still be pending. A handshake that loads it again first keeps it."""
        with self._lock:
            self._forget_at[agent] = time.monotonic() + self.timeout_s + RELEASE_SETTLE_S

    def _drop_forgotten(self) -> None:
        now = time.monotonic()
        with self._lock:
            busy = {agent for _h, _a, agent in self._unreleased}
            due = [a for a, t in self._forget_at.items() if t <= now and a not in busy]
            for agent in due:
                del self._forget_at[agent]
                self._credits.pop(agent, None)
                self._books.pop(agent, None)  # a gate may still be held by a thread giving up: it stays
        for agent in due:
            with self._lock:
                self._loaded.discard(agent)
            try:
                self.agent.remove_remote_agent(agent)
                log.info("event=nixl_agent_removed agent=%s", q(agent))
            except Exception as exc:  # noqa: BLE001 - never loaded, or already gone
                log.info("event=nixl_agent_remove_failed agent=%s error=%s", q(agent), q(_why(exc)))

"""The lifecycle core: typed events in, effects out; no socket, thread, loop or clock here.

Shells call :meth:`Lifecycle.handle` with an event and the time, and then carry out what
:meth:`Lifecycle.take_effects` returns (send to an engine, to a peer, start a job, cut
connections). Engine calls also get a return value (the state to answer with) or raise a
:class:`~kvxferd.errors.RequestError` to answer with.

Failures go through one worklist (:meth:`Lifecycle._fail`): failing a request at one side
may fail the other side of the same request on this daemon, which never propagates back,
so an abort touches each entry at most once and no call chain grows with it.
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import RequestError
from . import effects, events, states
from .base import Entry
from .decode import DecodeSide
from .inbox import DestEntry
from .links import UP, Link, Links
from .prefill import PrefillSide
from .quotas import PeerRequests
from .registry import Rank


class Lifecycle(DecodeSide, PrefillSide):
    """Every request of one daemon, both sides, and the one book of plans and routes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # the books: :class:`~.base.LifecycleBase`
        #: prefill side: the requests each decode daemon's link bound here (its quota, :mod:`.quotas`)
        self.peer_requests = PeerRequests()
        self._handlers: dict[type, Callable[[Any], Any]] = {
            events.ExpectCalled: self._expect, events.SendCalled: self._send,
            events.AbortCalled: self._abort_called, events.RankGone: self._rank_gone,
            events.PlanFound: self._plan_found, events.BootstrapFailed: self._bootstrap_failed,
            events.HandshakeAnswered: self._handshake_answered,
            events.DestChanged: lambda ev: self._dest_changed(ev.entry),
            events.ChunkRefused: lambda ev: self._fail(ev.entry, ev.code, ev.message),
            events.UpstreamAbort: self._upstream_abort, events.UpstreamFenced: self._upstream_fenced,
            events.NoHandshake: self._no_handshake, events.SourceLost: self._source_lost,
            events.HandshakeAsked: self._handshake_asked,
            events.HandshakeRefusedHere: lambda ev: self.routes.refused(ev.prefill, ev.decode, ev.identity),
            events.PeerExpected: self._on_expect, events.DownstreamAbort: self._downstream_abort,
            events.DownstreamEnded: self._downstream_ended,
            events.FenceAsked: self._fence_asked, events.DownstreamLost: self._downstream_lost,
            events.DownstreamLanded: self._downstream_landed,
            events.JobFinished: self._job_finished, events.Tick: self._tick, events.ShutDown: self._shut_down,
            events.LinkOpened: self._link_opened, events.SourceHeard: self._source_heard,
            events.DecodeHeard: self._decode_heard, events.DecodeGone: self._decode_gone,
            events.Heartbeat: self._heartbeat,
        }

    # -- the interface ---------------------------------------------------------------------------
    def handle(self, event: Any, now: float) -> Any:
        """Apply one event at time ``now``; effects wait in :meth:`take_effects`."""
        self.now = now
        return self._handlers[type(event)](event)

    def take_effects(self) -> list[effects.Effect]:
        out, self._effects = self._effects, []
        return out

    # -- failures: one bounded worklist ------------------------------------------------------------
    def _fail(self, entry: Entry, code: str, message: str, propagate: bool = True) -> None:
        """Fail ``entry``; with ``propagate`` the other side of the request hears it once (and
        does not propagate back). Called while a failure is being applied, it queues."""
        self._failures.append((entry, code, message, propagate))
        if self._failing:
            return
        self._failing = True
        try:
            while self._failures:
                item, code_, message_, propagate_ = self._failures.popleft()
                if isinstance(item, DestEntry):
                    self._fail_dest_now(item, code_, message_, propagate_)
                else:
                    self._fail_src_now(item, code_, message_, propagate_)
        finally:
            self._failing = False

    # -- engine calls and ranks ------------------------------------------------------------------
    def _abort_called(self, ev: events.AbortCalled) -> str:
        if ev.rank.role == "decode":
            dest = self.inbox.get(ev.request_id, ev.rank.id)
            if dest is not None:
                self._fail(dest, "aborted", ev.reason)
                return states.FAILED
        else:
            src = self.sources.get((ev.request_id, ev.rank.id))
            if src is not None:
                self._fail(src, "aborted", ev.reason)
                return states.FAILED
        done = self.finished.get((ev.request_id, ev.rank.id))
        if done is not None:
            return str(done["state"])
        raise RequestError(f"unknown request {ev.request_id!r} at {ev.rank.id}", field="request_id",
                           fix="abort a request this rank expected or sent")

    def _rank_gone(self, ev: events.RankGone) -> None:
        self.ledger.forget(ev.rank.id)
        for dest in self.inbox.all():
            if dest.rank is ev.rank:
                self._fail(dest, "rank_gone", ev.reason)
        for src in list(self.sources.values()):
            if src.rank_id == ev.rank.id and src.state not in states.TERMINAL:
                self._fail(src, "rank_gone", ev.reason)

    def _bootstrap_failed(self, ev: events.BootstrapFailed) -> None:
        if ev.entry.failure is not None:  # it failed while its bootstrap ran: the source hears it once more
            self._retell_end(ev.entry)
            return
        # a refusal (whichever daemon computed it), a bootstrap timeout: the source side hears it too
        self._fail(ev.entry, ev.code, ev.message)

    def poll(self, rank: Rank, request_id: str) -> dict[str, Any]:
        """What ``poll`` answers (reads only)."""
        if rank.role == "decode":
            dest = self.inbox.get(request_id, rank.id)
            if dest is not None:
                return {"state": dest.state}
        else:
            src = self.sources.get((request_id, rank.id))
            if src is not None:
                return {"state": src.state}
        done = self.finished.get((request_id, rank.id))
        if done is not None:
            return dict(done)
        end = self.decode_end(request_id, rank.instance) if rank.role == "prefill" else None
        if end is not None:  # the decode side ended it before this rank sent anything
            return {"state": states.FAILED, "bytes": 0, "code": end.code, "reason": end.message}
        if rank.role == "prefill" and self.routes.request(request_id, rank.instance) is not None:
            # the decode side's expect reached this daemon: the rank may send, whether or not the
            # plan gives it anything to write (a head replica) and before it sent anything
            return {"state": states.WAITING}
        raise RequestError(f"unknown request {request_id!r} at {rank.id}", field="request_id",
                           fix="poll a request this rank expected or sent")

    # -- links to peer daemons ----------------------------------------------------------------------
    def _link_opened(self, ev: events.LinkOpened) -> None:
        link = self.source_daemons.get(ev.address) or Link(ev.address, ev.address)
        self._moved(self.source_daemons, link, "opened")

    def _source_heard(self, ev: events.SourceHeard) -> bool:
        link = self.source_daemons.get(ev.address) or Link(ev.address, ev.address)
        self._moved(self.source_daemons, link, "heard")
        old = Links.incarnation(link, ev.incarnation)
        if not old:
            return False
        self.emit(effects.LinkChanged(self.source_daemons.side, link.key, link.daemon, UP, UP, "restarted",
                                      old_incarnation=old, new_incarnation=link.incarnation))
        self._source_lost(events.SourceLost(
            ev.address, "peer_restarted", f"source daemon {ev.address} restarted (incarnation {old} -> "
            f"{link.incarnation}); the request's source side went with the old process", sent_before=ev.sent_before))
        return True

    def _decode_heard(self, ev: events.DecodeHeard) -> None:
        link = self.decode_daemons.get(ev.identity)
        if link is None:
            if ev.daemon is None:
                return  # a connection that never named its daemon (no ping, no handshake yet)
            link = Link(ev.identity, ev.daemon)
        self._moved(self.decode_daemons, link, "heard")
        if not link.incarnation:  # a connection speaks for one process: its first incarnation holds
            Links.incarnation(link, ev.incarnation)

    def _decode_gone(self, ev: events.DecodeGone) -> None:
        link = self.decode_daemons.get(ev.identity)
        if link is None:
            return
        self._moved(self.decode_daemons, link, "closed", "restarted", old_incarnation=ev.old, new_incarnation=ev.new)
        self._downstream_lost(events.DownstreamLost(
            ev.identity, "peer_restarted", f"decode daemon {ev.daemon} restarted (incarnation {ev.old} -> {ev.new}); "
            "the request's decode side went with the old process"))

    def _heartbeat(self, ev: events.Heartbeat) -> None:
        def waited_on(link: Link) -> bool:
            return any(e.from_source(link.daemon) for e in self.inbox.all())

        for link, happened in self.source_daemons.due(self.now, ev.timeout_s, waited_on):
            was_up, silent_for = link.state == UP, self.now - link.last_seen
            self._moved(self.source_daemons, link, happened, silent_for=silent_for if happened == "silent" else 0.0)
            if happened == "silent" and was_up:
                self._source_lost(events.SourceLost(link.daemon, "peer_dead",
                                                    f"source daemon {link.daemon} unresponsive for {silent_for:.1f}s"))
            elif happened == "silent":  # never answered: what waits for its handshakes stops waiting
                self._source_unreachable(link.daemon)
        # a decode daemon's link is closed as soon as it goes silent: nothing here waits on it after
        # its requests failed, and a new connection of it is a new link
        for link, _happened in self.decode_daemons.due(self.now, ev.timeout_s, lambda link: False):
            before, silent_for = link.state, self.now - link.last_seen
            self.decode_daemons.move(link, "silent", self.now)
            self.decode_daemons.move(link, "idle", self.now)
            self.emit(effects.LinkChanged(self.decode_daemons.side, link.key, link.daemon, before, None, "silent",
                                          silent_for=silent_for))
            self._downstream_lost(events.DownstreamLost(
                link.key, "peer_dead", f"decode daemon {link.daemon} unresponsive for {silent_for:.1f}s"))

    # -- timers and shutdown -------------------------------------------------------------------------
    def _tick(self, ev: events.Tick) -> None:
        self._tick_handshakes()
        self._tick_dests()
        self._tick_sources()

    def _shut_down(self, ev: events.ShutDown) -> None:
        if not ev.final:
            for dest in self.inbox.all():
                self._fail(dest, "shutdown", "daemon shut down before the transfer finished")
            for src in list(self.sources.values()):
                self._fail(src, "shutdown", "daemon shut down before the transfer finished")
            return
        # the drain's end: what is left is told now (a thread still blocked ends with the process)
        for dest in self.inbox.all():
            if dest.state not in states.TERMINAL:
                self._finalize_dest(dest, states.FAILED)
        for src in list(self.sources.values()):
            if src.state not in states.TERMINAL:
                self._finalize_src(src, states.FAILED)

"""Decode side of the lifecycle core: finding a destination's plan.

A destination starts ``bootstrapping``. Its source instance on this daemon: the plan is
made here, once the instance has registered. At another daemon: the instance pair's
handshake with it (:mod:`.handshakes`), shared by every destination of the pair; and when
the source instance's ranks are spread over several daemons (the handshake answer names
them, as its rendezvous's directory lists them), a handshake with each of them, which
must all agree on the plan and on the transport. Then :class:`~.events.PlanFound`, or the
destination fails ``incompatible`` naming the daemon and the field.

Hellos leave as :class:`~.effects.SendHandshake` effects; the shell numbers them and hands
every answer back as :class:`~.events.HandshakeAnswered`. Silence, pauses and the end of
every waiter are seen on the :class:`~.events.Tick`.
"""

from __future__ import annotations

import logging

from ..directory.holders import spec_difference
from ..errors import ClaimRefused, KvxferError, PlanRefusal
from ..model.geometry import InstanceSpec, rank_id
from ..model.plan_wire import plan_from_wire
from ..model.planner import make_plan
from ..model.sampling import stricter
from ..ops.logutil import q
from ..wire import protocol
from ..wire.messages import HandshakeOk, HandshakeRefused, HandshakeRetry
from . import effects, events
from .base import LifecycleBase
from .handshakes import AGREED, ASKING, Handshake, Key
from .links import DOWN
from .inbox import DestEntry
from .outbox import Route

log = logging.getLogger("kvxferd.lifecycle")


class BootstrapSide(LifecycleBase):
    # -- a destination's plan ---------------------------------------------------------------------
    def _bootstrap(self, entry: DestEntry) -> None:
        if not entry.source_address:
            self._bootstrap_local(entry)
            return
        hs = self._need(entry, entry.source_address)
        if hs is not None and hs.state == AGREED:
            self._proceed(entry)

    def _need(self, entry: DestEntry, address: str) -> Handshake | None:
        """The handshake of the entry's pair with ``address``; a hello leaves if none was asked.
        None: the daemon at ``address`` is backed off (:mod:`.links`), and the entry failed at once."""
        link = self.source_daemons.get(address)
        if link is not None and link.state == DOWN:
            if self.now < link.retry_at:
                self._bootstrap_failed(events.BootstrapFailed(entry, *self._down_failure(entry, address)))
                return None
            self._moved(self.source_daemons, link, "retry")  # its backoff ran out: this request tries it
        key: Key = (address, entry.source_instance, entry.rank.instance)
        hs, fresh = self.handshakes.need(key, entry.rank.geometry.spec, entry, self.now)
        if fresh:
            hs.ask = self.standing(entry.rank.instance)  # the instance's, whichever rank asks first
            self.emit(effects.SendHandshake(address, entry.source_instance, entry.rank.instance, hs.spec, hs.ask))
        if hs.state != AGREED:
            entry.waiting_for = self._waiting_text(entry, hs)
        return hs

    def _down_failure(self, entry: DestEntry, address: str) -> tuple[str, str]:
        """Why a request naming the down daemon at ``address`` fails: (code, message). A daemon
        that refused this one's key is reported as such on every request until it is heard."""
        link = self.source_daemons.get(address)
        tries, retry_at = (link.tries, link.retry_at) if link is not None else (1, self.now)
        if link is not None and link.refused:
            return "auth_failed", f"{link.refused}; the next try in {max(0.0, retry_at - self.now):.1f}s"
        return "peer_unreachable", self._unreachable_text(entry, address, tries, retry_at)

    def _unreachable_text(self, entry: DestEntry, address: str, tries: int, retry_at: float) -> str:
        what = f"source daemon {address}"
        if address != entry.source_address:
            primary = self.handshakes.get((entry.source_address, entry.source_instance, entry.rank.instance))
            held = _ranks_at(entry.source_instance, primary.rank_map if primary else {}, address)
            what = f"daemon {address}, holding {held} by the directory of rendezvous {entry.source_address},"
        silent = f" for {self.peer.peer_timeout_s}s" if self.peer is not None else ""
        return (f"{what} is unreachable: {tries} {'try' if tries == 1 else 'tries'} in a row found it silent{silent}; "
                f"the next try in {max(0.0, retry_at - self.now):.1f}s (check that it runs and that its advertised "
                "address, peer.advertise_host, is reachable from here)")

    def _source_unreachable(self, address: str) -> None:
        """The daemon at ``address`` never answered: destinations waiting for a handshake with it fail."""
        for hs in self.handshakes.at(address):
            for entry in list(hs.waiting):
                if entry.failure is None:
                    self._bootstrap_failed(events.BootstrapFailed(entry, *self._down_failure(entry, address)))
            if hs.state != AGREED:  # the next try asks afresh, at once
                self.handshakes.move(hs, "abandoned", self.now)

    def _waiting_text(self, entry: DestEntry, hs: Handshake) -> str:
        if hs.said:
            return f"the source daemon {hs.address}, which said: {hs.said}"
        if hs.address == entry.source_address:
            return f"a handshake answer from source daemon {hs.address} (unreachable, or the instance is not registered)"
        primary = self.handshakes.get((entry.source_address, entry.source_instance, entry.rank.instance))
        held = _ranks_at(entry.source_instance, primary.rank_map if primary else {}, hs.address)
        return (f"a handshake with daemon {hs.address}, holding {held} by the directory of rendezvous "
                f"{entry.source_address}: is that address reachable from here (peer.advertise_host of that daemon)?")

    def _proceed(self, entry: DestEntry) -> None:
        """One of the entry's handshakes agreed: the plan is found once all it needs have."""
        prefill, decode = entry.source_instance, entry.rank.instance
        primary = self.handshakes.get((entry.source_address, prefill, decode))
        if primary is None or primary.state != AGREED:  # forgotten meanwhile (the link went down): ask again
            if entry.failure is None:
                self._bootstrap(entry)
            return
        plan = primary.plan
        assert plan is not None
        entry.integrity = self.integrity.at_least(entry.integrity, primary.integrity)  # the pair's agreed floor
        if not primary.rank_map:
            self._plan_found(events.PlanFound(entry, plan, primary.token, primary.kind))
            return
        addresses = sorted(set(primary.rank_map.values()))
        if entry.failure is not None:  # it failed while bootstrapping: those it reached hear it again
            agreed = {a for a in addresses if (hs := self.handshakes.get((a, prefill, decode))) and hs.state == AGREED}
            self._plan_found(events.PlanFound(entry, plan, primary.token, primary.kind,
                                              {c: a for c, a in primary.rank_map.items() if a in agreed}))
            return
        if self.address in addresses:
            held = _ranks_at(prefill, primary.rank_map, self.address)
            self._refuse(entry, PlanRefusal(f"ranks {held} of {prefill!r} are registered at this decode daemon "
                                            f"{self.address} and the rest at other daemons: a source instance partly "
                                            "on its decode daemon is not supported", field="ranks"))
            return
        needed = [self._need(entry, a) for a in addresses if a != primary.address]
        others = [hs for hs in needed if hs is not None]
        if len(others) < len(needed) or any(hs.state != AGREED for hs in others):
            return  # the entry waits in each handshake not agreed yet; the last one to agree proceeds it
        refusal = _disagreement(prefill, primary, others)
        if refusal is not None:
            self._refuse(entry, refusal)
            return
        entry.waiting_for = ""
        self._plan_found(events.PlanFound(entry, plan, primary.token, primary.kind, dict(primary.rank_map),
                                          {hs.address: hs.token for hs in (primary, *others) if hs.token}))

    def _refuse(self, entry: DestEntry, refusal: PlanRefusal) -> None:
        self.metrics.refusals.labels(refusal.field or "unknown").inc()
        self._bootstrap_failed(events.BootstrapFailed(entry, refusal.code, str(refusal)))

    def _bootstrap_local(self, entry: DestEntry) -> None:
        """The source instance is on this daemon: the plan is made here, once it registered."""
        prefill, decode = entry.source_instance, entry.rank.instance
        cached = self.routes.local(prefill, decode)
        if cached is not None:
            entry.integrity = self.integrity.at_least(entry.integrity, self.routes.integrity(prefill, decode))
            self._plan_found(events.PlanFound(entry, cached[0]))
            return
        elsewhere = self.remote_ranks(prefill)
        if elsewhere:  # its writers elsewhere would never be asked for their bytes
            self._refuse(entry, PlanRefusal(
                f"instance {prefill!r} has ranks at other daemons ({sorted(elsewhere)} at {sorted(set(elsewhere.values()))}) "
                "and at this decode daemon: a source instance partly on its decode daemon is not supported",
                field="ranks"))
            return
        spec = self.registry.spec(prefill, "prefill")
        if spec is None:
            entry.waiting_for = f"a prefill rank of instance {prefill!r} to register at this daemon"
            self.local_waiting.append(entry)
            return
        try:
            plan = make_plan(spec, entry.rank.geometry.spec, mode="direct",  # config.LOCAL_MODE_NOTE
                             require_same_page_size=self.require_same_page_size)
        except PlanRefusal as refusal:
            self._refuse(entry, refusal)
            return
        agreed = stricter(self.integrity.standing(entry.rank.integrity), self.standing(prefill))
        self.routes.set_pair(prefill, decode, plan, Route("local", daemon=self.address), agreed)
        entry.integrity = self.integrity.at_least(entry.integrity, agreed)
        self.metrics.handshakes.labels("ok").inc()
        entry.waiting_for = ""
        self._plan_found(events.PlanFound(entry, plan))

    # -- answers and time -------------------------------------------------------------------------
    def _handshake_answered(self, ev: events.HandshakeAnswered) -> None:
        hs = self.handshakes.get((ev.address, ev.prefill, ev.decode))
        if hs is None or hs.state != ASKING:
            return  # the answer to a hello asked again, or to a pair forgotten meanwhile
        answer = ev.answer
        if isinstance(answer, HandshakeRetry):
            hs.said = answer.reason[:500]
            self.handshakes.move(hs, "retry", self.now)
            for entry in hs.waiting:
                entry.waiting_for = self._waiting_text(entry, hs)
            self._member_still_lost(hs)
            return
        if isinstance(answer, HandshakeRefused):
            err = answer.error
            self.metrics.handshakes.labels("refused").inc()
            log.warning("event=handshake_refused peer=%s field=%s msg=%s", hs.address, err.get("field"),
                        q(str(err.get("message"))[:300]))
            # a refused claim keeps its code (the destination fails claim_refused); any other is incompatible
            kind = ClaimRefused if err.get("code") == ClaimRefused.code else PlanRefusal
            self._handshake_failed(hs, kind(str(err.get("message", "refused")),
                                            field=str(err.get("field") or "unknown"),
                                            prefill=err.get("prefill"), decode=err.get("decode")))
            return
        assert isinstance(answer, HandshakeOk)
        try:
            prefill_spec = InstanceSpec.from_dict(protocol.bounded_geometry(answer.prefill_spec, "prefill_spec"))
            hs.plan = plan_from_wire(answer.plan, prefill_spec, hs.spec, answer.mode,  # the source's, checked
                                     require_same_page_size=self.require_same_page_size)
        except KvxferError as exc:
            self.metrics.handshakes.labels("refused").inc()
            self._handshake_failed(hs, PlanRefusal(f"peer's handshake answer is unusable: {exc}",
                                                   field=exc.field or "geometry"))
            return
        hs.rank_map = {(tp, pp): address for tp, pp, address in answer.ranks or ()}
        hs.integrity = stricter(hs.ask, answer.integrity)
        hs.token, hs.kind, hs.said = ev.token, ev.kind, ""
        self.metrics.handshakes.labels("ok").inc()
        log.info("event=handshake_ok peer=%s prefill=%s decode=%s mode=%s transport=%s", hs.address, ev.prefill,
                 ev.decode, hs.plan.mode, ev.kind)
        self.handshakes.move(hs, "agreed", self.now)
        waiting, hs.waiting = hs.waiting, []
        for entry in waiting:
            self._proceed(entry)

    def _member_still_lost(self, hs: Handshake) -> None:
        """The rendezvous says "retry later" for a pair whose rank map named a member daemon that
        went down and is not back: its ranks are gone, not on their way, so the destinations fail
        now, naming the member and the rendezvous, instead of waiting out their bootstrap."""
        lost = self.handshakes.lost.get(hs.key)
        if lost is None or self.source_daemons.is_up(lost[0]):
            return
        member, held = lost
        text = (f"ranks {held} were at daemon {member}, which went silent; their rendezvous {hs.address} lists "
                f"no daemon for them yet (it said: {hs.said}): they must register again, at {member} once it "
                f"is back or at another daemon naming {hs.address} as their rendezvous")
        for entry in list(hs.waiting):
            if entry.failure is None:
                self._bootstrap_failed(events.BootstrapFailed(entry, "peer_dead", text))

    def _wants_handshake(self, entry: DestEntry) -> bool:
        """A destination waits for its handshake while it lives, and once failed while its end went to
        the source ahead of the handshake (it goes again behind it), within its bootstrap time."""
        if entry.failure is None:
            return True
        return entry.end_told and self.now - entry.created <= self.timeouts.bootstrap_s

    def _handshake_failed(self, hs: Handshake, refusal: PlanRefusal) -> None:
        waiting = hs.waiting
        self.handshakes.move(hs, "refused", self.now)
        for entry in waiting:
            self._refuse(entry, refusal)

    def _tick_handshakes(self) -> None:
        for hs, happened in self.handshakes.due(self.now, self._wants_handshake):
            if happened == "abandoned":
                self.metrics.handshakes.labels("timeout").inc()
            if self.handshakes.move(hs, happened, self.now) == ASKING:
                self.emit(effects.SendHandshake(*hs.key, hs.spec, hs.ask))
        waiting, self.local_waiting = self.local_waiting, []
        for entry in waiting:
            if entry.failure is None:
                self._bootstrap_local(entry)

    def _source_handshakes(self, address: str, code: str) -> None:
        """A source daemon went (peer_dead), restarted, or refused this daemon's key: its handshakes
        say so. Asking ones ask the new process again; agreed ones are forgotten (the next
        destination asks again)."""
        happened = {"peer_restarted": "restarted", "peer_dead": "forgotten"}.get(code, "auth_failed")
        for hs in self.handshakes.at(address):
            if self.handshakes.move(hs, happened, self.now) == ASKING and happened == "restarted":
                self.emit(effects.SendHandshake(*hs.key, hs.spec, hs.ask))
        # a rendezvous's rank map that names the lost daemon is stale: its ranks register again
        # elsewhere, and the rendezvous's directory will say where; the next destination asks it anew
        for hs in list(self.handshakes.book.values()):
            if hs.state == AGREED and hs.address != address and address in hs.rank_map.values():
                log.info("event=rank_map_forgotten rendezvous=%s prefill=%s decode=%s lost=%s", hs.address,
                         hs.key[1], hs.key[2], address)
                if code == "peer_dead":
                    self.handshakes.member_lost(hs, address, _ranks_at(hs.key[1], hs.rank_map, address))
                self.handshakes.move(hs, "forgotten", self.now)

    def _handshakes_forgotten(self, address: str) -> None:
        """The source answered an expect ``no_handshake``: it holds none of this daemon's pairs."""
        for hs in self.handshakes.at(address):
            if hs.state == AGREED:
                self.handshakes.move(hs, "forgotten", self.now)


def _ranks_at(instance: str, rank_map: dict[tuple[int, int], str], address: str) -> str:
    return ", ".join(rank_id(instance, *c) for c, a in sorted(rank_map.items()) if a == address)


def _disagreement(prefill: str, primary: Handshake, others: list[Handshake]) -> PlanRefusal | None:
    """Every daemon of a source instance plans from the same two specs, and their data
    must reach this daemon one way: a refusal naming the first that differs, else None."""
    plan = primary.plan
    assert plan is not None
    for hs in others:
        theirs = hs.plan
        assert theirs is not None
        held = _ranks_at(prefill, primary.rank_map, hs.address)
        if theirs.prefill != plan.prefill:
            field, ours, other = spec_difference(plan.prefill, theirs.prefill)
            return PlanRefusal(f"daemon {hs.address} holding {held} answers {field} = {other!r}, the rendezvous "
                               f"{primary.address} answers {field} = {ours!r}", field=field)
        if theirs.mode != plan.mode:
            return PlanRefusal(f"daemon {hs.address} plans mode {theirs.mode!r}, the rendezvous {primary.address} "
                               f"{plan.mode!r}", field="mode", prefill=theirs.mode, decode=plan.mode)
        if theirs != plan:  # its writers follow the plan it sent: it must be the one this daemon holds
            return PlanRefusal(f"daemon {hs.address} holding {held} sent a plan whose writers differ from the "
                               f"rendezvous {primary.address}'s", field="plan",
                               fix="run the same kvxferd version on every daemon of the instance")
    kinds = {hs.address: hs.kind for hs in (primary, *others)}
    distinct = sorted(set(kinds.values()))
    if len(distinct) > 1:  # one destination, one way in: a fence and a receive path per request
        one, other = (next(a for a, k in sorted(kinds.items()) if k == kind) for kind in distinct[:2])
        return PlanRefusal(f"daemon {one} sends {prefill!r} over {distinct[0]!r} and daemon {other} over "
                           f"{distinct[1]!r}; every daemon of a source instance must reach this decode daemon "
                           "the same way", field="transport",
                           fix="give every daemon of the instance the same peer.transport and NIXL install")
    return None

"""Decode side of the lifecycle core: destinations (one request at one decode rank).

Entries live in the :class:`~kvxferd.lifecycle.inbox.Inbox`, which data threads share under its lock
to admit and account chunks (an admission is a fact they record, ``DestEntry.admitted``); every
change of a destination's state happens here, on this core's clock.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

from ..model.group_requests import group_origin
from ..model.sampling import Sample, granule
from ..ops.logutil import q
from ..wire.messages import Event, Fence, Landed, PeerAbort, PeerEnded
from . import effects, events, states
from .bootstrap import BootstrapSide
from .inbox import DestEntry

log = logging.getLogger("kvxferd.lifecycle")


class DecodeSide(BootstrapSide):
    def _expect(self, ev: events.ExpectCalled) -> str:
        self.refuse_finished(ev.request_id, ev.rank.id)
        entry = DestEntry(ev.request_id, ev.rank, ev.source_instance, ev.pages, ev.num_tokens, ev.start,
                          created=self.now, phase_since=self.now, groups=ev.groups or {},
                          integrity=self.integrity.sample(ev.rank.integrity))
        entry.transport = "tcp" if ev.source_address else "local"
        entry.source_address = ev.source_address
        self.inbox.add(entry)
        state = entry.state  # what the engine hears: the plan may be found at once (a local source)
        self._bootstrap(entry)
        return state

    def _plan_found(self, ev: events.PlanFound) -> None:
        entry = ev.entry
        if entry.closed:  # it failed while its bootstrap ran
            self._retell_end(entry, sorted(set(ev.rank_daemons.values())))
            return
        entry.data_token = ev.token
        if entry.source_address:
            entry.transport = ev.transport
        entry.bind(ev.plan)
        self._choose_pages(entry)
        self.metrics.phase_latency.labels("bootstrap").observe(self.now - entry.phase_since)
        states.advance(entry, states.DEST, "bound", self.now)
        if ev.rank_daemons:
            self._expect_each_daemon(entry, ev)
            return
        if entry.source_address:
            entry.expects_sent[entry.source_address] = self.now
            self.emit(effects.ExpectUpstream(entry.source_address, entry))
            return
        pair = self.routes.local(entry.source_instance, entry.rank.instance)
        assert pair is not None, "a local plan is found through the route book"
        self._on_expect(events.PeerExpected(entry.request_id, entry.source_instance, entry.rank.instance,
                                            entry.rank.coords, pair[0], pair[1], start=entry.start,
                                            num_tokens=entry.num_tokens or 0, integrity=entry.integrity))

    def _choose_pages(self, entry: DestEntry) -> None:
        """A sampled request checks the granules that hold a page the ledger finds due; its
        expect names them to every source (once: a request bound again keeps its picks)."""
        ask = entry.integrity
        if ask is None or ask.full or ask.picks:
            return
        picks = {group: self.ledger.choose(entry.rank.id, group, *span, ask.period)
                 for group, span in self._ledger_spans(entry)}
        entry.integrity = Sample(ask.period, ask.offset, picks)

    def _undo_pages(self, entry: DestEntry) -> None:
        """A sampled request that failed wrote nothing an engine will read and checked nothing:
        the ledger forgets its write, so every page stays checked within ``period`` writes that
        count."""
        ask = entry.integrity
        if ask is None or not ask.picks or entry.plan is None:
            return
        for group, span in self._ledger_spans(entry):
            if group in ask.picks:
                self.ledger.undo(entry.rank.id, group, *span, ask.picks[group], ask.period)

    def _ledger_spans(self, entry: DestEntry) -> Iterator[tuple[str, tuple[Any, int, int, int, int]]]:
        """Per cache group with granules, what the page ledger reads of a request: its page table,
        page size, token range and granule."""
        spec = entry.rank.geometry.spec
        for group in sorted({w.group for w in entry.writers.values()}):
            grain = granule(entry.plan, group)
            if not grain:
                continue  # a state slot is checked whole
            pages = entry.groups[group] if group else entry.pages
            page_size = spec.group_spec(group).page_size
            end = entry.num_tokens or int(pages.size) * page_size
            start = group_origin(spec, group, entry.start, entry.num_tokens)
            if end > start:
                yield group, (pages, page_size, start, end, grain)

    def _expect_each_daemon(self, entry: DestEntry, ev: events.PlanFound) -> None:
        """A source instance over several daemons: every daemon of it hears the expect, naming the
        writers of this rank it holds (maybe none: its ranks still learn the request's route)."""
        held: dict[str, list[tuple[int, int]]] = {address: [] for address in sorted(set(ev.rank_daemons.values()))}
        for writer in entry.writers:
            held[ev.rank_daemons[writer]].append(writer)
        entry.source_daemons = {address: tuple(writers) for address, writers in held.items()}
        entry.writer_tokens = {w: ev.tokens[address] for address, ws in held.items() for w in ws
                               if address in ev.tokens}
        for address, writers in entry.source_daemons.items():
            entry.expects_sent[address] = self.now
            self.emit(effects.ExpectUpstream(address, entry, writers))

    def _admitted(self, entry: DestEntry) -> None:
        """A data thread admitted a chunk (``entry.admitted``, under the inbox lock): the destination
        is transferring from now, on this core's clock. Checked before anything reads its state."""
        if entry.admitted and states.may(entry, states.DEST, "chunk_admitted"):
            states.advance(entry, states.DEST, "chunk_admitted", self.now)

    def _dest_changed(self, entry: DestEntry) -> None:
        """A data thread admitted or finished a chunk. Tell the engine what it may know: done once
        complete, failed once nothing touches the pages."""
        self._admitted(entry)
        if entry.failure is not None:
            if entry.inflight == 0 and entry.state != states.FAILED and not entry.fence_until:
                self._finalize_dest(entry, states.FAILED)
            return
        if entry.state in states.TERMINAL:
            return
        if entry.complete():
            entry.closed = True
            self._finalize_dest(entry, states.DONE)

    def _fail_dest_now(self, entry: DestEntry, code: str, message: str, propagate: bool) -> None:
        if not states.mark_failed(entry, code, message):
            return
        if propagate:
            self._propagate_upstream(entry, code, message)
        if entry.inflight:
            self.emit(effects.StopReceiving(entry))  # end writes into its pages now, then tell the engine
        if entry.source_address and self.one_sided(entry.transport):  # every source link shares one kind
            self._fence(entry)
        self._dest_changed(entry)

    def _fence(self, entry: DestEntry) -> None:
        """One-sided WRITEs land without this daemon's help: before the engine hears that a request
        failed (and reuses its pages), the source must say none of its WRITEs is left in flight."""
        entry.fence_waiting = {a for a in entry.source_addresses() if self.source_up(a)}
        if not entry.fence_waiting:
            return  # an unreachable source cannot answer; peer_dead failures are told at once
        entry.fence_until = self.now + self.timeouts.fence_s
        for address in sorted(entry.fence_waiting):
            self.emit(effects.SendUpstream(address, Fence(entry.request_id)))

    def _fence_done(self, entry: DestEntry, why: str = "") -> None:
        if not entry.fence_until:
            return
        self.metrics.fences.labels("unconfirmed" if why else "confirmed").inc()
        if why:
            log.warning("event=fence_unconfirmed request=%s rank=%s source=%s reason=%s", q(entry.request_id),
                        entry.rank.id, entry.source_address, q(why))
        entry.fence_until = 0.0
        entry.fence_waiting.clear()
        self._dest_changed(entry)

    def _finalize_dest(self, entry: DestEntry, state: str) -> None:
        phase = self.now - entry.phase_since
        states.advance(entry, states.DEST, "complete" if state == states.DONE else "failed", self.now)
        self.inbox.remove(entry)
        mode = entry.plan.mode if entry.plan else "none"
        self.metrics.transfers.labels("decode", state, mode, entry.transport).inc()
        record = {"state": state, "bytes": entry.bytes_received}
        if state == states.DONE:
            if entry.source_address and self.one_sided(entry.transport):  # its sources wait for this word
                for address in entry.source_addresses():
                    self.emit(effects.SendUpstream(address, Landed(entry.request_id, entry.rank.instance,
                                                                   list(entry.rank.coords))))
            self.metrics.latency.observe(self.now - entry.created)
            self.metrics.phase_latency.labels("transfer").observe(phase)
            if entry.aux is not None:
                record["aux"] = entry.aux
        else:
            code, message = entry.failure or ("unknown", "")
            record.update(code=code, reason=message)
            self.record_failure("decode", entry.request_id, entry.rank.id, code, message)
            self._undo_pages(entry)
        self.remember(entry.request_id, entry.rank.id, record)
        self.emit(effects.TellEngine(entry.rank.identity, Event.of(entry.rank.id, entry.request_id, record)))

    def _propagate_upstream(self, entry: DestEntry, code: str, message: str) -> None:
        if not entry.source_address:  # the source instance is on this daemon: its side ends here and now
            self._downstream_ended(events.DownstreamEnded(None, entry.request_id, entry.source_instance,
                                                          entry.rank.instance, code, message))
        else:  # sent where a link to a source daemon exists
            self._tell_sources(entry, code, message)

    def _tell_sources(self, entry: DestEntry, code: str, message: str, skip: str = "",
                      also: list[str] | None = None, ended: bool = False) -> None:
        """Tell every source daemon of the destination that it failed: ``abort`` where its expect went
        (the request is bound there), ``ended`` where it never did (a refused handshake, a bootstrap
        that failed or was overtaken, an expect answered ``no_handshake`` and not sent again yet):
        that one names the instance pair, which the source checks against the link's handshakes, and
        ends a request the source may not know yet."""
        ended = ended or entry.state == states.BOOTSTRAPPING
        for address in [*entry.source_addresses(), *(also or ())]:
            if address == skip:
                continue
            if address in entry.expects_sent and not ended:
                self.emit(effects.SendUpstream(address, PeerAbort.of(entry.request_id, code, message)))
            else:
                entry.end_told = True
                self.emit(effects.SendUpstream(address, PeerEnded.of(entry.request_id, entry.source_instance,
                                                                     entry.rank.instance, code, message)))

    def _retell_end(self, entry: DestEntry, also: list[str] | None = None) -> None:
        """A destination failed here while its bootstrap ran, and the bootstrap has now returned. What
        went to the source before may have left ahead of the handshake (which a source needs to take
        the word of a link for a request it never bound), or before the link existed: it goes again
        now, after the handshake (and to each daemon of a source instance over several, ``also``)."""
        if entry.end_told and entry.failure is not None and entry.source_address:
            self._tell_sources(entry, *entry.failure, also=[a for a in also or () if a != entry.source_address],
                               ended=True)

    def _fail_from_source(self, entry: DestEntry, code: str, message: str, skip: str = "",
                          ended: bool = False) -> None:
        """A source daemon failed the request or went. With an instance over several daemons every
        source daemon of the request hears it from here (also the one it came from: its other ranks
        of the request learn it too; it does not answer back), except ``skip``, a link that is gone.
        ``ended``: the source refused the request's expect, so it holds nothing of it; every source
        daemon, that one too, hears ``ended``, which a source keeps for a request it has not bound."""
        first = entry.failure is None
        if first and entry.state not in states.TERMINAL:
            self.metrics.peer_end("decode", code)
        self._fail(entry, code, message, propagate=False)
        if first and (entry.source_daemons or ended):
            self._tell_sources(entry, code, message, skip=skip, ended=ended)

    # -- the source daemon -------------------------------------------------------------------
    def _upstream_abort(self, ev: events.UpstreamAbort) -> None:
        for entry in self.inbox.for_request(ev.request_id):
            # only requests this peer is the source of
            if entry.from_source(ev.address) and not (ev.started_only and entry.state == states.BOOTSTRAPPING):
                # an error answer refused an expect: the source bound nothing, and an abort of a
                # request it does not hold yet would be dropped there, leaving its prefill side
                # waiting for a bootstrap that cannot come; ``ended`` names the pair and is kept
                self._fail_from_source(entry, ev.code, ev.message, ended=ev.started_only)

    def _upstream_fenced(self, ev: events.UpstreamFenced) -> None:
        for entry in self.inbox.for_request(ev.request_id):
            if entry.from_source(ev.address) and ev.address in entry.fence_waiting:
                entry.fence_waiting.discard(ev.address)
                if not entry.fence_waiting:
                    self._fence_done(entry)

    def _no_handshake(self, ev: events.NoHandshake) -> None:
        """The source answered an expect with no_handshake (it restarted, or forgot the pair): handshake
        again and send the expect anew, once per request, while nothing of it has arrived yet."""
        self._handshakes_forgotten(ev.address)
        for entry in self.inbox.for_request(ev.request_id):
            self._admitted(entry)
            if (entry.from_source(ev.address) and entry.failure is None and entry.rehandshakes == 0
                    and entry.state == states.WAITING and entry.bytes_received == 0):
                entry.rehandshakes += 1
                states.advance(entry, states.DEST, "rehandshake", self.now)
                log.info("event=handshake_again peer=%s request=%s rank=%s", ev.address, q(ev.request_id),
                         entry.rank.id)
                self._bootstrap(entry)

    def _source_lost(self, ev: events.SourceLost) -> None:
        if ev.code == "auth_failed" and (link := self.source_daemons.get(ev.address)) is not None:
            link.refused = ev.message
        self._source_handshakes(ev.address, ev.code)
        for entry in self.inbox.all():
            if not entry.from_source(ev.address):
                continue
            self._admitted(entry)
            if ev.code == "peer_dead":
                if entry.fence_until:
                    entry.fence_waiting.discard(ev.address)
                    if not entry.fence_waiting:
                        self._fence_done(entry, f"source daemon {ev.address} unresponsive")
                if entry.state not in states.TERMINAL:
                    self._fail_from_source(entry, ev.code, ev.message, skip=ev.address)
            elif ev.code == "peer_restarted":
                # an entry still bootstrapping has told the old process nothing: its handshake goes to the
                # new one; nor has an entry whose expect left after the message the new process answered
                # (one connection, in order): the new process answers it no_handshake, and it handshakes again
                if (entry.failure is None and entry.state != states.BOOTSTRAPPING
                        and (ev.sent_before is None or entry.expects_sent.get(ev.address, 0.0) <= ev.sent_before)):
                    self._fail_from_source(entry, ev.code, ev.message, skip=ev.address)
            elif entry.failure is None:
                self._fail_from_source(entry, ev.code, ev.message, skip=ev.address)

    def _tick_dests(self) -> None:
        limits = self.phase_limits()
        for entry in self.inbox.all():
            self._admitted(entry)
            if entry.fence_until and self.now > entry.fence_until:
                self._fence_done(entry, f"no fenced answer from the source within {self.timeouts.fence_s}s; "
                                        "a WRITE still in flight may land in the request's pages")
            limit = limits.get(entry.state)
            if limit is not None and entry.failure is None and self.now - entry.phase_since > limit:
                why = f" (waiting for {entry.waiting_for})" if entry.waiting_for and entry.state == states.BOOTSTRAPPING \
                    else ""
                self._fail(entry, states.timeout_code(entry.state),
                           f"request spent more than {limit}s in state {entry.state}{why}")

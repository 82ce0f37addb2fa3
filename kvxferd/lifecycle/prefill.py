"""Prefill side of the lifecycle core: sources (one request at one prefill rank).

A source pairs the chunks its engine sends with the destinations decode daemons announce
(whichever comes first), posts one job per (chunk, destination), and is done when every
destination the plan gives it confirmed every chunk. Its pages are the engine's again only
once no job reads them (``inflight`` is zero).
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import ClaimRefused, KvxferError, PeerHungUp, RequestError, TransferError
from ..model.geometry import rank_id as make_rank_id
from ..model.group_requests import group_origin, source_range
from ..model.plan import Plan, group_key
from ..model.planner import make_plan
from ..model.qos import Qos
from ..model.sampling import Sample, granule, stricter, to_send
from ..model.segments import clip_slots
from ..ops.logutil import q
from ..wire.messages import Event, Fenced, PeerAbort
from . import effects, events, states
from .base import LifecycleBase
from .jobs import ChunkJob
from .outbox import Binding, Chunk, Route, SrcEntry, Target
from .quotas import Quota, share_of
from .routes import DecodeEnd, Holder as RouteHolder, all_ranks

log = logging.getLogger("kvxferd.lifecycle")


class PrefillSide(LifecycleBase):
    # -- the table: by (request, rank) and by request ------------------------------------------
    def _handshake_asked(self, ev: events.HandshakeAsked) -> Plan:
        """Plan a pair a decode daemon asked for and bind it to the link's route (a decode instance
        over several daemons: each handshakes, and all must find the same plan)."""
        plan = make_plan(ev.spec, ev.decode_spec, mode=ev.mode, decode_tensors=ev.decode_tensors,
                         require_same_page_size=self.require_same_page_size)
        self.routes.check_pair(ev.prefill, ev.decode, plan, ev.route.daemon)
        claimed = {tuple(c) for c in ev.ranks} if ev.ranks is not None else all_ranks(plan)
        holder = self.routes.held_elsewhere(ev.prefill, ev.decode, ev.route.daemon, claimed, self.decode_live)
        if holder is not None:
            # two decode instances given one name, or a peer naming a live instance as its own: the
            # live holder keeps the pair; the newcomer gets in once that holder's link is gone
            self.metrics.peer_claims_refused.labels("handshake", "instance_held").inc()
            raise ClaimRefused(f"decode daemon {ev.route.daemon} claims ranks of decode instance {ev.decode!r} "
                               f"for prefill instance {ev.prefill!r}, but {holder.describe(ev.decode)} over a live "
                               "peer link", field="decode_instance", prefill=holder.daemon, decode=ev.route.daemon,
                               fix=f"give each decode instance its own name (decode daemons {holder.daemon} and "
                               f"{ev.route.daemon} both name {ev.decode!r}); a restarted decode daemon gets in once "
                               "its old link is gone")
        self.routes.set_pair(ev.prefill, ev.decode, plan, ev.route, stricter(ev.integrity, self.standing(ev.prefill)),
                             claimed)
        return plan

    # -- claims and quotas of decode daemons -----------------------------------------------------
    def decode_live(self, identity: bytes) -> bool:
        """Whether a decode daemon's link is live (heard within the peer timeout, not gone)."""
        return self.decode_daemons.get(identity) is not None

    def expect_claim(self, prefill: str, decode: str, route: Route, dst: tuple[int, int]) -> RouteHolder | None:
        """An expect for decode rank ``dst`` over ``route``: another live decode daemon of the pair that
        holds that rank (the expect is refused), else None, and the rank is the route's daemon's now."""
        holder = self.routes.held_elsewhere(prefill, decode, route.daemon, {dst}, self.decode_live)
        if holder is None:
            self.routes.claim(prefill, decode, route.daemon, dst)
        else:
            self.metrics.peer_claims_refused.labels("expect", "instance_held").inc()
        return holder

    def _share(self, total: int) -> int:
        """One decode daemon's part of a shared limit: all of it while it is the only one linked here
        (nobody to leave room for: a single-peer deployment keeps its whole capacity), else its share."""
        return total if len(self.decode_daemons) <= 1 else share_of(total, self.limits.peer_share)

    def request_quota(self, identity: bytes) -> tuple[Quota, int] | None:
        """The quota a new request of this decode daemon's link would pass, and what it holds (None: within)."""
        limit = self._share(self.limits.max_inflight_requests)
        held = self.peer_requests.count(identity, limit, lambda rid: rid in self._by_request)
        if held < limit:
            return None
        self.metrics.peer_claims_refused.labels("expect", "quota").inc()
        return Quota("requests in flight", limit, "limits.peer_share x limits.max_inflight_requests"), held

    def pair_quota(self, identity: bytes, prefill: str, decode: str) -> tuple[Quota, int] | None:
        """The quota a new instance pair of this link would pass (None: within, or the pair is its already)."""
        if self.routes.route_of(prefill, decode, identity) is not None:
            return None
        limit = self._share(self.limits.max_peer_pairs)
        held = self.routes.pairs_of(identity)
        if held < limit and self.routes.pair_count() < self.limits.max_peer_pairs:
            return None
        self.metrics.peer_claims_refused.labels("handshake", "quota").inc()
        if held < limit:
            return Quota("of all decode daemons' instance pairs", self.limits.max_peer_pairs,
                         "limits.max_peer_pairs"), self.routes.pair_count()
        return Quota("instance pairs", limit, "limits.peer_share x limits.max_peer_pairs"), held

    def sources_of(self, request_id: str) -> list[SrcEntry]:
        return list(self._by_request.get(request_id, {}).values())

    def _new_source(self, request_id: str, rank_id: str, coords: tuple[int, int]) -> SrcEntry:
        entry = SrcEntry(request_id, rank_id, coords, created=self.now, phase_since=self.now)
        self.sources[(request_id, rank_id)] = entry
        self._by_request.setdefault(request_id, {})[rank_id] = entry
        return entry

    def _drop_source(self, entry: SrcEntry) -> None:
        if self.sources.pop((entry.request_id, entry.rank_id), None) is not None:
            self.held_chunks -= len(entry.chunks)
        by_rank = self._by_request.get(entry.request_id)
        if by_rank is not None:
            by_rank.pop(entry.rank_id, None)
            if not by_rank:
                del self._by_request[entry.request_id]

    # -- engine calls --------------------------------------------------------------------------
    def _send(self, ev: events.SendCalled) -> str:
        rank = ev.rank
        key = (ev.request_id, rank.id)
        self.refuse_finished(ev.request_id, rank.id)
        entry = self.sources.get(key)
        if entry is None and (end := self.decode_end(ev.request_id, rank.instance)) is not None:
            # the decode side ended the request before this first chunk came: it fails now, with
            # the decode side's code and reason, and nothing of it is held
            entry = self._new_source(ev.request_id, rank.id, rank.coords)
            binding = self.routes.request(ev.request_id, rank.instance)
            if binding is not None:
                entry.bind(binding, self.now)
            self._fail_from_downstream([entry], end.identity, end.code, end.message)
            return entry.state
        if entry is None:
            self.check_capacity()
            if self.held_chunks >= self.limits.max_pending_chunks:
                raise RequestError("too many chunks are held", field="request_id", code="busy",
                                   fix="retry later, or raise limits.max_pending_chunks")
            entry = self._new_source(ev.request_id, rank.id, rank.coords)
            binding = self.routes.request(ev.request_id, rank.instance)
            if binding is not None:
                entry.bind(binding, self.now)
        elif entry.closed:
            # failed but still draining its chunks in flight: say why, as for a request already ended
            why = f"failed ({entry.failure[0]}: {entry.failure[1]})" if entry.failure else entry.state
            if entry.reason_due is not None:
                why = "failing: the decode daemon hung up on a chunk; the finished event gives its reason"
            raise RequestError(f"request {ev.request_id!r} is {why}", field="request_id",
                               code="request_finished", fix="start a new request")
        if not entry.chunks:  # the first chunk's ask holds for the request at this rank
            cls, weight = self.qos.resolve(rank.instance, ev.qos_class)
            entry.qos = Qos(cls, rank.instance, weight, None if ev.budget_s is None else self.now + ev.budget_s)
        entry.add_chunk(ev.chunk)
        self.held_chunks += 1
        self._pump(entry)
        self._check_src(entry)
        return entry.state

    # -- decode daemons ------------------------------------------------------------------------
    def _on_expect(self, ev: events.PeerExpected) -> None:
        end = self.routes.ended(ev.request_id, ev.prefill)
        if end is not None and end.decode == ev.decode and end.identity == ev.route.identity:
            # another rank of this decode side ended the request before this expect came (over the
            # same link, so in order): the request fails here, and this rank's side hears it
            self._fail_from_downstream(self._sources_answering(ev.request_id, ev.prefill, end.identity),
                                       end.identity, end.code, end.message)
            self._late_expect(ev.request_id, ev.route, {"state": "failed", "code": end.code, "reason": end.message})
            return
        binding = self._binding_for(ev)
        binding.routes.setdefault(ev.dst, ev.route)  # the destination rank's daemon: its expect's link
        if ev.route.identity is not None:
            self.peer_requests.add(ev.route.identity, ev.request_id)  # counted against its quota
        for w in ev.plan.writers_of(*ev.dst):  # the cache groups' writers included
            if ev.writers is not None and w.src not in ev.writers:
                continue  # held by another daemon of the instance
            rank_id = make_rank_id(ev.prefill, *w.src)
            key = (ev.request_id, rank_id)
            entry = self.sources.get(key)
            if entry is None:
                if key in self.finished:
                    self._late_expect(ev.request_id, ev.route, self.finished[key])
                    continue
                entry = self._new_source(ev.request_id, rank_id, w.src)
            if entry.closed:
                if entry.failure is not None:
                    self._late_expect(ev.request_id, ev.route, {"state": "failed", "code": entry.failure[0],
                                                                "reason": entry.failure[1]})
                continue
            entry.bind(binding, self.now)
            start = group_origin(ev.plan.prefill, w.group, ev.start, ev.num_tokens)
            # one-sided writes address a group's chunk by the group's own destination table
            dst_pages = (ev.dst_groups or {}).get(w.group) if w.group else ev.dst_pages
            target = Target(ev.dst, w, route=ev.route, dst_pages=dst_pages, start=start,
                            confirm=not ev.route.local and self.one_sided(ev.route.kind),
                            digests=self._digests(rank_id, ev), granule=granule(ev.plan, w.group))
            entry.targets.setdefault(group_key(ev.dst, w.group, w.part), target)
            self._pump(entry)
        # ranks that write nothing of this request learn the plan too, so they can finish
        for entry in self.sources_of(ev.request_id):
            if entry.plan is None and entry.rank_id.startswith(ev.prefill + "/"):
                entry.bind(binding, self.now)
                self._pump(entry)
            self._check_src(entry)

    def _digests(self, rank_id: str, ev: events.PeerExpected) -> Sample | None:
        """What a target's chunk digests cover: its expect's ask, or this daemon's, the source
        instance's or the pair's agreed mode where stricter (a rank that registers later is held
        to this daemon's)."""
        rank = self.registry.get(rank_id)
        own = self.integrity.sample(rank.integrity if rank is not None else None)
        return to_send(self.integrity.at_least(own, self.routes.integrity(ev.prefill, ev.decode)), ev.integrity)

    def _binding_for(self, ev: events.PeerExpected) -> Binding:
        """The request's one binding: every decode rank's expect adds its route to it (the peer
        endpoint refused an expect of another decode instance or plan already)."""
        binding = self.routes.request(ev.request_id, ev.prefill)
        if binding is None:  # the book is bounded: a source may still hold it
            binding = next((e.binding for e in self.sources_of(ev.request_id)
                            if e.binding is not None and e.rank_id.startswith(ev.prefill + "/")), None)
        if binding is None or binding.decode_instance != ev.decode or binding.plan != ev.plan:
            binding = Binding(ev.plan, ev.decode)
        self.routes.bind(ev.request_id, ev.prefill, binding)
        return binding

    def _late_expect(self, request_id: str, route: Route, record: dict[str, Any]) -> None:
        """An expect for a request this side already ended: a failure must reach the decode side,
        which would otherwise wait for bytes until its own phase timeout."""
        if record.get("state") == "failed":
            self._propagate_downstream(request_id, [route], str(record.get("code") or "failed"),
                                       str(record.get("reason") or "request failed on the prefill side"))

    def _fail_from_downstream(self, entries: list[SrcEntry], identity: bytes, code: str,
                              message: str) -> None:
        """A decode daemon failed the request or went: fail the sources here, and pass it on once to
        the request's other decode daemons (a decode instance over several daemons), never back."""
        told: set[int] = set()
        for entry in entries:
            first = entry.failure is None or entry.reason_due is not None
            if first and entry.state not in states.TERMINAL:
                self.metrics.peer_end("prefill", code)
            if entry.reason_due is not None:  # the reason for the hang-up: it replaces the socket error
                entry.reason_due = None
                entry.failure = (code, message)
                self._check_src(entry)
            self._fail(entry, code, message, propagate=False)
            if first and entry.binding is not None and id(entry.binding) not in told:
                told.add(id(entry.binding))
                others = [r for r in entry.binding.daemons() if r.identity != identity]
                self._propagate_downstream(entry.request_id, others, code, message)

    def _downstream_landed(self, ev: events.DownstreamLanded) -> None:
        """A decode rank landed the request whole: its targets over that link are confirmed. The
        word of another link, or about another decode instance, confirms nothing."""
        for entry in self.sources_of(ev.request_id):
            if entry.decode_instance != ev.decode or entry.state in states.TERMINAL:
                continue
            for target in entry.targets.values():
                if target.dst == ev.dst and target.route is not None and target.route.identity == ev.identity:
                    target.landed = True
            self._check_src(entry)

    def _downstream_abort(self, ev: events.DownstreamAbort) -> None:
        # a decode daemon may abort the requests routed to it, and those not routed anywhere yet
        self._fail_from_downstream([e for e in self.sources_of(ev.request_id)
                                    if e.binding is None or e.routed_to(ev.identity)],
                                   ev.identity, ev.code, ev.message)

    def _downstream_ended(self, ev: events.DownstreamEnded) -> None:
        """A decode rank's request ended before its expect bound it here. Like an abort, it fails
        the request's sources that are routed to that decode daemon or not routed anywhere yet; and
        when the link handshook the pair here (accepted or refused), the end is kept, so a send or
        poll that comes later, or an expect of the same decode side, finds the request failed."""
        if ev.identity is None or self.routes.linked(ev.prefill, ev.decode, ev.identity):
            binding = self.routes.request(ev.request_id, ev.prefill)
            if binding is None or (binding.decode_instance == ev.decode and binding.routed_to(ev.identity)):
                self.routes.end(ev.request_id, ev.prefill, DecodeEnd(ev.decode, ev.identity, ev.code, ev.message))
        self._fail_from_downstream(self._sources_answering(ev.request_id, ev.prefill, ev.identity),
                                   ev.identity, ev.code, ev.message)

    def _sources_answering(self, request_id: str, prefill: str, identity: bytes | None) -> list[SrcEntry]:
        """The request's sources of a prefill instance that a decode daemon's word may end: those
        routed to that daemon's link, and those not routed anywhere yet."""
        return [e for e in self.sources_of(request_id) if e.rank_id.startswith(prefill + "/")
                and (e.binding is None or e.routed_to(identity))]

    def decode_end(self, request_id: str, prefill: str) -> DecodeEnd | None:
        """The decode side's end of a request, where it still speaks for the request: while no
        expect bound it, or the binding is that decode side's own."""
        end = self.routes.ended(request_id, prefill)
        if end is None:
            return None
        binding = self.routes.request(request_id, prefill)
        if binding is not None and not (binding.decode_instance == end.decode and binding.routed_to(end.identity)):
            return None  # bound since by another decode side: the end was not about that one
        return end

    def _fence_asked(self, ev: events.FenceAsked) -> Fenced | None:
        self._fail_from_downstream([e for e in self.sources_of(ev.request_id) if e.routed_to(ev.identity)],
                                   ev.identity, "peer_aborted", "the decode daemon failed the request")
        if self._writing(ev.request_id, ev.identity):
            self.fence_waiters.setdefault(ev.request_id, set()).add(ev.identity)
            return None
        return Fenced(ev.request_id)

    def _writing(self, request_id: str, identity: bytes) -> bool:
        """Whether a chunk job of the request towards that decode daemon has not returned yet."""
        return any(target.inflight and target.route is not None and target.route.identity == identity
                   for entry in self.sources_of(request_id) for target in entry.targets.values())

    def _answer_fences(self, request_id: str) -> None:
        waiters = self.fence_waiters.get(request_id)
        if not waiters:
            return
        for identity in list(waiters):
            if not self._writing(request_id, identity):
                waiters.discard(identity)
                self.emit(effects.SendDownstream(identity, Fenced(request_id)))
        if not waiters:
            del self.fence_waiters[request_id]

    def _downstream_lost(self, ev: events.DownstreamLost) -> None:
        """Forget a decode daemon's link: its routes, transports state; fail its requests (on the
        request's other decode daemons too)."""
        for route in self.routes.drop_peer(ev.identity):
            self.emit(effects.PeerGone(route.kind, route.nixl, route.data_address, ev.message))
        self.peer_requests.forget(ev.identity)
        for request_id, waiters in list(self.fence_waiters.items()):
            waiters.discard(ev.identity)
            if not waiters:
                del self.fence_waiters[request_id]
        self._fail_from_downstream([e for e in self.sources.values() if e.routed_to(ev.identity)], ev.identity,
                                   ev.code, ev.message)

    # -- jobs ----------------------------------------------------------------------------------
    def _pump(self, entry: SrcEntry) -> None:
        if entry.closed or entry.binding is None:
            return
        rank = self.registry.get(entry.rank_id)
        if rank is None:
            return
        for target in entry.targets.values():
            for idx, chunk in enumerate(entry.chunks):
                if idx in target.scheduled:
                    continue
                target.scheduled.add(idx)
                if not self._post(entry, rank, target, idx, chunk):
                    return

    def _post(self, entry: SrcEntry, rank: Any, target: Target, idx: int, chunk: Chunk) -> bool:
        """One job for a chunk to a destination; False if the source failed instead."""
        assert entry.binding is not None
        if target.writer.group:
            return self._post_group(entry, rank, target, idx, chunk)
        start, chunk_slots = chunk.start, chunk.slots
        if target.start > chunk.start:  # the decode side holds a prefix already: only the rest moves
            if chunk.end <= target.start:
                if chunk.last:
                    self._fail(entry, "request", f"the last chunk ends at token {chunk.end}, at or before token "
                                                 f"{target.start} where the decode side starts; nothing is left "
                                                 "to move")
                    return False
                target.acked.add(idx)  # nothing of it is wanted: done without a byte moved
                return True
            start = target.start
            chunk_slots = clip_slots(chunk_slots, rank.geometry.spec, chunk.start, start)
        route = target.route
        assert route is not None
        job = ChunkJob(entry.request_id, entry.binding.decode_instance, target.dst, rank, target.writer,
                       start, chunk.end, chunk.last, chunk.aux, chunk_slots, entry.binding.plan.mode,
                       route.data_address, route.token, dst_pages=target.dst_pages, remote=route.nixl,
                       digests=target.digests, granule=target.granule, source=entry.serial,
                       pinned=route.pinned, qos=entry.qos)
        entry.inflight += 1
        target.inflight += 1
        if states.may(entry, states.SRC, "job_started"):
            states.advance(entry, states.SRC, "job_started", self.now)
        self.emit(effects.StartJob(job, route.kind, entry, target, idx))
        return True

    def _post_group(self, entry: SrcEntry, rank: Any, target: Target, idx: int, chunk: Chunk) -> bool:
        """A cache group's part of a chunk: its own token range (a window, or the state with the
        last chunk) and slots from the chunk's group pages; a chunk with nothing of it is done."""
        assert entry.binding is not None
        group = target.writer.group
        table = (chunk.groups or {}).get(group)
        part = source_range(rank.geometry, group, chunk.start, chunk.end, chunk.last, target.start, table)
        if part is None:
            target.acked.add(idx)
            return True
        start, end, slots = part
        route = target.route
        assert route is not None
        job = ChunkJob(entry.request_id, entry.binding.decode_instance, target.dst, rank, target.writer,
                       start, end, chunk.last, None, slots, entry.binding.plan.mode,
                       route.data_address, route.token, dst_pages=target.dst_pages, remote=route.nixl, group=group,
                       digests=target.digests, granule=target.granule, source=entry.serial,
                       pinned=route.pinned, qos=entry.qos)
        entry.inflight += 1
        target.inflight += 1
        if states.may(entry, states.SRC, "job_started"):
            states.advance(entry, states.SRC, "job_started", self.now)
        self.emit(effects.StartJob(job, route.kind, entry, target, idx))
        return True

    def _job_finished(self, ev: events.JobFinished) -> None:
        entry, target = ev.entry, ev.target
        entry.inflight -= 1
        target.inflight -= 1
        if ev.error is None and ev.moved is not None:
            moved = ev.moved
            target.acked.add(ev.index)
            entry.bytes_sent += moved.nbytes
            self.metrics.bytes_sent.labels(ev.kind, moved.mode).inc(moved.nbytes)
            if entry.plan is not None and entry.plan.groups:
                self.metrics.group_bytes.labels(entry.plan.group_kind(target.writer.group)).inc(moved.nbytes)
            self.metrics.chunks.labels(ev.kind, moved.mode, moved.why).inc()
            self.metrics.chunk_bytes.observe(moved.nbytes)
            self.metrics.fragments.observe(moved.fragments)
            self.metrics.phase_latency.labels("chunk").observe(ev.seconds)
        elif entry.failure is None:
            exc = ev.error if ev.error is not None else TransferError("job cancelled at shutdown")
            code = exc.code if isinstance(exc, KvxferError) else "transfer"
            chunk = entry.chunks[ev.index]
            log.warning("event=chunk_failed request=%s rank=%s dst=%s code=%s msg=%s", q(entry.request_id),
                        entry.rank_id, list(target.dst), code, q(str(exc)[:300]))
            message = f"chunk [{chunk.start}, {chunk.end}) to {list(target.dst)} failed: {exc}"
            if isinstance(exc, PeerHungUp):  # the reason is on its way (or the peer died): pass on that, later
                entry.reason_due = self.now + self.timeouts.cut_reason_s
                self._fail(entry, code, message, propagate=False)
            else:
                self._fail(entry, code, message)
        self._check_src(entry)

    # -- ends ----------------------------------------------------------------------------------
    def _check_src(self, entry: SrcEntry) -> None:
        if entry.failure is not None:
            if entry.inflight == 0 and entry.state != states.FAILED and entry.reason_due is None:
                self._finalize_src(entry, states.FAILED)
            return
        if entry.state not in states.TERMINAL and entry.complete():
            deadline = entry.qos.deadline
            if deadline is not None and self.now > deadline:  # never done late
                self._fail(entry, "deadline", f"every byte landed {(self.now - deadline) * 1e3:.1f} ms after "
                                              "the request's deadline")
                return
            entry.closed = True
            self._finalize_src(entry, states.DONE)

    def _fail_src_now(self, entry: SrcEntry, code: str, message: str, propagate: bool) -> None:
        if not states.mark_failed(entry, code, message):
            return
        if propagate:
            self._propagate_downstream(entry.request_id, entry.routes(), code, message)
        if entry.inflight:
            self.emit(effects.StopSending(entry.serial))  # end its sends now, then tell the engine
        self._check_src(entry)

    def _finalize_src(self, entry: SrcEntry, state: str) -> None:
        states.advance(entry, states.SRC, "complete" if state == states.DONE else "failed", self.now)
        self._drop_source(entry)
        self._answer_fences(entry.request_id)
        mode = entry.plan.mode if entry.plan else "none"
        self.metrics.transfers.labels("prefill", state, mode, entry.transport).inc()
        record: dict[str, Any] = {"state": state, "bytes": entry.bytes_sent}
        if state == states.FAILED:
            code, message = entry.failure or ("unknown", "")
            record.update(code=code, reason=message)
            self.record_failure("prefill", entry.request_id, entry.rank_id, code, message)
        self.remember(entry.request_id, entry.rank_id, record)
        rank = self.registry.get(entry.rank_id)
        if rank is not None:
            self.emit(effects.TellEngine(rank.identity, Event.of(entry.rank_id, entry.request_id, record)))

    def _propagate_downstream(self, request_id: str, routes: list[Route], code: str,
                              message: str) -> None:
        for route in routes:
            if route.local:
                for dest in self.inbox.for_request(request_id):
                    if dest.failure is None and dest.state not in states.TERMINAL:
                        self.metrics.peer_end("decode", code)
                    self._fail(dest, code, message, propagate=False)
            elif route.identity is not None:
                self.emit(effects.SendDownstream(route.identity, PeerAbort.of(request_id, code, message)))

    def _tick_sources(self) -> None:
        limits = self.phase_limits()
        for entry in list(self.sources.values()):
            if entry.reason_due is not None and self.now >= entry.reason_due:
                entry.reason_due = None  # no reason came: the socket error it is, told everywhere now
                if entry.failure is not None:
                    self._propagate_downstream(entry.request_id, entry.routes(), *entry.failure)
                self._check_src(entry)
                continue
            if entry.qos.deadline is not None and entry.failure is None and self.now > entry.qos.deadline:
                self._fail(entry, "deadline", f"the request's deadline passed in state {entry.state} with "
                                              f"{entry.bytes_sent} bytes sent; recompute it, or give it a longer budget")
                continue
            limit = limits.get(entry.state)
            if limit is not None and entry.failure is None and self.now - entry.phase_since > limit:
                awaiting = entry.awaiting_landed()
                why = (f" (every chunk went; waiting for decode rank{'s' if len(awaiting) > 1 else ''} "
                       f"{', '.join(sorted({str(list(t.dst)) for t in awaiting}))} of "
                       f"{entry.decode_instance!r} to say the request landed)" if awaiting else "")
                self._fail(entry, states.timeout_code(entry.state),
                           f"request spent more than {limit}s in state {entry.state}{why}")

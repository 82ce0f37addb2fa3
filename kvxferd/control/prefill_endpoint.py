"""The peer endpoint: this daemon as the prefill side, serving decode daemons.

One function per operation a decode daemon may send (ping, handshake, expect, abort, ended, fence).
Each checks what only the endpoint can check (which link sent it, whether the pair was
handshaken over it) and hands the request's part to the lifecycle core.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Any, Callable

import zmq

from ..directory.holders import RankSetIncomplete
from ..errors import KvxferError, PlanRefusal, ProtocolError, RequestError
from ..lifecycle import effects, events
from ..lifecycle.core import Lifecycle
from ..lifecycle.outbox import Route
from ..lifecycle.registry import Registry
from ..model.geometry import InstanceSpec
from ..model.plan_wire import plan_to_wire
from ..model.sampling import Sample
from ..ops.config import Config
from ..ops.hops import TRACE
from ..ops.logutil import q
from ..ops.metrics import Metrics
from ..transport.hub import Transports
from ..wire import messages, protocol
from ..wire.coalesce import Coalescer, PartCounts
from .advertised import Advertised
from .rendezvous import Rendezvous
from .zmq_loop import ignore_result, serve_router

log = logging.getLogger("kvxferd.downstream")


class PrefillEndpoint:
    def __init__(self, cfg: Config, me: Advertised, *, metrics: Metrics, dispatch: Callable[[Any], Any],
                 life: Lifecycle, registry: Registry, rendezvous: Rendezvous, transports: Transports,
                 draining: Callable[[], bool], peers_changed: Callable[[], None]) -> None:
        self.cfg = cfg
        self.me = me
        self.metrics = metrics
        self.dispatch = dispatch
        self.life = life  # the core: the route book, and the requests held here
        self.registry = registry
        self.rendezvous = rendezvous  # announcements, lookups, and the rank maps of instances over several daemons
        self.transports = transports
        self.draining = draining  # the daemon is draining: a new request is refused
        self.peers_changed = peers_changed  # a decode daemon came or went: the peer gauges count again
        self.sock: Any = None  # the ROUTER socket, bound by the daemon
        self.max_parts = self.cfg.limits.max_peer_batch_parts
        #: answers and events for one decode daemon in one loop turn leave as one multipart message:
        #: its DEALER reads the parts one by one, so a decode daemon of any version reads them as before
        self.outgoing = Coalescer(self._send_parts, self.max_parts)
        self.sent = PartCounts()
        self.received = PartCounts()
        self._sent_metric = self.metrics.peer_parts.labels("sent")
        self._received_metric = self.metrics.peer_parts.labels("received")
        self._ops: dict[str, Callable[[bytes, Any], messages.Message | None]] = {
            "ping": self.ping, "handshake": self.handshake, "expect": self.expect, "abort": self.abort,
            "ended": self.ended, "fence": self.fence,
            "announce": lambda _identity, msg: self.rendezvous.on_announce(msg),
            "lookup": lambda _identity, msg: self.rendezvous.on_lookup(msg)}

    async def serve(self) -> None:
        await serve_router(self.sock, self.answer, self.max_parts, self._received)

    def _received(self, parts: int) -> None:
        self.received.add(parts)
        self._received_metric.observe(parts)

    def answer(self, identity: bytes, payload: bytes, over_limit: int = 0) -> None:
        """Answer one peer message (one part of a batch); ``over_limit``: the batch's size, when
        this part lies past ``limits.max_peer_batch_parts`` and is refused instead."""
        seq = None
        raw: dict[str, Any] = {}
        try:
            raw = protocol.decode(payload, self.cfg.limits.max_message_bytes)
            seq = raw.get("seq") if isinstance(raw.get("seq"), int) else None
            if over_limit:
                raise RequestError(f"a batch of {over_limit} peer messages exceeds limits.max_peer_batch_parts "
                                   f"{self.max_parts} of this daemon; this message was not run", field="batch",
                                   code="batch_too_large", fix=f"send at most {self.max_parts} messages per "
                                   "multipart message (the 'batch' this daemon's pong and handshake answers name)")
            answer = self.op(identity, messages.parse_peer(raw))
            if inspect.isawaitable(answer):  # read from elsewhere first (an etcd directory): answer later
                asyncio.ensure_future(self._answer_later(identity, seq, answer))
                return
            reply = answer.to_wire() if answer is not None else None
        except Exception as exc:  # noqa: BLE001 - mapped to a reply; the daemon goes on
            reply = self._error_reply(exc)
            request_id = raw.get("request_id")
            if over_limit and isinstance(request_id, str):
                reply["request_id"] = request_id[:protocol.MAX_ID_LEN]  # its request fails now, not at a timeout
        if reply is not None:
            if seq is not None:
                reply["seq"] = seq
            self.send_wire(identity, reply)

    async def _answer_later(self, identity: bytes, seq: int | None, answer: Any) -> None:
        try:
            message = await answer
            reply = message.to_wire() if message is not None else None
        except Exception as exc:  # noqa: BLE001 - mapped to a reply; the daemon goes on
            reply = self._error_reply(exc)
        if reply is not None and self.sock is not None:
            if seq is not None:
                reply["seq"] = seq
            self.send_wire(identity, reply)

    def _error_reply(self, exc: Exception) -> dict[str, Any]:
        """The reply for a handler that raised: a refusal, a typed error, or a bug (logged)."""
        if isinstance(exc, PlanRefusal):
            self.metrics.refusals.labels(exc.field or "unknown").inc()
            self.metrics.handshakes.labels("refused").inc()
            log.warning("event=handshake_refused field=%s msg=%s", exc.field, q(str(exc)[:300]))
            return messages.HandshakeRefused(exc.to_wire()).to_wire()
        if isinstance(exc, KvxferError):
            self.metrics.invalid_messages.labels("peer").inc()
            return messages.PeerError(exc.to_wire()).to_wire()
        log.error("event=peer_handler_crash", exc_info=exc)
        return messages.PeerError({"code": "internal", "message": repr(exc)[:300]}).to_wire()

    def send(self, identity: bytes, message: messages.Message) -> None:
        if self.sock is not None:
            self.send_wire(identity, message.to_wire())

    def send_wire(self, identity: bytes, message: dict[str, Any]) -> None:
        """Queue an answer or event; it leaves with the others of this loop turn for that peer."""
        self.outgoing.put(identity, protocol.encode(message))

    def _send_parts(self, parts: list[bytes]) -> None:
        if self.sock is None or self.sock.closed:
            return
        self.sent.add(len(parts) - 1)
        self._sent_metric.observe(len(parts) - 1)
        fut = self.sock.send_multipart(parts)
        if isinstance(fut, asyncio.Future):
            fut.add_done_callback(ignore_result)

    def op(self, identity: bytes, msg: Any) -> messages.Message | None:
        # a ping names its daemon and makes the link known; anything else keeps a known link alive
        self.dispatch(events.DecodeHeard(identity, msg.daemon if msg.op == "ping" else None,
                                         msg.incarnation if msg.op == "ping" else None))
        if msg.op in ("ping", "handshake") and msg.incarnation:
            self._incarnation(identity, msg.daemon, msg.incarnation)
        handler = self._ops.get(msg.op)
        return handler(identity, msg) if handler is not None else None

    # -- one function per operation -------------------------------------------------------------
    def ping(self, identity: bytes, msg: messages.PeerPing) -> messages.Message:
        return messages.Pong(self.me.address, self.me.incarnation, self.max_parts)

    def handshake(self, identity: bytes, msg: messages.Handshake) -> messages.Message:
        protocol.check_version(msg.v)
        try:
            return self._handshake(identity, msg)
        except PlanRefusal:
            # the link that was refused may still end the requests it expected of the pair ("ended")
            self.dispatch(events.HandshakeRefusedHere(identity, msg.prefill_instance, msg.decode_instance))
            raise

    def _handshake(self, identity: bytes, msg: messages.Handshake) -> messages.Message:
        prefill = msg.prefill_instance
        self.rendezvous.check_dp_request(prefill)  # a DP rank the instance does not have: refused now
        try:  # an instance over several daemons: the whole rank set, or wait (PlanRefusal: ranks disagree)
            ranks = self.rendezvous.handshake_ranks(prefill)
        except RankSetIncomplete as missing:
            return messages.HandshakeRetry(str(missing))
        spec = (self.registry.spec(prefill, "prefill")
                or self.rendezvous.directory.spec(prefill, "prefill", time.monotonic()))
        if spec is None:
            return messages.HandshakeRetry(f"instance {prefill!r} has no registered prefill rank")
        try:
            decode_spec = InstanceSpec.from_dict(protocol.bounded_geometry(msg.decode_spec, "decode_spec"))
        except KvxferError as exc:
            raise PlanRefusal(f"decode geometry is invalid: {exc}", field=exc.field or "geometry")
        existing = self.life.routes.route_at(prefill, msg.decode_instance, msg.daemon)
        if existing is not None and existing.identity != identity and self.life.decode_daemons.get(existing.identity) is not None:
            # the pair is bound to another live link of that decode daemon; a restarted decode daemon
            # gets in once the old link misses its heartbeats, a stranger replaying a handshake never does
            return messages.HandshakeRetry(f"decode instance {msg.decode_instance!r} at {msg.daemon} is bound to "
                                           "another live peer link")
        asked = msg.mode if msg.mode != "auto" else self.cfg.peer.mode
        transport, remote, mode, choice = self.transports.choose(msg.to_wire(), decode_spec, asked)
        host, port = protocol.split_address(msg.data_address)
        route = Route(transport, (host, port), identity, msg.daemon, msg.data_token, nixl=remote,
                      pinned=asked != "auto")  # auto may still become direct here: no landing ring
        plan = self.dispatch(events.HandshakeAsked(identity, prefill, msg.decode_instance, spec, decode_spec, mode,
                                                   msg.decode_tensors is not False, route, msg.integrity))
        self.dispatch(events.DecodeHeard(identity, msg.daemon, msg.incarnation))  # a link of that daemon now
        self.metrics.handshakes.labels("ok").inc()
        log.info("event=handshake_accepted peer=%s prefill=%s decode=%s mode=%s transport=%s", msg.daemon,
                 prefill, msg.decode_instance, plan.mode, transport)
        return messages.HandshakeOk(spec.to_dict(), plan.mode, plan_to_wire(plan), self.me.incarnation,
                                    self.transports.answer(choice), ranks, self.max_parts,
                                    self.life.standing(prefill))

    def expect(self, identity: bytes, msg: messages.PeerExpect) -> messages.Message | None:
        TRACE.mark(msg.request_id, "peer_expect_in")
        route = self.life.routes.route_of(msg.prefill_instance, msg.decode_instance, identity)
        plan = self.life.routes.plan(msg.prefill_instance, msg.decode_instance)
        if route is None or plan is None:
            return messages.PeerError.about(msg.request_id, "no_handshake", "no handshake for this instance "
                                            "pair; handshake again", incarnation=self.me.incarnation)
        dst = (msg.dst[0], msg.dst[1])
        bound = self.life.routes.request(msg.request_id, msg.prefill_instance)
        held = bound.routes.get(dst) if bound is not None else None
        if bound is not None and (bound.decode_instance != msg.decode_instance
                                  or (held is not None and held.identity != identity)):
            # first binding wins: a second decode side may not take over a request's bytes
            return messages.PeerError.about(msg.request_id, "request_bound",
                                            f"request {msg.request_id!r} is already bound to decode "
                                            f"instance {bound.decode_instance!r} on another peer link", "request_id")
        if not (dst[0] < plan.decode.tp_size and dst[1] < plan.decode.pp_size):
            raise ProtocolError(f"dst {list(dst)} is outside the decode instance's tp x pp",
                                field="dst", fix="send a rank of the decode instance")
        start = msg.start or 0
        if msg.num_tokens and start >= msg.num_tokens:
            raise ProtocolError(f"start {start} is not below num_tokens {msg.num_tokens}", field="start",
                                fix="send a start below the request's length")
        held = bool(self.life.sources_of(msg.request_id))  # chunks held here: the request is in flight
        if self.draining() and not held:
            return messages.PeerError.about(msg.request_id, "draining", "source daemon is draining")
        if self.life.active_count() >= self.cfg.limits.max_inflight_requests and not held:
            return messages.PeerError.about(msg.request_id, "busy", f"source daemon holds "
                                            f"{self.cfg.limits.max_inflight_requests} requests in flight")
        try:  # one-sided writes need the destination page table
            dst_pages, dst_groups = self.transports.prepare(route.kind, route.nixl, dst, msg.extra)
        except KvxferError as exc:
            return messages.PeerError(exc.to_wire(), msg.request_id)
        writers = tuple((w[0], w[1]) for w in msg.writers) if msg.writers is not None else None
        self.dispatch(events.PeerExpected(msg.request_id, msg.prefill_instance, msg.decode_instance, dst, plan,
                                          route, dst_pages, start, writers, msg.num_tokens, dst_groups,
                                          Sample.from_wire(msg.integrity) if msg.integrity else None))
        return None

    def abort(self, identity: bytes, msg: messages.PeerAbort) -> None:
        self.dispatch(events.DownstreamAbort(identity, msg.request_id, msg.code or "peer_aborted", msg.reason))

    def ended(self, identity: bytes, msg: messages.PeerEnded) -> None:
        """Not answered, like an abort; the core decides what the link may end (see ``_downstream_ended``)."""
        self.dispatch(events.DownstreamEnded(identity, msg.request_id, msg.prefill_instance, msg.decode_instance,
                                             msg.code, msg.reason))

    def fence(self, identity: bytes, msg: messages.Fence) -> messages.Message | None:
        return self.dispatch(events.FenceAsked(identity, msg.request_id))

    # -- liveness and restarts ------------------------------------------------------------------
    def describe(self, now: float) -> list[dict[str, Any]]:
        """Each decode daemon, as ``status`` lists it among the daemon's peers."""
        return self.life.decode_daemons.describe(now)

    def changed(self, change: effects.LinkChanged) -> None:
        """Count and log a decode daemon's link changing (the core failed what it had to)."""
        if change.why == "silent":
            self.metrics.heartbeat_misses.inc()
            log.warning("event=peer_unresponsive peer=%s silent_s=%.1f side=decode", change.daemon, change.silent_for)
        elif change.why == "restarted":
            self.metrics.peer_restarts.labels("decode").inc()
            log.warning("event=peer_restarted peer=%s side=decode old=%s new=%s", change.daemon,
                        change.old_incarnation, change.new_incarnation)
        if change.before != change.after:
            self.peers_changed()

    def _incarnation(self, identity: bytes, daemon: str, incarnation: str) -> None:
        """A decode daemon named its incarnation on a ping or handshake. Another link of the same
        daemon address with another incarnation belongs to a process that is gone, once ZeroMQ has
        seen its connection close (a live link is never taken over by a stranger's claim)."""
        for other in self.life.decode_daemons.others(identity, daemon, incarnation):
            if self._identity_gone(other.key):
                self.dispatch(events.DecodeGone(other.key, daemon, other.incarnation, incarnation))

    def _identity_gone(self, identity: bytes) -> bool:
        """Whether the peer socket has no connection with this routing id any more (ROUTER_MANDATORY probe)."""
        if self.sock is None:
            return False
        probe = zmq.Socket.shadow(self.sock.underlying)
        probe.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            pong = messages.Pong(self.me.address, self.me.incarnation, self.max_parts).to_wire()
            probe.send_multipart([identity, protocol.encode(pong)], flags=zmq.NOBLOCK)
            return False
        except zmq.ZMQError as exc:
            return exc.errno == zmq.EHOSTUNREACH
        finally:
            probe.setsockopt(zmq.ROUTER_MANDATORY, 0)

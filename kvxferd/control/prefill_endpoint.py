"""The peer endpoint: this daemon as the prefill side, serving decode daemons.

One function per operation a decode daemon may send (ping, handshake, expect, abort, ended, fence,
landed).
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
from ..errors import ClaimRefused, KvxferError, PlanRefusal, ProtocolError, RequestError
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
from ..transport import chunk_modes
from ..transport.hub import Transports
from ..wire import auth, messages, protocol
from ..wire.coalesce import Coalescer, PartCounts
from .advertised import Advertised
from .claim_confirm import ClaimConfirmer
from .rendezvous import Rendezvous
from .message_bounds import MessageBounds, Oversize
from .zmq_loop import LogGate, ignore_result, serve_router

log = logging.getLogger("kvxferd.downstream")


class PrefillEndpoint:
    def __init__(self, cfg: Config, me: Advertised, *, metrics: Metrics, dispatch: Callable[[Any], Any],
                 life: Lifecycle, registry: Registry, rendezvous: Rendezvous, transports: Transports,
                 draining: Callable[[], bool], peers_changed: Callable[[], None],
                 confirmer: ClaimConfirmer | None = None, owns_token: Callable[[bytes], bool] = lambda _d: False,
                 key_claims: dict[str, auth.KeyClaims] | None = None) -> None:
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
        #: auth off: the daemon address a handshake claims is called back before it is accepted
        self.confirmer = confirmer
        self.owns_token = owns_token  # whether a link of this daemon holds a token (by its digest)
        #: auth on: what each allowed key may speak for (a key without an entry: anything)
        self.key_claims = key_claims or {}
        self._head: Any = None  # the routing-id frame of the message being answered (its User-Id, Peer-Address)
        self._claim_log = LogGate()
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
            "ended": self.ended, "fence": self.fence, "landed": self.landed, "announce": self.announce,
            "lookup": lambda _identity, msg: self.rendezvous.on_lookup(msg)}

    async def serve(self) -> None:
        lim = self.cfg.limits
        bounds = MessageBounds("peer", self.max_parts, "limits.max_peer_batch_parts", lim.max_batch_bytes,
                               lim.drop_sender_s)
        await serve_router(self.sock, self.answer, bounds, refuse=self._oversized, metrics=self.metrics,
                           received=self._received, head=self._take_head)

    def _take_head(self, frame: Any) -> None:
        self._head = frame

    def _oversized(self, identity: bytes, over: Oversize) -> None:
        """The one answer to a message dropped past its bounds (its messages past that point never ran)."""
        err = RequestError(over.describe(), field="batch", code="message_too_large", fix=over.fix())
        self.send_wire(identity, messages.PeerError(err.to_wire()).to_wire())

    def _received(self, parts: int) -> None:
        self.received.add(parts)
        self._received_metric.observe(parts)

    def answer(self, identity: bytes, payload: bytes, over_limit: int = 0) -> None:
        """Answer one peer message (one part of a batch); ``over_limit``: the part's number, when
        it lies past ``limits.max_peer_batch_parts`` and is refused instead."""
        seq = None
        raw: dict[str, Any] = {}
        try:
            raw = protocol.decode(payload, self.cfg.limits.max_message_bytes)
            seq = raw.get("seq") if isinstance(raw.get("seq"), int) else None
            if over_limit:
                raise RequestError(f"a batch of at least {over_limit} peer messages exceeds "
                                   f"limits.max_peer_batch_parts {self.max_parts} of this daemon; this message "
                                   "was not run", field="batch",
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
        if msg.op == "ping" and msg.confirm is not None:
            return self.ping(identity, msg)  # a source daemon's call back about a handshake: no link of ours
        # a ping names its daemon and makes the link known; anything else keeps a known link alive
        self.dispatch(events.DecodeHeard(identity, msg.daemon if msg.op == "ping" else None,
                                         msg.incarnation if msg.op == "ping" else None))
        if msg.op in ("ping", "handshake") and msg.incarnation:
            self._incarnation(identity, msg.daemon, msg.incarnation)
        handler = self._ops.get(msg.op)
        return handler(identity, msg) if handler is not None else None

    # -- one function per operation -------------------------------------------------------------
    def ping(self, identity: bytes, msg: messages.PeerPing) -> messages.Message:
        confirmed = self.owns_token(msg.confirm) if msg.confirm is not None else None
        return messages.Pong(self.me.address, self.me.incarnation, self.max_parts, confirmed)

    # -- claims: what the sender may speak for -----------------------------------------------------
    def _sender_key(self) -> str:
        """The CURVE public key of the message being answered ("" without auth)."""
        if self._head is None or not self.key_claims:
            return ""
        try:
            return str(self._head.get("User-Id") or "")
        except zmq.ZMQError:
            return ""

    def _sender_address(self) -> str:
        """The network address of the link that sent the message being answered (for the words of a refusal)."""
        try:
            return str(self._head.get("Peer-Address")) if self._head is not None else "?"
        except zmq.ZMQError:
            return "?"

    def _key_refusal(self, op: str, daemon: str | None, instance: str) -> KvxferError | None:
        """A message outside its sender's ``auth.key_claims``: the error to answer (counted, logged)."""
        key = self._sender_key()
        claims = self.key_claims.get(key) if key else None
        if claims is None:
            return None  # no auth, or an unscoped key: it may speak for any daemon and instance
        why = claims.refusal(daemon, instance) if daemon is not None else (
            None if claims.covers_instance(instance) else
            ("instance", f"instance {instance!r} is not among {list(claims.instances)}"))
        if why is None:
            return None
        self._count_claim(op, "key", f"key={key[:12]}... what={why[0]}", daemon or "", instance)
        message = (f"key {key} may not speak for this {op}: {why[1]} (its claims in auth.key_claims: "
                   f"{claims.describe()})")
        fix = "add it to that key's auth.key_claims entry here, or send it with the key of the daemon that holds it"
        if op == "handshake":
            return ClaimRefused(message, field="daemon" if why[0] == "daemon" else "decode_instance", fix=fix)
        return RequestError(message, field="daemon" if why[0] == "daemon" else "instance", code="claim_refused",
                            fix=fix)

    def _count_claim(self, op: str, reason: str, detail: str, daemon: str, instance: str) -> None:
        """Count a refused claim; log it at most once a second (a flood repeats it)."""
        self.metrics.peer_claims_refused.labels(op, reason).inc()
        if self._claim_log.open(time.monotonic()):
            log.warning("event=claim_refused op=%s reason=%s daemon=%s instance=%s from=%s %s suppressed=%d", op,
                        reason, daemon, instance, self._sender_address(), detail, self._claim_log.take_suppressed())

    def _unconfirmed(self, msg: messages.Handshake) -> Any:
        """Auth off: the daemon address the handshake claims, confirmed by a call back to it. None: go on;
        an awaitable: the answer comes once the call back returns; raises ClaimRefused where it failed."""
        if self.confirmer is None:
            return None
        key = self.confirmer.key(msg.daemon, msg.incarnation, msg.data_token)
        if key is None:
            self._count_claim("handshake", "unconfirmed", "why=no_token", msg.daemon, msg.decode_instance)
            raise ClaimRefused(f"the handshake claims decode daemon {msg.daemon} but carries no data_token, so the "
                               "claim cannot be confirmed", field="data_token",
                               fix="send handshakes from a kvxferd daemon (each carries its link's token)")
        known = self.confirmer.known(key, time.monotonic())
        if known is True:
            return None
        if isinstance(known, str):
            self._refuse_unconfirmed(msg, known, self._sender_address())
        if self.confirmer.busy(key):
            return messages.HandshakeRetry("this daemon is confirming too many claimed decode daemon addresses; "
                                           "retry shortly")
        return self.confirmer.confirm(key)

    def _refuse_unconfirmed(self, msg: messages.Handshake, why: str, sender: str) -> None:
        self._count_claim("handshake", "unconfirmed", "", msg.daemon, msg.decode_instance)
        raise ClaimRefused(f"a peer link from {sender} claims to be decode daemon {msg.daemon}, but "
                           f"{msg.daemon} did not confirm it: {why}", field="daemon", prefill=msg.daemon,
                           decode=sender,
                           fix="name this daemon's own advertised control address (peer.advertise_host:"
                           "peer.control_port) in the handshake, reachable from the prefill daemon")

    async def _handshake_confirmed(self, identity: bytes, msg: messages.Handshake, confirming: Any,
                                   sender: str) -> messages.Message:
        why = await confirming
        if why is not None:
            try:
                self._refuse_unconfirmed(msg, why, sender)
            except ClaimRefused:
                self.dispatch(events.HandshakeRefusedHere(identity, msg.prefill_instance, msg.decode_instance))
                raise
        return self.handshake(identity, msg)  # confirmed now: the cache answers at once

    def handshake(self, identity: bytes, msg: messages.Handshake) -> Any:
        protocol.check_version(msg.v)
        try:
            refused = self._key_refusal("handshake", msg.daemon, msg.decode_instance)
            if refused is not None:
                raise refused
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
        confirming = self._unconfirmed(msg)
        if isinstance(confirming, messages.Message):
            return confirming
        if confirming is not None:
            return self._handshake_confirmed(identity, msg, confirming, self._sender_address())
        existing = self.life.routes.route_at(prefill, msg.decode_instance, msg.daemon)
        if existing is not None and existing.identity != identity and self.life.decode_daemons.get(existing.identity) is not None:
            # the pair is bound to another live link of that decode daemon; a restarted decode daemon
            # gets in once the old link misses its heartbeats, a stranger replaying a handshake never does
            return messages.HandshakeRetry(f"decode instance {msg.decode_instance!r} at {msg.daemon} is bound to "
                                           "another live peer link")
        over = self.life.pair_quota(identity, prefill, msg.decode_instance)
        if over is not None:
            self._count_claim("handshake", "quota", "", msg.daemon, msg.decode_instance)
            return messages.HandshakeRetry(f"{over[0].message(msg.daemon, over[1])}: {over[0].fix()}")
        asked = msg.mode if msg.mode != "auto" else self.cfg.peer.mode
        transport, remote, mode, choice = self.transports.choose(msg.to_wire(), decode_spec, asked)
        host, port = protocol.split_address(msg.data_address)
        route = Route(transport, (host, port), identity, msg.daemon, msg.data_token, nixl=remote,
                      pinned=asked != "auto")  # auto may still become direct here: no landing ring
        plan = self.dispatch(events.HandshakeAsked(identity, prefill, msg.decode_instance, spec, decode_spec, mode,
                                                   msg.decode_tensors is not False, route, msg.integrity,
                                                   tuple((c[0], c[1]) for c in msg.ranks) if msg.ranks else None))
        self.dispatch(events.DecodeHeard(identity, msg.daemon, msg.incarnation))  # a link of that daemon now
        self.metrics.handshakes.labels("ok").inc()
        log.info("event=handshake_accepted peer=%s prefill=%s decode=%s mode=%s transport=%s", msg.daemon,
                 prefill, msg.decode_instance, plan.mode, transport)
        short = chunk_modes.short_slices(plan, asked)
        if short:
            log.warning("event=direct_short_runs peer=%s prefill=%s decode=%s slice_bytes=%d note=%s", msg.daemon,
                        prefill, msg.decode_instance, short,
                        q("peer.mode = direct is kept: each head slice moves as a run of its own (a socket view "
                          "or a NIXL descriptor per token, layer and kind), several times slower than auto, "
                          "which stages them"))
        return messages.HandshakeOk(spec.to_dict(), plan.mode, plan_to_wire(plan), self.me.incarnation,
                                    self.transports.answer(choice), ranks, self.max_parts,
                                    self.life.standing(prefill))

    def expect(self, identity: bytes, msg: messages.PeerExpect) -> messages.Message | None:
        TRACE.mark(msg.request_id, "peer_expect_in")
        refused = self._key_refusal("expect", None, msg.decode_instance)
        if refused is not None:
            return messages.PeerError(refused.to_wire(), msg.request_id)
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
        holder = self.life.expect_claim(msg.prefill_instance, msg.decode_instance, route, dst)
        if holder is not None:  # counted by the core
            self._count_claim("expect", "instance_held", "", route.daemon, msg.decode_instance)
            return messages.PeerError.about(msg.request_id, "claim_refused", f"decode daemon {route.daemon} expects "
                                            f"rank {list(dst)}, but {holder.describe(msg.decode_instance)} over a "
                                            "live peer link", "dst")
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
        over = self.life.request_quota(identity) if not held else None
        if over is not None:  # one peer's flood leaves the others the rest (counted by the core)
            self._count_claim("expect", "quota", "", route.daemon, msg.decode_instance)
            return messages.PeerError.about(msg.request_id, "busy", over[0].message(route.daemon, over[1]),
                                            "request_id")
        try:  # one-sided writes need the destination page table
            dst_pages, dst_groups = self.transports.prepare(route.kind, route.nixl, dst, msg.extra)
        except KvxferError as exc:
            return messages.PeerError(exc.to_wire(), msg.request_id)
        writers = tuple((w[0], w[1]) for w in msg.writers) if msg.writers is not None else None
        self.dispatch(events.PeerExpected(msg.request_id, msg.prefill_instance, msg.decode_instance, dst, plan,
                                          route, dst_pages, start, writers, msg.num_tokens, dst_groups,
                                          Sample.from_wire(msg.integrity) if msg.integrity else None))
        return None

    def announce(self, identity: bytes, msg: messages.Announce) -> Any:
        """Ranks announced (or withdrawn: none named) to this daemon as their rendezvous: only within
        the sender key's claims, and only over the link that announced them first while it lives."""
        refused = self._key_refusal("announce" if msg.ranks else "withdraw", msg.daemon, msg.instance)
        if refused is not None:
            raise refused
        return self.rendezvous.on_announce(msg, identity, lambda owner: not self._identity_gone(owner))

    def abort(self, identity: bytes, msg: messages.PeerAbort) -> None:
        self.dispatch(events.DownstreamAbort(identity, msg.request_id, msg.code or "peer_aborted", msg.reason))

    def ended(self, identity: bytes, msg: messages.PeerEnded) -> None:
        """Not answered, like an abort; the core decides what the link may end (see ``_downstream_ended``)."""
        self.dispatch(events.DownstreamEnded(identity, msg.request_id, msg.prefill_instance, msg.decode_instance,
                                             msg.code, msg.reason))

    def fence(self, identity: bytes, msg: messages.Fence) -> messages.Message | None:
        return self.dispatch(events.FenceAsked(identity, msg.request_id))

    def landed(self, identity: bytes, msg: messages.Landed) -> None:
        """Not answered; the core takes it only for targets routed over this very link."""
        self.dispatch(events.DownstreamLanded(identity, msg.request_id, msg.decode_instance,
                                              (msg.dst[0], msg.dst[1])))

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

"""Decode side's links to source (prefill) daemons: they carry hellos and what sources say.

One :class:`PeerLink` per source daemon address: a DEALER socket, its numbered hellos,
its liveness. Which hellos to send, and what an answer means, the lifecycle core decides
(:mod:`kvxferd.lifecycle.bootstrap`). What a source says about requests (abort, fenced, errors) and what
happens to the link (down, restarted, key refused) become lifecycle events.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict, deque
from typing import Any, Callable

import zmq
import zmq.asyncio

from .. import PROTOCOL_VERSION
from ..errors import KvxferError, ProtocolError, RequestError, TransferError
from ..lifecycle import effects, events
from ..lifecycle.handshakes import AGREED, Handshakes
from ..lifecycle.inbox import DestEntry, Inbox
from ..lifecycle.links import DOWN, UP, Links
from ..ops.config import Config
from ..ops.hops import TRACE
from ..ops.logutil import q
from ..ops.metrics import Metrics
from ..transport.hub import Transports
from ..wire import auth, linkwatch, messages, protocol
from ..wire.coalesce import Coalescer, PartCounts
from .advertised import Advertised

log = logging.getLogger("kvxferd.upstream")

MAX_UNANSWERED = 256  # numbered messages a link remembers the sending time of
PING_BURST = 64  # links pinged at once; more are spread over the heartbeat interval
#: messages a link holds for a peer whose socket takes no more (past SNDHWM), before it drops them
MAX_BACKLOG = 1024


class PeerLink:
    """This daemon's connection to a peer daemon that hosts prefill instances."""

    def __init__(self, links: "DecodeLinks", address: str) -> None:
        self.address = address
        # a plain socket, driven from the loop by its descriptor (:meth:`_on_fd`): an asyncio socket
        # builds a future and a poller per message, which at a thousand idle links (a pong each a
        # second) was 40% of the loop's time
        self.sock = zmq.Context.shadow(links.ctx.underlying).socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 10000)
        self.sock.setsockopt(zmq.RCVHWM, 10000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, links.cfg.limits.max_message_bytes)
        self.max_bytes = links.cfg.limits.max_message_bytes
        self.monitor: zmq.Socket | None = None  # CURVE links: handshake outcomes (linkwatch)
        self.auth_error = ""
        host, port = protocol.split_address(address)
        if links.keys is not None:
            server_key = links.peer_keys.get(address)
            if server_key is None:
                self.sock.close(0)
                raise RequestError(f"no CURVE server key configured for peer {address}", field="auth.peer_keys",
                                   fix=f"add \"{address}=<its public key>\" to auth.peer_keys")
            self.sock.curve_secretkey = links.keys.secret.encode()
            self.sock.curve_publickey = links.keys.public.encode()
            self.sock.curve_serverkey = server_key.encode()
            watch_at = f"inproc://kvxferd-linkwatch-{id(self)}"
            self.sock.monitor(watch_at, linkwatch.EVENTS)
            self.monitor = links.ctx.socket(zmq.PAIR)  # an asyncio socket: linkwatch awaits it
            self.monitor.connect(watch_at)
        self.sock.connect(f"tcp://{host}:{port}")
        # ties our data connections to this authenticated link; sent inside the handshake, proven by
        # each data connection the source opens to this daemon (kvxferd.transport.tcp_proof)
        self.token = os.urandom(16)
        links.transports.link_keys.add(self.token)
        #: what a source daemon asks, calling this daemon back, to confirm a handshake came from here
        self.token_digest = auth.token_digest(self.token)
        self.seq = 0
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        #: when each numbered message (ping, handshake) left, until answered: an answer that shows a
        #: restart says which of this link's expects can have reached the old process
        self.sent_at: OrderedDict[int, float] = OrderedDict()
        #: hellos sent and not answered yet: number -> (prefill instance, decode instance)
        self.asks: OrderedDict[int, tuple[str, str]] = OrderedDict()
        #: what this link sends in one loop turn leaves as one multipart message, once the source said
        #: (``batch`` in its pong or handshake answer) that it reads every part: a source that did not
        #: would take only the last part, so until then, and for such a source, one message each
        self.max_parts = links.cfg.limits.max_peer_batch_parts
        self.outgoing = Coalescer(lambda parts: self._send_parts(parts[1:]), max_parts=1)
        self.sent = links.sent
        self.metric_sent = links.metrics.peer_parts.labels("sent")
        #: parts of messages the socket would not take yet (the peer reads slower than we send),
        #: in order; sent as it becomes writable. Bounded (MAX_BACKLOG): past it a message is
        #: dropped, counted and logged, and the silent peer's link ends on the heartbeat timeout
        self.backlog: deque[list[bytes]] = deque()
        self.links = links
        self.loop = asyncio.get_running_loop()
        self.fd = self.sock.getsockopt(zmq.FD)
        self.loop.add_reader(self.fd, self._on_fd)
        self._check_due = False
        self._check_soon()  # what came before the descriptor was watched
        self.watcher = None if self.monitor is None or links.keys is None else asyncio.ensure_future(
            linkwatch.watch(self.monitor, address, links.keys.public,
                            lambda message: links.auth_failed(self, message),
                            lambda: setattr(self, "auth_error", "")))

    def send(self, message: messages.Message) -> None:
        self.outgoing.put(b"", protocol.encode(message.to_wire()))

    def _send_parts(self, parts: list[bytes]) -> None:
        if self.sock.closed:
            return
        self.sent.add(len(parts))
        self.metric_sent.observe(len(parts))
        if not self.backlog:
            try:
                self.sock.send_multipart(parts, zmq.NOBLOCK)
            except zmq.Again:
                self.backlog.append(parts)
            except zmq.ZMQError as exc:
                log.info("event=peer_send_failed peer=%s error=%s", self.address, q(str(exc)))
        elif len(self.backlog) < MAX_BACKLOG:
            self.backlog.append(parts)
        else:  # the peer has not read for SNDHWM messages and MAX_BACKLOG more: it answers no pings either
            self.links.metrics.peer_send_dropped.inc()
            log.warning("event=peer_send_dropped peer=%s backlog=%d note=%s", self.address, len(self.backlog),
                        q("a peer link's outgoing messages past its bound: dropped; the peer's silence ends the link"))
        # a send may take the descriptor's edge for a message that arrived meanwhile: look once more
        self._check_soon()

    def _check_soon(self) -> None:
        if not self._check_due:
            self._check_due = True
            self.loop.call_soon(self._on_fd)

    def _on_fd(self) -> None:
        """The socket's descriptor is readable (ZeroMQ's edge: something changed), or a look was due:
        send what waited, read what came (up to ``limits.max_peer_batch_parts`` parts a turn, then
        the loop's other work goes first and this link is looked at again)."""
        self._check_due = False
        if self.sock.closed:
            return
        try:
            events = self.sock.getsockopt(zmq.EVENTS)
            while self.backlog and events & zmq.POLLOUT:
                try:
                    self.sock.send_multipart(self.backlog[0], zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.backlog.popleft()
                events = self.sock.getsockopt(zmq.EVENTS)
            if events & zmq.POLLIN and self._read_some(self.links):
                self._check_soon()  # more is waiting: after the loop's other work
        except zmq.ZMQError:
            return  # closed under us

    def peer_reads(self, batch: Any) -> None:
        """The source named (or left out) how many parts of one message it reads: batch up to that."""
        if isinstance(batch, int) and not isinstance(batch, bool) and batch >= 1:
            self.outgoing.max_parts = min(batch, self.max_parts)
        else:
            self.outgoing.max_parts = 1

    def _number(self) -> int:
        self.seq += 1
        self.sent_at[self.seq] = time.monotonic()
        while len(self.sent_at) > MAX_UNANSWERED:
            self.sent_at.popitem(last=False)
        return self.seq

    def ping(self, message: messages.PeerPing) -> None:
        """A numbered ping: its pong echoes the number, so a pong from a new process dates the restart."""
        self.outgoing.put(b"", protocol.encode({**message.to_wire(), "seq": self._number()}))

    def answered(self, msg: dict[str, Any]) -> float | None:
        """When the message an answer answers left (None: not numbered, or too long ago)."""
        seq = msg.get("seq")
        return self.sent_at.pop(seq, None) if isinstance(seq, int) else None

    def ask(self, hello: messages.Handshake, pair: tuple[str, str]) -> None:
        """A numbered hello; its answer is routed to :meth:`Upstream.answered` by the number."""
        seq = self._number()
        self.asks[seq] = pair
        while len(self.asks) > MAX_UNANSWERED:
            self.asks.popitem(last=False)
        self.outgoing.put(b"", protocol.encode({**hello.to_wire(), "seq": seq}))

    async def request(self, message: messages.Message, timeout: float) -> dict[str, Any]:
        seq = self._number()
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiting[seq] = fut
        try:
            self.outgoing.put(b"", protocol.encode({**message.to_wire(), "seq": seq}))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.waiting.pop(seq, None)
            self.sent_at.pop(seq, None)

    def _read_some(self, links: "DecodeLinks") -> bool:
        """What the source says, part by part, until nothing waits or this turn's share is read
        (True: more may wait). A source of any version sends one message, or the parts of one
        (answers of one turn). Each part is handled as it is read, so none is kept; a message
        past ``limits.max_batch_bytes`` or twice ``limits.max_peer_batch_parts`` (no answers of
        one turn come to that) is dropped unread from there on, counted and logged."""
        received = links.metrics.peer_parts.labels("received")
        limits = links.cfg.limits
        hard_parts, budget = 2 * limits.max_peer_batch_parts, limits.max_batch_bytes
        raw = self.sock
        taken = 0
        while taken < limits.max_peer_batch_parts:
            try:
                data = raw.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return False
            parts, nbytes, over = 1, len(data), ""
            self._one(links, data)
            while raw.getsockopt(zmq.RCVMORE):
                if over:
                    raw.recv(zmq.NOBLOCK, copy=False)  # dropped unread: never copied into the daemon
                    parts += 1
                    continue
                data = raw.recv(zmq.NOBLOCK, copy=True)
                parts += 1
                nbytes += len(data)
                if nbytes > budget or parts > hard_parts:
                    over = "bytes" if nbytes > budget else "parts"
                    continue
                self._one(links, data)
            links.received.add(parts)
            received.observe(parts)
            if over:
                links.metrics.oversized_messages.labels("source", over).inc()
                log.warning("event=source_message_dropped source=%s reason=%s parts=%d bytes=%d note=%s", self.address,
                            over, parts, nbytes, q("a source daemon's message past limits.max_batch_bytes or twice "
                                                   "limits.max_peer_batch_parts: the rest of it was dropped unread"))
            taken += parts
            if self.sock.closed:  # a message handled above closed this link
                return False
        return True

    def _one(self, links: "DecodeLinks", data: bytes) -> None:
        try:
            msg = protocol.decode(data, self.max_bytes)
        except ProtocolError:
            links.metrics.invalid_messages.labels("peer").inc()
            return
        links.dispatch(events.SourceHeard(self.address))  # alive, whatever it said
        if msg.get("op") in ("pong", "handshake_ok"):
            self.peer_reads(msg.get("batch"))
        seq = msg.get("seq") if isinstance(msg.get("seq"), int) else None
        pair = self.asks.pop(seq, None) if seq is not None else None
        if pair is not None:
            links.answered(self, pair, msg, self.answered(msg))
            return
        fut = self.waiting.get(seq) if seq is not None else None
        if fut is not None and not fut.done():
            fut.set_result(msg)
            return
        links.handle(self, msg)

    def close(self) -> None:
        self.outgoing.flush()  # what this turn queued (an abort) leaves before the socket closes
        if self.sock.closed:
            return
        self.loop.remove_reader(self.fd)  # before the close: the descriptor may be reused at once
        try:
            while self.backlog:  # what waited for the peer, as far as it takes it now
                self.sock.send_multipart(self.backlog.popleft(), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        for fut in self.waiting.values():
            if not fut.done():
                fut.cancel()
        if self.monitor is not None:
            if self.watcher is not None:
                self.watcher.cancel()
            self.sock.disable_monitor()
            self.monitor.close(0)
        self.sock.close(linger=500)  # an abort sent while draining still reaches the peer


class DecodeLinks:
    """Every link to a source daemon: hellos and expects out, what sources say in."""

    def __init__(self, cfg: Config, ctx: zmq.asyncio.Context, me: Advertised, *, keys: auth.KeyPair | None,
                 peer_keys: dict[str, str], refused_by: auth.RefusalBook, metrics: Metrics,
                 dispatch: Callable[[Any], Any], transports: Transports, inbox: Inbox, handshakes: Handshakes,
                 book: Links, peers_changed: Callable[[], None],
                 held_ranks: Callable[[str], list[list[int]]] | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.me = me
        self.keys = keys  # this daemon's CURVE key pair (None: links are not authenticated)
        self.peer_keys = peer_keys  # the server key of each source daemon
        self.refused_by = refused_by  # the source daemons that refused this daemon's key
        self.metrics = metrics
        self.dispatch = dispatch
        self.transports = transports
        self.inbox = inbox
        self.handshakes = handshakes  # the core's, read for ``status`` only
        self.book = book  # the core's links to source daemons: their state, read here only
        self.peers_changed = peers_changed  # a link came, went, or changed state: the peer gauges count again
        self.links: dict[str, PeerLink] = {}
        #: a decode instance -> its ranks registered here ([tp, pp] each), named in its hellos
        self.held_ranks = held_ranks
        self.sent = PartCounts()  # multipart messages to source daemons, and the messages they carried
        self.received = PartCounts()

    def owns_token(self, digest: bytes) -> bool:
        """Whether one of this daemon's links holds the token of that digest: a source daemon
        confirming that a handshake naming this daemon came from it."""
        return any(link.token_digest == digest for link in self.links.values())

    def is_up(self, address: str) -> bool:
        return self.book.is_up(address)

    def send(self, address: str, message: messages.Message) -> None:
        """Send where a link exists (a source never linked, or forgotten, has nothing to hear)."""
        link = self.links.get(address)
        if link is not None:
            link.send(message)

    def send_expect(self, address: str, entry: DestEntry, writers: tuple[tuple[int, int], ...] | None = None) -> None:
        num_tokens = entry.num_tokens if entry.num_tokens is not None else 0
        TRACE.mark(entry.request_id, "peer_expect_out")
        self.send(address, messages.PeerExpect(
            entry.request_id, entry.source_instance, entry.rank.instance, list(entry.rank.coords), num_tokens,
            entry.start or None, self.transports.expect_fields(address, entry),
            [list(w) for w in writers] if writers is not None else None,
            entry.integrity.to_wire() if entry.integrity is not None else None))

    def link(self, address: str) -> PeerLink:
        link = self.links.get(address)
        if link is not None and link.auth_error:
            link.close()  # libzmq does not retry a refused key: a new link tries again
            link = None
        if link is None:
            link = self.links[address] = PeerLink(self, address)
            self.dispatch(events.LinkOpened(address))
        return link

    async def ask(self, address: str, message: messages.Message, timeout: float) -> dict[str, Any]:
        """A numbered message to the daemon at ``address`` and its answer (an announcement to a
        rendezvous goes this way). A daemon backed off after silent tries is not asked: opening a
        link to it would start its backoff over at every heartbeat; it raises TimeoutError, as an
        unanswered ask does, and the heartbeat after the backoff tries again."""
        if self.book.backed_off(address, time.monotonic()) is not None:
            raise TimeoutError(f"daemon {address} is backed off after silent tries")
        return await self.link(address).request(message, timeout)

    def describe(self, now: float) -> list[dict[str, Any]]:
        """Each link, as ``status`` lists it among the daemon's peers."""
        out = []
        asking: dict[str, list[dict[str, Any]]] = {}
        for h in self.handshakes.describe():
            asking.setdefault(h["source"], []).append(h)
        agreed: dict[str, list[str]] = {}
        for hs in self.handshakes.book.values():
            if hs.state == AGREED:
                agreed.setdefault(hs.address, []).append(f"{hs.key[1]}->{hs.key[2]}")
        for seen in self.book.describe(now):
            link = self.links.get(seen["address"])
            out.append({**seen, "auth_error": link.auth_error if link else "",
                        "batch": link.outgoing.max_parts if link else 1,
                        "plans": sorted(agreed.get(seen["address"], [])),
                        "handshaking": asking.get(seen["address"], [])})
        return out

    # -- handshakes: the core decides, this carries -------------------------------------------------
    def hello(self, effect: effects.SendHandshake) -> None:
        """Send one hello the core asked for; its answer comes back as HandshakeAnswered."""
        link = self.link(effect.address)
        hello = messages.Handshake(
            PROTOCOL_VERSION, self.me.address, self.me.data_address, effect.prefill, effect.decode,
            effect.spec.to_dict(), self.cfg.peer.mode, self.transports.offered(), link.token, self.me.incarnation,
            integrity=effect.integrity, extra=self.transports.handshake_fields(link.address, effect.prefill, effect.decode),
            ranks=(self.held_ranks(effect.decode) or None) if self.held_ranks is not None else None)
        link.ask(hello, (effect.prefill, effect.decode))

    def answered(self, link: PeerLink, pair: tuple[str, str], msg: dict[str, Any], asked: float | None) -> None:
        """A source answered a hello: typed, checked for a restart, its transport taken, handed to the core."""
        prefill, decode = pair
        try:
            answer = messages.parse_handshake_answer(msg)
        except KvxferError as exc:
            self.metrics.invalid_messages.labels("peer").inc()
            answer = messages.HandshakeRefused({"message": f"peer's handshake answer is unusable: {exc}",
                                                "field": exc.field or "op"})
        kind = "tcp"
        if isinstance(answer, messages.HandshakeOk):
            if self.note_incarnation(link, answer.incarnation, sent_before=asked):
                return  # a restarted source: the core asks the new process again
            kind = self.transports.accepted(link.address, prefill, decode, msg)
        self.dispatch(events.HandshakeAnswered(link.address, prefill, decode, answer, link.token, kind))


    # -- what sources say ------------------------------------------------------------------------
    def handle(self, link: PeerLink, msg: dict[str, Any]) -> None:
        """Unsolicited messages from a source daemon: aborts, fences answered, errors about requests."""
        op = msg.get("op")
        try:
            if op == "abort":
                m = messages.parse_peer(msg)
                assert isinstance(m, messages.PeerAbort)
                self.dispatch(events.UpstreamAbort(link.address, m.request_id, m.code or "peer_aborted", m.reason))
            elif op == "error" and isinstance(msg.get("request_id"), str):
                self._error(link, msg["request_id"], msg)
            elif op == "fenced":
                m = messages.parse_peer(msg)
                assert isinstance(m, messages.Fenced)
                self.dispatch(events.UpstreamFenced(link.address, m.request_id))
            elif op == "pong":
                self.note_incarnation(link, msg.get("incarnation"), sent_before=link.answered(msg))
        except KvxferError:
            self.metrics.invalid_messages.labels("peer").inc()

    def _error(self, link: PeerLink, request_id: str, msg: dict[str, Any]) -> None:
        err = msg.get("error") if isinstance(msg.get("error"), dict) else {}
        if err.get("code") == "no_handshake":
            self.dispatch(events.NoHandshake(link.address, request_id))
            # that expect reached the new process: so did every one sent after it
            sent = [e.expects_sent[link.address] for e in self.inbox.for_request(request_id)
                    if link.address in e.expects_sent]
            self.note_incarnation(link, msg.get("incarnation"), sent_before=max(sent) if sent else None)
        self.dispatch(events.UpstreamAbort(
            link.address, request_id, str(err.get("code", "peer_error"))[:64],
            f"source daemon {link.address}: {str(err.get('message'))[:300]}", started_only=True))

    def note_incarnation(self, link: PeerLink, incarnation: Any, sent_before: float | None = None) -> bool:
        """A message of the source daemon named its incarnation; True if it changed (a restart: the
        core fails what went to the old process, see :class:`~kvxferd.lifecycle.events.SourceHeard`).

        ``sent_before``: when the message left that this one answers; expects sent later went to the
        new process and are not failed (None: every entry that told the old process is)."""
        return bool(self.dispatch(events.SourceHeard(link.address, incarnation, sent_before)))

    def auth_failed(self, link: PeerLink, message: str) -> None:
        """A peer refused this daemon's key (or could not be authenticated): fail what waits on it now."""
        link.auth_error = message
        self.metrics.peer_auth_failures.inc()
        record, log_now = self.refused_by.note(message, address=link.address)
        if log_now:
            log.warning("event=peer_auth_failed peer=%s count=%s msg=%s", link.address, record["count"], q(message))
        for fut in link.waiting.values():  # the handshake in progress ends with it
            if not fut.done():
                fut.set_exception(TransferError(message, field="auth", code="auth_failed"))
        self.dispatch(events.SourceLost(link.address, "auth_failed", message))

    # -- liveness: the core decides (:mod:`kvxferd.lifecycle.links`), this carries -----------------
    def ping_all(self) -> None:
        """A numbered ping to every source daemon: its pong is heard, and dates a restart.

        Up to ``PING_BURST`` links are pinged at once; more are spread in groups over the
        heartbeat interval (each link still once per interval, at about the same offset each
        time). A thousand pings and their pongs in one burst held the loop for tenths of a
        second every heartbeat, and any call that came then (``status``) waited it out.
        """
        links = list(self.links.values())
        groups = [links[i:i + PING_BURST] for i in range(0, len(links), PING_BURST)]
        if not groups:
            return
        self._ping(groups[0])
        loop = asyncio.get_running_loop()
        step = self.cfg.peer.heartbeat_interval_s / len(groups)
        for k, group in enumerate(groups[1:], start=1):
            loop.call_later(step * k, self._ping, group)

    def _ping(self, group: list[PeerLink]) -> None:
        ping = messages.PeerPing(self.me.address, self.me.incarnation)
        for link in group:
            if self.links.get(link.address) is link:  # not closed (gone silent, replaced) since
                link.ping(ping)

    def changed(self, change: effects.LinkChanged) -> None:
        """Carry out what a link's change means here: its socket, its transports state, the counts."""
        link = self.links.get(change.key)
        if change.why == "silent":  # down: its socket goes (no reconnect attempts) until the core tries it again
            if link is not None:
                link.close()
                self.links.pop(change.key, None)
            if change.before == UP:
                self.metrics.heartbeat_misses.inc()
                log.warning("event=peer_unresponsive peer=%s silent_s=%.1f", change.daemon, change.silent_for)
                self.transports.source_down(change.daemon)  # its landing ring: no new blocks, memory quarantined
            else:
                log.info("event=peer_unreachable peer=%s silent_s=%.1f", change.daemon, change.silent_for)
            self.transports.source_gone(change.daemon)  # and its agent, once nothing can be in flight
        elif change.why == "retry":
            self.link(change.key)  # a new socket: the hello that follows and the next ping go over it
        elif change.why == "restarted":
            self.metrics.peer_restarts.labels("prefill").inc()
            log.warning("event=peer_restarted peer=%s side=prefill old=%s new=%s", change.daemon,
                        change.old_incarnation, change.new_incarnation)
            self.transports.source_down(change.daemon)  # the landing ring it knew: retired (quarantined, then freed)
            self.transports.source_gone(change.daemon)  # and its agent, once nothing can be in flight
        elif change.why == "heard" and change.before == DOWN:
            log.info("event=peer_back peer=%s", change.daemon)
        if change.before != change.after:
            self.peers_changed()

    def close(self) -> None:
        for link in self.links.values():
            link.close()


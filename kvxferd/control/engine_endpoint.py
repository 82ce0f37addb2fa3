"""The engine endpoint: engine ranks' calls over the ipc:// ROUTER socket.

One function per call. Each validates what the engine sent against the rank's geometry and
the daemon's limits, then hands the request's part to the lifecycle core; a refusal is a
typed error in the reply, never a stop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any, Callable

import zmq
import zmq.asyncio

from ..datapath import engine_caller
from ..datapath.engine_caller import Caller, TrustRefusal
from ..datapath.regions import MemoryMapper
from ..errors import KvxferError, ProtocolError, RegistrationError, RequestError
from ..lifecycle import events
from ..lifecycle.core import Lifecycle
from ..lifecycle.outbox import Chunk
from ..lifecycle.registry import ProcessRef, Rank, Registry
from ..model import dp
from ..model.geometry import RankGeometry, rank_id
from ..model.group_requests import expect_tables, send_tables
from ..model.qos import budget_s
from ..model.segments import as_pages, check_whole_pages, unit_slots
from ..ops.config import Config
from ..ops.hops import TRACE
from ..ops.logutil import q
from ..ops.metrics import Metrics
from ..wire import messages, protocol
from ..wire.coalesce import Coalescer
from .advertised import Advertised
from .binding import binding
from .rendezvous import check_rendezvous
from .message_bounds import MessageBounds, Oversize
from .zmq_loop import LogGate, ignore_result, serve_router

log = logging.getLogger("kvxferd.engine")


class EngineEndpoint:
    def __init__(self, cfg: Config, ctx: zmq.asyncio.Context, me: Advertised, *, metrics: Metrics,
                 dispatch: Callable[[Any], Any], life: Lifecycle, registry: Registry, mapper: MemoryMapper,
                 dp_seen: Callable[[str, str], dp.DpSize | None], add_rank: Callable[[Rank, str | None], None],
                 drop_rank: Callable[[Rank, str], None], release_mappings: Callable[[], None],
                 status: Callable[[], dict[str, Any]], draining: Callable[[], bool]) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.me = me
        self.metrics = metrics
        self.dispatch = dispatch
        self.life = life
        self.registry = registry
        self.mapper = mapper  # maps the memory a registering rank names
        self.dp_seen = dp_seen  # the dp_size a data-parallel instance's ranks said, here or elsewhere
        self.add_rank = add_rank  # a registered rank joins the daemon (registry, transports, rendezvous)
        self.drop_rank = drop_rank
        self.release_mappings = release_mappings  # forget mappings no registered rank uses
        self.status = status
        self.draining = draining  # the daemon is draining: no new work
        self.sock: Any = None
        self.bound = False  # the socket file is ours to remove
        self.outgoing = Coalescer(self._send_parts)
        #: the routing-id frame of the message being answered: its connection's peer credentials
        #: (SO_PEERCRED), read from it at most once per message and only where a call needs them
        self._head: Any = None
        self._head_caller: Caller | None | bool = False  # False: not read yet for this message
        #: refusal reason -> its log gate: a flood is counted, and logged once a second per reason
        self._refusal_lines: dict[str, LogGate] = {}
        self._ops: dict[str, Callable[[bytes, Any], dict[str, Any]]] = {
            "ping": lambda identity, msg: messages.reply(),
            "status": lambda identity, msg: messages.reply(status=self.status()),
            "register": self.register, "unregister": self.unregister, "poll": self.poll, "abort": self.abort,
            "expect": self.expect, "send": self.send_chunk}

    def bind(self) -> None:
        path = Path(self.cfg.socket_path)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        if path.exists() or path.is_symlink():
            st = os.lstat(path)
            if not stat.S_ISSOCK(st.st_mode):
                raise RegistrationError(f"{path} exists and is not a socket", field="engine.socket_path",
                                        fix="point engine.socket_path at a free path")
            with socket.socket(socket.AF_UNIX) as probe:
                try:
                    probe.connect(str(path))
                    raise RegistrationError(f"another daemon listens on {path}", field="engine.socket_path",
                                            fix="stop it or use another socket path")
                except (ConnectionRefusedError, FileNotFoundError):
                    path.unlink()  # stale socket from a crashed daemon
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.limits.max_message_bytes)
        old = os.umask(0o077)
        try:
            with binding("engine.socket_path", f"ipc://{path}"):
                self.sock.bind(f"ipc://{path}")
            self.bound = True  # from here on the socket file is ours to remove
        finally:
            os.umask(old)
        os.chmod(path, int(self.cfg.engine.socket_mode, 8))
        if self.cfg.engine.socket_group:
            import grp
            os.chown(path, -1, grp.getgrnam(self.cfg.engine.socket_group).gr_gid)

    def unlink(self) -> None:
        if self.bound:  # never another daemon's socket, found in place at start-up
            try:
                os.unlink(self.cfg.socket_path)
            except OSError:
                pass

    async def serve(self) -> None:
        """Every part of a multipart message is one call (a batch from :meth:`EngineClient.batch`);
        their answers leave coalesced, in order (:class:`~kvxferd.wire.coalesce.Coalescer`)."""
        lim = self.cfg.limits
        bounds = MessageBounds("engine", lim.max_batch_calls, "limits.max_batch_calls", lim.max_batch_bytes,
                               lim.drop_sender_s)
        # a turn of the loop after every message: a ready socket must not starve the answers' flush
        await serve_router(self.sock, self.answer, bounds, refuse=self._oversized, metrics=self.metrics,
                           turn_parts=1, head=self._new_message)

    def _new_message(self, frame: Any) -> None:
        self._head, self._head_caller = frame, False

    def _oversized(self, identity: bytes, over: Oversize) -> None:
        """The one answer to a message dropped past its bounds (its calls past that point never ran)."""
        err = RequestError(over.describe(), field="batch", code="message_too_large", fix=over.fix())
        self.deliver(identity, messages.error_reply(err.to_wire()))

    def answer(self, identity: bytes, payload: bytes, over_limit: int = 0) -> None:
        seq = None
        call = ""
        try:
            raw = protocol.decode(payload, self.cfg.limits.max_message_bytes)
            seq, call = raw.get("seq"), str(raw.get("op", ""))
            if over_limit:
                raise RequestError(f"call {over_limit} of a batch exceeds limits.max_batch_calls "
                                   f"{self.cfg.limits.max_batch_calls}; this call was not run",
                                   field="batch", code="batch_too_large",
                                   fix="send smaller batches or raise limits.max_batch_calls")
            msg = messages.parse_engine(raw)
            reply = self.op(identity, msg)
        except KvxferError as exc:
            if isinstance(exc, ProtocolError):
                self.metrics.invalid_messages.labels("engine").inc()
            reason = getattr(exc, "reason", None)
            if reason:
                self._refused(identity, call, reason, exc)
            log.info("event=engine_error code=%s field=%s msg=%s", exc.code, exc.field, q(str(exc)[:300]))
            reply = messages.error_reply(exc.to_wire())
        except Exception as exc:  # noqa: BLE001 - a bug in one handler must not stop the daemon
            log.exception("event=engine_handler_crash")
            reply = messages.error_reply({"code": "internal", "field": None, "message": repr(exc)[:300]})
        if seq is not None:
            reply["seq"] = seq
        self.deliver(identity, reply)

    def deliver(self, identity: bytes, message: dict[str, Any]) -> None:
        """Queue a reply or event; it leaves with the others of this loop turn for that engine."""
        self.outgoing.put(identity, protocol.encode(message))

    def _send_parts(self, parts: list[bytes]) -> None:
        if self.sock is None or self.sock.closed:
            return
        fut = self.sock.send_multipart(parts)
        if isinstance(fut, asyncio.Future):
            fut.add_done_callback(ignore_result)

    def op(self, identity: bytes, msg: Any) -> dict[str, Any]:
        if self.draining() and msg.op in ("expect", "send") and not (
                msg.op == "send" and (msg.request_id, msg.rank_id) in self.life.sources):
            # later chunks of a request already in flight still go through: the drain finishes it
            raise RequestError("daemon is draining and takes no new work", field="op", code="draining",
                               fix="retry on the restarted daemon")
        return self._ops[msg.op](identity, msg)

    def caller(self, identity: bytes) -> Caller | None:
        """The peer credentials of the connection the message being answered came on; None where
        libzmq reports none (a connection that is not a unix socket's)."""
        if self._head_caller is False:
            value = None
            try:
                if self._head is not None and self._head.bytes == identity:
                    value = self._head.get(engine_caller.PEER_PROPERTY)
            except zmq.ZMQError:  # no such property on this connection
                value = None
            self._head_caller = engine_caller.parse_peer(value)
        return self._head_caller  # type: ignore[return-value]

    def _refused(self, identity: bytes, call: str, reason: str, exc: KvxferError) -> None:
        """A call refused because the engine claimed what it cannot show is its own: counted and logged
        with who asked (the reply carries the error)."""
        call = call if call in self._ops else "other"
        self.metrics.engine_refusals.labels(call, reason).inc()
        gate = self._refusal_lines.setdefault(reason, LogGate())  # reasons are a bounded set
        if not gate.open(time.monotonic()):
            return
        held_back = gate.take_suppressed()
        who = self.caller(identity)
        log.warning("event=engine_refused call=%s reason=%s pid=%s uid=%s field=%s suppressed=%d msg=%s", call,
                    reason, who.pid if who else "unknown", who.uid if who else "unknown", exc.field, held_back,
                    q(str(exc)[:300]))

    def _mine(self, identity: bytes, rank_id: str, fix: str) -> Rank:
        rank = self.registry.get(rank_id)
        if rank is None or rank.identity != identity or (
                rank.caller is not None and getattr(self.caller(identity), "peer", None) != rank.caller.peer):
            err = RequestError(f"rank {rank_id!r} is not registered on this connection", field="rank_id", fix=fix)
            if rank is not None:  # another connection's rank: a stranger's call, counted
                err.reason = "not_holder"  # type: ignore[attr-defined]
            raise err
        return rank

    def _owned(self, identity: bytes, rank_id: str, role: str) -> Rank:
        rank = self._mine(identity, rank_id, "register the rank first and use the rank_id it returned")
        if rank.role != role:
            raise RequestError(f"rank {rank_id} is a {rank.role} rank; this call is for {role} ranks",
                               field="rank_id", fix=f"call it from a {role} rank")
        return rank

    # -- one function per call ------------------------------------------------------------------
    def register(self, identity: bytes, msg: messages.Register) -> dict[str, Any]:
        geometry = RankGeometry.from_dict(protocol.bounded_geometry(msg.geometry, "geometry"))
        dp.check_registration(msg.instance, msg.dp_rank, msg.dp_size)
        instance = msg.instance if msg.dp_rank is None else dp.dp_instance(msg.instance, msg.dp_rank)
        self.registry.check_new(instance, msg.role, geometry)
        if msg.dp_size is not None:  # every DP rank of the instance names the same dp_size
            rid = rank_id(instance, geometry.tp_rank, geometry.pp_rank)
            dp.check_same_size(msg.instance, rid, msg.dp_size, self.me.address, self.dp_seen(msg.instance, msg.role))
        if msg.rendezvous:
            check_rendezvous(msg.rendezvous)
        caller = self.caller(identity)
        if caller is None:
            raise TrustRefusal("no_credentials", "the daemon cannot read this connection's peer credentials "
                               "(SO_PEERCRED), so it cannot tell whose memory the regions are", field="pid",
                               fix="connect over the daemon's ipc:// engine socket (engine.socket_path)")
        pid = engine_caller.engine_pid(msg.pid, caller)  # the peer's own pid, or refused
        process = ProcessRef.find(pid) if pid is not None else None
        held = self.registry.get(rank_id(instance, geometry.tp_rank, geometry.pp_rank))
        if held is not None:  # refused before anything is mapped; the holder keeps its rank untouched
            self.registry.check_takeover(held, identity, caller, process)
        # memfd regions are opened through the engine's own descriptors, /proc/<pid>/fd/<fd>
        try:
            regions = self.mapper.map_regions(geometry, msg.regions, pid, caller.uid)
            if process is not None and not process.alive():  # the pid went to another process meanwhile
                raise RegistrationError(f"engine process {process.pid} exited while registering", field="pid",
                                        fix="register from a live engine process")
        except BaseException:
            self.release_mappings()  # a refused registration keeps nothing mapped
            raise
        rank = Rank(instance, msg.role, geometry, regions, identity, process, msg.dp_size, msg.integrity, caller)
        old = self.registry.get(rank.id)
        if old is not None:
            self.drop_rank(old, "rank re-registered (engine restarted)")
        self.add_rank(rank, msg.rendezvous)
        log.info("event=rank_registered rank=%s role=%s tp=%d/%d pp=%d/%d pages=%d", rank.id, rank.role,
                 geometry.tp_rank, geometry.spec.tp_size, geometry.pp_rank, geometry.spec.pp_size,
                 geometry.num_pages)
        return messages.reply(rank_id=rank.id, daemon=self.me.address)

    def unregister(self, identity: bytes, msg: messages.Unregister) -> dict[str, Any]:
        rank = self._mine(identity, msg.rank_id, "unregister only ranks this connection registered")
        self.drop_rank(rank, "engine unregistered the rank")
        return messages.reply()

    def poll(self, identity: bytes, msg: messages.Poll) -> dict[str, Any]:
        rank = self._mine(identity, msg.rank_id, "use the rank_id register returned")
        return messages.reply(**self.life.poll(rank, msg.request_id))

    def abort(self, identity: bytes, msg: messages.Abort) -> dict[str, Any]:
        rank = self._mine(identity, msg.rank_id, "use the rank_id register returned")
        state = self.dispatch(events.AbortCalled(rank, msg.request_id, msg.reason or "aborted by engine"))
        return messages.reply(state=state)

    def _pages(self, rank: Rank, pages: list[int]) -> Any:
        if len(pages) > self.cfg.limits.max_pages_per_request:
            raise RequestError(f"{len(pages)} pages exceed limits.max_pages_per_request",
                               field="pages", fix="split the request or raise the limit")
        return as_pages(pages, rank.geometry.num_pages, "pages")

    def expect(self, identity: bytes, msg: messages.Expect) -> dict[str, Any]:
        TRACE.mark(msg.request_id, "expect_in")
        rank = self._owned(identity, msg.rank_id, "decode")
        self.life.check_capacity()
        pages = self._pages(rank, msg.pages)
        num_tokens = msg.num_tokens
        capacity = pages.size * rank.geometry.spec.page_size
        if num_tokens is not None and num_tokens > capacity:
            raise RequestError(f"num_tokens {num_tokens} exceeds the {capacity} tokens of {pages.size} pages",
                               field="num_tokens", fix="allocate enough pages for the request")
        start = msg.start or 0
        if num_tokens is not None and start >= num_tokens:
            raise RequestError(f"start {start} is not below num_tokens {num_tokens}: nothing would move",
                               field="start", fix="send start (tokens already in the decode pages) below "
                                                  "num_tokens, or omit it")
        if start >= max(capacity, 1):
            raise RequestError(f"start {start} is not below the {capacity} tokens of {pages.size} pages",
                               field="start", fix="send pages for the whole request from token 0, start below it")
        unit = rank.geometry.spec.slot_tokens
        if start % unit:
            raise RequestError(f"start {start} is not a multiple of page_size {unit}; the "
                               f"{rank.geometry.spec.layout} layout moves whole pages", field="start",
                               fix=f"round start down to a page boundary ({start // unit * unit}): the "
                                   "partly cached page is sent again, whole")
        source = msg.source_instance
        if msg.source_dp_rank is not None:  # a DP rank of a data-parallel instance: an instance of its own
            source = dp.dp_instance(source, msg.source_dp_rank)
        source_address = msg.source_address or ""
        if source_address == self.me.address:
            source_address = ""
        if source_address:
            protocol.split_address(source_address)
        groups = expect_tables(rank.geometry, msg.groups, num_tokens) if rank.geometry.spec.groups or msg.groups else {}
        state = self.dispatch(events.ExpectCalled(rank, msg.request_id, source, pages,
                                                  num_tokens, start, source_address, groups))
        return messages.reply(state=state)

    def send_chunk(self, identity: bytes, msg: messages.Send) -> dict[str, Any]:
        TRACE.mark(msg.request_id, "send_in")
        rank = self._owned(identity, msg.rank_id, "prefill")
        start, end = msg.start, msg.end
        if end < start:
            raise RequestError(f"end {end} is before start {start}", field="end", fix="send start <= end")
        pages = self._pages(rank, msg.pages)
        if end - start > min(pages.size, rank.geometry.num_pages) * rank.geometry.spec.page_size:
            # checked before slots() materialises one index per token of the claimed range
            raise RequestError(f"token range [{start}, {end}) is longer than the {pages.size} pages sent",
                               field="pages", fix="send a page for every page_size tokens of the range")
        check_whole_pages(rank.geometry.spec, start, end, msg.last)
        chunk_slots = unit_slots(rank.geometry.spec, pages, start, end, start, rank.geometry.slot_pitch)
        groups = (send_tables(rank.geometry, msg.groups, start, end, msg.last)
                  if rank.geometry.spec.groups or msg.groups else None)
        chunk = Chunk(start, end, msg.last, chunk_slots, msg.aux, groups)
        budget = budget_s(msg.budget_ms, msg.deadline_at, time.time())
        state = self.dispatch(events.SendCalled(rank, msg.request_id, chunk, msg.qos_class, budget))
        return messages.reply(state=state)

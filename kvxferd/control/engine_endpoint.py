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
from pathlib import Path
from typing import Any, Callable

import zmq
import zmq.asyncio

from ..datapath.regions import MemoryMapper
from ..errors import KvxferError, ProtocolError, RegistrationError, RequestError
from ..lifecycle import events
from ..lifecycle.core import Lifecycle
from ..lifecycle.outbox import Chunk
from ..lifecycle.registry import ProcessRef, Rank, Registry
from ..model import dp
from ..model.geometry import RankGeometry, rank_id
from ..model.group_requests import expect_tables, send_tables
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
from .zmq_loop import ignore_result

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
        limit = self.cfg.limits.max_batch_calls
        while True:
            frames = await self.sock.recv_multipart(copy=True)
            calls = len(frames) - 1
            for i, payload in enumerate(frames[1:]):
                self.answer(frames[0], payload, calls if i >= limit else 0)
            await asyncio.sleep(0)  # a ready socket must not starve the loop (and the answers' flush)

    def answer(self, identity: bytes, payload: bytes, over_limit: int = 0) -> None:
        seq = None
        try:
            raw = protocol.decode(payload, self.cfg.limits.max_message_bytes)
            seq = raw.get("seq")
            if over_limit:
                raise RequestError(f"a batch of {over_limit} calls exceeds limits.max_batch_calls "
                                   f"{self.cfg.limits.max_batch_calls}; this call was not run",
                                   field="batch", code="batch_too_large",
                                   fix="send smaller batches or raise limits.max_batch_calls")
            msg = messages.parse_engine(raw)
            reply = self.op(identity, msg)
        except KvxferError as exc:
            if isinstance(exc, ProtocolError):
                self.metrics.invalid_messages.labels("engine").inc()
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

    def _mine(self, identity: bytes, rank_id: str, fix: str) -> Rank:
        rank = self.registry.get(rank_id)
        if rank is None or rank.identity != identity:
            raise RequestError(f"rank {rank_id!r} is not registered on this connection", field="rank_id", fix=fix)
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
        process = ProcessRef.find(msg.pid) if msg.pid is not None else None
        # memfd regions are opened through the engine's own descriptors, /proc/<pid>/fd/<fd>
        try:
            regions = self.mapper.map_regions(geometry, msg.regions, msg.pid)
            if process is not None and not process.alive():  # the pid went to another process meanwhile
                raise RegistrationError(f"engine process {process.pid} exited while registering", field="pid",
                                        fix="register from a live engine process")
        except BaseException:
            self.release_mappings()  # a refused registration keeps nothing mapped
            raise
        rank = Rank(instance, msg.role, geometry, regions, identity, process, msg.dp_size, msg.integrity)
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
        state = self.dispatch(events.SendCalled(rank, msg.request_id, chunk))
        return messages.reply(state=state)

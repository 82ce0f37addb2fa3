"""The daemon: endpoints, request lifecycle, peers and data threads wired together.

Control runs on one asyncio loop (uvloop when installed); every byte of KV data moves on
data-plane threads (:mod:`kvxferd.transport`), which report back with
``loop.call_soon_threadsafe``. State is only mutated on the loop, except the inbox, which
data threads share under its own lock.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import stat
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from . import PROTOCOL_VERSION, __version__, auth, linkwatch, messages, protocol, sdnotify
from .binding import binding
from .config import LOCAL_MODE_NOTE, Config, transport_preference
from .errors import KvxferError, PlanRefusal, ProtocolError, RegistrationError, RequestError, TransferError
from .geometry import InstanceSpec, RankGeometry
from .httpserver import OpsServer
from .inbox import DestEntry, Inbox, Sink
from .logutil import q
from .memory import MemoryMapper
from .metrics import Metrics
from .outbox import Chunk, Route, SrcEntry, Target
from .planner import Plan, make_plan
from .registry import ProcessRef, Rank, Registry, rank_id
from .segments import as_pages, check_whole_pages, clip_slots, unit_slots
from .transport.base import ChunkJob, Moved
from .transport.local import LocalTransport
from .staging import StagingPool
from .transport.tcp import TcpDataServer, TcpTransport
from .transport.nixl_support import NixlSupport

log = logging.getLogger("kvxferd.daemon")

TERMINAL = ("done", "failed")
STATES = ("bootstrapping", "waiting_for_input", "transferring")


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise RequestError(f"address {address!r} is not host:port", field="source_address",
                           fix="give the peer daemon as host:control_port")
    return host.strip("[]"), int(port)


#: geometry sizes past these are refused before anything is built from them: a num_layers
#: or pp_size of 10**9 makes per-layer lists that size, a tp_size drives the planner's loops
GEOMETRY_BOUNDS = {"num_layers": 1 << 16, "pp_size": 1 << 12, "tp_size": 1 << 12,
                   "total_kv_heads": 1 << 16, "heads_per_rank": 1 << 16}


def bounded_geometry(data: Any, field: str) -> Any:
    """Refuse a geometry map with non-string keys or sizes no deployment has, before parsing it."""
    if isinstance(data, dict):
        if not all(isinstance(k, str) for k in data):
            raise ProtocolError(f"{field} has a key that is not a string", field=field,
                                fix="send geometry fields by name")
        for key, limit in GEOMETRY_BOUNDS.items():
            value = data.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > limit:
                raise ProtocolError(f"{field}.{key} = {value} exceeds {limit}", field=key,
                                    fix=f"send a real {key} (at most {limit})")
    return data


class PeerLink:
    """This daemon's connection to a peer daemon that hosts prefill instances."""

    def __init__(self, daemon: "Daemon", address: str) -> None:
        self.daemon = daemon
        self.address = address
        self.sock = daemon.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 10000)
        self.sock.setsockopt(zmq.RCVHWM, 10000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, daemon.cfg.limits.max_message_bytes)
        self.monitor: zmq.Socket | None = None  # CURVE links: handshake outcomes (linkwatch)
        self.auth_error = ""
        host, port = split_address(address)
        if daemon.keys is not None:
            server_key = daemon.peer_keys.get(address)
            if server_key is None:
                self.sock.close(0)
                raise RequestError(f"no CURVE server key configured for peer {address}", field="auth.peer_keys",
                                   fix=f"add \"{address}=<its public key>\" to auth.peer_keys")
            self.sock.curve_secretkey = daemon.keys.secret.encode()
            self.sock.curve_publickey = daemon.keys.public.encode()
            self.sock.curve_serverkey = server_key.encode()
            self.monitor = self.sock.get_monitor_socket(linkwatch.EVENTS)
        self.sock.connect(f"tcp://{host}:{port}")
        # ties our data connections to this authenticated link; sent inside the handshake
        self.token = os.urandom(16)
        self.state = "connecting"
        self.last_seen = time.monotonic()
        self.peer_incarnation = ""  # learnt from its pongs and handshake answers
        self.seq = 0
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.plans: dict[tuple[str, str], asyncio.Future[Plan]] = {}
        self.reader = asyncio.ensure_future(self._read())
        self.watcher = None if self.monitor is None or daemon.keys is None else asyncio.ensure_future(
            linkwatch.watch(self.monitor, address, daemon.keys.public,
                            lambda message: daemon.peer_auth_failed(self, message),
                            lambda: setattr(self, "auth_error", "")))

    def send(self, message: messages.Message) -> None:
        fut = self.sock.send(protocol.encode(message.to_wire()))
        if isinstance(fut, asyncio.Future):
            fut.add_done_callback(_ignore)

    async def request(self, message: messages.Message, timeout: float) -> dict[str, Any]:
        self.seq += 1
        seq = self.seq
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiting[seq] = fut
        try:
            wire = {**message.to_wire(), "seq": seq}
            send = self.sock.send(protocol.encode(wire))
            if isinstance(send, asyncio.Future):
                send.add_done_callback(_ignore)
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.waiting.pop(seq, None)

    async def _read(self) -> None:
        while True:
            try:
                data = await self.sock.recv()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            try:
                msg = protocol.decode(data, self.daemon.cfg.limits.max_message_bytes)
            except ProtocolError:
                self.daemon.metrics.invalid_messages.labels("peer").inc()
                continue
            self.daemon.peer_seen(self)
            fut = self.waiting.get(msg.get("seq")) if isinstance(msg.get("seq"), int) else None
            if fut is not None and not fut.done():
                fut.set_result(msg)
                continue
            self.daemon.handle_upstream(self, msg)

    def close(self) -> None:
        self.reader.cancel()
        for fut in self.waiting.values():
            if not fut.done():
                fut.cancel()
        if self.monitor is not None:
            if self.watcher is not None:
                self.watcher.cancel()
            self.sock.disable_monitor()
            self.monitor.close(0)
        self.sock.close(linger=500)  # an abort sent while draining still reaches the peer


def _ignore(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


class DownstreamPeer:
    """A decode daemon that handshook with this daemon (known by its routing id)."""

    def __init__(self, identity: bytes, daemon: str, incarnation: str = "") -> None:
        self.identity = identity
        self.daemon = daemon
        self.incarnation = incarnation
        self.last_seen = time.monotonic()


class Daemon:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.metrics = Metrics()
        self.keys = auth.read_keypair(cfg.auth.secret_key_file) if cfg.auth.enabled else None
        self.peer_keys = auth.parse_peer_keys(cfg.auth.peer_keys) if cfg.auth.enabled else {}
        self.authenticator: Any = None
        self.registry = Registry(cfg.limits.max_ranks)
        self.mapper = MemoryMapper(cfg.engine.shm_dirs)
        self.inbox = Inbox(self._inbox_changed)
        self.sources: dict[tuple[str, str], SrcEntry] = {}
        self.src_plans: dict[tuple[str, str], tuple[Plan, Route]] = {}
        self.links: dict[str, PeerLink] = {}
        self.downstream: dict[bytes, DownstreamPeer] = {}
        self.finished: OrderedDict[tuple[str, str], dict[str, Any]] = OrderedDict()
        # (request, prefill instance) -> what its expects taught us; bounded, oldest dropped
        self.request_routes: OrderedDict[tuple[str, str], tuple[Plan, str, Route]] = OrderedDict()
        #: request -> decode daemons (peer identities) waiting for "fenced" once its jobs return
        self.fence_waiters: dict[str, set[bytes]] = {}
        self.recent_failures: list[dict[str, Any]] = []
        self.auth_refusals = auth.RefusalBook()  # peers this daemon's ZAP handler refused
        self.auth_refused_by = auth.RefusalBook()  # peers that refused this daemon
        self.started = time.time()
        self.incarnation = os.urandom(8).hex()  # this process start; peers tell a restart by it
        self.ready = False
        self.draining = False
        self._hurry = False
        self._stop: asyncio.Event | None = None  # created in run(), on the daemon's loop
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ctx = zmq.asyncio.Context()
        self.executor = ThreadPoolExecutor(cfg.daemon.data_threads, thread_name_prefix="kvxferd-data")
        self.staging = StagingPool(cfg.limits.staging_bytes, cfg.limits.staging_slot_bytes,
                                   self._staging_changed, self.metrics.staging_waits.inc)
        self.local = LocalTransport(self.inbox)
        self.tcp = TcpTransport(timeout_s=cfg.timeouts.transfer_s, max_reply_bytes=1 << 16,
                                staging=self.staging, connections_per_peer=cfg.peer.data_connections)
        self.nixl = NixlSupport(  # the agent itself starts on first use, only where nixl is configured
            cfg.daemon.instance_name or socket.gethostname(), transport_preference(cfg.peer), self.inbox,
            timeout_s=cfg.timeouts.transfer_s, max_header_bytes=cfg.limits.max_message_bytes,
            max_pages=cfg.limits.max_pages_per_request, staging=self.staging,
            landing_slots=cfg.limits.nixl_landing_slots, landing_bytes=cfg.limits.nixl_landing_bytes,
            on_received=lambda sink, moved: self.metrics.bytes_received.labels("nixl").inc(moved.nbytes),
            on_refused=self._nixl_refused_threadsafe,
            on_invalid=lambda code: self.metrics.invalid_messages.labels("data").inc())
        self.data_server: TcpDataServer | None = None
        self.ops: OpsServer | None = None
        self.engine_sock: zmq.asyncio.Socket | None = None
        self._engine_bound = False
        self.peer_sock: zmq.asyncio.Socket | None = None
        self.control_port = cfg.peer.control_port
        self.tasks: list[asyncio.Task[Any]] = []
        self.metrics.start_time.set(self.started)
        self._states_cache: tuple[float, dict[tuple[str, str], int]] | None = None
        for side in ("decode", "prefill"):
            for state in STATES:
                self.metrics.inflight.labels(side, state).set_function(
                    lambda key=(side, state): self._state_counts()[key])

    def _staging_changed(self, slots_in_use: int, bytes_in_use: int) -> None:
        self.metrics.staging_slots.set(slots_in_use)
        self.metrics.staging_bytes.set(bytes_in_use)

    # -- lifecycle -------------------------------------------------------------------
    @property
    def address(self) -> str:
        return f"{self.cfg.advertise_host}:{self.control_port}"

    @property
    def data_address(self) -> str:
        port = self.data_server.port if self.data_server else self.cfg.peer.data_port
        return f"{self.cfg.advertise_host}:{port}"

    def _bind_engine(self) -> None:
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
        self.engine_sock = self.ctx.socket(zmq.ROUTER)
        self.engine_sock.setsockopt(zmq.LINGER, 0)
        self.engine_sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.limits.max_message_bytes)
        old = os.umask(0o077)
        try:
            with binding("engine.socket_path", f"ipc://{path}"):
                self.engine_sock.bind(f"ipc://{path}")
            self._engine_bound = True  # from here on the socket file is ours to remove
        finally:
            os.umask(old)
        os.chmod(path, int(self.cfg.engine.socket_mode, 8))
        if self.cfg.engine.socket_group:
            import grp
            os.chown(path, -1, grp.getgrnam(self.cfg.engine.socket_group).gr_gid)

    def _bind_peer(self) -> None:
        self.peer_sock = self.ctx.socket(zmq.ROUTER)
        self.peer_sock.setsockopt(zmq.LINGER, 0)
        self.peer_sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.limits.max_message_bytes)
        host = self.cfg.peer.bind_host
        if self.keys is not None:
            self.authenticator = auth.ZapAuthenticator(self.ctx, self._auth_refused)
            self.authenticator.start()
            self.authenticator.configure_curve_callback(
                "*", credentials_provider=auth.AllowList(self.cfg.auth.allowed_keys))
            self.peer_sock.curve_secretkey = self.keys.secret.encode()
            self.peer_sock.curve_publickey = self.keys.public.encode()
            self.peer_sock.curve_server = True
        elif host not in ("127.0.0.1", "::1", "localhost"):
            log.warning("event=unauthenticated_peer_endpoint bind=%s fix=%s", host,
                        q("enable [auth] with `kvxferd keygen` keys, or bind to loopback"))
        with binding("peer.control_port", f"{host}:{self.cfg.peer.control_port}"):
            if self.cfg.peer.control_port == 0:
                self.control_port = self.peer_sock.bind_to_random_port(f"tcp://{host}")
            else:
                self.peer_sock.bind(f"tcp://{host}:{self.cfg.peer.control_port}")
        with binding("peer.data_port", f"{host}:{self.cfg.peer.data_port}"):
            self.data_server = self._data_server(host)

    def _data_server(self, host: str) -> TcpDataServer:
        return TcpDataServer(
            host, self.cfg.peer.data_port, self.inbox,
            max_header_bytes=self.cfg.limits.max_message_bytes, timeout_s=self.cfg.timeouts.transfer_s,
            staging=self.staging, on_received=self._on_received_threadsafe,
            on_invalid=lambda code: self.metrics.invalid_messages.labels("data").inc())

    def _auth_refused(self, address: str, key: str, reason: str) -> None:
        """ZAP refused a peer: count it, log it (bounded), keep it for ``status``."""
        self.metrics.auth_denied.inc()
        record, log_now = self.auth_refusals.note(reason, address=address, key=key)
        if log_now:
            log.warning("event=auth_refused peer=%s key=%s reason=%s count=%s fix=%s", address, key, q(reason),
                        record["count"], q("add the key to auth.allowed_keys if that daemon is one of yours"))

    def peer_auth_failed(self, link: PeerLink, message: str) -> None:
        """A peer refused this daemon's key (or could not be authenticated): fail what waits on it now."""
        link.auth_error = message
        self.metrics.peer_auth_failures.inc()
        record, log_now = self.auth_refused_by.note(message, address=link.address)
        if log_now:
            log.warning("event=peer_auth_failed peer=%s count=%s msg=%s", link.address, record["count"], q(message))
        for fut in link.waiting.values():  # the handshake in progress ends with it
            if not fut.done():
                fut.set_exception(TransferError(message, field="auth", code="auth_failed"))
        for entry in self.inbox.all():
            if entry.source_address == link.address and entry.failure is None:
                self._fail_dest(entry, "auth_failed", message, propagate=False)

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            # the engine socket last: engines never find one whose daemon then fails to start
            self._bind_peer()
            if self.cfg.metrics.bind:
                with binding("metrics.bind", self.cfg.metrics.bind):
                    self.ops = OpsServer(self.cfg.metrics.bind, self.metrics.registry, lambda: self.ready)
            self._bind_engine()
        except BaseException:
            await self.close()  # no socket, file or port of a failed start outlives it
            raise
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self.loop.add_signal_handler(sig, self.request_stop)
            except (NotImplementedError, RuntimeError):
                pass
        self.tasks = [asyncio.ensure_future(c) for c in
                      (self._engine_loop(), self._peer_loop(), self._sweeper(), self._heartbeats(),
                       self._watchdog())]
        self.ready = True
        self.metrics.up.set(1)
        metrics_url = f"http://{self.cfg.metrics.bind.rpartition(':')[0]}:{self.ops.port}/metrics" if self.ops else ""
        log.info("event=listening engine=%s peer=%s data=%s metrics=%s version=%s", q(self.cfg.socket_path),
                 self.address, self.data_address, q(metrics_url), __version__)
        if self.cfg.peer.mode == "staged":
            log.info("event=mode_scope mode=staged local=direct reason=%s", q(LOCAL_MODE_NOTE))
        sdnotify.notify(f"READY=1\nSTATUS=serving peer={self.address}")
        await self._stop.wait()
        await self._drain()

    def request_stop(self) -> None:
        if self._stop is None:
            return
        if not self._stop.is_set():
            log.info("event=stopping reason=signal")
            self._stop.set()
        elif not self._hurry:
            log.info("event=stopping reason=second_signal drain=cut_short")
            self._hurry = True  # a second signal ends the grace period now

    async def _drain(self) -> None:
        self.draining = True
        self.ready = False
        sdnotify.notify(f"STOPPING=1\nSTATUS=draining {self._active_count()} requests "
                        f"(up to {self.cfg.timeouts.drain_grace_s}s)")
        deadline = time.monotonic() + self.cfg.timeouts.drain_grace_s
        while self._active_count() and time.monotonic() < deadline and not self._hurry:
            await asyncio.sleep(0.05)
        left = self._active_count()
        for entry in self.inbox.all():
            self._fail_dest(entry, "shutdown", "daemon shut down before the transfer finished")
        for entry in list(self.sources.values()):
            self._fail_src(entry, "shutdown", "daemon shut down before the transfer finished")
        # Failures are told to engines only once no data thread touches their pages: cut the
        # inbound data connections so receivers stop, give copies a moment to end, then tell
        # whatever is left (a thread still blocked in a send ends with the process).
        if self.data_server:
            self.data_server.close()
        fence = time.monotonic() + min(5.0, self.cfg.timeouts.transfer_s)
        while self._inflight_jobs() and time.monotonic() < fence:
            await asyncio.sleep(0.02)
        for entry in self.inbox.all():
            if entry.state not in TERMINAL:
                self._finalize_dest(entry, "failed")
        for entry in list(self.sources.values()):
            if entry.state not in TERMINAL:
                self._finalize_src(entry, "failed")
        await asyncio.sleep(0.05)
        log.info("event=stopped drained=%s failed_on_exit=%d", left == 0, left)
        await self.close()

    async def close(self) -> None:
        self.metrics.up.set(0)
        for t in self.tasks:
            t.cancel()
        for link in self.links.values():
            link.close()
        if self.data_server:
            self.data_server.close()
        self.tcp.close()
        self.nixl.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.ops:
            self.ops.close()
        for sock in (self.engine_sock, self.peer_sock):
            if sock is not None:
                sock.close(linger=500)  # up to 0.5 s to deliver the last events and aborts
        if self.authenticator is not None:
            self.authenticator.stop()
        if self._engine_bound:  # never another daemon's socket, found in place at start-up
            try:
                os.unlink(self.cfg.socket_path)
            except OSError:
                pass
        self.ctx.term()

    def _inflight_jobs(self) -> int:
        return sum(e.inflight for e in self.inbox.all()) + sum(e.inflight for e in self.sources.values())

    def _active_count(self) -> int:
        return len(self.inbox) + sum(1 for e in self.sources.values() if e.state not in TERMINAL)

    # -- engine endpoint -------------------------------------------------------------
    async def _engine_loop(self) -> None:
        assert self.engine_sock is not None
        while True:
            frames = await self.engine_sock.recv_multipart(copy=True)
            identity, payload = frames[0], frames[-1]
            seq = None
            try:
                raw = protocol.decode(payload, self.cfg.limits.max_message_bytes)
                msg = messages.parse_engine(raw)
                seq = raw.get("seq")
                reply = self._engine_op(identity, msg)
            except KvxferError as exc:
                if isinstance(exc, ProtocolError):
                    self.metrics.invalid_messages.labels("engine").inc()
                log.info("event=engine_error code=%s field=%s msg=%s", exc.code, exc.field, q(str(exc)[:300]))
                reply = {"ok": False, "error": exc.to_wire()}
            except Exception as exc:  # noqa: BLE001 - a bug in one handler must not stop the daemon
                log.exception("event=engine_handler_crash")
                reply = {"ok": False, "error": {"code": "internal", "field": None, "message": repr(exc)[:300]}}
            if seq is not None:
                reply["seq"] = seq
            reply.setdefault("op", "reply")
            self._send_engine(identity, reply)

    def _send_engine(self, identity: bytes, message: dict[str, Any]) -> None:
        assert self.engine_sock is not None
        fut = self.engine_sock.send_multipart([identity, protocol.encode(message)])
        if isinstance(fut, asyncio.Future):
            fut.add_done_callback(_ignore)

    def _owned(self, identity: bytes, rid: str, role: str) -> Rank:
        rank = self.registry.get(rid)
        if rank is None or rank.identity != identity:
            raise RequestError(f"rank {rid!r} is not registered on this connection", field="rank_id",
                               fix="register the rank first and use the rank_id it returned")
        if rank.role != role:
            raise RequestError(f"rank {rid} is a {rank.role} rank; this call is for {role} ranks",
                               field="rank_id", fix=f"call it from a {role} rank")
        return rank

    def _engine_op(self, identity: bytes, msg: Any) -> dict[str, Any]:
        op = msg.op
        if op == "ping":
            return {"ok": True}
        if op == "status":
            return {"ok": True, "status": self.status()}
        if op == "register":
            return self._register(identity, msg)
        if op == "unregister":
            rank = self.registry.get(msg.rank_id)
            if rank is None or rank.identity != identity:
                raise RequestError(f"rank {msg.rank_id!r} is not registered on this connection",
                                   field="rank_id", fix="unregister only ranks this connection registered")
            self._drop_rank(rank, "engine unregistered the rank")
            return {"ok": True}
        if op in ("poll", "abort"):
            rid = msg.rank_id
            rank = self.registry.get(rid)
            if rank is None or rank.identity != identity:
                raise RequestError(f"rank {rid!r} is not registered on this connection", field="rank_id",
                                   fix="use the rank_id register returned")
            if op == "abort":
                return self._abort_from_engine(rank, msg.request_id, msg.reason or "aborted by engine")
            return {"ok": True, **self._poll(rank, msg.request_id)}
        if self.draining and not (op == "send" and (msg.request_id, msg.rank_id) in self.sources):
            # later chunks of a request already in flight still go through: the drain finishes it
            raise RequestError("daemon is draining and takes no new work", field="op", code="draining",
                               fix="retry on the restarted daemon")
        if op == "expect":
            return self._expect(self._owned(identity, msg.rank_id, "decode"), msg)
        if op == "send":
            return self._send(self._owned(identity, msg.rank_id, "prefill"), msg)
        raise ProtocolError(f"unhandled op {op!r}", field="op", fix="use a documented op")

    def _register(self, identity: bytes, msg: messages.Register) -> dict[str, Any]:
        geometry = RankGeometry.from_dict(bounded_geometry(msg.geometry, "geometry"))
        self.registry.check_new(msg.instance, msg.role, geometry)
        process = ProcessRef.find(msg.pid) if msg.pid is not None else None
        # memfd regions are opened through the engine's own descriptors, /proc/<pid>/fd/<fd>
        try:
            regions = self.mapper.map_regions(geometry, msg.regions, msg.pid)
            if process is not None and not process.alive():  # the pid went to another process meanwhile
                raise RegistrationError(f"engine process {process.pid} exited while registering", field="pid",
                                        fix="register from a live engine process")
        except BaseException:
            # a refused registration keeps nothing mapped (files mapped before the refusal)
            self.mapper.release_unused(region.flat for r in self.registry for region in r.regions.values())
            raise
        rank = Rank(msg.instance, msg.role, geometry, regions, identity, process)
        old = self.registry.get(rank.id)
        if old is not None:
            self._drop_rank(old, "rank re-registered (engine restarted)")
        self.registry.add(rank)
        self.nixl.register(rank)  # no-op unless NIXL is enabled and usable here
        self._update_rank_metrics()
        log.info("event=rank_registered rank=%s role=%s tp=%d/%d pp=%d/%d pages=%d", rank.id, rank.role,
                 geometry.tp_rank, geometry.spec.tp_size, geometry.pp_rank, geometry.spec.pp_size,
                 geometry.num_pages)
        return {"ok": True, "rank_id": rank.id, "daemon": self.address}

    def _drop_rank(self, rank: Rank, reason: str) -> None:
        for entry in self.inbox.all():
            if entry.rank is rank:
                self._fail_dest(entry, "rank_gone", reason)
        for entry in list(self.sources.values()):
            if entry.rid == rank.id and entry.state not in TERMINAL:
                self._fail_src(entry, "rank_gone", reason)
        if self.registry.get(rank.id) is rank:
            self.registry.remove(rank.id)
        self.nixl.deregister(rank)
        # forget file mappings no rank uses any more (they unmap once in-flight copies drop them)
        self.mapper.release_unused(region.flat for r in self.registry for region in r.regions.values())
        self._update_rank_metrics()
        log.info("event=rank_unregistered rank=%s reason=%s", rank.id, q(reason))

    def _update_rank_metrics(self) -> None:
        for role, n in self.registry.count_by_role().items():
            self.metrics.ranks.labels(role).set(n)

    def _refuse_finished(self, request_id: str, rid: str) -> None:
        record = self.finished.get((request_id, rid))
        if record is not None:
            why = f" ({record.get('code')}: {record.get('reason')})" if record["state"] == "failed" else ""
            raise RequestError(f"request {request_id!r} already {record['state']} at {rid}{why}",
                               field="request_id", code="request_finished",
                               fix="use a new request id per request")

    def _check_capacity(self) -> None:
        if self._active_count() >= self.cfg.limits.max_inflight_requests:
            raise RequestError(f"{self.cfg.limits.max_inflight_requests} requests are in flight",
                               field="request_id", code="busy",
                               fix="retry later, or raise limits.max_inflight_requests")

    # -- decode side -----------------------------------------------------------------
    def _expect(self, rank: Rank, msg: messages.Expect) -> dict[str, Any]:
        self._check_capacity()
        if len(msg.pages) > self.cfg.limits.max_pages_per_request:
            raise RequestError(f"{len(msg.pages)} pages exceed limits.max_pages_per_request",
                               field="pages", fix="split the request or raise the limit")
        pages = as_pages(msg.pages, rank.geometry.num_pages, "pages")
        num_tokens = msg.num_tokens
        capacity = pages.size * rank.geometry.spec.page_size
        if num_tokens is not None and num_tokens > capacity:
            raise RequestError(f"num_tokens {num_tokens} exceeds the {capacity} tokens of {pages.size} pages",
                               field="num_tokens", fix="allocate enough pages for the request")
        start = (msg.start or 0)
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
        self._refuse_finished(msg.request_id, rank.id)
        source_address = msg.source_address or ""
        if source_address == self.address:
            source_address = ""
        if source_address:
            split_address(source_address)
        entry = DestEntry(msg.request_id, rank, msg.source_instance, pages, num_tokens, start)
        entry.transport = "tcp" if source_address else "local"
        entry.source_address = source_address
        self.inbox.add(entry)
        asyncio.ensure_future(self._bootstrap(entry, source_address))
        return {"ok": True, "state": entry.state}

    async def _bootstrap(self, entry: DestEntry, source_address: str) -> None:
        started = time.monotonic()
        deadline = entry.created + self.cfg.timeouts.bootstrap_s
        decode_spec = entry.rank.geometry.spec
        try:
            if source_address:
                link = self._link(source_address)
                plan = await self._remote_plan(link, entry.source_instance, entry.rank.instance,
                                               decode_spec, deadline)
            else:
                link = None
                plan = await self._local_plan(entry.source_instance, entry.rank.instance, decode_spec, deadline)
        except PlanRefusal as refusal:
            self.metrics.refusals.labels(refusal.field or "unknown").inc()
            self._fail_dest(entry, "incompatible", str(refusal), propagate=False)
            return
        except (asyncio.TimeoutError, TimeoutError):
            self._fail_dest(entry, "bootstrap_timeout",
                            f"no plan with source instance {entry.source_instance!r} within "
                            f"{self.cfg.timeouts.bootstrap_s}s (source daemon unreachable or instance not registered)",
                            propagate=False)
            return
        except KvxferError as exc:
            self._fail_dest(entry, exc.code, str(exc), propagate=False)
            return
        if entry.closed:
            return
        entry.data_token = link.token if link is not None else None
        if link is not None:
            entry.transport = self.nixl.route_kind(link.address, entry.source_instance, entry.rank.instance)
        entry.bind(plan)
        entry.state = "waiting_for_input"
        entry.phase_since = time.monotonic()
        self.metrics.phase_latency.labels("bootstrap").observe(time.monotonic() - started)
        num_tokens = entry.num_tokens if entry.num_tokens is not None else 0
        if link is None:
            plan_route = self.src_plans[(entry.source_instance, entry.rank.instance)]
            self._on_expect(entry.request_id, entry.source_instance, entry.rank.instance, entry.rank.coords,
                            plan_route[0], plan_route[1], start=entry.start)
        else:
            link.send(messages.PeerExpect(entry.request_id, entry.source_instance, entry.rank.instance,
                                          list(entry.rank.coords), num_tokens, entry.start or None,
                                          self.nixl.expect_fields(link.address, entry)))

    async def _local_plan(self, prefill: str, decode: str, spec: InstanceSpec, deadline: float) -> Plan:
        while True:
            cached = self.src_plans.get((prefill, decode))
            if cached is not None and cached[1].kind == "local":
                return cached[0]
            prefill_spec = self.registry.spec(prefill, "prefill")
            if prefill_spec is not None:
                plan = make_plan(prefill_spec, spec, mode="direct",  # config.LOCAL_MODE_NOTE
                                 require_same_page_size=self.cfg.peer.require_same_page_size)
                self.src_plans[(prefill, decode)] = (plan, Route("local", daemon=self.address))
                self.metrics.handshakes.labels("ok").inc()
                return plan
            if time.monotonic() >= deadline:
                raise asyncio.TimeoutError
            await asyncio.sleep(self.cfg.timeouts.handshake_retry_s)

    def _transports_for(self, decode: str) -> list[str]:
        """What a decode instance can be written by: NIXL's WRITEs address pages as dense, so a
        rank whose pages are strided (``page_stride``) is offered tcp only."""
        offered = self.nixl.offered()
        if any(r.instance == decode and r.geometry.page_stride is not None for r in self.registry):
            return [t for t in offered if t != "nixl"]
        return offered

    def _link(self, address: str) -> PeerLink:
        link = self.links.get(address)
        if link is not None and link.auth_error:
            link.close()  # libzmq does not retry a refused key: a new link tries again
            link = None
        if link is None:
            link = self.links[address] = PeerLink(self, address)
            self._count_peers()
        return link

    async def _remote_plan(self, link: PeerLink, prefill: str, decode: str, spec: InstanceSpec,
                           deadline: float) -> Plan:
        key = (prefill, decode)
        fut = link.plans.get(key)
        if fut is None or (fut.done() and (fut.cancelled() or fut.exception() is not None)):
            fut = link.plans[key] = asyncio.ensure_future(self._handshake(link, prefill, decode, spec, deadline))
            fut.add_done_callback(_ignore)  # every waiter sees the outcome; none may be left unretrieved
        return await asyncio.wait_for(asyncio.shield(fut), max(0.001, deadline - time.monotonic()))

    async def _handshake(self, link: PeerLink, prefill: str, decode: str, spec: InstanceSpec,
                         deadline: float) -> Plan:
        while True:
            if link.auth_error:
                raise TransferError(link.auth_error, field="auth", code="auth_failed")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.metrics.handshakes.labels("timeout").inc()
                raise asyncio.TimeoutError
            try:
                hello = messages.Handshake(
                    PROTOCOL_VERSION, self.address, self.data_address, prefill, decode, spec.to_dict(),
                    self.cfg.peer.mode, self._transports_for(decode), link.token, self.incarnation,
                    extra=self.nixl.handshake_fields(link.address, prefill, decode))
                reply = await link.request(hello, timeout=min(remaining, max(1.0, self.cfg.peer.heartbeat_interval_s)))
            except asyncio.TimeoutError:
                continue
            op = reply.get("op")
            if op == "handshake_ok" and self._note_incarnation(link, reply.get("incarnation")):
                continue  # a restarted source: what this handshake offered (a landing ring) went with the old one
            if op == "handshake_ok":
                try:
                    prefill_spec = InstanceSpec.from_dict(bounded_geometry(reply.get("prefill_spec"),
                                                                           "prefill_spec"))
                    mode = reply.get("mode")
                    plan = make_plan(prefill_spec, spec, mode=mode if mode in ("direct", "staged") else "auto",
                                     require_same_page_size=self.cfg.peer.require_same_page_size)
                except KvxferError as exc:
                    self.metrics.handshakes.labels("refused").inc()
                    raise PlanRefusal(f"peer's handshake answer is unusable: {exc}", field=exc.field or "geometry")
                self.metrics.handshakes.labels("ok").inc()
                transport = self.nixl.accepted(link.address, prefill, decode, reply)
                log.info("event=handshake_ok peer=%s prefill=%s decode=%s mode=%s transport=%s", link.address,
                         prefill, decode, plan.mode, transport)
                return plan
            if op == "handshake_refused":
                err = reply.get("error") or {}
                self.metrics.handshakes.labels("refused").inc()
                log.warning("event=handshake_refused peer=%s field=%s msg=%s", link.address, err.get("field"),
                            q(str(err.get("message"))[:300]))
                raise PlanRefusal(str(err.get("message", "refused")), field=str(err.get("field") or "unknown"),
                                  prefill=err.get("prefill"), decode=err.get("decode"))
            await asyncio.sleep(self.cfg.timeouts.handshake_retry_s)

    def handle_upstream(self, link: PeerLink, msg: dict[str, Any]) -> None:
        """Unsolicited messages from a prefill daemon: aborts and errors about requests."""
        op = msg.get("op")
        try:
            if op == "abort":
                m = messages.parse_peer(msg)
                assert isinstance(m, messages.PeerAbort)
                for entry in self.inbox.for_request(m.request_id):
                    if entry.source_address == link.address:  # only requests this peer is the source of
                        self._fail_dest(entry, m.code or "peer_aborted", m.reason, propagate=False)
            elif op == "error" and isinstance(msg.get("request_id"), str):
                rid = msg["request_id"]
                err = msg.get("error") if isinstance(msg.get("error"), dict) else {}
                if err.get("code") == "no_handshake":
                    link.plans.clear()
                    self._handshake_again(link, rid)
                    self._note_incarnation(link, msg.get("incarnation"))
                for entry in self.inbox.for_request(rid):
                    if entry.source_address == link.address and entry.state != "bootstrapping":
                        self._fail_dest(entry, str(err.get("code", "peer_error"))[:64],
                                        f"source daemon {link.address}: {str(err.get('message'))[:300]}",
                                        propagate=False)
            elif op == "fenced":
                m = messages.parse_peer(msg)
                assert isinstance(m, messages.Fenced)
                for entry in self.inbox.for_request(m.request_id):
                    if entry.source_address == link.address:
                        self._fence_done(entry)
            elif op == "pong":
                self._note_incarnation(link, msg.get("incarnation"))
        except KvxferError:
            self.metrics.invalid_messages.labels("peer").inc()

    def _inbox_changed(self, entry: DestEntry) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._dest_changed, entry)

    def _dest_changed(self, entry: DestEntry) -> None:
        if entry.failure is not None:
            if entry.inflight == 0 and entry.state != "failed" and not entry.fence_until:
                self._finalize_dest(entry, "failed")
            return
        if entry.state in TERMINAL:
            return
        if entry.complete():
            entry.closed = True
            self._finalize_dest(entry, "done")

    def _fail_dest(self, entry: DestEntry, code: str, message: str, propagate: bool = True) -> None:
        if entry.state in TERMINAL or entry.failure is not None:
            return
        entry.closed = True
        entry.failure = (code, message)
        if propagate:
            self._propagate_abort_upstream(entry, code, message)
        if entry.inflight and self.data_server is not None:
            self.data_server.cut(entry)  # end writes into its pages now, then tell the engine
        if entry.inflight and entry.transport == "nixl":
            self.nixl.abandon(entry)  # staged chunks still assembling end once no scatter touches them
        if entry.transport == "nixl" and entry.source_address:
            self._fence(entry)
        self._dest_changed(entry)

    def _fence(self, entry: DestEntry) -> None:
        """One-sided WRITEs land without this daemon's help: before the engine hears that a request
        failed (and reuses its pages), the source must say none of its WRITEs is left in flight."""
        link = self.links.get(entry.source_address)
        if link is None or link.state != "up":
            return  # an unreachable source cannot answer; peer_dead failures are told at once
        entry.fence_until = time.monotonic() + self.cfg.timeouts.fence_s
        link.send(messages.Fence(entry.request_id))

    def _fence_done(self, entry: DestEntry, why: str = "") -> None:
        if not entry.fence_until:
            return
        self.metrics.fences.labels("unconfirmed" if why else "confirmed").inc()
        if why:
            log.warning("event=fence_unconfirmed request=%s rank=%s source=%s reason=%s", q(entry.request_id),
                        entry.rank.id, entry.source_address, q(why))
        entry.fence_until = 0.0
        self._dest_changed(entry)

    def _finalize_dest(self, entry: DestEntry, state: str) -> None:
        entry.state = state
        self.inbox.remove(entry)
        mode = entry.plan.mode if entry.plan else "none"
        self.metrics.transfers.labels("decode", state, mode, entry.transport).inc()
        record = {"state": state, "bytes": entry.bytes_received}
        if state == "done":
            self.metrics.latency.observe(time.monotonic() - entry.created)
            self.metrics.phase_latency.labels("transfer").observe(time.monotonic() - entry.phase_since)
            if entry.aux is not None:
                record["aux"] = entry.aux
        else:
            code, message = entry.failure or ("unknown", "")
            record.update(code=code, reason=message)
            self._record_failure("decode", entry.request_id, entry.rank.id, code, message)
        self._remember(entry.request_id, entry.rank.id, record)
        self._send_engine(entry.rank.identity, messages.Event.of(entry.rank.id, entry.request_id, record).to_wire())

    def _propagate_abort_upstream(self, entry: DestEntry, code: str, message: str) -> None:
        if entry.transport == "local":
            self._abort_sources(entry.request_id, code, message)
        else:
            link = self.links.get(entry.source_address)
            if link is not None:
                link.send(messages.PeerAbort.of(entry.request_id, code, message))

    # -- prefill side ----------------------------------------------------------------
    def _send(self, rank: Rank, msg: messages.Send) -> dict[str, Any]:
        start, end = msg.start, msg.end
        if end < start:
            raise RequestError(f"end {end} is before start {start}", field="end", fix="send start <= end")
        if len(msg.pages) > self.cfg.limits.max_pages_per_request:
            raise RequestError(f"{len(msg.pages)} pages exceed limits.max_pages_per_request",
                               field="pages", fix="split the request or raise the limit")
        pages = as_pages(msg.pages, rank.geometry.num_pages, "pages")
        if end - start > min(pages.size, rank.geometry.num_pages) * rank.geometry.spec.page_size:
            # checked before slots() materialises one index per token of the claimed range
            raise RequestError(f"token range [{start}, {end}) is longer than the {pages.size} pages sent",
                               field="pages", fix="send a page for every page_size tokens of the range")
        check_whole_pages(rank.geometry.spec, start, end, msg.last)
        chunk_slots = unit_slots(rank.geometry.spec, pages, start, end, start, rank.geometry.slot_pitch)
        key = (msg.request_id, rank.id)
        self._refuse_finished(msg.request_id, rank.id)
        entry = self.sources.get(key)
        if entry is None:
            self._check_capacity()
            if sum(len(e.chunks) for e in self.sources.values()) >= self.cfg.limits.max_pending_chunks:
                raise RequestError("too many chunks are held", field="request_id", code="busy",
                                   fix="retry later, or raise limits.max_pending_chunks")
            entry = self.sources[key] = SrcEntry(msg.request_id, rank.id, rank.coords)
            route = self._routes_for(msg.request_id, rank.instance)
            if route is not None:
                entry.bind(*route)
        elif entry.closed:
            # failed but still draining its chunks in flight: say why, as for a request already ended
            why = f"failed ({entry.failure[0]}: {entry.failure[1]})" if entry.failure else entry.state
            raise RequestError(f"request {msg.request_id!r} is {why}", field="request_id",
                               code="request_finished", fix="start a new request")
        entry.add_chunk(Chunk(start, end, msg.last, chunk_slots, msg.aux))
        self._pump(entry)
        self._check_src(entry)
        return {"ok": True, "state": entry.state}

    def _routes_for(self, request_id: str, instance: str) -> tuple[Plan, str, Route] | None:
        """The plan learnt for this request from any expect, also after other ranks finished.

        A rank the plan gives nothing to write (a replica) may send after the ranks that do
        write have already completed; it still needs the plan to finish.
        """
        return self.request_routes.get((request_id, instance))

    def _on_expect(self, request_id: str, prefill: str, decode: str, dst: tuple[int, int], plan: Plan,
                   route: Route, dst_pages: Any = None, start: int = 0) -> None:
        dest = plan.destination(*dst)
        self.request_routes[(request_id, prefill)] = (plan, decode, route)
        self.request_routes.move_to_end((request_id, prefill))
        while len(self.request_routes) > 2 * self.cfg.limits.max_inflight_requests:
            self.request_routes.popitem(last=False)
        for w in dest.writers:
            rid = rank_id(prefill, *w.src)
            key = (request_id, rid)
            entry = self.sources.get(key)
            if entry is None:
                if key in self.finished:
                    self._late_expect(request_id, route, self.finished[key])
                    continue
                entry = self.sources[key] = SrcEntry(request_id, rid, w.src)
            if entry.closed:
                if entry.failure is not None:
                    self._late_expect(request_id, route, {"state": "failed", "code": entry.failure[0],
                                                          "reason": entry.failure[1]})
                continue
            entry.bind(plan, decode, route)
            entry.targets.setdefault(dst, Target(dst, w, dst_pages=dst_pages, start=start))
            self._pump(entry)
        # ranks that write nothing of this request learn the plan too, so they can finish
        for (req, rid), entry in list(self.sources.items()):
            if req == request_id and entry.plan is None and rid.startswith(prefill + "/"):
                entry.bind(plan, decode, route)
                self._pump(entry)
            if req == request_id:
                self._check_src(entry)

    def _late_expect(self, request_id: str, route: Route, record: dict[str, Any]) -> None:
        """An expect for a request this side already ended: a failure must reach the decode side,
        which would otherwise wait for bytes until its own phase timeout."""
        if record.get("state") == "failed":
            self._propagate_abort_downstream(request_id, route, str(record.get("code") or "failed"),
                                             str(record.get("reason") or "request failed on the prefill side"))

    def _pump(self, entry: SrcEntry) -> None:
        if entry.closed or entry.plan is None or entry.route is None:
            return
        rank = self.registry.get(entry.rid)
        if rank is None:
            return
        for target in entry.targets.values():
            for idx, chunk in enumerate(entry.chunks):
                if idx in target.scheduled:
                    continue
                target.scheduled.add(idx)
                start, chunk_slots = chunk.start, chunk.slots
                if target.start > chunk.start:  # the decode side holds a prefix already: only the rest moves
                    if chunk.end <= target.start:
                        if chunk.last:
                            self._fail_src(entry, "request", f"the last chunk ends at token {chunk.end}, at or "
                                                              f"before token {target.start} where the decode side "
                                                              "starts; nothing is left to move")
                            return
                        target.acked.add(idx)  # nothing of it is wanted: done without a byte moved
                        continue
                    start = target.start
                    chunk_slots = clip_slots(chunk_slots, rank.geometry.spec, chunk.start, start)
                job = ChunkJob(entry.request_id, entry.decode_instance or "", target.dst, rank, target.writer,
                               start, chunk.end, chunk.last, chunk.aux, chunk_slots, entry.plan.mode,
                               entry.route.data_address, entry.route.token,
                               dst_pages=target.dst_pages, remote=entry.route.nixl)
                kind = entry.route.kind
                transport = self.local if kind == "local" else self.nixl.transport if kind == "nixl" else self.tcp
                entry.inflight += 1
                if entry.state == "waiting_for_input":
                    entry.state = "transferring"
                    entry.phase_since = time.monotonic()
                queued = time.monotonic()
                fut = self.executor.submit(self._run_job, transport, job, queued)
                fut.add_done_callback(lambda f, e=entry, t=target, i=idx, tr=transport.name:
                                      self._job_finished_threadsafe(e, t, i, tr, f))

    def _run_job(self, transport: Any, job: ChunkJob, queued: float) -> tuple[Moved, float]:
        started = time.monotonic()
        self.metrics.phase_latency.labels("queue").observe(started - queued)
        moved = transport.send(job)
        return moved, time.monotonic() - started

    def _job_finished_threadsafe(self, entry: SrcEntry, target: Target, idx: int, transport: str, fut: Any) -> None:
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._job_finished, entry, target, idx, transport, fut)

    def _job_finished(self, entry: SrcEntry, target: Target, idx: int, transport: str, fut: Any) -> None:
        entry.inflight -= 1
        exc = fut.exception() if not fut.cancelled() else TransferError("job cancelled at shutdown")
        if exc is None:
            moved, seconds = fut.result()
            target.acked.add(idx)
            entry.bytes_sent += moved.nbytes
            self.metrics.bytes_sent.labels(transport, moved.mode).inc(moved.nbytes)
            self.metrics.chunks.labels(transport, moved.mode).inc()
            self.metrics.chunk_bytes.observe(moved.nbytes)
            self.metrics.fragments.observe(moved.fragments)
            self.metrics.phase_latency.labels("chunk").observe(seconds)
            if transport == "local":
                self.metrics.bytes_received.labels("local").inc(moved.nbytes)
        elif entry.failure is None:
            code = exc.code if isinstance(exc, KvxferError) else "transfer"
            log.warning("event=chunk_failed request=%s rank=%s dst=%s code=%s msg=%s", q(entry.request_id),
                        entry.rid, list(target.dst), code, q(str(exc)[:300]))
            self._fail_src(entry, code, f"chunk [{entry.chunks[idx].start}, {entry.chunks[idx].end}) to "
                                        f"{list(target.dst)} failed: {exc}")
        self._check_src(entry)

    def _check_src(self, entry: SrcEntry) -> None:
        if entry.failure is not None:
            if entry.inflight == 0 and entry.state != "failed":
                self._finalize_src(entry, "failed")
            return
        if entry.state not in TERMINAL and entry.complete():
            entry.closed = True
            self._finalize_src(entry, "done")

    def _fail_src(self, entry: SrcEntry, code: str, message: str, propagate: bool = True) -> None:
        if entry.state in TERMINAL or entry.failure is not None:
            return
        entry.closed = True
        entry.failure = (code, message)
        if propagate and entry.route is not None:
            self._propagate_abort_downstream(entry.request_id, entry.route, code, message)
        self._check_src(entry)

    def _finalize_src(self, entry: SrcEntry, state: str) -> None:
        entry.state = state
        self.sources.pop((entry.request_id, entry.rid), None)
        self._answer_fences(entry.request_id)
        mode = entry.plan.mode if entry.plan else "none"
        transport = entry.route.kind if entry.route else "none"
        self.metrics.transfers.labels("prefill", state, mode, transport).inc()
        record: dict[str, Any] = {"state": state, "bytes": entry.bytes_sent}
        if state == "failed":
            code, message = entry.failure or ("unknown", "")
            record.update(code=code, reason=message)
            self._record_failure("prefill", entry.request_id, entry.rid, code, message)
        self._remember(entry.request_id, entry.rid, record)
        rank = self.registry.get(entry.rid)
        if rank is not None:
            self._send_engine(rank.identity, messages.Event.of(entry.rid, entry.request_id, record).to_wire())

    def _propagate_abort_downstream(self, request_id: str, route: Route, code: str, message: str) -> None:
        if route.kind == "local":
            for entry in self.inbox.for_request(request_id):
                self._fail_dest(entry, code, message, propagate=False)
        elif route.identity is not None and self.peer_sock is not None:
            self._send_peer(route.identity, messages.PeerAbort.of(request_id, code, message).to_wire())

    def _abort_sources(self, request_id: str, code: str, message: str) -> None:
        for (req, _rid), entry in list(self.sources.items()):
            if req == request_id:
                self._fail_src(entry, code, message, propagate=False)

    def _abort_from_engine(self, rank: Rank, request_id: str, reason: str) -> dict[str, Any]:
        if rank.role == "decode":
            entry = self.inbox.get(request_id, rank.id)
            if entry is not None:
                self._fail_dest(entry, "aborted", reason)
                return {"ok": True, "state": "failed"}
        else:
            src = self.sources.get((request_id, rank.id))
            if src is not None:
                self._fail_src(src, "aborted", reason)
                return {"ok": True, "state": "failed"}
        done = self.finished.get((request_id, rank.id))
        if done is not None:
            return {"ok": True, "state": done["state"]}
        raise RequestError(f"unknown request {request_id!r} at {rank.id}", field="request_id",
                           fix="abort a request this rank expected or sent")

    # -- peer endpoint (this daemon as the prefill side) --------------------------------
    async def _peer_loop(self) -> None:
        assert self.peer_sock is not None
        while True:
            frames = await self.peer_sock.recv_multipart(copy=True)
            identity, payload = frames[0], frames[-1]
            seq = None
            try:
                raw = protocol.decode(payload, self.cfg.limits.max_message_bytes)
                seq = raw.get("seq") if isinstance(raw.get("seq"), int) else None
                answer = self._peer_op(identity, messages.parse_peer(raw))
                reply = answer.to_wire() if answer is not None else None
            except PlanRefusal as refusal:
                self.metrics.refusals.labels(refusal.field or "unknown").inc()
                self.metrics.handshakes.labels("refused").inc()
                log.warning("event=handshake_refused field=%s msg=%s", refusal.field, q(str(refusal)[:300]))
                reply = messages.HandshakeRefused(refusal.to_wire()).to_wire()
            except KvxferError as exc:
                self.metrics.invalid_messages.labels("peer").inc()
                reply = messages.PeerError(exc.to_wire()).to_wire()
            except Exception as exc:  # noqa: BLE001
                log.exception("event=peer_handler_crash")
                reply = messages.PeerError({"code": "internal", "message": repr(exc)[:300]}).to_wire()
            if reply is not None:
                if seq is not None:
                    reply["seq"] = seq
                self._send_peer(identity, reply)

    def _send_peer(self, identity: bytes, message: dict[str, Any]) -> None:
        assert self.peer_sock is not None
        fut = self.peer_sock.send_multipart([identity, protocol.encode(message)])
        if isinstance(fut, asyncio.Future):
            fut.add_done_callback(_ignore)

    def _peer_op(self, identity: bytes, msg: Any) -> messages.Message | None:
        op = msg.op
        peer = self.downstream.get(identity)
        if peer is not None:
            peer.last_seen = time.monotonic()
        if op in ("ping", "handshake") and msg.incarnation:
            self._downstream_incarnation(identity, msg.daemon, msg.incarnation)
        if op == "ping":
            if peer is None:
                self.downstream[identity] = DownstreamPeer(identity, msg.daemon, (msg.incarnation or ""))
                self._count_peers()
            return messages.Pong(self.address, self.incarnation)
        if op == "handshake":
            return self._peer_handshake(identity, msg)
        if op == "expect":
            found = self.src_plans.get((msg.prefill_instance, msg.decode_instance))
            if found is None or found[1].identity != identity:
                return messages.PeerError.about(msg.request_id, "no_handshake", "no handshake for this instance "
                                                "pair; handshake again", incarnation=self.incarnation)
            plan, route = found
            bound = self.request_routes.get((msg.request_id, msg.prefill_instance))
            if bound is not None and (bound[1] != msg.decode_instance or bound[2].identity != identity):
                # first binding wins: a second decode side may not take over a request's bytes
                return messages.PeerError.about(msg.request_id, "request_bound",
                                                f"request {msg.request_id!r} is already bound to decode "
                                                f"instance {bound[1]!r} on another peer link", "request_id")
            dst = msg.dst
            if not (dst[0] < plan.decode.tp_size and dst[1] < plan.decode.pp_size):
                raise ProtocolError(f"dst {list(dst)} is outside the decode instance's tp x pp",
                                    field="dst", fix="send a rank of the decode instance")
            start = (msg.start or 0)
            if msg.num_tokens and start >= msg.num_tokens:
                raise ProtocolError(f"start {start} is not below num_tokens {msg.num_tokens}", field="start",
                                    fix="send a start below the request's length")
            if self.draining and not any(req == msg.request_id for req, _rid in self.sources):
                # a request whose chunks this daemon already holds is in flight: let it finish
                return messages.PeerError.about(msg.request_id, "draining", "source daemon is draining")
            if (self._active_count() >= self.cfg.limits.max_inflight_requests
                    and not any(req == msg.request_id for req, _rid in self.sources)):
                return messages.PeerError.about(msg.request_id, "busy", f"source daemon holds "
                                                f"{self.cfg.limits.max_inflight_requests} requests in flight")
            dst_pages = None
            if route.kind == "nixl":  # one-sided writes need the destination page table
                try:
                    dst_pages = self.nixl.expect_pages(route.nixl, dst, msg.extra)
                except KvxferError as exc:
                    return messages.PeerError(exc.to_wire(), msg.request_id)
            self._on_expect(msg.request_id, msg.prefill_instance, msg.decode_instance, dst, plan, route,
                            dst_pages, start)
            return None
        if op == "abort":
            # a decode daemon may abort the requests routed to it, and those not routed anywhere yet
            for (req, _rid), entry in list(self.sources.items()):
                if req == msg.request_id and (entry.route is None or entry.route.identity == identity):
                    self._fail_src(entry, msg.code or "peer_aborted", msg.reason, propagate=False)
            return None
        if op == "fence":
            request_id = msg.request_id
            for (req, _rid), entry in list(self.sources.items()):
                if req == request_id and entry.route is not None and entry.route.identity == identity:
                    self._fail_src(entry, "peer_aborted", "the decode daemon failed the request", propagate=False)
            if self._writing(request_id, identity):
                waiters = self.fence_waiters.setdefault(request_id, set())
                waiters.add(identity)
                return None
            return messages.Fenced(request_id)
        return None

    def _writing(self, request_id: str, identity: bytes) -> bool:
        """Whether a chunk job of the request towards that decode daemon has not returned yet."""
        return any(req == request_id and entry.inflight and entry.route is not None
                   and entry.route.identity == identity for (req, _rid), entry in self.sources.items())

    def _answer_fences(self, request_id: str) -> None:
        waiters = self.fence_waiters.get(request_id)
        if not waiters:
            return
        for identity in list(waiters):
            if not self._writing(request_id, identity):
                waiters.discard(identity)
                if self.peer_sock is not None:
                    self._send_peer(identity, messages.Fenced(request_id).to_wire())
        if not waiters:
            del self.fence_waiters[request_id]

    def _peer_handshake(self, identity: bytes, msg: messages.Handshake) -> messages.Message:
        protocol.check_version(msg.v)
        prefill = msg.prefill_instance
        spec = self.registry.spec(prefill, "prefill")
        if spec is None:
            return messages.HandshakeRetry(f"instance {prefill!r} has no registered prefill rank")
        try:
            decode_spec = InstanceSpec.from_dict(bounded_geometry(msg.decode_spec, "decode_spec"))
        except KvxferError as exc:
            raise PlanRefusal(f"decode geometry is invalid: {exc}", field=exc.field or "geometry")
        existing = self.src_plans.get((prefill, msg.decode_instance))
        if existing is not None and existing[1].identity != identity and existing[1].identity in self.downstream:
            # the pair is bound to another live link; a restarted decode daemon gets in once
            # the old link misses its heartbeats, a stranger replaying a handshake never does
            return messages.HandshakeRetry(f"decode instance {msg.decode_instance!r} is bound to another live "
                                           "peer link")
        mode = msg.mode if msg.mode != "auto" else self.cfg.peer.mode
        transport, nixl_peer = self.nixl.choose(msg.to_wire(), decode_spec, mode)
        if nixl_peer is not None and nixl_peer.credits is None and mode == "auto":
            mode = "direct"  # no landing ring to stage into: NIXL writes the head slices one by one
        plan = make_plan(spec, decode_spec, mode=mode,
                         decode_tensors=msg.decode_tensors is not False,
                         require_same_page_size=self.cfg.peer.require_same_page_size)
        host, port = split_address(msg.data_address)
        route = Route(transport, (host, port), identity, msg.daemon, msg.data_token, nixl=nixl_peer)
        self.src_plans[(prefill, msg.decode_instance)] = (plan, route)
        if identity not in self.downstream:
            self.downstream[identity] = DownstreamPeer(identity, msg.daemon, (msg.incarnation or ""))
            self._count_peers()
        self.metrics.handshakes.labels("ok").inc()
        log.info("event=handshake_accepted peer=%s prefill=%s decode=%s mode=%s transport=%s", msg.daemon,
                 prefill, msg.decode_instance, plan.mode, transport)
        return messages.HandshakeOk(spec.to_dict(), plan.mode, self.incarnation, self.nixl.answer(transport))

    def peer_seen(self, link: PeerLink) -> None:
        link.last_seen = time.monotonic()
        if link.state != "up":
            if link.state == "down":
                log.info("event=peer_back peer=%s", link.address)
            link.state = "up"
            self._count_peers()

    def _on_received_threadsafe(self, sink: Sink, moved: Moved) -> None:
        self.metrics.bytes_received.labels("tcp").inc(moved.nbytes)

    def _nixl_refused_threadsafe(self, entry: DestEntry, code: str, message: str) -> None:
        """A NIXL chunk notification failed the inbox checks: fail that request (from the NIXL thread)."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._fail_dest, entry, code, message)

    # -- timers ----------------------------------------------------------------------
    async def _heartbeats(self) -> None:
        interval = self.cfg.peer.heartbeat_interval_s
        timeout = self.cfg.peer.peer_timeout_s
        while True:
            now = time.monotonic()
            for link in list(self.links.values()):
                link.send(messages.PeerPing(self.address, self.incarnation))
                if link.state == "up" and now - link.last_seen > timeout:
                    self._link_down(link, now - link.last_seen)
                elif link.state == "connecting" and now - link.last_seen > timeout:
                    link.state = "down"
                    self._count_peers()
                if link.state == "down" and not any(e.source_address == link.address for e in self.inbox.all()):
                    # nothing waits on it: without this every address an engine ever named keeps a socket
                    link.close()
                    self.links.pop(link.address, None)
                    self.nixl.forget_source(link.address)
                    self._count_peers()
            for identity, peer in list(self.downstream.items()):
                if now - peer.last_seen > timeout:
                    self._downstream_down(peer, now - peer.last_seen)
            await asyncio.sleep(interval)

    async def _watchdog(self) -> None:
        """``WATCHDOG=1`` every WatchdogSec/2 while the loop runs (own timer: heartbeats may be slower)."""
        interval = sdnotify.watchdog_interval()
        while interval:
            sdnotify.notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    def _link_down(self, link: PeerLink, silent_for: float) -> None:
        link.state = "down"
        link.plans.clear()
        self.metrics.heartbeat_misses.inc()
        self._count_peers()
        log.warning("event=peer_unresponsive peer=%s silent_s=%.1f", link.address, silent_for)
        self.nixl.source_down(link.address)  # its landing ring: no new blocks, memory quarantined
        for entry in self.inbox.all():
            if entry.fence_until and entry.source_address == link.address:
                self._fence_done(entry, f"source daemon {link.address} unresponsive")
            if entry.transport in ("tcp", "nixl") and entry.state not in TERMINAL:
                if entry.source_address == link.address:
                    self._fail_dest(entry, "peer_dead",
                                    f"source daemon {link.address} unresponsive for {silent_for:.1f}s",
                                    propagate=False)

    def _downstream_down(self, peer: DownstreamPeer, silent_for: float) -> None:
        self.metrics.heartbeat_misses.inc()
        log.warning("event=peer_unresponsive peer=%s silent_s=%.1f side=decode", peer.daemon, silent_for)
        self._drop_downstream(peer, "peer_dead", f"decode daemon {peer.daemon} unresponsive for {silent_for:.1f}s")

    def _drop_downstream(self, peer: DownstreamPeer, code: str, why: str) -> None:
        """Forget a decode daemon's link: its plans, NIXL agent, data connections; fail its requests."""
        self.downstream.pop(peer.identity, None)
        self._count_peers()
        for key, (plan, route) in list(self.src_plans.items()):
            if route.identity == peer.identity:
                del self.src_plans[key]
                if route.nixl is not None:  # NIXL WRITEs in flight to it stop waiting for their completion
                    route.nixl.dead = why
                    self.nixl.forget_peer(route.nixl.agent)
                if route.data_address is not None:
                    self.tcp.forget(route.data_address)
        for key, (_plan, _decode, route) in list(self.request_routes.items()):
            if route.identity == peer.identity:
                del self.request_routes[key]
        for request_id, waiters in list(self.fence_waiters.items()):
            waiters.discard(peer.identity)
            if not waiters:
                del self.fence_waiters[request_id]
        for entry in list(self.sources.values()):
            if entry.route is not None and entry.route.identity == peer.identity:
                self._fail_src(entry, code, why, propagate=False)

    # -- incarnations: a restarted peer is a new one ------------------------------------
    def _note_incarnation(self, link: PeerLink, incarnation: Any) -> bool:
        """Decode side: a message of the source daemon named its incarnation; True if it changed."""
        if not isinstance(incarnation, str) or not incarnation or len(incarnation) > 64:
            return False
        old, link.peer_incarnation = link.peer_incarnation, incarnation
        if not old or old == incarnation:
            return False
        self.metrics.peer_restarts.labels("prefill").inc()
        log.warning("event=peer_restarted peer=%s side=prefill old=%s new=%s", link.address, old, incarnation)
        link.plans.clear()  # its handshakes went with it; the next request handshakes again
        self.nixl.source_down(link.address)  # the landing ring it knew: retired (quarantined, then freed)
        self.nixl.forget_source(link.address)  # and its agent, once nothing can be in flight
        why = (f"source daemon {link.address} restarted (incarnation {old} -> {incarnation}); "
               "the request's source side went with the old process")
        for entry in self.inbox.all():
            # an entry still bootstrapping has told the old process nothing: its handshake goes to the new one
            if entry.source_address == link.address and entry.failure is None and entry.state != "bootstrapping":
                self._fail_dest(entry, "peer_restarted", why, propagate=False)
        return True

    def _handshake_again(self, link: PeerLink, request_id: str) -> None:
        """The source answered an expect with no_handshake (it restarted, or forgot the pair): handshake
        again and send the expect anew, once per request, while nothing of it has arrived yet."""
        for entry in self.inbox.for_request(request_id):
            if (entry.source_address == link.address and entry.failure is None and entry.rehandshakes == 0
                    and entry.state == "waiting_for_input" and entry.bytes_received == 0):
                entry.rehandshakes += 1
                entry.state = "bootstrapping"
                entry.phase_since = time.monotonic()
                log.info("event=handshake_again peer=%s request=%s rank=%s", link.address, q(request_id),
                         entry.rank.id)
                asyncio.ensure_future(self._bootstrap(entry, link.address))

    def _downstream_incarnation(self, identity: bytes, daemon: str, incarnation: str) -> None:
        """Prefill side: a decode daemon named its incarnation on a ping or handshake. Another link of
        the same daemon address with another incarnation belongs to a process that is gone, once
        ZeroMQ has seen its connection close (a live link is never taken over by a stranger's claim)."""
        peer = self.downstream.get(identity)
        if peer is not None and not peer.incarnation:
            peer.incarnation = incarnation
        for other in list(self.downstream.values()):
            if (other.identity != identity and other.daemon == daemon and other.incarnation
                    and other.incarnation != incarnation and self._identity_gone(other.identity)):
                self.metrics.peer_restarts.labels("decode").inc()
                log.warning("event=peer_restarted peer=%s side=decode old=%s new=%s", daemon, other.incarnation,
                            incarnation)
                self._drop_downstream(other, "peer_restarted",
                                      f"decode daemon {daemon} restarted (incarnation {other.incarnation} -> "
                                      f"{incarnation}); the request's decode side went with the old process")

    def _identity_gone(self, identity: bytes) -> bool:
        """Whether the peer socket has no connection with this routing id any more (ROUTER_MANDATORY probe)."""
        if self.peer_sock is None:
            return False
        probe = zmq.Socket.shadow(self.peer_sock.underlying)
        probe.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            pong = messages.Pong(self.address, self.incarnation).to_wire()
            probe.send_multipart([identity, protocol.encode(pong)], flags=zmq.NOBLOCK)
            return False
        except zmq.ZMQError as exc:
            return exc.errno == zmq.EHOSTUNREACH
        finally:
            probe.setsockopt(zmq.ROUTER_MANDATORY, 0)

    async def _sweeper(self) -> None:
        t = self.cfg.timeouts
        limits = {"bootstrapping": t.bootstrap_s, "waiting_for_input": t.waiting_for_input_s,
                  "transferring": t.transfer_s}
        last_liveness = 0.0
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            liveness = now - last_liveness >= 0.5
            if liveness:
                last_liveness = now
            # one call per tick: its loop variables die with it, so none of them keeps a dropped
            # rank (and through it the engine's memory mapping) alive between ticks
            self._sweep(now, limits, liveness)

    def _sweep(self, now: float, limits: dict[str, float], liveness: bool) -> None:
        if liveness:
            for rank in self.registry:
                if rank.process is not None and not rank.process.alive():
                    log.warning("event=engine_gone rank=%s pid=%d", rank.id, rank.process.pid)
                    self._drop_rank(rank, f"engine process {rank.process.pid} of rank {rank.id} exited")
        for entry in self.inbox.all():
            if entry.fence_until and now > entry.fence_until:
                self._fence_done(entry, f"no fenced answer from the source within {self.cfg.timeouts.fence_s}s; "
                                        "a WRITE still in flight may land in the request's pages")
            limit = limits.get(entry.state)
            if limit is not None and entry.failure is None and now - entry.phase_since > limit:
                self._fail_dest(entry, f"{entry.state}_timeout",
                                f"request spent more than {limit}s in state {entry.state}")
        for entry in list(self.sources.values()):
            limit = limits.get(entry.state)
            if limit is not None and entry.failure is None and now - entry.phase_since > limit:
                self._fail_src(entry, f"{entry.state}_timeout",
                               f"request spent more than {limit}s in state {entry.state}")

    # -- bookkeeping -----------------------------------------------------------------
    def _remember(self, request_id: str, rid: str, record: dict[str, Any]) -> None:
        self.finished[(request_id, rid)] = record
        while len(self.finished) > self.cfg.limits.max_inflight_requests:
            self.finished.popitem(last=False)

    def _record_failure(self, side: str, request_id: str, rid: str, code: str, message: str) -> None:
        self.metrics.failures.labels(side, code[:48]).inc()
        log.info("event=request_failed side=%s request=%s rank=%s code=%s reason=%s", side, q(request_id), rid,
                 code, q(message[:300]))
        self.recent_failures.append({"time": time.time(), "side": side, "request_id": request_id,
                                     "rank_id": rid, "code": code, "reason": message[:500]})
        del self.recent_failures[:-self.cfg.limits.recent_failures]

    def _poll(self, rank: Rank, request_id: str) -> dict[str, Any]:
        if rank.role == "decode":
            entry = self.inbox.get(request_id, rank.id)
            if entry is not None:
                return {"state": entry.state}
        else:
            src = self.sources.get((request_id, rank.id))
            if src is not None:
                return {"state": src.state}
        done = self.finished.get((request_id, rank.id))
        if done is not None:
            return dict(done)
        if rank.role == "prefill" and self._routes_for(request_id, rank.instance) is not None:
            # the decode side's expect reached this daemon: the rank may send, whether or not the
            # plan gives it anything to write (a head replica) and before it sent anything
            return {"state": "waiting_for_input"}
        raise RequestError(f"unknown request {request_id!r} at {rank.id}", field="request_id",
                           fix="poll a request this rank expected or sent")

    def _state_counts(self) -> dict[tuple[str, str], int]:
        """Requests per (side, state), counted when Prometheus asks (from its thread) and reused for
        the other label values of the same scrape. Counting on every state change instead made
        the control loop's work grow with the number of requests in flight."""
        now = time.monotonic()
        cached = self._states_cache
        if cached is not None and now - cached[0] < 0.05:
            return cached[1]
        counts = {("decode", s): 0 for s in STATES} | {("prefill", s): 0 for s in STATES}
        for entry in self.inbox.all():
            if entry.state in STATES:
                counts[("decode", entry.state)] += 1
        for src in list(self.sources.values()):  # one C-level copy: safe against the loop's changes
            if src.state in STATES:
                counts[("prefill", src.state)] += 1
        self._states_cache = (now, counts)
        return counts

    def _count_peers(self) -> None:
        counts = {"up": 0, "down": 0, "connecting": 0}
        for link in self.links.values():
            counts[link.state] = counts.get(link.state, 0) + 1
        counts["up"] += len(self.downstream)
        for state, n in counts.items():
            self.metrics.peers.labels(state).set(n)

    def status(self) -> dict[str, Any]:
        by_state: dict[str, int] = {}
        for entry in self.inbox.all():
            by_state[f"decode:{entry.state}"] = by_state.get(f"decode:{entry.state}", 0) + 1
        for src in self.sources.values():
            by_state[f"prefill:{src.state}"] = by_state.get(f"prefill:{src.state}", 0) + 1
        metrics_url = ""
        if self.ops is not None:
            host = self.cfg.metrics.bind.rpartition(":")[0] or "127.0.0.1"
            metrics_url = f"http://{host}:{self.ops.port}/metrics"
        return {
            "version": __version__, "protocol": PROTOCOL_VERSION, "pid": os.getpid(), "incarnation": self.incarnation,
            "name": self.cfg.daemon.instance_name or socket.gethostname(),
            "uptime_s": round(time.time() - self.started, 3), "ready": self.ready, "draining": self.draining,
            "engine_endpoint": f"ipc://{self.cfg.socket_path}", "peer_endpoint": f"tcp://{self.address}",
            "data_endpoint": self.data_address, "metrics_url": metrics_url,
            "ranks": [r.describe() for r in self.registry],
            "peers": [{"address": l.address, "state": l.state, "side": "prefill",
                       "last_seen_s": round(time.monotonic() - l.last_seen, 3), "auth_error": l.auth_error,
                       "incarnation": l.peer_incarnation,
                       "plans": sorted(f"{p}->{d}" for p, d in l.plans)} for l in self.links.values()]
                     + [{"address": p.daemon, "state": "up", "side": "decode", "incarnation": p.incarnation,
                         "last_seen_s": round(time.monotonic() - p.last_seen, 3)} for p in self.downstream.values()],
            "requests": by_state,
            "recent_failures": list(self.recent_failures),
            "auth": {"refused_here": self.auth_refusals.describe(), "refused_by_peers": self.auth_refused_by.describe()},
            "transports": self.nixl.describe(),
        }


def run(cfg: Config) -> int:
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run

    async def main() -> None:
        daemon = Daemon(cfg)
        await daemon.run()

    runner(main())
    return 0

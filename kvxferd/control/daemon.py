"""The daemon: the app that wires the lifecycle core to its shells and drains them.

Control runs on one asyncio loop (uvloop when installed). The lifecycle core
(:mod:`kvxferd.lifecycle`) holds every request and decides; the shells do the I/O: the
engine endpoint (:mod:`.engine_endpoint`), the decode side's links to source daemons
(:mod:`.decode_links`), the prefill side's endpoint serving decode daemons
(:mod:`.prefill_endpoint`), the rendezvous (:mod:`.rendezvous`), the data plane's threads
(:mod:`kvxferd.transport.dataplane`, :mod:`kvxferd.transport`) and timers (:mod:`.timers`).
Each shell is handed the parts it works with, never the daemon. Every shell turns what it
hears into an event for :meth:`Daemon.dispatch`, which applies it to the core and carries
out the effects the core returns. State is only changed on the loop, except the inbox's
chunk accounting, which data threads do under its lock.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import time
from typing import Any

import zmq
import zmq.asyncio

from .. import PROTOCOL_VERSION, __version__
from ..datapath import runcopy
from ..datapath.integrity import LandedCheck
from ..datapath.regions import MemoryMapper
from ..datapath.staging import StagingPool
from ..directory.holders import Directory
from ..lifecycle import effects, events, states
from ..lifecycle.core import Lifecycle
from ..lifecycle.inbox import Inbox
from ..lifecycle.registry import Rank, Registry
from ..model import sampling
from ..model.qos import QosPolicy
from ..ops import sdnotify
from ..ops.config import LOCAL_MODE_NOTE, Config, transport_preference
from ..ops.hops import TRACE
from ..ops.httpserver import OpsServer
from ..ops.logutil import q
from ..ops.metrics import Metrics
from ..transport.choices import PairTransport
from ..transport.dataplane import DataPlane
from ..transport.hub import Transports
from ..transport.tcp import TcpDataServer
from ..transport.tcp_guard import Deadlines
from ..wire import auth
from . import request_counts, timers
from .advertised import Advertised
from .binding import binding
from .claim_confirm import ClaimConfirmer
from .decode_links import DecodeLinks
from .engine_endpoint import EngineEndpoint
from .prefill_endpoint import PrefillEndpoint
from .rendezvous import Rendezvous

log = logging.getLogger("kvxferd.daemon")


class Daemon:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.metrics = Metrics()
        self.keys = auth.read_keypair(cfg.auth.secret_key_file) if cfg.auth.enabled else None
        self.peer_keys = auth.parse_peer_keys(cfg.auth.peer_keys) if cfg.auth.enabled else {}
        self.authenticator: Any = None
        self.auth_refusals = auth.RefusalBook()  # peers this daemon's ZAP handler refused
        self.auth_refused_by = auth.RefusalBook()  # peers that refused this daemon
        self.registry = Registry(cfg.limits.max_ranks)
        self.mapper = MemoryMapper(cfg.engine.shm_dirs, cfg.integrity.device_digest_on_cpu,
                                   allow_named_files=cfg.engine.allow_named_files)
        self.started = time.time()
        self.me = Advertised(cfg.advertise_host, cfg.peer.control_port, cfg.peer.data_port)
        self.ready = False
        self.draining = False
        self._hurry = False
        self._stop: asyncio.Event | None = None  # created in run(), on the daemon's loop
        self.ctx = zmq.asyncio.Context()
        TRACE.configure(cfg.daemon.hop_trace)
        self.data = DataPlane(cfg.daemon.data_threads, self.metrics, self.dispatch, cfg.daemon.data_batch_chunks,
                              qos=cfg.qos.enabled, bulk_floor=cfg.qos.bulk_floor,
                              latency_threads=cfg.qos.latency_threads, bulk_nice=cfg.qos.bulk_nice)
        self.inbox = Inbox(self.data.dest_changed, check=LandedCheck(self.metrics, cfg.integrity.corrupt_landed_every,
                                                                     cfg.integrity.corrupt_header),
                           on_refused=self.data.chunk_refused)
        self.staging = StagingPool(cfg.limits.staging_bytes, cfg.limits.staging_slot_bytes,
                                   self._staging_changed, self.metrics.staging_waits.inc)
        self.transports = Transports(
            self.inbox, self.staging, daemon_name=cfg.daemon.instance_name or socket.gethostname(),
            preference=transport_preference(cfg.peer), timeout_s=cfg.timeouts.transfer_s,
            max_header_bytes=cfg.limits.max_message_bytes, max_pages=cfg.limits.max_pages_per_request,
            # the latency lane's threads keep a pooled connection of their own: a latency chunk sent
            # while bulk chunks hold the others does not pay a new connection and its proof
            data_connections=cfg.peer.data_connections + (cfg.qos.latency_threads if cfg.qos.enabled else 0),
            landing_slots=cfg.limits.nixl_landing_slots,
            landing_bytes=cfg.limits.nixl_landing_bytes, in_place_bytes=cfg.limits.nixl_in_place_bytes,
            nixl_block_bytes=cfg.limits.nixl_block_bytes,
            bulk_block_bytes=cfg.qos.bulk_block_bytes if cfg.qos.enabled else 0, qos_lanes=cfg.qos.enabled,
            bulk_nice=cfg.qos.bulk_nice if cfg.qos.enabled and cfg.qos.latency_threads else 0,
            on_received=lambda kind, sink, moved: self.metrics.bytes_received.labels(kind).inc(moved.nbytes),
            on_refused=self.data.chunk_refused,
            on_invalid=lambda code: self.metrics.invalid_messages.labels("data").inc(),
            on_fallback=self._transport_fallback, nixl_engine_memory=cfg.peer.nixl_engine_memory,
            on_nixl_registered=lambda memory, nbytes: self.metrics.nixl_registered.labels(memory).set(nbytes),
            on_nixl_refused=lambda reason: self.metrics.nixl_refusals.labels(reason).inc())
        self.life = Lifecycle(cfg.limits, cfg.timeouts, self.registry, self.inbox, self.metrics,
                              one_sided=lambda kind: getattr(self.transports.find(kind), "one_sided", False),
                              wall_clock=time.time,
                              peer=cfg.peer,
                              remote_ranks=lambda instance: {c: h.daemon for c, h in self.directory.remote(
                                  instance, "prefill", time.monotonic()).items()},
                              integrity=sampling.Policy(cfg.integrity.mode,
                                                        sampling.period_of(cfg.integrity.sample_share)),
                              qos=QosPolicy.parse(cfg.qos.default_class, cfg.qos.instances))
        #: the ranks other daemons announced to this one (or it read from etcd), by instance
        self.directory = Directory("", cfg.peer.peer_timeout_s, cfg.limits.max_ranks)
        self.decode_links = DecodeLinks(
            cfg, self.ctx, self.me, keys=self.keys, peer_keys=self.peer_keys, refused_by=self.auth_refused_by,
            metrics=self.metrics, dispatch=self.dispatch, transports=self.transports, inbox=self.inbox,
            handshakes=self.life.handshakes, book=self.life.source_daemons, peers_changed=self.count_peers,
            held_ranks=lambda instance: [list(r.coords) for r in self.registry
                                         if r.instance == instance and r.role == "decode"])
        self.rendezvous = Rendezvous(cfg, self.me, self.registry, self.directory, self.decode_links.ask, self.metrics)
        self.prefill_endpoint = PrefillEndpoint(
            cfg, self.me, metrics=self.metrics, dispatch=self.dispatch, life=self.life, registry=self.registry,
            rendezvous=self.rendezvous, transports=self.transports, draining=lambda: self.draining,
            peers_changed=self.count_peers, owns_token=self.decode_links.owns_token,
            # auth off: a claimed decode daemon address is called back; auth on: keys say what they speak for
            confirmer=(ClaimConfirmer(self.ctx, self.me, cfg.peer.peer_timeout_s, cfg.limits.max_message_bytes)
                       if not cfg.auth.enabled and cfg.peer.confirm_claims else None),
            key_claims=auth.parse_key_claims(cfg.auth.key_claims, cfg.auth.allowed_keys) if cfg.auth.enabled else None)
        self.engine = EngineEndpoint(
            cfg, self.ctx, self.me, metrics=self.metrics, dispatch=self.dispatch, life=self.life,
            registry=self.registry, mapper=self.mapper, dp_seen=self.rendezvous.dp_seen, add_rank=self.add_rank,
            drop_rank=self.drop_rank, release_mappings=self.release_unused_mappings, status=self.status,
            draining=lambda: self.draining)
        self.data_server: TcpDataServer | None = None
        self.ops: OpsServer | None = None
        self.tasks: list[asyncio.Future[Any]] = []
        self.metrics.start_time.set(self.started)
        counts = request_counts.StateCounts(self.inbox, self.life)
        for side in ("decode", "prefill"):
            for state in states.ACTIVE:
                self.metrics.inflight.labels(side, state).set_function(lambda key=(side, state): counts()[key])

    def _transport_fallback(self, choice: PairTransport) -> None:
        """A pair runs on another transport than this daemon's first choice: said once per pair."""
        self.metrics.transport_fallbacks.labels(choice.side, choice.preferred, choice.transport, choice.reason).inc()
        log.warning("event=transport_fallback side=%s peer=%s prefill=%s decode=%s preferred=%s chosen=%s "
                    "reason=%s detail=%s", choice.side, choice.peer, choice.prefill, choice.decode, choice.preferred,
                    choice.transport, choice.reason, q(choice.detail))

    def _staging_changed(self, slots_in_use: int, bytes_in_use: int) -> None:
        self.metrics.staging_slots.set(slots_in_use)
        self.metrics.staging_bytes.set(bytes_in_use)

    # -- the core and its effects ------------------------------------------------------------------
    def dispatch(self, event: Any) -> Any:
        """Apply one event to the lifecycle core (on the loop) and carry out its effects."""
        try:
            return self.life.handle(event, time.monotonic())
        finally:
            for effect in self.life.take_effects():
                self._apply(effect)

    def _apply(self, effect: effects.Effect) -> None:
        if isinstance(effect, effects.TellEngine):
            if TRACE.keep:  # one daemon may hold both sides of a request: each side's event is its hop
                rank = self.registry.get(effect.event.rank_id)
                TRACE.mark(effect.event.request_id, f"told_{rank.role if rank is not None else 'engine'}")
            self.engine.deliver(effect.identity, effect.event.to_wire())
        elif isinstance(effect, effects.StartJob):
            TRACE.mark(effect.job.request_id, "job_queued")
            self.data.start(effect, self.transports.get(effect.kind))
        elif isinstance(effect, effects.SendUpstream):
            self.decode_links.send(effect.address, effect.message)
        elif isinstance(effect, effects.SendDownstream):
            self.prefill_endpoint.send(effect.identity, effect.message)
        elif isinstance(effect, effects.ExpectUpstream):
            self.decode_links.send_expect(effect.address, effect.entry, effect.writers)
        elif isinstance(effect, effects.SendHandshake):
            self.decode_links.hello(effect)
        elif isinstance(effect, effects.StopSending):
            self.transports.stop_sending(effect.source)
        elif isinstance(effect, effects.StopReceiving):
            self.transports.stop_receiving(effect.entry)
        elif isinstance(effect, effects.PeerGone):
            self.transports.peer_lost(effect.kind, effect.remote, effect.data_address, effect.why)
        elif isinstance(effect, effects.LinkChanged):
            (self.decode_links if effect.side == "prefill" else self.prefill_endpoint).changed(effect)

    # -- ranks ------------------------------------------------------------------------------------
    def add_rank(self, rank: Rank, rendezvous: str | None) -> None:
        """A rank the engine endpoint registered (any rank it replaces dropped first)."""
        self.registry.add(rank)
        self.transports.register(rank)  # NIXL registers its memory where it is enabled and usable
        self.rendezvous.registered(rank, rendezvous)
        self.update_rank_metrics()

    def drop_rank(self, rank: Rank, reason: str) -> None:
        self.dispatch(events.RankGone(rank, reason))
        if self.registry.get(rank.id) is rank:
            self.registry.remove(rank.id)
            self.rendezvous.unregistered(rank)
        self.transports.deregister(rank)
        # forget file mappings no rank uses any more (they unmap once in-flight copies drop them)
        self.release_unused_mappings()
        self.update_rank_metrics()
        log.info("event=rank_unregistered rank=%s reason=%s", rank.id, q(reason))

    def release_unused_mappings(self) -> None:
        self.mapper.release_unused(region.flat for r in self.registry for region in r.regions.values())

    def update_rank_metrics(self) -> None:
        for role, n in self.registry.count_by_role().items():
            self.metrics.ranks.labels(role).set(n)

    def count_peers(self) -> None:
        counts = self.life.source_daemons.count()
        for state, n in self.life.decode_daemons.count().items():
            counts[state] += n
        for state, n in counts.items():
            self.metrics.peers.labels(state).set(n)

    def heartbeat(self, now: float) -> None:
        """Ping the peers (a silent one is down) and renew the ranks announced to another daemon."""
        self.decode_links.ping_all()
        self.dispatch(events.Heartbeat(self.cfg.peer.peer_timeout_s))
        self.rendezvous.heartbeat()

    def status(self) -> dict[str, Any]:
        """What an engine's ``status`` call (``kvxferd status``) answers."""
        cfg = self.cfg
        metrics_url = ""
        if self.ops is not None:
            host = cfg.metrics.bind.rpartition(":")[0] or "127.0.0.1"
            metrics_url = f"http://{host}:{self.ops.port}/metrics"
        now = time.monotonic()
        links, peers = self.decode_links, self.prefill_endpoint
        return {
            "version": __version__, "protocol": PROTOCOL_VERSION, "pid": os.getpid(),
            "incarnation": self.me.incarnation, "name": cfg.daemon.instance_name or socket.gethostname(),
            "uptime_s": round(time.time() - self.started, 3), "ready": self.ready, "draining": self.draining,
            "engine_endpoint": f"ipc://{cfg.socket_path}", "peer_endpoint": f"tcp://{self.me.address}",
            "data_endpoint": self.me.data_address, "metrics_url": metrics_url,
            "ranks": [r.describe() for r in self.registry],
            "peers": links.describe(now) + peers.describe(now),
            "requests": request_counts.by_state(self.inbox, self.life),
            # multipart messages between daemons and the peer messages they carried (parts > messages: batched)
            "peer_messages": {"to_sources": links.sent.describe(), "from_sources": links.received.describe(),
                              "to_decode": peers.sent.describe(), "from_decode": peers.received.describe()},
            "recent_failures": list(self.life.recent_failures),
            "auth": {"refused_here": self.auth_refusals.describe(),
                     "refused_by_peers": self.auth_refused_by.describe()},
            "transports": self.transports.describe(),
            # chunks sent per transport/mode/why: an explicit peer.mode is kept on host memory, auto
            # stages short runs per chunk, GPU pages go through a device slot (transport/chunk_modes.py)
            "chunk_modes": self.metrics.chunk_modes(),
            # the data threads' QoS: per class and instance what is queued, running and moved
            "qos": self.data.describe(),
            "copy_path": runcopy.copy_path(),  # native, or torch and why
            # "full" or "sampled": chunks carry digests checked over the landed bytes (all, or a share)
            "integrity": cfg.integrity.mode,
            **({"integrity_sample_share": self.life.integrity.share}
               if cfg.integrity.mode == "sampled" else {}),
            # each instance pair's integrity, as agreed at its handshake (the stricter side's; a request may ask more)
            "integrity_pairs": self.life.handshakes.integrity_pairs() + self.life.routes.integrity_pairs(),
            "rendezvous": self.rendezvous.status(),  # instances over several daemons: who holds which rank
            **({"hops": TRACE.snapshot()} if TRACE.keep else {}),  # daemon.hop_trace: per-request hop times
        }

    # -- start, drain, stop --------------------------------------------------------------------------
    def _bind_peer(self) -> None:
        sock = self.prefill_endpoint.sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.limits.max_message_bytes)
        host = self.cfg.peer.bind_host
        if self.keys is not None:
            self.authenticator = auth.ZapAuthenticator(self.ctx, self._auth_refused)
            self.authenticator.start()
            self.authenticator.configure_curve_callback(
                "*", credentials_provider=auth.AllowList(self.cfg.auth.allowed_keys))
            for key in self.cfg.auth.allowed_keys:
                if key not in self.prefill_endpoint.key_claims:  # said once: such a key speaks for anyone
                    log.warning("event=unscoped_peer_key key=%s fix=%s", key, q(
                        "add an auth.key_claims entry naming the daemon addresses and instances this key may "
                        "speak for"))
            sock.curve_secretkey = self.keys.secret.encode()
            sock.curve_publickey = self.keys.public.encode()
            sock.curve_server = True
        elif host not in ("127.0.0.1", "::1", "localhost"):
            log.warning("event=unauthenticated_peer_endpoint bind=%s fix=%s", host,
                        q("enable [auth] with `kvxferd keygen` keys, or bind to loopback"))
        with binding("peer.control_port", f"{host}:{self.cfg.peer.control_port}"):
            if self.cfg.peer.control_port == 0:
                self.me.control_port = sock.bind_to_random_port(f"tcp://{host}")
            else:
                sock.bind(f"tcp://{host}:{self.cfg.peer.control_port}")
        with binding("peer.data_port", f"{host}:{self.cfg.peer.data_port}"):
            lim, tmo = self.cfg.limits, self.cfg.timeouts
            self.data_server = self.transports.listen(
                host, self.cfg.peer.data_port, max_connections=lim.max_data_connections,
                deadlines=Deadlines(tmo.data_proof_s, tmo.data_frame_s, float(lim.data_min_bytes_per_s),
                                    lim.max_unproven_connections),
                on_conn_refused=lambda reason: self.metrics.connections_refused.labels("data", reason).inc(),
                on_accept_error=self.metrics.accept_errors.labels("data").inc)
        self.me.data_port = self.data_server.port
        self.directory.own_address = self.me.address  # the advertised address, as peers dial it
        self.life.address = self.me.address

    def _auth_refused(self, address: str, key: str, reason: str) -> None:
        """ZAP refused a peer: count it, log it (bounded), keep it for ``status``."""
        self.metrics.auth_denied.inc()
        record, log_now = self.auth_refusals.note(reason, address=address, key=key)
        if log_now:
            log.warning("event=auth_refused peer=%s key=%s reason=%s count=%s fix=%s", address, key, q(reason),
                        record["count"], q("add the key to auth.allowed_keys if that daemon is one of yours"))

    async def run(self) -> None:
        loop = self.data.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            # the engine socket last: engines never find one whose daemon then fails to start
            self._bind_peer()
            if self.cfg.metrics.bind:
                with binding("metrics.bind", self.cfg.metrics.bind):
                    self.ops = OpsServer(
                        self.cfg.metrics.bind, self.metrics.registry, lambda: self.ready,
                        max_connections=self.cfg.metrics.max_connections, timeout_s=self.cfg.metrics.timeout_s,
                        on_refused=lambda reason: self.metrics.connections_refused.labels("http", reason).inc(),
                        on_accept_error=self.metrics.accept_errors.labels("http").inc)
            self.engine.bind()
        except BaseException:
            await self.close()  # no socket, file or port of a failed start outlives it
            raise
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.request_stop)
            except (NotImplementedError, RuntimeError):
                pass
        self.tasks = [asyncio.ensure_future(c) for c in
                      (self.engine.serve(), self.prefill_endpoint.serve(),
                       timers.sweeper(self.registry, self.drop_rank, self.dispatch),
                       timers.heartbeats(self.cfg.peer.heartbeat_interval_s, self.heartbeat), timers.watchdog())]
        # what start-up made (torch, numpy, the modules: some 170k objects) lives as long as the process:
        # kept out of the cyclic collector's sweeps, which otherwise walk it every time a burst of objects
        # survives (tens of thousands of page views of one large chunk), at a microsecond per view
        gc.freeze()
        self.ready = True
        self.metrics.up.set(1)
        metrics_url = f"http://{self.cfg.metrics.bind.rpartition(':')[0]}:{self.ops.port}/metrics" if self.ops else ""
        log.info("event=listening engine=%s peer=%s data=%s metrics=%s version=%s", q(self.cfg.socket_path),
                 self.me.address, self.me.data_address, q(metrics_url), __version__)
        if self.cfg.peer.mode == "staged":
            log.info("event=mode_scope mode=staged local=direct reason=%s", q(LOCAL_MODE_NOTE))
        copy = runcopy.copy_path()
        self.metrics.copy_path.labels(copy["path"]).set(1)
        if copy["path"] == "native":
            log.info("event=copy_path path=native library=%s hashing=%s", q(copy["library"]), copy["hashing"])
        else:  # several times slower CPU copies: said where an operator looks first
            log.warning("event=copy_path path=torch reason=%s", q(copy["reason"]))
        sdnotify.notify(f"READY=1\nSTATUS=serving peer={self.me.address}")
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
        life = self.life
        sdnotify.notify(f"STOPPING=1\nSTATUS=draining {life.active_count()} requests "
                        f"(up to {self.cfg.timeouts.drain_grace_s}s)")
        deadline = time.monotonic() + self.cfg.timeouts.drain_grace_s
        while life.active_count() and time.monotonic() < deadline and not self._hurry:
            await asyncio.sleep(0.05)
        left = life.active_count()
        self.dispatch(events.ShutDown())
        # Failures are told to engines only once no data thread touches their pages: cut the
        # inbound data connections so receivers stop, give copies a moment to end, then tell
        # whatever is left (a thread still blocked in a send ends with the process).
        if self.data_server:
            self.data_server.close()
        fence = time.monotonic() + min(5.0, self.cfg.timeouts.transfer_s)
        while life.inflight_jobs() and time.monotonic() < fence:
            await asyncio.sleep(0.02)
        self.dispatch(events.ShutDown(final=True))
        await asyncio.sleep(0.05)
        log.info("event=stopped drained=%s failed_on_exit=%d", left == 0, left)
        await self.close()

    async def close(self) -> None:
        self.metrics.up.set(0)
        for t in self.tasks:
            t.cancel()
        await self.rendezvous.close()  # an etcd directory revokes its lease: the ranks here leave it now
        self.decode_links.close()
        if self.prefill_endpoint.confirmer is not None:
            self.prefill_endpoint.confirmer.close()
        self.transports.close()
        self.data.close()
        if self.ops:
            self.ops.close()
        self.engine.outgoing.flush()  # the last events of this loop turn leave before the socket closes
        self.prefill_endpoint.outgoing.flush()  # and the last answers and aborts to decode daemons
        for sock in (self.engine.sock, self.prefill_endpoint.sock):
            if sock is not None:
                sock.close(linger=500)  # up to 0.5 s to deliver the last events and aborts
        if self.authenticator is not None:
            self.authenticator.stop()
        self.engine.unlink()
        self.ctx.term()


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

"""Optional NIXL transport: one-sided WRITEs from prefill regions into decode regions.

One NIXL agent (UCX backend) per daemon, created on first use when the config asks for
``nixl``. What it registers depends on ``peer.nixl_engine_memory``:

- ``private`` (the default): decode ranks' memory is never registered. The agent holds the
  landing rings (each described only to its own source link) and prefill ranks' memory (read
  by this daemon's own WRITEs, described to no peer: the metadata a decode daemon gets of this
  agent is its connection info alone). The offer says ``nixl_private``: a source writes every
  chunk into its link's ring, where this daemon checks the header against the request before
  scattering the bytes into the engine's pages with its own page table.
- ``exposed``: every KV region the daemon maps is registered when its rank registers and
  deregistered when the rank goes, and decode ranks' regions are described to sources, which
  WRITE into them in place (faster; every source that handshook may write any of them).

Who knows what:

- The decode daemon puts its agent name, the partial agent metadata of its decode ranks
  (only their KV regions, plus connection info) and each region's base address into the
  handshake. A rank that registers later, or again, is described in the next peer
  ``expect`` that names it.
- The prefill daemon loads that metadata (``add_remote_agent``) and answers which
  transport it chose. With ``nixl`` the decode daemon's peer ``expect`` carries the
  destination page table, because a WRITE needs remote addresses: the prefill side turns
  (page tables, token range, plan writer) into paired byte segments with
  :func:`~kvxferd.model.segments.paired_segments`, adds the regions' base addresses with numpy,
  and posts one WRITE per chunk.
- Each WRITE carries a notification: the chunk's data header in msgpack. NIXL delivers it
  after the chunk's bytes are in place. The decode daemon's NIXL thread polls for
  notifications and runs them through the same :class:`~kvxferd.lifecycle.inbox.Inbox` checks as a
  tcp chunk header; a header that fails them fails that request with the reason.

- Staged plans (head slices) go through landing rings instead, one descriptor per block:
  see :mod:`.staging`. Negotiation and the handshake fields live in :mod:`.support`.

Unlike tcp, the bytes of a direct one-sided WRITE land before the receiver has validated
anything about the chunk. What bounds a peer is NIXL itself: a WRITE must fall inside
memory the receiver registered and described to that peer, which is only its KV regions
and its landing ring; and a request the decode side fails is told to its engine only after
the source confirms no WRITE of it is in flight (the fence, in the daemon).

Progress: NIXL's own progress thread is off. The sending data thread drives its transfer
(``check_xfer_state``) until DONE or ERR, within the transfer timeout; the daemon's NIXL
thread drives the receiving side while it polls notifications.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from ...wire import protocol
from ...errors import KvxferError, RequestError, TransferError
from ...lifecycle.inbox import DestEntry, Inbox, Sink
from ...ops.logutil import q
from ...lifecycle.registry import Rank
from ...datapath.copier import gather, settle
from ...datapath.digest import RunningDigests
from ...model.segments import paired_segments
from ...datapath.staging import StagingPool, block_bytes, block_count, block_pieces, slices_per_slot
from ...lifecycle.jobs import ChunkJob, Moved
from ...model.qos import BULK
from .. import chunk_modes
from ..framing import SMALL_RUN
from . import blocks as nixl_blocks
from .api import BACKEND, PRIVATE, NixlPeer, _descs, _mem, _Registered, apply_ucx_defaults, load_api
from .receive import NixlReceiver, _why
from .agents import RELEASE_SETTLE_S, RemoteAgents
from .remote import Gate, RemoteBook
from .staging import Assemblies, Credits, LandingRing, LandingRings

log = logging.getLogger("kvxferd.nixl")

MAX_UNRELEASED = 4096
#: blocks of one chunk on the wire at once (each holds a landing slot, and a staging slot unless read in place)
BLOCKS_IN_FLIGHT = 4
#: a bulk chunk's direct WRITEs on the wire at once (``qos.bulk_block_bytes``): two keep the link busy
#: while the next is posted, and bound what a latency WRITE to the same agent waits behind
DIRECT_BLOCKS_IN_FLIGHT = 2
SCATTER_THREADS = 2  # decode side: staged blocks scattered at once (bounded anyway by the landing slots)


class NixlTransport(RemoteAgents, NixlReceiver):
    """The daemon's NIXL agent: registration, metadata exchange, WRITEs and notifications."""

    name = "nixl"
    one_sided = True

    def __init__(self, daemon_name: str, inbox: Inbox, *, timeout_s: float, max_header_bytes: int,
                 staging: StagingPool | None = None, landing_slots: int = 0, landing_bytes: int = 0,
                 in_place_bytes: int = 256 * 1024, engine_memory: str = PRIVATE, bulk_block_bytes: int = 0,
                 on_received: Callable[[Sink, Moved], None] | None = None,
                 on_refused: Callable[[DestEntry, str, str], None] | None = None,
                 on_invalid: Callable[[str], None] | None = None,
                 on_registered: Callable[[str, int], None] | None = None,
                 on_nixl_refused: Callable[[str], None] | None = None) -> None:
        api = load_api()
        applied = apply_ucx_defaults()
        if applied:
            log.info("event=ucx_defaults set=%s", ",".join(f"{k}={v}" for k, v in applied.items()))
        self.inbox = inbox
        self.timeout_s = timeout_s
        self.max_header_bytes = max_header_bytes
        self.staging = staging
        self.in_place_bytes = in_place_bytes
        #: QoS: a bulk chunk's direct WRITE is cut into WRITEs of at most this many bytes (0: never), so a
        #: latency WRITE to the same agent queues behind at most ``DIRECT_BLOCKS_IN_FLIGHT`` of them
        self.bulk_block_bytes = bulk_block_bytes
        #: prefill side: direct chunks sent, and the WRITEs they took (more than one: cut by QoS), for ``status``
        self.direct_chunks = self.direct_writes = 0
        #: "private": decode engines' memory is never registered nor described (see the module doc)
        self.private = engine_memory == PRIVATE
        self.on_registered = on_registered
        self.on_nixl_refused = on_nixl_refused
        self.on_received = on_received
        self.on_refused = on_refused
        self.on_invalid = on_invalid
        safe = "".join(c if c.isalnum() or c in "-_.:" else "_" for c in daemon_name)[:64]
        self.agent_name = f"kvxferd-{safe}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        config = api.nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=[BACKEND],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)  # data threads share the agent
        self.agent = api.nixl_agent(self.agent_name, config)
        if BACKEND not in self.agent.backends:
            raise RuntimeError(f"NIXL has no {BACKEND} backend here (plugins: {self.agent.get_plugin_list()})")
        self._ranks: dict[str, _Registered] = {}
        #: private: decode ranks kept out of NIXL, by rank id (the device a landing ring for them lives on)
        self._unexposed: dict[str, tuple[Rank, int]] = {}
        self._generation = 0
        self._lock = threading.Lock()
        #: decode side: the agent each source daemon (by control address) writes from
        self.source_agents: dict[str, str] = {}
        self._unreleased: list[Any] = []
        self._sending = 0  # WRITEs in flight from data threads
        #: decode side: where staged blocks land, one ring per source daemon link
        self.landing = LandingRings(landing_slots if staging is not None else 0,
                                    staging.slot_bytes if staging is not None else 0, landing_bytes,
                                    quarantine_s=2 * timeout_s, register=self._register_ring,
                                    deregister=self._deregister_ring)
        #: decode side: staged chunks whose blocks are arriving, and the threads that scatter them
        self.assemblies = Assemblies(inbox)
        self._scatterers = ThreadPoolExecutor(SCATTER_THREADS, thread_name_prefix="kvxferd-nixl-scatter")
        #: prefill side: credits for the landing ring of each decode agent
        self._credits: dict[str, Credits] = {}
        #: prefill side: registrations of local staging slots (the pool keeps its slots for good)
        self._slot_regs: dict[int, Any] = {}
        #: prefill side: staging pools on GPUs, by device index (device regions stage beside themselves)
        self._device_pools: dict[int, StagingPool] = {}
        self._conn_md: bytes | None = None
        #: remote agents of peers that went away, removed once no WRITE to them can be pending
        self._forget_at: dict[str, float] = {}
        #: remote agents whose metadata is loaded now (for status: what a departed peer leaves behind)
        self._loaded: set[str] = set()
        #: prefill side: the blobs loaded of each decode agent (a stale one calls for a reload), and the
        #: gate its WRITEs share with that reload
        self._books: dict[str, RemoteBook] = {}
        self._gates: dict[str, Gate] = {}
        self._md_lock = threading.Lock()  # loading a remote agent's metadata, or reloading it
        self._warned_no_ring = False
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._poll_loop, name="kvxferd-nixl", daemon=True)
        self._thread.start()
        log.info("event=nixl_agent_ready agent=%s backend=%s", self.agent_name, BACKEND)

    # -- registration ----------------------------------------------------------------
    def register_rank(self, rank: Rank) -> None:
        """Register every region of a rank (once, at rank registration)."""
        regions = list(rank.regions.values())
        devices = {_device(r.flat) for r in regions}
        if len(devices) != 1:
            raise RuntimeError(f"regions of {rank.id} span devices {sorted(devices)}")
        device = devices.pop()
        if self.private and rank.role == "decode":  # never registered: no peer can be handed its keys
            with self._lock:
                self._unexposed[rank.id] = (rank, device)
                old = self._ranks.pop(rank.id, None)
            if old is not None and old.rank is not rank:
                self._deregister(old)
            self._report()
            return
        # each range once: regions may lie over each other (vLLM's sliding-window group reuses the
        # full-attention group's memory), and NIXL's deregistration of a range listed twice crashes
        rows = np.unique(np.array([[r.flat.data_ptr(), r.nbytes, max(device, 0)] for r in regions],
                                  dtype=np.uint64), axis=0)
        reg = self.agent.register_memory(rows, _mem(device))
        if device >= 0 and self.landing.slots_per_ring == 0 and not self._warned_no_ring:
            self._warned_no_ring = True
            log.warning("event=nixl_gpu_without_landing_ring rank=%s reason=%s fix=%s", rank.id,
                        q("sources write into this engine's GPU memory in place, which UCX moves by software "
                          "(0.05-0.25 GB/s on one H200)"), q("set limits.nixl_landing_slots above 0"))
        with self._lock:
            self._generation += 1
            old = self._ranks.get(rank.id)
            self._ranks[rank.id] = _Registered(rank, self._generation, device, reg,
                                               {(r.layer, r.kind): r.flat.data_ptr() for r in regions},
                                               nbytes=int(rows[:, 1].sum()))
        if old is not None and old.rank is not rank:
            self._deregister(old)
        self._report()

    def deregister_rank(self, rank: Rank) -> None:
        with self._lock:
            unexposed = self._unexposed.get(rank.id)
            if unexposed is not None and unexposed[0] is rank:
                del self._unexposed[rank.id]
            reg = self._ranks.get(rank.id)
            if reg is None or reg.rank is not rank:
                return
            del self._ranks[rank.id]
        self._deregister(reg)
        self._report()

    def registered_bytes(self) -> dict[str, int]:
        """Bytes registered with the agent, by what they are (``status`` and a gauge): with private
        engine memory, ``decode_engine`` stays 0."""
        with self._lock:
            regs = list(self._ranks.values())
        out = {"prefill_engine": 0, "decode_engine": 0, "landing": self.landing.bytes_registered}
        for reg in regs:
            out[f"{reg.rank.role}_engine"] = out.get(f"{reg.rank.role}_engine", 0) + reg.nbytes
        return out

    def _report(self) -> None:
        if self.on_registered is not None:
            for memory, nbytes in self.registered_bytes().items():
                self.on_registered(memory, nbytes)

    def _deregister(self, reg: _Registered) -> None:
        try:
            self.agent.deregister_memory(reg.reg_descs)
        except Exception as exc:  # noqa: BLE001 - the rank is gone either way
            log.warning("event=nixl_deregister_failed rank=%s error=%s", reg.rank.id, _why(exc))

    def _describe(self, reg: _Registered) -> tuple[bytes, list[list[Any]]]:
        if reg.metadata is None:
            reg.metadata = bytes(self.agent.get_partial_agent_metadata(reg.reg_descs, True))
        tp, pp = reg.rank.coords
        geometry = reg.rank.geometry
        return reg.metadata, [[tp, pp, layer, kind, addr, reg.rank.regions[(layer, kind)].nbytes, reg.device,
                               geometry.group(kind.rpartition(".")[0]).page_stride or 0]
                              for (layer, kind), addr in reg.addresses.items()]

    def offer(self, decode_instance: str, source: str) -> tuple[dict[str, Any], dict[str, int]]:
        """Handshake fields describing this daemon's ranks of a decode instance (and the landing
        ring of the source daemon's link, where there is room for one), and the ranks' generations."""
        with self._lock:
            regs = [r for r in self._ranks.values() if r.rank.instance == decode_instance]
            unexposed = {device for rank, device in self._unexposed.values() if rank.instance == decode_instance}
        mds, table, sent = [], [], {}
        if self.private:  # the landing ring is all a source may write: no engine region is described
            regs = []
        for reg in regs:
            md, rows = self._describe(reg)
            mds.append(md)
            table.extend(rows)
            sent[reg.rank.id] = reg.generation
        fields: dict[str, Any] = {"nixl_agent": self.agent_name, "nixl_md": mds, "nixl_regions": table}
        if self.private:
            fields["nixl_private"] = True
        # staged blocks land beside the memory they are scattered into: on the decode ranks' GPU
        # when they all live on one, else in host memory
        devices = {reg.device for reg in regs} | unexposed
        try:
            ring, why = self.landing.for_source(source, devices.pop() if len(devices) == 1 else -1)
        except Exception as exc:  # noqa: BLE001 - NIXL refused the registration: sliced plans run direct
            ring, why = None, _why(exc)
        if ring is not None:
            mds.append(ring.metadata)
            fields["nixl_landing"] = ring.info.to_wire()
        elif self.landing.slots_per_ring > 0:
            log.warning("event=nixl_landing_unavailable peer=%s reason=%s fix=%s", q(source), q(why),
                        q("raise limits.nixl_landing_bytes; until then " + (
                            "pairs from this peer run over tcp (engine memory is private)" if self.private
                            else "sliced plans from this peer run direct")))
        self._report()
        return fields, sent

    def _register_ring(self, ring: LandingRing) -> None:
        rows = np.array([[ring.buffer.data_ptr(), ring.nbytes, max(ring.device, 0)]], dtype=np.uint64)
        ring.reg_descs = self.agent.register_memory(rows, _mem(ring.device))
        ring.metadata = bytes(self.agent.get_partial_agent_metadata(ring.reg_descs, True))

    def _deregister_ring(self, ring: LandingRing) -> None:
        try:
            self.agent.deregister_memory(ring.reg_descs)
        except Exception as exc:  # noqa: BLE001 - the memory stays quarantined either way
            log.warning("event=nixl_deregister_failed ring=%s error=%s", ring.ring, _why(exc))
        self._report()

    def connection_metadata(self) -> bytes:
        """This agent's connection info without any memory: lets a decode daemon send ``free`` notifications
        without being able to write anywhere here."""
        if self._conn_md is None:
            bindings = importlib.import_module(load_api().__name__ + "._bindings")
            empty = bindings.nixlRegDList(self.agent.nixl_mems["DRAM"], np.zeros((0, 3), dtype=np.uint64))
            self._conn_md = bytes(self.agent.get_partial_agent_metadata(empty, True))
        return self._conn_md

    def describe_rank(self, rank: Rank, sent_generation: int | None) -> tuple[dict[str, Any], int | None]:
        """Expect fields for a rank the peer has not seen in this registration, else nothing (always
        nothing where engine memory is private: no peer is told of it)."""
        if self.private:
            return {}, sent_generation
        with self._lock:
            reg = self._ranks.get(rank.id)
        if reg is None or reg.rank is not rank or reg.generation == sent_generation:
            return {}, sent_generation
        md, rows = self._describe(reg)
        return {"nixl_md": [md], "nixl_regions": rows}, reg.generation

    # -- sending ---------------------------------------------------------------------
    def send(self, job: ChunkJob) -> Moved:
        peer = job.remote
        if not isinstance(peer, NixlPeer):
            raise TransferError("nixl chunk without a remote agent", field="transport", fix="handshake again")
        gate = self._enter(peer.agent, time.monotonic() + self.timeout_s)
        try:
            return self._send(job, peer)
        finally:
            if gate is not None:
                gate.leave()

    def _send(self, job: ChunkJob, peer: NixlPeer) -> Moved:
        w = job.writer
        # the decode side's own slot arithmetic (token rows or packed pages, dense or strided); a
        # cache group's chunk is addressed by the group's own destination table (its pages from
        # token 0, or the request's state slot: one "page" of the slot's rows)
        dst_slots = (peer.dst_slots(job.dst, job.group, job.dst_pages, job.start, job.end)
                     if job.dst_pages is not None else None)
        kinds = job.kinds
        src_bases, src_limit, src_device = self._local_bases(job.rank, w.layers, kinds)
        if peer.private:
            return self._send_private(job, peer, src_device)
        # small runs (head slices of a TP-mismatched plan, one-token pages): a descriptor each would
        # cost UCX more than copying them through a slot (tcp's rule for socket views); a head slice
        # is one run per token, so its size decides before any segment is built. GPU memory is never
        # read in place: it is an engine's, opened here by CUDA IPC, and UCX classifies it as host
        # memory on the sending side, so a WRITE from it runs as a software copy over tcp (one H200:
        # 0.21-0.28 GB/s, UCX_PROTO_INFO "from host memory to cuda ... software emulation"); gathered
        # into this daemon's own device slot it goes over cuda_ipc (3.7-14.9 GB/s in the same check)
        # The decode side's GPU memory is likewise an engine's opened by CUDA IPC: written in place
        # it moved at 0.05-0.25 GB/s on the same H200, so it is written through the landing ring
        dst_bases, dst_limit, dst_device = peer.bases(job.dst, w.layers, kinds)
        gpu_src, gpu_dst = src_device >= 0, dst_device >= 0
        mode, why = chunk_modes.pick(job.mode, job.pinned, gpu_src or gpu_dst,
                                     not w.whole_rows and w.slice_bytes < SMALL_RUN)
        if mode == chunk_modes.STAGED:
            route = self._route(job, peer, dst_slots, src_in_place=not gpu_src, dst_in_place=not gpu_dst)
            if route is not None:
                return self._send_blocks(job, peer, route, dst_slots, why)
            why = chunk_modes.NO_LANDING_RING
        if dst_slots is None:
            raise TransferError("nixl chunk without destination pages", field="transport", fix="handshake again")
        segs = paired_segments(job.src_slots, dst_slots, w)
        if len(segs) == 0:
            self._notify(peer.agent, protocol.encode(job.header()))
            return Moved(job.nbytes, 0, chunk_modes.DIRECT, why)
        if mode == chunk_modes.DIRECT:  # whole rows in short runs (one-token pages): under auto, a slot
            mode, why = chunk_modes.pick(job.mode, job.pinned, False,
                                         int(segs.lengths.sum()) < SMALL_RUN * len(segs))
            if mode == chunk_modes.STAGED:
                route = self._route(job, peer, dst_slots)
                if route is not None:
                    return self._send_blocks(job, peer, route, dst_slots, why)
                why = chunk_modes.NO_LANDING_RING
        ends_src = int((segs.src + segs.lengths).max())
        ends_dst = int((segs.dst + segs.lengths).max())
        if ends_src > src_limit or ends_dst > dst_limit:
            raise RequestError(f"chunk reaches byte {ends_src} of a {src_limit}-byte source region or "
                               f"{ends_dst} of a {dst_limit}-byte destination region", field="pages",
                               fix="send pages inside both ranks' registered regions")
        local = _descs(src_bases, segs.src, segs.lengths, src_device)
        remote = _descs(dst_bases, segs.dst, segs.lengths, dst_device)
        cut = self.bulk_block_bytes if job.qos.cls == BULK else 0
        writes = nixl_blocks.cut_rows(local, remote, cut)
        deadline = time.monotonic() + self.timeout_s
        # with digests, the WRITE goes first and the source's pages are hashed while it moves them;
        # the header follows once every byte landed (a notification of its own), else with the WRITE.
        # A chunk cut into several WRITEs (QoS) tells its header once the last of them is DONE
        trailing = job.digests is not None or len(writes) > 1
        notif = b""
        in_flight: deque[Any] = deque()
        with self._lock:
            self._sending += 1
            self.direct_chunks += 1
            self.direct_writes += len(writes)
        try:
            for k, (loc, rem) in enumerate(writes):
                in_flight.append(self._post(loc, _mem(src_device), rem, _mem(dst_device), peer.agent,
                                            b"" if trailing else protocol.encode(job.header())))
                if k == 0 and trailing:
                    notif = protocol.encode(job.header())
                while in_flight and (len(in_flight) >= DIRECT_BLOCKS_IN_FLIGHT or k == len(writes) - 1):
                    self._wait(in_flight[0], peer, deadline)
                    self._release(in_flight.popleft(), agent=peer.agent)
        finally:
            while in_flight:  # an error with WRITEs on the wire: the fence counts on each settling
                self._release(in_flight.popleft(), settle_s=RELEASE_SETTLE_S, agent=peer.agent)
            with self._lock:
                self._sending -= 1
        if trailing:
            self._notify(peer.agent, notif)
        return Moved(job.nbytes, int(local.shape[0]), chunk_modes.DIRECT, why)

    def _send_private(self, job: ChunkJob, peer: NixlPeer, src_device: int) -> Moved:
        """A chunk to a decode daemon that keeps its engines' memory private: the peer described no
        page and sent no page table, so every block lands in this link's landing ring (``read`` or
        ``land``) and the decode daemon scatters it itself."""
        w = job.writer
        _mode, why = chunk_modes.pick(job.mode, job.pinned, src_device >= 0,
                                      not w.whole_rows and w.slice_bytes < SMALL_RUN, private_destination=True)
        route = self._route(job, peer, None, src_in_place=src_device < 0, dst_in_place=False)
        if route is None:
            raise TransferError(f"NIXL agent {peer.agent} keeps its engines' memory private and gave this "
                                f"daemon no landing ring to write into", field="peer.nixl_engine_memory",
                                fix="raise limits.nixl_landing_slots/_bytes on the decode daemon (its pairs then "
                                    "take the ring), or let the pair run over tcp")
        return self._send_blocks(job, peer, route, None, why)

    def _route(self, job: ChunkJob, peer: NixlPeer, dst_slots: np.ndarray | None,
               src_in_place: bool = True, dst_in_place: bool = True) -> str | None:
        """How a chunk goes in blocks (:mod:`.blocks`), or None if it can only go direct."""
        w = job.writer
        return nixl_blocks.choose(
            src_whole=w.slice_bytes == w.src_row_bytes, dst_whole=w.slice_bytes == w.dst_row_bytes,
            src_slots=job.src_slots, dst_slots=dst_slots, slice_bytes=w.slice_bytes,
            can_land=peer.credits is not None, can_gather=self.staging is not None, in_place_bytes=self.in_place_bytes,
            src_in_place=src_in_place, dst_in_place=dst_in_place)

    def _send_blocks(self, job: ChunkJob, peer: NixlPeer, route: str, dst_slots: np.ndarray | None,
                     why: str = chunk_modes.PLAN) -> Moved:
        """Cut the chunk's wire stream into blocks as :func:`~kvxferd.datapath.staging.pack` does and WRITE each
        block along ``route`` (:mod:`.blocks`): gathered into a local staging slot unless the
        source is read in place, into a landing slot of the peer unless the decode pages are written
        in place. Up to ``BLOCKS_IN_FLIGHT`` blocks are on the wire while the next is gathered; the
        receiver derives every block's pieces from the header (``block``, ``pack``) alone."""
        w = job.writer
        regions = list(job.regions())
        n_slots = job.src_slots.size  # tokens, or whole pages of a packed layout
        credits = peer.credits if route != nixl_blocks.PLACE else None
        pool = self._pool_for(job) if route != nixl_blocks.READ else None
        assert (credits is not None or route == nixl_blocks.PLACE) and (pool is not None or route == nixl_blocks.READ)
        pack_bytes = min(size for size in (pool.slot_bytes if pool else 0, credits.info.slot_bytes if credits else 0)
                         if size)
        per_slot = slices_per_slot(w.slice_bytes, pack_bytes)
        n_blocks = block_count(len(regions), n_slots, per_slot)
        if n_blocks == 0:  # an empty chunk (say, a bare last one) still has to be told
            self._notify(peer.agent, protocol.encode(job.header()))
            return Moved(0, 0, chunk_modes.STAGED, why)
        # every slot of host pages checked: each block is hashed as it goes, right after its gather into
        # a host slot (in cache) or just before NIXL reads it in place, and the digests ride in the last
        # block's notification (``trailer``), so the first block waits for no pass over the whole chunk
        running = (RunningDigests(len(regions)) if job.can_trail and (pool is None or pool.device.type == "cpu")
                   else None)
        head = {**job.header(trailer=running is not None), "pack": pack_bytes,
                **({"ring": credits.info.ring} if credits else {})}
        if route == nixl_blocks.READ:
            in_place_bases, in_place_limit, in_place_device = self._local_bases(job.rank, w.layers, job.kinds)
        elif route == nixl_blocks.PLACE:
            in_place_bases, in_place_limit, in_place_device = peer.bases(job.dst, w.layers, job.kinds)
            assert dst_slots is not None
        deadline = time.monotonic() + self.timeout_s
        abandoned = lambda: peer.dead or self._closed.is_set() and "shutdown"  # noqa: E731
        in_flight: deque[tuple[Any, Any]] = deque()  # (handle, local staging slot or None), oldest first
        fragments = 0
        with self._lock:
            self._sending += 1
        try:
            for k in range(n_blocks):
                pieces = block_pieces(k, len(regions), n_slots, per_slot, w.slice_bytes)
                nbytes = block_bytes(pieces, w.slice_bytes)
                local = None
                remote_slot = None
                try:
                    if pool is not None:
                        local = self._hold(pool.try_acquire, lambda: pool.acquire(max(0.0, deadline - time.monotonic())),
                                           in_flight, peer, deadline, pool)
                        _gather_block(job, regions, pieces, local)  # overlaps the WRITEs in flight
                        settle((local,))  # a device gather must be done before NIXL reads the slot
                        if running is not None:  # blocks are gathered in wire order
                            running.add_block(pieces, local, w.slice_bytes)
                    elif running is not None:  # read in place (``read``): hashed just before NIXL reads it
                        for piece in pieces:
                            running.add_slots(piece.region, regions[piece.region].view,
                                              job.src_slots[piece.lo:piece.hi], w.src_row_bytes, job.head_offset,
                                              w.slice_bytes)
                    if credits is not None:
                        remote_slot = self._hold(credits.try_acquire, lambda: credits.acquire(deadline, abandoned),
                                                 in_flight, peer, deadline, pool)
                    if route == nixl_blocks.LAND:
                        local_rows = np.array([[self._slot_address(local), nbytes]], dtype=np.uint64)
                        remote_rows = np.array([[credits.info.slot_address(remote_slot), nbytes]], dtype=np.uint64)
                        local_device, remote_device = _device(local), credits.info.device
                    elif route == nixl_blocks.READ:
                        descs = nixl_blocks.read_block(pieces, job.src_slots, w.src_row_bytes, w.slice_bytes,
                                                       in_place_bases, in_place_limit,
                                                       credits.info.slot_address(remote_slot))
                        local_rows, remote_rows = descs.local, descs.remote
                        local_device, remote_device = in_place_device, credits.info.device
                    else:
                        descs = nixl_blocks.place_block(pieces, dst_slots, w.dst_row_bytes, w.slice_bytes,
                                                        in_place_bases, in_place_limit, self._slot_address(local))
                        local_rows, remote_rows = descs.local, descs.remote
                        local_device, remote_device = _device(local), in_place_device
                except BaseException:
                    if local is not None:
                        pool.release(local)
                    if remote_slot is not None:
                        credits.release(remote_slot)  # nothing was posted into it
                    raise
                block_head = {**head, "block": k, **({"slot": remote_slot} if remote_slot is not None else {})}
                if running is not None and k == n_blocks - 1:
                    block_head["digests"] = running.digests()
                handle = self._post_block(peer, credits, remote_slot, _with_device(local_rows, local_device),
                                          _with_device(remote_rows, remote_device), local_device, remote_device,
                                          protocol.encode(block_head),
                                          release=None if local is None else (lambda slot=local: pool.release(slot)))
                fragments += int(local_rows.shape[0])
                in_flight.append((handle, local))
                while len(in_flight) >= BLOCKS_IN_FLIGHT:
                    self._finish(in_flight.popleft(), peer, deadline, pool)
            while in_flight:
                self._finish(in_flight.popleft(), peer, deadline, pool)
        finally:
            while in_flight:  # an error while blocks before it were on the wire
                handle, local = in_flight.popleft()
                self._release(handle, None if local is None else (lambda slot=local: pool.release(slot)),
                              settle_s=RELEASE_SETTLE_S, agent=peer.agent)
            with self._lock:
                self._sending -= 1
        return Moved(job.nbytes, fragments, chunk_modes.STAGED, why)

    def _hold(self, take: Callable[[], Any], wait: Callable[[], Any], in_flight: deque[tuple[Any, Any]],
              peer: NixlPeer, deadline: float, pool: StagingPool | None) -> Any:
        """A slot (local staging, or a remote landing credit): ``take`` one that is free, else finish
        this chunk's oldest block on the wire (its slots come back only as it completes) and try
        again, and ``wait`` only while holding none: threads that each hold slots on the wire and
        wait for another would starve each other until the deadline."""
        got = take()
        while got is None and in_flight:
            self._finish(in_flight.popleft(), peer, deadline, pool)
            got = take()
        return got if got is not None else wait()

    def _post_block(self, peer: NixlPeer, credits: Credits | None, remote_slot: int | None, local: np.ndarray,
                    remote: np.ndarray, local_device: int, remote_device: int, notif: bytes,
                    release: Callable[[], None] | None) -> Any:
        """WRITE one block (host memory, or a GPU); ``release`` frees its local staging slot once done."""
        try:
            return self._post(local, _mem(local_device), remote, _mem(remote_device), peer.agent, notif,
                              after=release)
        except TransferError as exc:
            if credits is not None and remote_slot is not None and not getattr(exc, "posted", True):
                credits.release(remote_slot)  # nothing was posted: the landing slot is still ours
            raise  # else it stays taken: a WRITE that may still land there must not meet another

    def _finish(self, in_flight: tuple[Any, Any], peer: NixlPeer, deadline: float, pool: StagingPool | None) -> None:
        handle, local = in_flight
        try:
            self._wait(handle, peer, deadline)
        finally:
            self._release(handle, None if local is None else (lambda: pool.release(local)), settle_s=RELEASE_SETTLE_S,
                          agent=peer.agent)

    def _slot_address(self, slot: Any) -> int:
        """Address of a local staging slot, registered with NIXL on its first use (the pool keeps slots)."""
        address = slot.data_ptr()
        device = _device(slot)
        with self._lock:
            if address not in self._slot_regs:
                rows = np.array([[address, slot.numel(), max(device, 0)]], dtype=np.uint64)
                self._slot_regs[address] = self.agent.register_memory(rows, _mem(device))
        return address

    def _pool_for(self, job: ChunkJob) -> StagingPool:
        """Staging beside the source memory: the host pool for host regions, one pool per GPU (as
        large as the host pool, allocated as used) for device regions, so a sliced GPU transfer
        gathers on its own GPU and crosses PCIe never."""
        assert self.staging is not None
        device = _device(next(job.regions()).flat)
        if device < 0:
            return self.staging
        with self._lock:
            pool = self._device_pools.get(device)
            if pool is None:
                pool = self._device_pools[device] = StagingPool(
                    self.staging.capacity * self.staging.slot_bytes, self.staging.slot_bytes, device=f"cuda:{device}")
        return pool

    def _local_bases(self, rank: Rank, layers: tuple[int, int], kinds: tuple[str, ...]) -> tuple[np.ndarray, int, int]:
        with self._lock:
            reg = self._ranks.get(rank.id)
        if reg is None or reg.rank is not rank:
            raise TransferError(f"rank {rank.id} is not registered with NIXL", field="transport",
                                fix="see the daemon log for event=nixl_register_failed")
        names = [(layer, kind) for layer in range(*layers) for kind in kinds]
        bases = np.array([reg.addresses[name] for name in names], dtype=np.uint64)
        # the bound of the regions written from (a cache group's regions differ in size from the rest)
        return bases, min(rank.regions[name].nbytes for name in names), reg.device

    def _notify(self, agent: str, notif: bytes) -> None:
        try:
            self.agent.send_notif(agent, notif)
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"NIXL notification to {agent} failed: {_why(exc)}", field="transport",
                                fix="check the decode daemon is up") from None

    def _post(self, local: np.ndarray, local_mem: str, remote: np.ndarray, remote_mem: str, agent: str,
              notif: bytes, after: Callable[[], None] | None = None) -> Any:
        """Start one WRITE; the notification reaches ``agent`` after its bytes.

        ``after`` runs once nothing reads the local side any more. If preparing fails, nothing
        was posted: TransferError with ``posted`` False. If starting fails, some bytes may still move.
        """
        try:
            handle = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(local, local_mem),
                                                self.agent.get_xfer_descs(remote, remote_mem), agent, notif)
        except Exception as exc:  # noqa: BLE001
            if after is not None:
                after()
            error = TransferError(f"NIXL could not prepare a WRITE of {local.shape[0]} segments to {agent}: "
                                  f"{_why(exc)}", field="transport",
                                  fix="check the decode daemon is up and its regions registered")
            error.posted = False  # type: ignore[attr-defined]
            raise error from None
        try:
            state = self.agent.transfer(handle)
        except Exception as exc:  # noqa: BLE001
            self._release(handle, after, agent=agent)
            raise TransferError(f"NIXL WRITE to {agent} failed: {_why(exc)}", field="transport",
                                fix="check the decode daemon and the network path to it") from None
        if state not in ("PROC", "DONE"):
            self._release(handle, after, agent=agent)
            raise TransferError(f"NIXL WRITE to {agent} ended in state {state}", field="transport",
                                fix="check the decode daemon and the network path to it")
        return handle

    def _wait(self, handle: Any, peer: NixlPeer, deadline: float) -> None:
        """Drive a posted WRITE to DONE; raise if it errs, the peer dies, the daemon stops or time runs out."""
        agent = peer.agent
        try:
            state = self.agent.check_xfer_state(handle)
            pause = 0.0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(f"NIXL WRITE to {agent} did not complete within {self.timeout_s}s",
                                        field="timeouts.transfer_s", code="transfer_timeout",
                                        fix="check the network path to the decode daemon")
                if self._closed.is_set():
                    raise TransferError("daemon shut down during a NIXL WRITE", field="transport",
                                        code="shutdown")
                if peer.dead:  # a peer gone silent (no RST on the path) would otherwise hold the thread
                    raise TransferError(f"NIXL WRITE to {agent} abandoned: {peer.dead}", field="transport",
                                        code="peer_dead")
                if pause:
                    time.sleep(pause)
                pause = min(pause * 2 or 2e-5, 5e-4)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"NIXL WRITE to {agent} ended in state {state}", field="transport",
                                    fix="check the decode daemon and the network path to it")
        except KvxferError:
            raise
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own types (remote disconnect, backend errors)
            raise TransferError(f"NIXL WRITE to {agent} failed: {_why(exc)}", field="transport",
                                fix="check the decode daemon and the network path to it") from None

    def _release(self, handle: Any, after: Callable[[], None] | None = None, settle_s: float = 0.0,
                 agent: str = "") -> None:
        """Release a transfer handle; ``after`` runs once NIXL has let go of it (at once, or on a retry).

        A handle NIXL will not release yet may still be reading its source: a staging slot it
        reads from must not be reused before then, or a late WRITE would carry another block's bytes.
        After a failed WRITE the data thread keeps trying for ``settle_s`` (driving progress), so
        that its job returns, and the request's fence is answered, only once nothing moves.
        """
        until = time.monotonic() + settle_s
        while True:
            try:
                handle.release()
            except Exception as exc:  # noqa: BLE001 - an active transfer may not cancel at once
                if time.monotonic() < until:
                    try:
                        self.agent.check_xfer_state(handle)
                    except Exception:  # noqa: BLE001 - only progress is wanted here
                        pass
                    time.sleep(1e-3)
                    continue
                self._defer(handle, after, _why(exc), agent)
                return
            if after is not None:
                after()
            return

    def _defer(self, handle: Any, after: Callable[[], None] | None, why: str, agent: str) -> None:
        log.warning("event=nixl_release_deferred agent=%s error=%s", q(agent), q(why))
        with self._lock:
            self._unreleased.append((handle, after, agent))
            dropped = self._unreleased[:-MAX_UNRELEASED]
            del self._unreleased[:-MAX_UNRELEASED]
        if dropped:  # their slots stay out of the pool for good: a bounded leak, never a reuse
            log.warning("event=nixl_release_abandoned handles=%d", len(dropped))

    def _retry_releases(self) -> None:
        with self._lock:
            pending, self._unreleased = self._unreleased, []
        for handle, after, agent in pending:
            self._release(handle, after, agent=agent)

    def credits_out(self) -> dict[str, int]:
        """Prefill side: per destination agent, landing slots written and not yet handed back."""
        with self._lock:
            credits = list(self._credits.items())
        return {agent: c.outstanding for agent, c in credits}

    def registrations(self) -> dict[str, int]:
        """What this agent holds now, for ``status``: a soak compares it before and after churn."""
        rings = self.landing.ring_count  # outside our lock: the rings have their own
        registered = self.registered_bytes()
        with self._lock:
            return {"engine_memory": "private" if self.private else "exposed",
                    "ranks": len(self._ranks), "ranks_unexposed": len(self._unexposed),
                    **{f"{memory}_bytes": nbytes for memory, nbytes in registered.items()},
                    "staging_slots": len(self._slot_regs),
                    "device_staging_pools": len(self._device_pools),
                    "landing_rings": rings, "remote_agents": len(self._loaded),
                    "remote_agents_to_drop": len(self._forget_at), "credit_rings": len(self._credits),
                    "unreleased_notifications": len(self._unreleased)}

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2)
        self._retry_releases()
        self._scatterers.shutdown(wait=True, cancel_futures=True)
        self.landing.close()


def _gather_block(job: ChunkJob, regions: list[Any], pieces: list[Any], local: Any) -> None:
    """Pack one block's pieces (head slices of some tokens of some regions) into a staging slot."""
    w = job.writer
    for piece in pieces:
        out = local[piece.offset:piece.offset + (piece.hi - piece.lo) * w.slice_bytes]
        gather(regions[piece.region].flat, job.src_slots[piece.lo:piece.hi], w.src_row_bytes,
               job.head_offset, w.slice_bytes, out)


def _with_device(rows: np.ndarray, device: int) -> np.ndarray:
    """(address, length) rows as NIXL's (address, length, device id) rows."""
    out = np.empty((rows.shape[0], 3), dtype=np.uint64)
    out[:, :2] = rows
    out[:, 2] = max(device, 0)
    return out


def _device(t: Any) -> int:
    """GPU index of a tensor, -1 for host memory (NIXL's DRAM)."""
    return int(t.device.index or 0) if t.device.type == "cuda" else -1

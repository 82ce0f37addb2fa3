"""NIXL's receiving side: the daemon's NIXL thread polls notifications (which also drives
UCX progress for WRITEs landing here), admits each chunk header through the inbox, and
scatters staged blocks from landing slots. Mixed into :class:`.transport.NixlTransport`."""

from __future__ import annotations

import logging
import time
from typing import Any

from ...wire import protocol
from ...datapath.copier import scatter, settle
from ...errors import IntegrityError, KvxferError, ProtocolError, RequestError
from ...lifecycle.inbox import DestEntry, Sink
from ...ops.logutil import q
from ...model.geometry import rank_id
from ...datapath.staging import block_bytes
from ...lifecycle.jobs import Moved
from .staging import Assembly, LandingRing

log = logging.getLogger("kvxferd.nixl")

#: the NIXL thread's pause between polls: right after a notification, while requests are
#: open here (UCX over TCP also needs the receiver's progress for data to land), and idle
POLL_BUSY_S, POLL_ACTIVE_S, POLL_IDLE_S = 5e-5, 2e-4, 1e-2
POLL_BUSY_ROUNDS = 200  # short pauses after the last notification


def _hashes(sink: Sink) -> bool:
    """Its landed check hashes pages (digests came, or were asked for)."""
    return sink.sample is not None or sink.entry.integrity is not None


def _code(exc: KvxferError) -> str:
    """What a refused header fails its request with: ``integrity`` where it differs from what its
    source sent (the inbox failed the request so already), else ``peer_refused``."""
    return exc.code if isinstance(exc, IntegrityError) else "peer_refused"


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:300]


class NixlReceiver:
    """Receive-side methods; the attributes they use are set by ``NixlTransport.__init__``."""

    agent: Any
    inbox: Any
    private: bool
    on_nixl_refused: Any

    # -- receiving -------------------------------------------------------------------
    def _poll_loop(self) -> None:
        busy = 0
        last_retry = time.monotonic()
        while not self._closed.is_set():
            try:
                notifs = self.agent.get_new_notifs()
            except Exception as exc:  # noqa: BLE001 - keep polling; one bad round must not stop receiving
                log.warning("event=nixl_poll_failed error=%s", _why(exc))
                notifs = {}
                self._closed.wait(0.05)
            for sender, messages in notifs.items():
                name = sender.decode() if isinstance(sender, bytes) else str(sender)
                for message in messages:
                    try:
                        self._deliver(name, message)
                    except Exception as exc:  # noqa: BLE001 - one notification must not stop all receiving
                        log.error("event=notification_crashed sender=%s error=%s", q(name), q(_why(exc)))
            busy = 0 if notifs else busy + 1
            if (self._unreleased or self._forget_at or self.landing.quarantined) and \
                    time.monotonic() - last_retry > 1.0:
                last_retry = time.monotonic()
                self._retry_releases()
                self._drop_forgotten()
                # a retired ring's memory goes when its quarantine ends, not only when the next ring is made
                # (after a peer restart no new link may come for a long time)
                self.landing.sweep()
            if busy < POLL_BUSY_ROUNDS:
                self._closed.wait(POLL_BUSY_S)
            else:
                self._closed.wait(POLL_ACTIVE_S if self._sending or len(self.inbox) else POLL_IDLE_S)

    def _deliver(self, sender: str, message: bytes) -> None:
        """One notification: a chunk's or staged block's data header, or a landing slot handed back."""
        try:
            msg = protocol.decode(bytes(message), self.max_header_bytes)
            if msg["op"] == "free":
                self._freed(sender, protocol.NIXL_FREE.check(msg))
                return
            if msg["op"] != "data":
                raise ProtocolError(f"NIXL notification with op {msg['op'][:32]!r}", field="op",
                                    fix="notify with data headers (and free) only")
            header = protocol.DATA_HEADER.check(msg)
        except KvxferError as exc:
            log.warning("event=chunk_refused transport=nixl sender=%s code=%s msg=%s", q(sender), exc.code,
                        q(str(exc)[:300]))
            if self.on_invalid:
                self.on_invalid(exc.code)
            return
        if "slot" in header or "ring" in header:
            self._land(sender, header)
            return
        if self.private and ("block" in header or header["nbytes"] > 0):
            # nothing of the engines' memory was described to any source: a chunk said to be written
            # in place never was by a source this daemon trusts, and is not taken as landed
            if self.on_nixl_refused:
                self.on_nixl_refused("in_place_private")
            self._refuse(sender, header, rank_id(header["decode_instance"], *header["dst"]), "peer_refused",
                         f"{'block' if 'block' in header else 'chunk'} [{header['start']}, {header['end']}) from "
                         f"{list(header['src'])} says it was written in place, but this daemon keeps its engines' "
                         f"memory private (peer.nixl_engine_memory): every block must land in the link's "
                         f"landing ring")
            return
        if "block" in header:
            self._placed(sender, header)
            return
        dest_rank = rank_id(header["decode_instance"], *header["dst"])
        if header.get("trailer"):  # a direct WRITE's header is sent after it: its digests are in it
            self._refuse(sender, header, dest_rank, "peer_refused", "direct chunk notification says its digests "
                         "trail it; a direct NIXL chunk's header carries them (trailer is for staged blocks)")
            return
        sink = self._begin(sender, header, dest_rank)
        if sink is None:
            return
        moved = Moved(sink.nbytes, 0, "direct")
        if _hashes(sink):  # the check reads the chunk's pages: not on this thread, which drives UCX
            self._scatterers.submit(self._finish_checked, sink, moved)
            return
        self.inbox.finish(sink, True, "nixl")
        if self.on_received:
            self.on_received(sink, moved)

    def _finish_checked(self, sink: Sink, moved: Moved) -> None:
        """A landed direct chunk whose digests are checked, on a scatter thread: a digest that
        differs fails the request in there."""
        try:
            self.inbox.finish(sink, True, "nixl")
            if self.on_received:
                self.on_received(sink, moved)
        except Exception as exc:  # noqa: BLE001 - a scatter thread must survive any one chunk
            log.error("event=check_crashed request=%s error=%s", q(sink.entry.request_id[:64]), q(_why(exc)))

    def _begin(self, sender: str, header: dict[str, Any], dest_rank: str) -> Sink | None:
        """The inbox checks of a data header, plus: only the request's own source agent may send it."""
        try:
            sink = self.inbox.begin(header, dest_rank, "nixl")
        except KvxferError as exc:
            self._refuse(sender, header, dest_rank, _code(exc),
                         f"chunk [{header['start']}, {header['end']}) from {list(header['src'])} refused: {exc}")
            return None
        source = sink.entry.daemon_of(tuple(sink.writer.src))
        if self.source_agents.get(source) != sender:
            # not counted, and not allowed to fail the request either: that would let any peer
            # holding this daemon's metadata fail requests it does not serve
            self.inbox.finish(sink, False)
            self._refuse(sender, header, dest_rank, "peer_refused",
                         f"chunk notification from NIXL agent {sender!r}, which is not the agent of source "
                         f"daemon {source or '(local)'} (holding rank {list(sink.writer.src)})")
            return None
        return sink

    def _land(self, sender: str, header: dict[str, Any]) -> None:
        """A staged block sits in a landing slot: claim the slot and hand the scatter to a scatter
        thread, so this thread keeps driving UCX (over TCP, bytes land only while it progresses)."""
        ring = self.landing.by_agent(sender)
        slot = header.get("slot", -1)
        problem = ""
        if ring is None or header.get("ring") != ring.ring or not 0 <= slot < ring.count:
            problem = (f"staged block names ring {header.get('ring')} slot {slot}; agent {sender!r} holds "
                       f"{f'ring {ring.ring} of {ring.count} slots' if ring else 'no ring here'}")
            if self.on_nixl_refused:
                self.on_nixl_refused("foreign_ring")
        elif "block" not in header or not 0 < header.get("pack", 0) <= ring.slot_bytes:
            problem = f"staged block without block index, or pack {header.get('pack')} outside (0, {ring.slot_bytes}]"
        elif not ring.claim(slot):
            problem = f"staged block into slot {slot}, which still holds a block being scattered"
        if problem:
            log.warning("event=chunk_refused transport=nixl sender=%s code=protocol_error msg=%s", q(sender),
                        q(problem))
            if self.on_invalid:
                self.on_invalid("protocol_error")
            return  # not a slot this sender may use now: nothing to free, nothing it may fail
        assert ring is not None
        self._scatterers.submit(self._scatter_block, sender, ring, slot, header)

    def _placed(self, sender: str, header: dict[str, Any]) -> None:
        """A block written in place into the decode pages (:mod:`.blocks`, ``place``): its bytes
        are where they belong; the chunk is received when its last block is in."""
        dest_rank = rank_id(header["decode_instance"], *header["dst"])
        if "pack" not in header:
            self._refuse(sender, header, dest_rank, "peer_refused", "block without its pack size")
            return
        try:
            asm, pieces = self.assemblies.start_block(header, dest_rank, sender, lambda sink: self._check_source(
                sender, sink))
        except KvxferError as exc:
            self._refuse(sender, header, dest_rank, _code(exc), f"block {header['block']} of chunk "
                         f"[{header['start']}, {header['end']}) from {list(header['src'])} refused: {exc}")
            return
        moved = Moved(block_bytes(pieces, asm.sink.writer.slice_bytes), 1, "staged")
        if _hashes(asm.sink):  # its last block's end checks the chunk's pages: not on this thread
            self._scatterers.submit(self._end_placed, asm, moved)
            return
        self.assemblies.end_block(asm, True)
        if self.on_received:
            self.on_received(asm.sink, moved)

    def _end_placed(self, asm: Assembly, moved: Moved) -> None:
        try:
            self.assemblies.end_block(asm, True)  # the last block's end checks the chunk's digests
            if self.on_received:
                self.on_received(asm.sink, moved)
        except Exception as exc:  # noqa: BLE001 - a scatter thread must survive any one block
            log.error("event=check_crashed request=%s error=%s", q(asm.sink.entry.request_id[:64]), q(_why(exc)))

    def _scatter_block(self, sender: str, ring: LandingRing, slot: int, header: dict[str, Any]) -> None:
        freed = False
        try:
            dest_rank = rank_id(header["decode_instance"], *header["dst"])
            try:
                asm, pieces = self.assemblies.start_block(header, dest_rank, sender, lambda sink: self._check_source(
                    sender, sink))
            except KvxferError as exc:
                self._refuse(sender, header, dest_rank, _code(exc), f"staged block {header['block']} of chunk "
                             f"[{header['start']}, {header['end']}) from {list(header['src'])} refused: {exc}")
                return
            sink = asm.sink
            w = sink.writer
            ok = False
            block = ring.slot(slot, block_bytes(pieces, w.slice_bytes))
            try:
                for piece in pieces:
                    part = block[piece.offset:piece.offset + (piece.hi - piece.lo) * w.slice_bytes]
                    scatter(asm.regions[piece.region].flat, sink.dst_slots[piece.lo:piece.hi], w.dst_row_bytes,
                            sink.head_offset, w.slice_bytes, part)
                settle(asm.regions[piece.region].flat for piece in pieces)
                ok = True
            except Exception as exc:  # noqa: BLE001 - fail this request, keep receiving
                log.warning("event=scatter_failed request=%s rank=%s error=%s", q(header["request_id"][:64]), dest_rank,
                            q(_why(exc)))
            finally:
                # the slot is read: the sender may write it again while this block's end (for a chunk's
                # last block, the check of all its pages) runs
                self._free_slot(sender, ring, slot)
                freed = True
                self.assemblies.end_block(asm, ok)
            if not ok:
                self._refuse(sender, header, dest_rank, "transfer", "scattering a staged block into the decode pages "
                                                              "failed (see the decode daemon log)")
            elif self.on_received:
                self.on_received(sink, Moved(block.numel(), 1, "staged"))
        except Exception as exc:  # noqa: BLE001 - a scatter thread must survive any one block
            log.error("event=scatter_crashed sender=%s error=%s", q(sender), q(_why(exc)))
        finally:
            if not freed:  # whatever became of the block, the slot is read
                self._free_slot(sender, ring, slot)

    def _free_slot(self, sender: str, ring: LandingRing, slot: int) -> None:
        """Hand a landing slot back to the sender that wrote it."""
        ring.unclaim(slot)
        try:
            self.agent.send_notif(sender, protocol.encode({"op": "free", "ring": ring.ring, "slot": slot}))
        except Exception as exc:  # noqa: BLE001 - the sender then runs out of credits and fails clearly
            log.warning("event=nixl_free_failed peer=%s ring=%s slot=%s error=%s", q(sender), ring.ring, slot,
                        q(_why(exc)))

    def _check_source(self, sender: str, sink: Sink) -> None:
        source = sink.entry.daemon_of(tuple(sink.writer.src))
        if self.source_agents.get(source) != sender:
            raise RequestError(f"notification from NIXL agent {sender!r}, which is not the agent of source daemon "
                               f"{source or '(local)'} (holding rank {list(sink.writer.src)})", field="sender",
                               fix="send blocks only for requests this daemon is the source of")

    def stop_receiving(self, entry: DestEntry) -> None:
        """The request failed: staged chunks still assembling end as failed once no block of theirs is busy."""
        self.assemblies.abandon(entry)

    def _freed(self, sender: str, msg: dict[str, Any]) -> None:
        with self._lock:
            credits = self._credits.get(sender)
        if credits is None or credits.info.ring != msg["ring"] or not credits.release(msg["slot"]):
            log.info("event=nixl_free_ignored peer=%s ring=%s slot=%s", q(sender), msg["ring"], msg["slot"])

    def _refuse(self, sender: str, header: dict[str, Any], dest_rank: str, code: str, message: str) -> None:
        log.warning("event=chunk_refused transport=nixl sender=%s request=%s rank=%s code=%s msg=%s", q(sender),
                    q(header["request_id"][:64]), q(dest_rank), code, q(message[:300]))
        if self.on_invalid:
            self.on_invalid(code)
        entry = self.inbox.get(header["request_id"], dest_rank)
        # only the request's own source may fail it: any other agent could name any request id
        if (entry is not None and self.on_refused is not None
                and any(self.source_agents.get(a) == sender for a in entry.source_addresses())):
            self.on_refused(entry, code, message)

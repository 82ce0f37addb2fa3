"""The built-in network transport: plain TCP data connections between daemons.

A new connection first proves which peer link it belongs to (the receiver's challenge, the
sender's hello: :mod:`.tcp_proof`), within a short deadline; each frame then must arrive whole
within a deadline of its own (:mod:`.tcp_guard`).

One frame per chunk: a length-prefixed msgpack header, the payload in wire order (then, where
integrity checks every slot, a frame with the source's digests, taken as the bytes left), then
a length-prefixed reply from the receiver once every byte is in place and checked. Small chunks to one
peer go back to back on one connection before their replies are read (:meth:`TcpTransport.
send_many`): the receiver handles frames in order either way, so a connection carries one
round trip per batch instead of one per chunk. A receiver refuses a small chunk on its own
(it reads past its payload and goes on with the next frame); a larger refused chunk ends
the connection, since its payload is not worth reading. Large contiguous runs
go straight between KV pages and the socket (``sendmsg`` of page views, ``recv_into`` page
views); small fragments (head slices, tiny pages) are gathered into staging slots (see
:mod:`kvxferd.datapath.staging`) with one index kernel per piece, so syscalls stay few.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable

import torch

from ..datapath.copier import scatter, settle
from ..datapath.digest import RunningDigests, batches
from ..datapath.pipeline import receive_blocks, send_blocks
from ..datapath.staging import Piece, StagingPool, block_bytes, pack
from ..errors import IntegrityError, KvxferError, PeerHungUp, ProtocolError, RequestError, TransferError
from ..lifecycle.inbox import Inbox, Sink
from ..lifecycle.jobs import ChunkJob, Moved
from ..model.geometry import rank_id
from ..model.qos import BULK, LATENCY
from ..wire import protocol
from ..wire.auth import RefusalBook
from . import chunk_modes, tcp_proof
from .base import SMALL_CHUNK, nice_this_thread
from .framing import FrameReader, gather_block, payload_runs, read_frame, sendmsg_all, use_staging
from .tcp_batch import send_batch
from .tcp_guard import ConnectionGuard, Deadlines, Watched

log = logging.getLogger("kvxferd.tcp")

IDLE_TIMEOUT_S = 300.0  # an idle data connection is closed after this long
FIRST_HEADER_TIMEOUT_S = 10.0  # one recv of a new connection's hello (its whole proof has Deadlines.proof_s)
ACCEPT_BACKOFF_S = (0.05, 1.0)  # after an accept loop error: first pause, longest pause
PROOF_ATTEMPTS = 3  # new connections a sender tries when one is closed before it proved itself
MAX_HEADER_BYTES = protocol.MAX_AUX_BYTES + 64 * 1024  # aux bytes ride in the header
MAX_STOPPED = 4096  # failed sources remembered so their queued chunks do not leave


ACK_OK = protocol.frame({"op": "ack", "ok": True})


class _Replies:
    """Replies a receiver holds back while it has more frames in hand: they leave together when it
    would wait for the socket, or when the connection ends."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.pending = bytearray()

    def add(self, reply: bytes) -> None:
        self.pending += reply

    def flush(self) -> None:
        if self.pending:
            try:
                self.conn.sendall(self.pending)
            except OSError:
                pass  # the sender went away: it reads no reply
            self.pending.clear()


class _Timeouts:
    """``settimeout`` only when the value changes (each call is a system call)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.now: float | None = None

    def set(self, seconds: float) -> None:
        if seconds != self.now:
            self.conn.settimeout(seconds)
            self.now = seconds


def _stopped_error(job: ChunkJob) -> TransferError:
    return TransferError(f"request {job.request_id!r} failed at {job.rank.id} before this chunk left",
                         field="request_id", fix="the request's own failure says why")


def _shut_down(conns: list[socket.socket]) -> int:
    """Shut connections down both ways: whatever thread blocks on one returns at once (the thread
    that owns it still closes it)."""
    for conn in conns:
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    return len(conns)


def _alive(sock: socket.socket) -> bool:
    """An idle pooled connection is usable only if nothing (EOF, stray bytes) is readable."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


class TcpDataServer:
    """Accepts data connections from peer daemons and writes chunks via the inbox."""

    def __init__(self, host: str, port: int, inbox: Inbox, *, max_header_bytes: int,
                 timeout_s: float, staging: StagingPool, max_connections: int = 64,
                 on_received: Callable[[Sink, Moved], None] | None = None,
                 on_invalid: Callable[[str], None] | None = None,
                 keys: tcp_proof.LinkKeys | None = None, deadlines: Deadlines = Deadlines(),
                 on_conn_refused: Callable[[str], None] | None = None,
                 on_accept_error: Callable[[], None] | None = None, bulk_nice: int = 0) -> None:
        self.inbox = inbox
        #: QoS: the nice value a connection's thread takes from its first chunk of the bulk lane on
        #: (the sender keeps each lane's chunks on connections of their own; 0: none)
        self.bulk_nice = bulk_nice
        #: the link tokens a connection may prove (none: no connection proves itself)
        self.keys = keys if keys is not None else tcp_proof.LinkKeys()
        self.on_conn_refused = on_conn_refused  # a connection refused or cut, by reason (a metric)
        self.on_accept_error = on_accept_error
        self.refusals = RefusalBook()  # refused connections by (reason, peer): one log line each, repeats summed
        self.guard = ConnectionGuard(deadlines, self._guard_closed)
        self.max_header_bytes = min(max_header_bytes, MAX_HEADER_BYTES)
        self.max_per_host = max(2, max_connections // 4)  # one host cannot take every slot
        self._per_host: dict[str, int] = {}
        self._receiving: dict[socket.socket, tuple[Any, int]] = {}  # connection -> destination, chunk bytes
        self.timeout_s = timeout_s
        self.staging = staging
        self.on_received = on_received
        self.on_invalid = on_invalid
        self._sem = threading.BoundedSemaphore(max_connections)
        self._sock = socket.create_server((host, port), reuse_port=False, backlog=128)
        self.port = self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="kvxferd-data-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        """Accept until closed, whatever goes wrong with one connection (no thread to be had, no
        descriptor left): log it, count it, pause briefly, go on."""
        pause = ACCEPT_BACKOFF_S[0]
        while not self._closed.is_set():
            try:
                conn, addr = self._sock.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return
                pause = self._accept_failed(exc, pause)
                continue
            try:
                self._start(conn, addr[0])
            except Exception as exc:  # noqa: BLE001 - this connection goes; the port keeps serving
                conn.close()
                pause = self._accept_failed(exc, pause)
                continue
            pause = ACCEPT_BACKOFF_S[0]

    def _accept_failed(self, exc: BaseException, pause: float) -> float:
        """Count and log an accept loop error, pause; the next pause (doubled, bounded)."""
        if self.on_accept_error:
            self.on_accept_error()
        log.warning("event=data_accept_error error=%s msg=%s pause_s=%.2f", type(exc).__name__,
                    json.dumps(str(exc)[:200]), pause)
        self._closed.wait(pause)
        return min(pause * 2, ACCEPT_BACKOFF_S[1])

    def _start(self, conn: socket.socket, host: str) -> None:
        """A new connection on the unproven cap, and its thread."""
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(FIRST_HEADER_TIMEOUT_S)
        watched = self.guard.admit(conn, host)
        with self._lock:
            self._conns.add(conn)
        try:
            threading.Thread(target=self._serve, args=(conn, watched), name="kvxferd-data-recv", daemon=True).start()
        except BaseException:
            with self._lock:
                self._conns.discard(conn)
            self.guard.forget(watched)
            raise

    def _guard_closed(self, watched: Watched, reason: str) -> None:
        self._note_refused(reason, watched.peer, f"closed by the guard ({reason}); proven={watched.proven}")

    def _note_refused(self, reason: str, peer: str, message: str) -> None:
        """A connection refused or cut: counted; logged once per (reason, peer), repeats summed."""
        if self.on_conn_refused:
            self.on_conn_refused(reason)
        record, log_now = self.refusals.note(reason, kind=reason, peer=peer)
        if log_now:
            log.warning("event=data_conn_refused reason=%s peer=%s count=%s msg=%s", reason, peer,
                        record["count"], json.dumps(message[:300]))

    def _prove(self, conn: socket.socket, replies: "_Replies", watched: Watched) -> bytes | None:
        """The challenge out, the hello in: the link token this connection proved, or None (refused,
        or gone before it proved anything)."""
        nonce, challenge = tcp_proof.challenge()
        try:
            conn.sendall(challenge)
            hello = read_frame(conn, tcp_proof.MAX_HELLO_BYTES)  # exactly the hello: its first chunk stays queued
            return tcp_proof.check_hello(hello, nonce, self.keys)
        except (ConnectionError, OSError):
            return None  # went away, or cut by the guard (counted there)
        except ProtocolError as exc:  # not even a frame of a hello's size
            refusal = tcp_proof.ProofRefused(f"a data connection's first frame must be a hello: {exc.message}",
                                             tcp_proof.NO_HELLO)
        except tcp_proof.ProofRefused as exc:
            refusal = exc
        self._note_refused(refusal.reason, watched.peer, str(refusal))
        replies.add(protocol.frame({"op": "ack", "ok": False, "error": refusal.to_wire()}))
        return None

    def _take_slot(self, watched: Watched, replies: "_Replies") -> bool:
        """A proven connection takes one of the port's slots (at most a quarter of them per host)."""
        host = watched.peer
        with self._lock:
            crowded = self._per_host.get(host, 0) >= self.max_per_host
            if not crowded and self._sem.acquire(blocking=False):
                self._per_host[host] = self._per_host.get(host, 0) + 1
                return True
        reason = "per_host_cap" if crowded else "too_many_connections"
        error = TransferError(f"data port has no connection slot for {host} ({reason}: at most "
                              f"{self.max_per_host} per host)", field="connections", code=reason,
                              fix="use fewer data connections per peer (peer.data_connections)")
        self._note_refused(reason, host, str(error))
        replies.add(protocol.frame({"op": "ack", "ok": False, "error": error.to_wire()}))
        return False

    def _serve(self, conn: socket.socket, watched: Watched) -> None:
        replies = _Replies(conn)
        timeouts = _Timeouts(conn)
        slot = False  # proven, and holding one of the port's slots
        niced = False
        try:
            token = self._prove(conn, replies, watched)
            slot = token is not None and self._take_slot(watched, replies)
            if not slot:
                return
            self.guard.proven(watched)  # off the unproven cap
            reader = FrameReader(conn, before_wait=replies.flush)  # replies leave when nothing more is to read
            while not self._closed.is_set():
                self.guard.between_frames(watched)
                try:
                    timeouts.set(IDLE_TIMEOUT_S)
                    reader.wait()  # the next frame's first bytes: from here it has a deadline to arrive whole
                    started = self.guard.frame_started(watched)
                    header = reader.frame(self.max_header_bytes)
                    nbytes = header.get("nbytes")
                    if isinstance(nbytes, int) and nbytes >= 0:
                        self.guard.frame_size(watched, started, nbytes)
                    if not (isinstance(nbytes, int) and 0 <= nbytes <= reader.buffered):
                        # the payload is still to come: a transfer's timeout now, not an idle one (a
                        # small chunk read whole with its header waits on nothing: no system call)
                        timeouts.set(self.timeout_s)
                except (ConnectionError, OSError):
                    return  # peer closed between chunks, or timed out idle
                except ProtocolError as exc:  # oversize length prefix or undecodable header: say so, hang up
                    self._refuse(replies, exc)
                    return
                try:
                    if header.get("op") != "data":
                        raise ProtocolError(f"data connection got op {str(header.get('op'))[:32]!r}", field="op",
                                            fix="send data frames only on data connections")
                    header = protocol.DATA_HEADER.check(header)
                    said = header.get("token")
                    if said is not None and said != token:
                        raise RequestError("data header carries another link's token than the one this "
                                           "connection proved", field="token",
                                           fix="send each link's chunks on connections proven with its token")
                    header["token"] = token  # every chunk on this connection is the proven link's
                    if not niced and header.get("lane") == BULK:
                        nice_this_thread(self.bulk_nice)  # for good: the connection is the bulk lane's
                        niced = True
                    sink = self.inbox.begin(header, rank_id(header["decode_instance"], *header["dst"]), "tcp")
                    if sink.trailer:  # the digests are still to come, whatever the payload's size
                        timeouts.set(self.timeout_s)
                except KvxferError as exc:
                    self._refuse(replies, exc)
                    if isinstance(header.get("nbytes"), int) and 0 <= header["nbytes"] <= SMALL_CHUNK:
                        reader.skip(header["nbytes"])  # chunks behind it on this connection go on
                        if header.get("trailer") is True:
                            reader.frame(self.max_header_bytes)  # its digests, unread
                        continue
                    return  # a large payload is not worth reading: drop the connection
                ok = False
                with self._lock:
                    self._receiving[conn] = (sink.entry, sink.nbytes)
                try:
                    moved = self._receive(reader, sink)
                    bad_trailer = self._trailer(reader, sink)
                    ok = bad_trailer is None
                finally:
                    with self._lock:
                        self._receiving.pop(conn, None)
                    failed = self.inbox.finish(sink, ok, "tcp")
                if failed is None and self.on_received:
                    self.on_received(sink, moved)
                # the connection may now wait idle for minutes: nothing of this chunk may stay referenced, or
                # its sink (the destination rank's regions) keeps a departed engine's KV cache mapped
                del sink, moved
                if bad_trailer is not None:  # the payload came, its digests frame is malformed: say so, hang up
                    self._refuse(replies, bad_trailer)
                    return
                if failed is not None:  # the bytes came, and differ from the source's: its sender hears why
                    replies.add(protocol.frame({"op": "ack", "ok": False, "error": failed.to_wire()}))
                    continue
                replies.add(ACK_OK)
        except Exception as exc:  # noqa: BLE001 - one broken connection must not stop the daemon
            log.info("event=data_conn_closed reason=%s msg=%s", type(exc).__name__, json.dumps(str(exc)[:300]))
        finally:
            replies.flush()
            self.guard.forget(watched)
            with self._lock:
                self._conns.discard(conn)
                if slot:
                    self._per_host[watched.peer] -= 1
                    if not self._per_host[watched.peer]:
                        del self._per_host[watched.peer]
            conn.close()
            if slot:
                self._sem.release()

    def _refuse(self, replies: "_Replies", exc: KvxferError) -> None:
        log.warning("event=chunk_refused code=%s field=%s msg=%s", exc.code, exc.field, json.dumps(str(exc)[:300]))
        if self.on_invalid:
            self.on_invalid(exc.code)
        replies.add(protocol.frame({"op": "ack", "ok": False, "error": exc.to_wire()}))

    def _trailer(self, reader: FrameReader, sink: Sink) -> ProtocolError | None:
        """The digests frame after a trailer chunk's payload, into ``sink.digests``; or why not."""
        if not sink.trailer:
            return None
        try:
            tail = reader.frame(self.max_header_bytes)
            if tail.get("op") != "digests":
                raise ProtocolError(f"chunk's payload was followed by op {str(tail.get('op'))[:32]!r}, its header "
                                    "said its digests would follow", field="op",
                                    fix="send the digests frame right after the payload of a chunk with trailer")
            sink.digests = protocol.DIGESTS_TRAILER.check(tail)["digests"]
        except ProtocolError as exc:
            return exc
        return None

    def _receive(self, reader: FrameReader, sink: Sink) -> Moved:
        w = sink.writer
        regions = sink.regions()
        runs = payload_runs(sink.dst_slots, w.dst_row_bytes, sink.head_offset, w.slice_bytes)
        cpu = all(r.is_cpu for r in regions)
        if not use_staging(runs, cpu, len(regions)):
            offsets, lengths = runs.offsets.tolist(), runs.lengths.tolist()
            running = self.inbox.running_digests(sink)
            if running is None:
                reader.read_into_many([region.view[off:off + n] for region in regions
                                       for off, n in zip(offsets, lengths)])
            else:  # each block hashed where it landed, while it is still in cache
                for batch in batches([region.view for region in regions], offsets, lengths):
                    reader.read_into_many([view for _, view in batch])
                    for i, view in batch:
                        running.add(i, view)
                sink.landed = running.digests()
            return Moved(sink.nbytes, len(runs) * len(regions), "direct")
        n_tokens = sink.dst_slots.size
        n = sink.nbytes

        def drain(block: list[Piece], data: torch.Tensor) -> None:
            for piece in block:
                scatter(regions[piece.region].flat, sink.dst_slots[piece.lo:piece.hi], w.dst_row_bytes,
                        sink.head_offset, w.slice_bytes,
                        data[piece.offset:piece.offset + (piece.hi - piece.lo) * w.slice_bytes])

        if cpu and 0 < n <= reader.capacity // 2:  # small: scattered from where the reader holds it, no slot
            (block,) = pack(len(regions), n_tokens, w.slice_bytes, max(n, w.slice_bytes))
            drain(block, torch.frombuffer(reader.take(n), dtype=torch.uint8))
            return Moved(n, 1, "staged")
        blocks = pack(len(regions), n_tokens, w.slice_bytes, self.staging.slot_bytes)

        def receive(block: list[Piece], slot: torch.Tensor) -> None:
            reader.read_into(memoryview(slot.numpy())[:block_bytes(block, w.slice_bytes)])

        # scatters of one block overlap the receipt of the next (two slots when the pool has them)
        receive_blocks(blocks, receive, drain, self.staging, self.timeout_s)
        settle(r.flat for r in regions)
        return Moved(sink.nbytes, len(blocks), "staged")

    def cut(self, entry: Any) -> int:
        """Break the connections writing a large chunk into ``entry`` (it failed): their threads
        stop at once, so the failure can be told without waiting for a dead sender's socket
        timeout."""
        with self._lock:
            # a small chunk ends by itself at once; cutting its connection would also fail the
            # chunks of other requests queued behind it there
            conns = [c for c, (e, nbytes) in self._receiving.items() if e is entry and nbytes > SMALL_CHUNK]
        return _shut_down(conns)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self.guard.close()
        with self._lock:
            conns = list(self._conns)
        _shut_down(conns)


class TcpTransport:
    """Sends chunks to peer daemons' data servers over pooled connections; receives through
    its :class:`TcpDataServer` once :meth:`listen` started it."""

    name = "tcp"
    one_sided = False
    server: TcpDataServer | None = None

    def listen(self, host: str, port: int, inbox: Inbox, **kwargs: Any) -> TcpDataServer:
        self.server = TcpDataServer(host, port, inbox, staging=self.staging, **kwargs)
        return self.server

    def stop_receiving(self, entry: Any) -> None:
        if self.server is not None:
            self.server.cut(entry)

    def __init__(self, *, timeout_s: float, max_reply_bytes: int, staging: StagingPool,
                 connections_per_peer: int = 2, lanes: bool = False) -> None:
        self.timeout_s = timeout_s
        self.max_reply_bytes = max_reply_bytes
        self.staging = staging
        self.connections_per_peer = connections_per_peer
        #: QoS: latency and bulk chunks travel on connections of their own (each header says which), so
        #: a receiver runs its bulk connections' threads at its ``qos.bulk_nice`` and a latency chunk is
        #: never queued in a socket behind a bulk one
        self.lanes = lanes
        self._idle: dict[tuple[tuple[str, int], str], list[socket.socket]] = {}  # (address, lane) -> idle
        #: connections carrying a large chunk now -> its source entry's serial (``ChunkJob.source``):
        #: what :meth:`stop_sending` cuts
        self._sending: dict[socket.socket, int] = {}
        #: sources stopped lately: a job of theirs that reaches a data thread only now ends at once
        self._stopped: OrderedDict[int, None] = OrderedDict()
        #: the link token each open connection proved (its hello); forgotten with the socket
        self._proven: "weakref.WeakKeyDictionary[socket.socket, bytes | None]" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def lane(self, jobs: list[ChunkJob]) -> str:
        """The connection lane of ``jobs`` (one chunk, or a batch): latency if any is, else bulk;
        ``""`` where the sender keeps no lanes (QoS off)."""
        if not self.lanes:
            return ""
        return LATENCY if any(job.qos.cls == LATENCY for job in jobs) else BULK

    def borrow(self, address: tuple[str, int], token: bytes | None = None, lane: str = "") -> socket.socket:
        """A connection to ``address`` proven with the link ``token``, for ``lane``'s chunks: a pooled
        one, or a new one that answered the receiver's challenge (:func:`.tcp_proof.prove`)."""
        with self._lock:
            idle = self._idle.get((address, lane), [])
            while idle:
                sock = idle.pop()
                if self._proven.get(sock) == token and _alive(sock):
                    return sock
                sock.close()  # the receiver closed it while idle, or it proved a link replaced since
        for attempt in range(PROOF_ATTEMPTS):
            try:
                sock = socket.create_connection(address, timeout=self.timeout_s)
            except OSError as exc:
                raise TransferError(f"cannot connect to data endpoint {address[0]}:{address[1]}: "
                                    f"{exc.strerror or exc}", field="data_address",
                                    fix="check the peer daemon is up and its data port reachable") from None
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                tcp_proof.prove(sock, token, address)
            except (OSError, ConnectionError) as exc:
                # closed before it could prove itself: a flood of strangers at the receiver may have
                # pushed it off the unproven cap; a new connection proves itself at once
                sock.close()
                if isinstance(exc, ConnectionError) and attempt + 1 < PROOF_ATTEMPTS:
                    continue  # (a timeout is a stalled receiver: not tried again)
                raise self.lost(address, exc) from None
            except BaseException:
                sock.close()
                raise
            with self._lock:
                self._proven[sock] = token
            return sock
        raise AssertionError("unreachable")

    def pooled(self, address: tuple[str, int]) -> list[socket.socket]:
        """The idle connections to ``address``, of every lane (for ``status`` and tests)."""
        with self._lock:
            return [s for (addr, _), idle in self._idle.items() if addr == address for s in idle]

    def give_back(self, address: tuple[str, int], sock: socket.socket, lane: str = "") -> None:
        with self._lock:
            idle = self._idle.setdefault((address, lane), [])
            if len(idle) < self.connections_per_peer:
                idle.append(sock)
                return
        sock.close()

    def stop_sending(self, source: int) -> int:
        """Break the connections sending a large chunk of this source (it failed): their jobs end at
        once instead of at a stalled or departed receiver's socket timeout. Small chunks end by
        themselves, and may share their connection with other requests' chunks."""
        with self._lock:
            self._stopped[source] = None
            while len(self._stopped) > MAX_STOPPED:
                self._stopped.popitem(last=False)
            conns = [c for c, owner in self._sending.items() if owner == source]
        return _shut_down(conns)

    def send(self, job: ChunkJob) -> Moved:
        assert job.data_address is not None
        key = job.source
        if key in self._stopped:  # failed while this job waited for a data thread
            raise _stopped_error(job)
        lane = self.lane([job])
        sock = self.borrow(job.data_address, job.token, lane)
        with self._lock:
            stopped = key in self._stopped
            if not stopped:
                self._sending[sock] = key
        if stopped:  # ... or while its connection was being made
            self.give_back(job.data_address, sock, lane)
            raise _stopped_error(job)
        try:
            moved = self._send_on(sock, job, lane)
        finally:
            with self._lock:
                self._sending.pop(sock, None)
        self.give_back(job.data_address, sock, lane)  # no longer one stop_sending may cut
        return moved

    def _send_on(self, sock: socket.socket, job: ChunkJob, lane: str = "") -> Moved:
        """One chunk on ``sock``; closes it on any failure, leaves it open once acknowledged."""
        assert job.data_address is not None
        try:
            if job.can_trail:  # every slot checked: hashed block by block as it leaves, the digests after it
                running = RunningDigests(len(list(job.regions())))
                sock.sendall(protocol.frame(tcp_proof.chunk_header(job, trailer=True, lane=lane)))
                moved = self._send_payload(sock, job, running)
                sock.sendall(protocol.frame({"op": "digests", "digests": running.digests()}))
            else:
                sock.sendall(protocol.frame(tcp_proof.chunk_header(job, lane=lane)))
                moved = self._send_payload(sock, job)
            reply = read_frame(sock, self.max_reply_bytes)
        except (OSError, ConnectionError) as exc:
            refusal = self._refusal(sock)
            sock.close()
            if refusal is not None:
                raise refusal from None
            raise self.lost(job.data_address, exc) from None
        except BaseException:
            sock.close()
            raise
        if not reply.get("ok"):
            sock.close()
            raise self.refused(reply)
        return moved

    @staticmethod
    def batch_key(job: ChunkJob) -> Hashable | None:
        """Small chunks to one data address, of one link, may share a connection's round trip."""
        return (job.data_address, job.token) if job.nbytes <= SMALL_CHUNK else None

    def send_many(self, jobs: list[ChunkJob]) -> list[Moved | BaseException]:
        """Chunks to one data address in one write, then their replies (:mod:`.tcp_batch`)."""
        return send_batch(self, jobs)

    @staticmethod
    def lost(address: tuple[str, int], exc: BaseException) -> KvxferError:
        # a timeout is a stalled peer; a reset or an end of stream is the receiver hanging up
        # (it failed the request and says why on the control link, or it died)
        error = PeerHungUp if isinstance(exc, ConnectionError) else TransferError
        return error(f"data connection to {address[0]}:{address[1]} failed: {exc}", field="transport",
                     fix="check the peer daemon; the request can be retried")

    @staticmethod
    def refused(reply: dict[str, Any]) -> KvxferError:
        err = reply.get("error") or {}
        if err.get("code") == IntegrityError.code:  # the bytes went, and landed other than they left
            return IntegrityError(f"destination found the chunk's bytes changed: {err.get('message', '')}",
                                  field="digests")
        # a request the receiver no longer expects ended there: its reason comes on the control link
        error = PeerHungUp if err.get("code") == "not_expected" else RequestError
        return error(f"destination refused chunk: {err.get('message', 'no reason given')}",
                     field=str(err.get("field") or "chunk"), code="peer_refused")

    def _refusal(self, sock: socket.socket) -> RequestError | None:
        """After a failed send, the receiver may have said why before closing: read it."""
        try:
            sock.settimeout(0.5)
            reply = read_frame(sock, self.max_reply_bytes)
        except (OSError, ConnectionError, KvxferError):
            return None
        return None if reply.get("ok") else self.refused(reply)

    def _send_payload(self, sock: socket.socket, job: ChunkJob, running: RunningDigests | None = None) -> Moved:
        """The chunk's payload; ``running``: fed every byte as it leaves (the trailer's digests)."""
        w = job.writer
        regions = list(job.regions())
        runs = payload_runs(job.src_slots, w.src_row_bytes, job.head_offset, w.slice_bytes)
        cpu = all(r.is_cpu for r in regions)
        mode, why = chunk_modes.pick(job.mode, job.pinned, not cpu, use_staging(runs, cpu, len(regions)))
        if mode == chunk_modes.DIRECT:
            offsets, lengths = runs.offsets.tolist(), runs.lengths.tolist()
            if running is None:
                # every region's runs in one gathered send: a region per call cost a system call per
                # layer and kind, which for one page of a 32-layer model was most of its send
                sendmsg_all(sock, [region.view[o:o + n] for region in regions for o, n in zip(offsets, lengths)])
            else:  # each block hashed right before the socket copies it: read from memory once, not twice
                for batch in batches([region.view for region in regions], offsets, lengths):
                    for i, view in batch:
                        running.add(i, view)
                    sendmsg_all(sock, [view for _, view in batch])
            return Moved(job.nbytes, len(runs) * len(regions), mode, why)
        n_tokens = job.src_slots.size
        blocks = pack(len(regions), n_tokens, w.slice_bytes, self.staging.slot_bytes)

        def fill(block: list[Piece], slot: torch.Tensor) -> None:
            gather_block(job, regions, block, slot)
            if running is not None:  # hashed while the gathered block is in cache (fills run in order)
                running.add_block(block, slot, w.slice_bytes)

        def send(block: list[Piece], slot: torch.Tensor) -> None:
            sock.sendall(memoryview(slot.numpy())[:block_bytes(block, w.slice_bytes)])

        # the next block is gathered while this one is sent (two slots when the pool has them)
        send_blocks(blocks, fill, send, self.staging, self.timeout_s)
        return Moved(job.nbytes, len(blocks), mode, why)

    def forget(self, address: tuple[str, int]) -> None:
        """The daemon at ``address`` is gone (restarted): its pooled connections are dead ends."""
        with self._lock:
            socks = [s for key in [k for k in self._idle if k[0] == address] for s in self._idle.pop(key)]
        for s in socks:
            s.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        with self._lock:
            for socks in self._idle.values():
                for s in socks:
                    s.close()
            self._idle.clear()

"""Small chunks to one peer in one write, and their replies read after.

A data thread hands tcp the small chunks queued for one peer together (see
:mod:`kvxferd.transport.dataplane`). Their frames (header, then payload) are laid out one behind the
other as the views of one scattered ``sendmsg``: page views for direct payloads, and for
staged ones the pieces gathered one behind the other into a single staging slot. Then the
replies are read in order, one per frame. A staged payload larger than the slot goes in
slot-sized blocks, the slot flushed between them. Frames are exactly those of a chunk sent alone,
so the receiver needs nothing new; it answers frames it had in hand together.

A job that fails before anything of it is written (its header, a gather) is left out of
the write and reports its own error; the others go on. A socket error, or a job failing
once part of its frame is laid out, fails every job whose reply did not come.
"""

from __future__ import annotations

import socket
from typing import Any, Protocol

import torch

from ..datapath.staging import StagingPool, block_bytes, pack
from ..errors import KvxferError
from ..lifecycle.jobs import ChunkJob, Moved
from ..wire import protocol
from . import chunk_modes
from .framing import FrameReader, gather_block, payload_runs, sendmsg_all, use_staging
from .tcp_proof import chunk_header

Outcome = Moved | BaseException


class TcpSender(Protocol):
    """What a batch asks of the tcp transport (:class:`~.tcp.TcpTransport`): its pooled
    connections, its staging pool and limits, and its words for a lost or refused chunk."""

    staging: StagingPool
    timeout_s: float
    max_reply_bytes: int

    def lane(self, jobs: list[ChunkJob]) -> str: ...

    def borrow(self, address: tuple[str, int], token: bytes | None = None, lane: str = "") -> socket.socket: ...

    def give_back(self, address: tuple[str, int], sock: socket.socket, lane: str = "") -> None: ...

    def lost(self, address: tuple[str, int], exc: BaseException) -> KvxferError: ...

    def refused(self, reply: dict[str, Any]) -> KvxferError: ...


class _Broken(OSError):
    """A job failed after part of its frame was laid out (and maybe sent): the connection is lost."""


class _Write:
    """The views of the frames laid out so far, and the staging slot their staged payloads share."""

    def __init__(self, transport: TcpSender, sock: socket.socket, lane: str) -> None:
        self.transport = transport
        self.sock = sock
        self.lane = lane
        self.views: list[memoryview] = []
        self.slot: torch.Tensor | None = None
        self.slot_view: memoryview | None = None
        self.used = 0

    def add(self, job: ChunkJob) -> Moved:
        """Lay out ``job``'s frame; raises (having written nothing of it) when it cannot be."""
        head = memoryview(protocol.frame(chunk_header(job, lane=self.lane)))
        w = job.writer
        regions = list(job.regions())
        runs = payload_runs(job.src_slots, w.src_row_bytes, job.head_offset, w.slice_bytes)
        cpu = all(r.is_cpu for r in regions)
        mode, why = chunk_modes.pick(job.mode, job.pinned, not cpu, use_staging(runs, cpu, len(regions)))
        if mode == chunk_modes.DIRECT:
            offsets, lengths = runs.offsets.tolist(), runs.lengths.tolist()
            self.views.append(head)
            self.views.extend(r.view[o:o + n] for r in regions for o, n in zip(offsets, lengths))
            return Moved(job.nbytes, len(runs) * len(regions), mode, why)
        # a small chunk may still be larger than a staging slot: then it goes in slot-sized blocks
        # (what it would be sent alone), the slot flushed between them
        blocks = pack(len(regions), job.src_slots.size, w.slice_bytes,
                      min(max(job.nbytes, w.slice_bytes), self.transport.staging.slot_bytes))
        for k, block in enumerate(blocks):
            n = block_bytes(block, w.slice_bytes)
            room = self._room(n)
            try:
                gather_block(job, regions, block, room)
            except BaseException as exc:
                if k == 0:
                    raise  # nothing of this job laid out: its own failure
                # part of its frame may be out already: the stream cannot be trusted any more
                raise _Broken(f"gathering block {k} of a chunk of {job.request_id!r} failed: {exc}") from exc
            assert self.slot_view is not None
            if k == 0:
                self.views.append(head)
            self.views.append(self.slot_view[self.used:self.used + n])
            self.used += n
        return Moved(job.nbytes, len(blocks), mode, why)

    def _room(self, n: int) -> torch.Tensor:
        """``n`` free bytes of the slot; what is laid out goes first when the slot is full."""
        if self.slot is None:
            self.slot = self.transport.staging.acquire(self.transport.timeout_s)
            self.slot_view = memoryview(self.slot.numpy())
        if self.used + n > self.slot.numel():
            self.flush()
        return self.slot[self.used:self.used + n]

    def flush(self) -> None:
        if self.views:
            views, self.views = self.views, []
            sendmsg_all(self.sock, views)
        self.used = 0

    def release(self) -> None:
        self.views = []
        if self.slot is not None:
            self.transport.staging.release(self.slot)
            self.slot = self.slot_view = None


def send_batch(transport: TcpSender, jobs: list[ChunkJob]) -> list[Outcome]:
    """One outcome per job, in order; a job is reported moved only on its own positive reply."""
    address = jobs[0].data_address
    assert address is not None
    lane = transport.lane(jobs)
    try:
        sock = transport.borrow(address, jobs[0].token, lane)  # a batch is one link's (its batch key)
    except KvxferError as exc:
        return [exc] * len(jobs)
    outcomes: list[Outcome | None] = [None] * len(jobs)
    framed: list[tuple[int, Moved]] = []
    write = _Write(transport, sock, lane)
    lost: KvxferError | None = None
    try:
        for i, job in enumerate(jobs):
            try:
                moved = write.add(job)
            except (OSError, ConnectionError):
                raise  # the socket, while the full slot went out
            except BaseException as exc:  # noqa: BLE001 - this job's own fault: nothing of it was written
                outcomes[i] = exc
                continue
            framed.append((i, moved))
        write.flush()
    except (OSError, ConnectionError) as exc:  # the connection is gone: only replies already on their way count
        lost = transport.lost(address, exc)
    finally:
        write.release()
    keep = lost is None and _read_replies(transport, sock, address, framed, outcomes)
    for i, o in enumerate(outcomes):
        if o is None:
            outcomes[i] = lost or transport.lost(address, ConnectionError("no reply"))
    if keep:
        transport.give_back(address, sock, lane)
    else:
        sock.close()
    return outcomes  # type: ignore[return-value]


def _read_replies(transport: TcpSender, sock: socket.socket, address: tuple[str, int],
                  framed: list[tuple[int, Moved]], outcomes: list[Outcome | None]) -> bool:
    """The replies to the frames written, in order; whether the connection may be pooled again."""
    replies = FrameReader(sock, size=4096)  # one recv takes in the replies the receiver sent together
    keep = True
    for n, (i, moved) in enumerate(framed):
        try:
            reply = replies.frame(transport.max_reply_bytes)
        except (OSError, ConnectionError, KvxferError) as exc:
            lost = transport.lost(address, exc if isinstance(exc, OSError) else ConnectionError(str(exc)))
            for j, _ in framed[n:]:
                outcomes[j] = lost
            return False
        if reply.get("ok"):
            outcomes[i] = moved
        else:
            outcomes[i] = transport.refused(reply)
            keep = False  # an older receiver hangs up after a refusal
    return keep and not replies.buffered  # (bytes past the last reply: the stream is not trusted)

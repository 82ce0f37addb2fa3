"""Frames on a tcp data connection: length-prefixed msgpack headers and raw payloads.

:class:`FrameReader` reads through a buffer of its own: one ``recv`` takes in whatever the
peer has sent so far (the frames of many small chunks sent back to back, or the replies to
them), and frames and small payloads are then taken from memory. Large payloads still go
straight from the socket into their destination (a page view or a staging slot), past the
buffer. Before each ``recv`` it calls ``before_wait``: a receiver sends the replies it held
back there, so replies leave together exactly when it has nothing more to read.
"""

from __future__ import annotations

import socket
from typing import Any, Callable

import numpy as np

from ..datapath.copier import gather
from ..datapath.staging import Piece
from ..errors import ProtocolError
from ..model.segments import Runs, side_runs
from ..wire import protocol

IOV_BATCH = 512
FEW_VIEWS = 64  # a chunk of at most this many runs (over all its regions) travels as socket views
READ_BUFFER = 256 * 1024
SMALL_RUN = 8192  # average run below this goes through a staging slot


def payload_runs(slots: np.ndarray, row: int, head: int, slice_bytes: int) -> Runs:
    """One side's byte runs of a chunk's payload in one region (the same in every region)."""
    return side_runs(slots, row, head, slice_bytes)


def use_staging(runs: Runs, cpu: bool, regions: int = 1) -> bool:
    """Many small runs (or device memory) go through a staging slot rather than one socket view
    each. A few views cost the socket call next to nothing, whatever their size, while a gather
    and a scatter cost a copy call per region on each side: a one-page tiny chunk (4 regions of
    one 2 KiB run) spent about 160 us gathering and 150 us scattering, against a few for its
    views."""
    if not cpu:
        return True
    return len(runs) > 0 and runs.nbytes // len(runs) < SMALL_RUN and len(runs) * regions > FEW_VIEWS


def gather_block(job: Any, regions: list[Any], block: list[Piece], out: Any) -> None:
    """One staged block of a chunk job's payload laid out in ``out``: each piece's token slices
    of its region, at the piece's offset (the byte stream of :func:`~kvxferd.datapath.staging.pack`)."""
    w = job.writer
    for piece in block:
        gather(regions[piece.region].flat, job.src_slots[piece.lo:piece.hi], w.src_row_bytes, job.head_offset,
               w.slice_bytes, out[piece.offset:piece.offset + (piece.hi - piece.lo) * w.slice_bytes])


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionError("peer closed the data connection mid-chunk")
        got += k


def sendmsg_all(sock: socket.socket, buffers: list[memoryview]) -> None:
    i = 0
    while i < len(buffers):
        batch = buffers[i:i + IOV_BATCH]
        sent = sock.sendmsg(batch)
        while i < len(buffers) and sent >= len(buffers[i]):
            sent -= len(buffers[i])
            i += 1
        if sent:
            buffers[i] = buffers[i][sent:]


def _too_long(length: int, max_bytes: int) -> ProtocolError:
    return ProtocolError(f"frame of {length} bytes exceeds {max_bytes}", field="frame", fix="keep data headers small")


def read_frame(sock: socket.socket, max_bytes: int) -> dict[str, Any]:
    """One frame straight off the socket (no buffer: nothing past it is read)."""
    head = bytearray(protocol.FRAME_LEN.size)
    recv_exact(sock, memoryview(head))
    (length,) = protocol.FRAME_LEN.unpack(head)
    if length > max_bytes:
        raise _too_long(length, max_bytes)
    body = bytearray(length)
    recv_exact(sock, memoryview(body))
    return protocol.decode(bytes(body), max_bytes)


class FrameReader:
    """Buffered reads of one connection, for as long as the connection lives."""

    def __init__(self, sock: socket.socket, before_wait: Callable[[], None] | None = None,
                 size: int = READ_BUFFER) -> None:
        self.sock = sock
        self.before_wait = before_wait
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    @property
    def buffered(self) -> int:
        return self._end - self._start

    def _fill(self, need: int) -> None:
        """At least ``need`` bytes (at most the buffer's size) in the buffer."""
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._buf) - self._start < need:  # move what is left to the front
            left = self._end - self._start
            self._view[:left] = self._view[self._start:self._end]
            self._start, self._end = 0, left
        while self._end - self._start < need:
            if self.before_wait is not None:
                self.before_wait()
            k = self.sock.recv_into(self._view[self._end:], len(self._buf) - self._end)
            if k == 0:
                raise ConnectionError("peer closed the data connection")
            self._end += k

    def wait(self) -> None:
        """Until the next frame's first bytes are in hand (none read past what one ``recv`` brings)."""
        self._fill(1)

    def _take(self, n: int) -> memoryview:
        view = self._view[self._start:self._start + n]
        self._start += n
        return view

    @property
    def capacity(self) -> int:
        return len(self._buf)

    def take(self, n: int) -> memoryview:
        """The next ``n`` bytes (at most :attr:`capacity`) where they lie in the buffer: valid
        until the next read."""
        self._fill(n)
        return self._take(n)

    def frame(self, max_bytes: int) -> dict[str, Any]:
        size = protocol.FRAME_LEN.size
        self._fill(size)
        (length,) = protocol.FRAME_LEN.unpack(self._take(size))
        if length > max_bytes:
            raise _too_long(length, max_bytes)
        if length <= len(self._buf):
            self._fill(length)
            return protocol.decode(bytes(self._take(length)), max_bytes)
        body = bytearray(length)
        self.read_into(memoryview(body))
        return protocol.decode(bytes(body), max_bytes)

    def read_into(self, dst: memoryview) -> None:
        """Exactly ``len(dst)`` bytes into ``dst``: first from the buffer, the rest from the
        socket (straight into ``dst`` when it is large, through the buffer when small)."""
        n = len(dst)
        have = min(n, self.buffered)
        if have:
            dst[:have] = self._take(have)
        if have == n:
            return
        rest = n - have
        if rest >= len(self._buf) // 4:
            if self.before_wait is not None:
                self.before_wait()
            recv_exact(self.sock, dst[have:])
            return
        self._fill(rest)
        dst[have:] = self._take(rest)

    def read_into_many(self, views: list[memoryview]) -> None:
        """Fill every view in order, as :meth:`read_into` would one by one, but with one
        scattered ``recvmsg_into`` for as many views as the socket has bytes for."""
        i, n = 0, len(views)
        head: memoryview | None = None  # what is left of views[i] once part of it was filled
        while i < n and self.buffered:  # what the buffer holds already, and not a byte more through it
            view = views[i]
            have = min(len(view), self.buffered)
            view[:have] = self._take(have)
            if have < len(view):
                head = view[have:]
                break
            i += 1
        if i == n:
            return
        if self.before_wait is not None:
            self.before_wait()
        # a chunk's views can be tens of thousands: walk them by index (slicing off the filled ones
        # after each call would copy the rest of the list every time, quadratic in the chunk's size)
        while i < n:
            batch = views[i:i + IOV_BATCH]
            if head is not None:
                batch[0] = head
            got = self.sock.recvmsg_into(batch)[0]
            if got == 0:
                raise ConnectionError("peer closed the data connection mid-chunk")
            k = 0
            while k < len(batch) and got >= len(batch[k]):
                got -= len(batch[k])
                k += 1
            i += k
            head = batch[k][got:] if got else None

    def skip(self, n: int) -> None:
        """Read past ``n`` bytes."""
        while n:
            if not self.buffered:
                self._fill(1)
            k = min(n, self.buffered)
            self._start += k
            n -= k

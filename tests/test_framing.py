"""FrameReader and sendmsg_all on a real loopback TCP connection: every byte lands where its
view says, whatever the socket hands over per call, checked against the bytes sent."""

from __future__ import annotations

import random
import socket
import threading

import pytest

from kvxferd.transport import framing
from kvxferd.transport.framing import FrameReader, sendmsg_all
from kvxferd.wire import protocol


@pytest.fixture
def conn():
    server = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(server.getsockname())
    b, _ = server.accept()
    server.close()
    for s in (a, b):
        s.settimeout(60)
    yield a, b
    a.close()
    b.close()


def _views(buf: bytearray, sizes: list[int]) -> list[memoryview]:
    view, out, at = memoryview(buf), [], 0
    for n in sizes:
        out.append(view[at:at + n])
        at += n
    return out


def _send_in_pieces(sock: socket.socket, data: bytes, rng: random.Random) -> threading.Thread:
    """Uneven writes, so the receiver's calls end anywhere: mid-view, on a boundary, past a batch."""
    def run() -> None:
        at = 0
        while at < len(data):
            n = rng.choice([1, 7, 4096, 65536, 300_000])
            sock.sendall(data[at:at + n])
            at += n
    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("seed", range(4))
def test_read_into_many_fills_thousands_of_views_in_order(conn, seed):
    a, b = conn
    rng = random.Random(seed)
    # more views than one scattered call takes (IOV_BATCH), of uneven sizes, some empty
    sizes = [rng.choice([0, 1, 100, 8192, 32768]) for _ in range(3 * framing.IOV_BATCH + 17)]
    payload = rng.randbytes(sum(sizes))
    header = protocol.frame({"op": "data", "n": len(payload)})
    sender = _send_in_pieces(a, header + payload, rng)
    reader = FrameReader(b)
    assert reader.frame(1 << 16) == {"op": "data", "n": len(payload)}  # part of the payload may be buffered now
    dst = bytearray(len(payload))
    reader.read_into_many(_views(dst, sizes))
    sender.join()
    assert dst == payload


def test_a_view_split_across_calls_is_resumed_where_it_stopped(conn):
    a, b = conn
    sizes = [10, 1 << 20, 10]  # the large view cannot arrive in one call
    payload = random.Random(9).randbytes(sum(sizes))
    sender = _send_in_pieces(a, payload, random.Random(3))
    dst = bytearray(len(payload))
    FrameReader(b).read_into_many(_views(dst, sizes))
    sender.join()
    assert dst == payload


def test_sendmsg_all_sends_every_view_in_order(conn):
    a, b = conn
    rng = random.Random(5)
    sizes = [rng.choice([0, 3, 8192, 65536]) for _ in range(2 * framing.IOV_BATCH + 5)]
    src = bytearray(rng.randbytes(sum(sizes)))
    got = bytearray(len(src))
    reader = threading.Thread(target=lambda: FrameReader(b).read_into(memoryview(got)))
    reader.start()
    sendmsg_all(a, _views(src, sizes))
    reader.join()
    assert got == src


def test_a_peer_closing_mid_views_is_an_error_not_a_short_read(conn):
    a, b = conn
    a.sendall(b"x" * 100)
    a.close()
    dst = bytearray(200)
    with pytest.raises(ConnectionError):
        FrameReader(b).read_into_many(_views(dst, [50, 150]))


class _Counting:
    """The real socket, with a count of the bytes each way of reading took in."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffered = self.scattered = 0

    def recv_into(self, *args):
        n = self.sock.recv_into(*args)
        self.buffered += n
        return n

    def recvmsg_into(self, *args):
        got = self.sock.recvmsg_into(*args)
        self.scattered += got[0]
        return got


def test_a_large_payload_goes_straight_into_its_views_not_through_the_buffer(conn):
    a, b = conn
    sizes = [32768] * 512  # 16 MiB of page views
    payload = random.Random(2).randbytes(sum(sizes))
    sender = _send_in_pieces(a, protocol.frame({"op": "data"}) + payload, random.Random(4))
    counting = _Counting(b)
    reader = FrameReader(counting)  # type: ignore[arg-type]
    reader.frame(1 << 16)
    dst = bytearray(len(payload))
    reader.read_into_many(_views(dst, sizes))
    sender.join()
    assert dst == payload
    # at most what one buffered read took in with the header; the rest landed in place
    assert counting.buffered <= framing.READ_BUFFER and counting.scattered >= len(payload) - framing.READ_BUFFER


def test_only_many_short_runs_or_device_memory_go_through_a_staging_slot():
    import numpy as np

    from kvxferd.model.segments import side_runs
    one_page = side_runs(np.arange(16), 128, 0, 128)  # 16 token rows of 128 B: one run of 2 KiB
    scattered = side_runs(np.arange(0, 200, 2), 128, 0, 128)  # 100 runs of one 128 B row
    long_runs = side_runs(np.arange(0, 4096), 4096, 0, 4096)  # one 16 MiB run
    assert not framing.use_staging(one_page, cpu=True, regions=4)  # 4 views: cheaper than two copies
    assert framing.use_staging(one_page, cpu=True, regions=framing.FEW_VIEWS + 1)
    assert framing.use_staging(scattered, cpu=True, regions=1)
    assert not framing.use_staging(long_runs, cpu=True, regions=1000)  # long runs: views at any count
    assert framing.use_staging(one_page, cpu=False, regions=1)  # GPU memory has no socket view

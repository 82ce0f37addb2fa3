"""What this machine allows at most: single-thread memcpy, raw TCP streams on loopback, and a
copy out of shared memory between two processes. The kvxferd rows are read against these."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import socket
import tempfile
import threading
import time
from typing import Any


def memcpy_limit(nbytes: int, repeats: int) -> float:
    """Best GB/s of a single-thread torch copy between two private buffers."""
    import torch
    torch.set_num_threads(1)
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(2)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return nbytes / min(times) / 1e9


def _shares(nbytes: int, streams: int) -> list[tuple[int, int]]:
    """(offset, length) of each stream's part of the payload."""
    cuts = [nbytes * i // streams for i in range(streams + 1)]
    return [(cuts[i], cuts[i + 1] - cuts[i]) for i in range(streams)]


def _recv_exact(conn: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        k = conn.recv_into(view[got:], len(view) - got)
        if k == 0:
            return False
        got += k
    return True


def _sock_sink(port_q: Any, nbytes: int, repeats: int, streams: int) -> None:
    """Accept ``streams`` connections; per repeat, each receives its share and acknowledges it."""
    import numpy as np
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conns = [srv.accept()[0] for _ in range(streams)]
    view = memoryview(np.ones(nbytes, dtype=np.uint8))

    def serve(conn: socket.socket, off: int, length: int) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(repeats + 1):
            if not _recv_exact(conn, view[off:off + length]):
                return
            conn.sendall(b"k")
        conn.close()

    threads = [threading.Thread(target=serve, args=(c, off, n)) for c, (off, n) in zip(conns, _shares(nbytes, streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    srv.close()


def socket_limit(nbytes: int, repeats: int, streams: int = 1) -> float:
    """Best GB/s of ``sendall`` of the payload to another process on loopback, acknowledged, cut
    over ``streams`` connections sent side by side (one thread each)."""
    return nbytes / min(_socket_times(nbytes, repeats, streams)) / 1e9


def socket_round_trip(nbytes: int, repeats: int) -> tuple[float, float]:
    """(p50, p99) milliseconds of one payload to another process on loopback and its one-byte
    acknowledgement: what a one-page request over tcp could take at best on this machine."""
    times = sorted(_socket_times(nbytes, repeats, 1))
    return 1e3 * times[len(times) // 2], 1e3 * times[min(len(times) - 1, int(len(times) * 0.99))]


def _socket_times(nbytes: int, repeats: int, streams: int) -> list[float]:
    """Seconds of each repeat (after one untimed) of the payload out and its acknowledgement back."""
    import numpy as np
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_sock_sink, args=(q, nbytes, repeats, streams), daemon=True)
    proc.start()
    socks: list[socket.socket] = []
    try:
        port = q.get(timeout=60)
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
        for s in socks:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = memoryview(np.full(nbytes, 7, dtype=np.uint8))

        def send(sock: socket.socket, off: int, length: int) -> None:
            sock.sendall(payload[off:off + length])
            if sock.recv(1) != b"k":
                raise ConnectionError("socket sink closed early")

        times = []
        for r in range(repeats + 1):
            t = time.perf_counter()
            if streams == 1:
                send(socks[0], 0, nbytes)
            else:
                threads = [threading.Thread(target=send, args=(s, off, n))
                           for s, (off, n) in zip(socks, _shares(nbytes, streams))]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
            if r:
                times.append(time.perf_counter() - t)
    finally:
        for s in socks:
            s.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return times


def _shm_reader(path: str, path2: str, nbytes: int, repeats: int, out_q: Any) -> None:
    import numpy as np
    import torch
    torch.set_num_threads(1)

    def mapped(p: str) -> Any:
        fd = os.open(p, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return mm, torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))

    _mm1, src = mapped(path)
    _mm2, shared_dst = mapped(path2)
    private = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    res = {}
    for name, dst in (("private", private), ("shared", shared_dst)):
        dst.copy_(src)  # first touch of this process's page tables, untimed
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
        res[name] = nbytes / min(times) / 1e9
    out_q.put(res)


def shm_limit(nbytes: int, repeats: int) -> dict[str, float]:
    """One process writes a /dev/shm mapping; another copies it (to private and to shared memory)."""
    import numpy as np
    paths = []
    try:
        for _ in range(2):
            fd, path = tempfile.mkstemp(prefix="kvxferd-bench-", dir="/dev/shm")
            paths.append(path)
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            os.close(fd)
            np.frombuffer(mm, dtype=np.uint8)[:] = 0x5A  # the writer's side
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        proc = ctx.Process(target=_shm_reader, args=(paths[0], paths[1], nbytes, repeats, q), daemon=True)
        proc.start()
        res = q.get(timeout=300)
        proc.join(30)
        return res
    finally:
        for p in paths:
            try:
                os.unlink(p)
            except OSError:
                pass

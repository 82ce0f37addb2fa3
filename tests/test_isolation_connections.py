"""Connections that prove themselves or go: the tcp data port and the HTTP port under hostile clients.

Through real ``kvxferd serve`` daemons on 127.0.0.1, with short deadlines configured so the
test waits seconds, not minutes (it waits for outcomes with generous overall deadlines, and
never asserts how long anything took):

- 64 connections trickling a byte at a time and 150 idle ones at a decode daemon's data port,
  and 150 half-sent HTTP requests at its metrics port, are all closed by the daemon; meanwhile
  a real prefill daemon's new data connection proves itself and its request lands byte-exact;
  afterwards the daemon's threads and resident memory are back at their baseline and it keeps serving.
- A hello that replays another connection's proof, one with a wrong token, one naming a link
  nobody was handed, and a connection whose first frame is no hello are each refused with a
  ``token`` error, counted in ``kvxferd_connections_refused_total`` and logged; a proven
  connection that trickles a frame is cut at the frame's deadline; the request they aimed at
  still completes byte-exact.
- With its descriptors nearly exhausted, the data port's accept loop fails, counts, pauses and
  goes on: once they are free again, a transfer connects and lands byte-exact.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import random
import resource
import select
import socket
import time
from typing import Any, Callable

import pytest

from e2e_util import Node, assert_verified, cluster_run, finished, pages_for, spec, start_nodes, transfer
from kvxferd.sdk.client import EngineClient
from kvxferd.tools.procstats import scrape
from kvxferd.transport import tcp_proof
from kvxferd.transport.framing import read_frame
from kvxferd.wire import protocol
from test_fuzz_data import DST, HELD, N_TOKENS, FakePrefillDaemon, data_connection, frame, oracle_payload

NUM_PAGES = 32
PROOF_S = 2.0
FRAME_S = 2.0
HTTP_TIMEOUT_S = 2.0
HTTP_CAP = 8
#: short deadlines, so a hostile connection is closed within seconds (each waited for, never timed)
DEADLINES = (f"[timeouts]\ndata_proof_s = {PROOF_S}\ndata_frame_s = {FRAME_S}\nwaiting_for_input_s = 60.0\n"
             "[limits]\nmax_unproven_connections = 16\ndata_min_bytes_per_s = 1048576\n")
HTTP_ENV = {"KVXFERD_METRICS_MAX_CONNECTIONS": str(HTTP_CAP), "KVXFERD_METRICS_TIMEOUT_S": str(HTTP_TIMEOUT_S)}
WAIT_S = 120.0  # the generous overall deadline for what the daemon must close within seconds
THREAD_MARGIN = 4


MEMORY_MARGIN = 16 << 20  # bytes: the allocator need not hand back every page a flood touched


def _status_field(pid: int, name: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {name}: line for pid {pid}")


def threads_of(pid: int) -> int:
    return _status_field(pid, "Threads")


def rss_of(pid: int) -> int:
    """Resident bytes of a process."""
    return _status_field(pid, "VmRSS") * 1024


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def refused(daemon, endpoint: str, reason: str | None = None) -> float:
    seen = scrape(daemon.metrics_url)
    prefix = f'kvxferd_connections_refused_total{{endpoint="{endpoint}",'
    return sum(v for k, v in seen.items() if k.startswith(prefix) and (reason is None or f'reason="{reason}"' in k))


class Flood:
    """Raw client sockets the daemon must close: each is read (and tricklers written to) until the
    daemon hangs up on it (end of stream or a reset)."""

    def __init__(self) -> None:
        self.open: list[socket.socket] = []
        self.tricklers: set[socket.socket] = set()
        self.closed = 0

    def connect(self, port: int, first: bytes = b"", trickle: bool = False) -> None:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
        except OSError:  # refused outright: closed as well as it gets
            self.closed += 1
            return
        s.setblocking(False)
        if first:
            s.send(first)
        self.open.append(s)
        if trickle:
            self.tricklers.add(s)

    def _gone(self, s: socket.socket) -> None:
        self.open.remove(s)
        self.tricklers.discard(s)
        s.close()
        self.closed += 1

    def pump(self, seconds: float) -> None:
        """Read what the daemon sends for ``seconds``; one byte to every trickler at the start."""
        for s in list(self.tricklers):
            try:
                s.send(b"\x01")
            except OSError:
                self._gone(s)
        end = time.monotonic() + seconds
        while self.open and time.monotonic() < end:
            readable, _, _ = select.select(self.open[:500], [], [], 0.1)
            for s in readable:
                try:
                    data = s.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    self._gone(s)

    def wait_all_closed(self, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while self.open:
            assert time.monotonic() < deadline, f"{len(self.open)} connections still open"
            self.pump(0.5)

    def close(self) -> None:
        for s in self.open:
            s.close()
        self.open.clear()


def test_floods_of_idle_trickling_and_half_sent_connections_are_closed_and_a_proven_peer_moves_bytes(request):
    with cluster_run(request) as c:
        first, second, dd = start_nodes(c, Node("prefill-one-node"), Node("prefill-two-node"),
                                        Node("decode-node", DEADLINES, env=HTTP_ENV))
        (p1,), (p2,), (d0,) = c.instances((first, "pone", "prefill", spec(), NUM_PAGES),
                                          (second, "ptwo", "prefill", spec(), NUM_PAGES),
                                          (dd, "dec", "decode", spec(), NUM_PAGES))
        rng = random.Random(43)

        def move(prefill, rid: str, source: str) -> None:
            n = rng.randrange(8, 40)
            dec, pre = transfer([prefill], [d0], rid, n, src_pages=pages_for(rng, NUM_PAGES, n, 4),
                                dst_pages=pages_for(rng, NUM_PAGES, n, 4), source_address=source)
            assert_verified(dec, pre)

        move(p1, "warm-0", first.address)  # the daemon's threads as they are once it has served
        pid = dd.proc.pid
        baseline, rss_before = threads_of(pid), rss_of(pid)
        data_before, http_before = refused(dd, "data"), refused(dd, "http")

        flood = Flood()
        try:
            # 64 tricklers: a hello's length prefix, then a byte every pump; 150 idle; 150 half-sent requests
            for _ in range(64):
                flood.connect(dd.data_port, first=protocol.FRAME_LEN.pack(100) + b"\x82", trickle=True)
            for _ in range(150):
                flood.connect(dd.data_port)
            for _ in range(150):
                flood.connect(dd.metrics_port, first=b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: ")
            # during the flood, a prefill daemon that never spoke to this one opens its data connections:
            # they prove themselves, and its request lands byte-exact
            move(p2, "during-0", second.address)
            flood.wait_all_closed()
        finally:
            flood.close()
        assert flood.closed == 364
        # every one was closed by the daemon: counted, by reason
        assert refused(dd, "data") - data_before >= 214
        assert refused(dd, "data", "proof_deadline") + refused(dd, "data", "unproven_cap") >= 214
        assert refused(dd, "http") - http_before >= 150
        assert refused(dd, "http", "timeout") >= 1 and refused(dd, "http", "max_connections") >= 1
        log = dd.log()
        assert "event=data_conn_refused" in log and "event=http_conn_refused" in log
        # the threads it took are gone (the second prefill daemon's pooled connections may stay)
        wait_until(lambda: threads_of(pid) <= baseline + 2 + THREAD_MARGIN,
                   f"threads back to {baseline} (+ margin), now {threads_of(pid)}")
        # and so is its memory (the connections' buffers and threads' stacks went with them)
        wait_until(lambda: rss_of(pid) <= rss_before + MEMORY_MARGIN,
                   f"resident memory back to {rss_before >> 20} MiB (+ margin), now {rss_of(pid) >> 20} MiB")
        # and it keeps serving
        move(p1, "after-0", first.address)
        move(p2, "after-1", second.address)
        with EngineClient(dd.socket_path, timeout=10) as client:
            assert client.call("ping")["ok"] is True
        assert dd.proc.poll() is None and "Traceback" not in dd.log()


def _hello(link: bytes, mac: bytes) -> bytes:
    return protocol.frame({"op": "hello", "link": link, "proof": mac})


def _challenge(s: socket.socket) -> bytes:
    msg = read_frame(s, 512)
    assert msg["op"] == "challenge" and len(msg["nonce"]) == tcp_proof.NONCE_BYTES, msg
    return msg["nonce"]


def _answer(port: int, hello: Callable[[bytes], bytes], then: bytes = b"") -> dict[str, Any]:
    """A new connection: its challenge answered with ``hello(nonce)``, ``then`` sent; the reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(hello(_challenge(s)) + then)
        return read_frame(s, 65536)


def test_wrong_replayed_and_missing_proofs_are_refused_counted_and_logged_and_a_trickled_frame_is_cut(request):
    fake = FakePrefillDaemon(spec(tp_size=2))
    try:
        with cluster_run(request) as c:
            (dd,) = start_nodes(c, Node("proof-decode-node", DEADLINES))
            (d0,) = c.instance(dd, "pdec", "decode", spec(), NUM_PAGES)
            d0.command(cmd="expect", request_id="proof-0", pages=DST, n=N_TOKENS, source_instance="pp",
                       source_address=fake.address)
            wait_until(lambda: "pdec" in fake.tokens, "the handshake")
            token = fake.tokens["pdec"]
            per_token = 2 * d0.geometry.spec.num_layers * d0.geometry.spec.row_bytes // 2
            writers = [[0, 0], [1, 0]]

            def header(w: int, start: int, end: int) -> dict[str, Any]:
                return {"op": "data", "request_id": "proof-0", "decode_instance": "pdec", "dst": [0, 0],
                        "src": writers[w], "start": start, "end": end, "last": end == N_TOKENS,
                        "nbytes": (end - start) * per_token}

            # the proof, computed here from its definition: HMAC-SHA256 keyed by the link's token
            link = hashlib.blake2b(token, digest_size=8, person=b"kvxferd-link").digest()

            def proof(key: bytes, nonce: bytes) -> bytes:
                return hmac.new(key, b"kvxferd data hello v1\x00" + nonce, hashlib.sha256).digest()

            # a legitimate connection: its hello is kept, and its first chunk lands
            kept: list[bytes] = []

            def good(nonce: bytes) -> bytes:
                kept.append(_hello(link, proof(token, nonce)))
                return kept[-1]

            reply = _answer(dd.data_port, good, frame(header(0, 0, HELD)) + oracle_payload("proof-0", 0, 0, HELD))
            assert reply == {"op": "ack", "ok": True}, reply

            before = {r: refused(dd, "data", r) for r in ("bad_proof", "unknown_link", "no_hello", "frame_deadline")}
            attempt = frame(header(1, 0, HELD)) + oracle_payload("proof-0", 1, 0, HELD)
            cases = {
                "bad_proof": lambda nonce: kept[0],  # replayed: another connection's nonce
                "unknown_link": lambda nonce: _hello(os.urandom(8), proof(os.urandom(16), nonce)),
                "no_hello": lambda nonce: b"",  # the data frame first
            }
            for reason, hello in cases.items():
                reply = _answer(dd.data_port, hello, attempt)
                assert reply["ok"] is False, (reason, reply)
                assert reply["error"]["field"] == "token" and reply["error"]["code"] == "unproven_connection", reply
            wrong = _answer(dd.data_port, lambda nonce: _hello(link, proof(os.urandom(16), nonce)), attempt)
            assert wrong["ok"] is False and "does not match" in wrong["error"]["message"], wrong
            assert "replayed" in wrong["error"]["message"]
            assert refused(dd, "data", "bad_proof") - before["bad_proof"] == 2  # the replay and the wrong token
            assert refused(dd, "data", "unknown_link") - before["unknown_link"] == 1
            assert refused(dd, "data", "no_hello") - before["no_hello"] == 1
            log = dd.log()
            for reason in ("bad_proof", "unknown_link", "no_hello"):
                assert f"event=data_conn_refused reason={reason}" in log, reason

            # a proven connection that trickles its frame is cut at the frame's deadline
            with data_connection(dd.data_port, token) as s:
                payload = oracle_payload("proof-0", 1, 0, HELD)
                s.sendall(frame(header(1, 0, HELD)) + payload[:1])
                wait_until(lambda: _trickle(s, payload[1:]), "the trickled frame cut")
            wait_until(lambda: refused(dd, "data", "frame_deadline") - before["frame_deadline"] >= 1,
                       "the frame deadline counted")
            assert "event=data_conn_refused reason=frame_deadline" in dd.log()

            # none of it touched the request: its writers finish it, byte-exact
            for w, (start, end) in ((1, (0, HELD)), (0, (HELD, N_TOKENS)), (1, (HELD, N_TOKENS))):
                reply = _answer(dd.data_port, lambda nonce: _hello(link, proof(token, nonce)),
                                frame(header(w, start, end)) + oracle_payload("proof-0", w, start, end))
                assert reply == {"op": "ack", "ok": True}, (w, start, reply)
            ev = finished(d0, "proof-0")
            assert ev["state"] == "done" and ev["mismatched_bytes"] == 0, ev
            assert dd.proc.poll() is None and "Traceback" not in dd.log()
    finally:
        fake.close()


def _trickle(s: socket.socket, rest: bytes) -> bool:
    """One more byte of a frame; True once the daemon hung up (bounded by the caller's deadline)."""
    time.sleep(0.5)
    try:
        s.send(rest[:1])
        readable, _, _ = select.select([s], [], [], 0)
        if readable:
            return s.recv(65536) == b""
    except OSError:
        return True
    return False


def test_the_accept_loop_survives_running_out_of_descriptors(request):
    with cluster_run(request) as c:
        pd, dd = start_nodes(c, Node("prefill-node"), Node("fd-decode-node", DEADLINES))
        (p0,), (d0,) = c.instances((pd, "fdp", "prefill", spec(), NUM_PAGES),
                                   (dd, "fdd", "decode", spec(), NUM_PAGES))
        pid = dd.proc.pid
        limits = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        in_use = len(os.listdir(f"/proc/{pid}/fd"))
        flood = Flood()
        try:
            # a handful of descriptors left: a burst of connections finds none, and accept fails
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (in_use + 4, limits[1]))
            for _ in range(32):
                flood.connect(dd.data_port)
            wait_until(lambda: "event=data_accept_error" in dd.log(), "an accept error logged")
        finally:
            flood.close()
            resource.prlimit(pid, resource.RLIMIT_NOFILE, limits)
        # descriptors free again: the loop went on, a new data connection is accepted and proves itself
        rng = random.Random(7)
        n = 24
        dec, pre = transfer([p0], [d0], "fd-0", n, src_pages=pages_for(rng, NUM_PAGES, n, 4),
                            dst_pages=pages_for(rng, NUM_PAGES, n, 4), source_address=pd.address)
        assert_verified(dec, pre)
        assert scrape(dd.metrics_url).get('kvxferd_accept_errors_total{endpoint="data"}', 0.0) >= 1
        assert dd.proc.poll() is None and "Traceback" not in dd.log()


@pytest.fixture(autouse=True)
def _no_leaked_sockets():
    """What a test opened by hand it closed: no client socket of this process outlives it."""
    before = set(os.listdir("/proc/self/fd"))
    yield

    def leaked() -> list[str]:
        out = []
        for fd in set(os.listdir("/proc/self/fd")) - before:
            try:
                if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                    out.append(fd)
            except OSError:
                pass  # closed meanwhile
        return out

    # ZeroMQ closes its sockets on its own thread, a moment after close(): wait for them
    wait_until(lambda: len(leaked()) <= 2, f"test sockets closed: {leaked()}", timeout=10)

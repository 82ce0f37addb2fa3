"""Fuzzing the tcp data port of a decode daemon that expects a real request.

A decode rank expects a legitimate request from a TP 2 prefill instance. The test itself
plays the prefill daemon (a ZeroMQ ROUTER that answers the handshake and heartbeats), so
it learns the data token the decode daemon hands that link, and it sends the legitimate
chunks itself with the oracle's bytes: both writers deliver the first chunk and hold back
the last one. Then raw sockets hit the decode daemon's data port with hostile frames, most
of them carrying the right token so that every check behind it is exercised: wrong request ids, wrong
destination ranks and instances, writers the plan does not name, ranges beyond the pages
or the request, overlapping and replayed ranges, wrong byte counts, bad last flags,
oversized aux, broken schemas, huge length prefixes, undecodable and truncated headers,
and valid headers whose payload is cut short. Every refused header must be answered
(``ok: false``) and counted in ``kvxferd_invalid_messages_total{endpoint="data"}``; no byte
may land anywhere but the request's destination rows; and when the prefill ranks finally
send the rest, the request completes byte-exact.
"""

from __future__ import annotations

import random
import socket
import struct
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

import digest_oracles
from e2e_util import carried_plan, cluster_run, finished, spec
from kvxferd.sdk.client import EngineClient
from kvxferd.tools.oracle import logical_cache
from kvxferd.transport.tcp_proof import prove
from kvxferd.wire.protocol import MAX_PICK_BYTES
from test_fuzz_engine import canary, junk, wait_idle

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import reliability_report as rr  # noqa: E402

NUM_PAGES = 16
N_TOKENS = 14  # 4 destination pages of 4 tokens: capacity 16, so tokens 14 and 15 must stay canary
DST = [9, 2, 14, 5]
SRC = [3, 11, 6, 0]
HELD = 8  # the prefill ranks delivered [0, 8) and hold [8, 14)
MESSAGES = 10_000
CONFIG = ("[timeouts]\nbootstrap_s = 20.0\nwaiting_for_input_s = 60.0\ntransfer_s = 60.0\ndrain_grace_s = 1.0\n"
          "[limits]\nmax_message_bytes = 2097152\n")
LENGTH = struct.Struct("!I")


def frame(header: Any) -> bytes:
    body = msgpack.packb(header, use_bin_type=True)
    return LENGTH.pack(len(body)) + body


def data_connection(port: int, token: bytes | None) -> socket.socket:
    """A connection to a data port that answered its challenge with the link's ``token`` (None:
    with an empty hello, which the port refuses), as a prefill daemon's first bytes."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        prove(s, token, ("127.0.0.1", port))
    except BaseException:
        s.close()
        raise
    return s


def exchange(port: int, data: bytes, payload: bytes = b"", *, token: bytes | None) -> dict[str, Any] | None:
    """On a new connection proven with ``token``: send one frame (and optional payload), read the
    reply frame; None when none came."""
    with data_connection(port, token) as s:
        try:
            s.sendall(data)
            if payload:
                s.sendall(payload)
            head = _recv(s, 4)
            if head is None:
                return None
            body = _recv(s, LENGTH.unpack(head)[0])
        except OSError:  # reset or timed out: no answer
            return None
        return None if body is None else msgpack.unpackb(body, raw=False)


def _recv(s: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        part = s.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return buf


class DataFuzzer:
    """Hostile data frames around one legitimate destination (request, rank, writers, ranges)."""

    def __init__(self, rng: random.Random, request_id: str, decode_instance: str, writers: list[list[int]],
                 bytes_per_token: int, token: bytes) -> None:
        self.rng = rng
        self.good = {"op": "data", "request_id": request_id, "decode_instance": decode_instance, "dst": [0, 0],
                     "token": token}
        self.writers = writers
        self.per_token = bytes_per_token
        self.sent: list[bytes] = []

    def header(self, start: int, end: int, src: list[int] | None = None, last: bool = False) -> dict[str, Any]:
        return {**self.good, "src": src or self.rng.choice(self.writers), "start": start, "end": end, "last": last,
                "nbytes": (end - start) * self.per_token}

    def message(self) -> tuple[str, bytes]:
        """(category, bytes on the wire); every header is wrong in at least one way."""
        r = self.rng
        if self.sent and r.random() < 0.05:
            return "replay", self.sent[r.randrange(len(self.sent))]
        unreceived = (r.randrange(HELD, N_TOKENS), N_TOKENS)
        h = self.header(*unreceived)  # right in every field: each category breaks one
        kind = r.choice(("token", "request_id", "decode_instance", "dst", "src", "beyond_capacity", "beyond_request",
                         "overlap", "replayed_range", "reversed", "nbytes", "last_flag", "aux", "missing", "extra",
                         "wrong_type", "length_bomb", "garbage", "not_a_map", "truncated_header", "op", "lane"))
        if kind == "token":  # an otherwise perfect header naming another token than its connection proved
            # (a header without one is the proven link's: kvxferd's own sources leave it out)
            choice = r.choice(("random", "empty", "long", "text"))
            h["token"] = {"random": r.randbytes(16), "empty": b"", "long": b"t" * 65, "text": "token"}[choice]
        elif kind == "request_id":
            h["request_id"] = r.choice(("legit-0", "ghost", "", "x" * 257, "legit-0 ", "LEGIT-0", "finished-1"))
            if h["request_id"] == "legit-0":
                h["request_id"] = "legit-00"
        elif kind == "decode_instance":
            h["decode_instance"] = r.choice(("dd2", "pp", "", "dd/tp0/pp0", "x" * 129))
        elif kind == "dst":
            h["dst"] = r.choice(([1, 0], [0, 1], [3, 3], [-1, 0], [2**16, 0], [0], "00"))
        elif kind == "src":
            h["src"] = r.choice(([2, 0], [0, 1], [1, 1], [7, 0], [-1, 0], [0, 0, 0]))
        elif kind == "beyond_capacity":
            start = r.choice((HELD, 15, 16, 2**40 - 1))
            h.update(start=start, end=r.choice((17, 64, 2**40)), last=False)
            h["nbytes"] = max(0, h["end"] - h["start"]) * self.per_token
        elif kind == "beyond_request":  # inside the pages, past the request's 14 tokens
            h.update(start=r.choice((HELD, 12, 14)), end=r.choice((15, 16)), last=r.random() < 0.5)
            h["nbytes"] = (h["end"] - h["start"]) * self.per_token
        elif kind == "overlap":  # straddles the delivered [0, 8)
            start = r.randrange(0, HELD)
            h.update(start=start, end=r.randrange(start + 1, N_TOKENS + 1), last=False)
            h["nbytes"] = (h["end"] - h["start"]) * self.per_token
        elif kind == "replayed_range":  # exactly what the real writers sent first
            h = self.header(0, HELD)
        elif kind == "reversed":
            h.update(start=12, end=r.choice((9, 11, 0)))
        elif kind == "nbytes":
            h["nbytes"] += r.choice((-1, 1, -h["nbytes"], 2**48 - h["nbytes"], self.per_token))
        elif kind == "last_flag":  # the last chunk must end at the request's last token
            h.update(start=HELD, end=r.choice((9, 12, 13)), last=True)
            h["nbytes"] = (h["end"] - h["start"]) * self.per_token
            if r.random() < 0.5:
                h["last"] = r.choice((1, "yes", None))
        elif kind == "aux":
            h["aux"] = r.choice((b"x" * ((1 << 20) + 1), "text", 7, [1]))  # over the 1 MiB aux limit
        elif kind == "missing":
            del h[r.choice(("request_id", "decode_instance", "dst", "src", "start", "end", "last", "nbytes"))]
        elif kind == "extra":
            h[r.choice(("offset", "page", "addr", "x" * 40))] = r.choice((0, 2**40, -8))
        elif kind == "wrong_type":
            field = r.choice(("request_id", "decode_instance", "dst", "src", "start", "end", "last", "nbytes",
                              "token"))
            h[field] = junk(r)
            if field == "last" and isinstance(h["last"], bool):  # still a valid chunk: break it
                h["last"] = "yes"
        elif kind == "length_bomb":
            data = LENGTH.pack(r.choice((0xFFFFFFFF, (2 << 20) + 1, 1 << 31)))
            self.sent.append(data)
            return kind, data
        elif kind == "garbage":
            body = r.randbytes(r.randint(1, 64))
            data = LENGTH.pack(len(body)) + body
            self.sent.append(data)
            return kind, data
        elif kind == "not_a_map":
            body = msgpack.packb(r.choice(([1, 2], "data", 5, None, [h])))
            data = LENGTH.pack(len(body)) + body
            self.sent.append(data)
            return kind, data
        elif kind == "truncated_header":  # a complete frame whose msgpack stops early
            body = msgpack.packb(h, use_bin_type=True)
            body = body[:r.randrange(1, len(body))]
            data = LENGTH.pack(len(body)) + body
            self.sent.append(data)
            return kind, data
        elif kind == "lane":  # a QoS lane that names no class: the header's one fault (a valid lane is a
            # sender's say over its own connection's receiving thread's nice, and nothing more)
            h["lane"] = r.choice(("urgent", "", "LATENCY", "l" * 9, 0, b"bulk", ["bulk"]))  # (nil: no lane at all)
        elif kind == "op":  # a data header carries op "data"; anything else is refused with it
            h["op"] = r.choice(("ack", "handshake", 5))
            h["nbytes"] = -1
        if kind not in ("length_bomb", "garbage", "not_a_map", "truncated_header") and r.random() < 0.05:
            h["nbytes"] = -1
        try:
            data = frame(h)
        except (TypeError, ValueError, OverflowError):
            data = frame({"op": "data"})
        self.sent.append(data)
        if len(self.sent) > 300:
            self.sent = self.sent[-300:]
        return kind, data


class FakePrefillDaemon:
    """Just enough of a prefill daemon for a decode daemon's peer link: answers the handshake with
    the prefill geometry, answers every ping, records the data token and the expects it is sent."""

    def __init__(self, prefill_spec) -> None:
        self.spec = prefill_spec
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"127.0.0.1:{self.port}"
        self.tokens: dict[str, bytes] = {}
        self.expects: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, payload = self.sock.recv_multipart()
            msg = msgpack.unpackb(payload, raw=False)
            reply = None
            if msg.get("op") == "handshake":
                self.tokens[msg["decode_instance"]] = msg.get("data_token")
                reply = {"op": "handshake_ok", "prefill_spec": self.spec.to_dict(), "mode": "direct",
                         "plan": carried_plan(self.spec, msg, "direct")}
            elif msg.get("op") == "ping":
                reply = {"op": "pong", "daemon": self.address}
            elif msg.get("op") == "expect":
                self.expects.append(msg)
            if reply is not None:
                if "seq" in msg:
                    reply["seq"] = msg["seq"]
                self.sock.send_multipart([identity, msgpack.packb(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)


def oracle_payload(request_id: str, writer: int, start: int, end: int) -> bytes:
    """The bytes prefill rank ``writer`` of a TP 2 instance sends a TP 1 rank: its two heads of tokens
    [start, end), in wire order (layers, then K and V, then tokens)."""
    logical = logical_cache(request_id, N_TOKENS, spec(), (0, spec().num_layers))
    return logical[:, :, start:end, 2 * writer:2 * writer + 2, :].contiguous().numpy().tobytes()


@pytest.fixture(scope="module")
def nodes(request):
    fake = FakePrefillDaemon(spec(tp_size=2))
    try:
        with cluster_run(request) as c:
            dd = c.daemon("data-decode-node", extra_toml=CONFIG)
            decode = c.instance(dd, "dd", "decode", spec(), NUM_PAGES)
            yield {"cluster": c, "dd": dd, "fake": fake, "decode": decode}
            # if a failure left it open, the engine stops waiting
            decode[0].command(cmd="abort", request_id="legit-0")
            time.sleep(0.3)
    finally:
        fake.close()


def test_data_port_refuses_10k_hostile_frames_and_writes_only_destination_rows(nodes):
    dd, fake, decode = nodes["dd"], nodes["fake"], nodes["decode"]
    decode[0].command(cmd="expect", request_id="legit-0", pages=DST, n=N_TOKENS, source_instance="pp",
                      source_address=fake.address)
    deadline = time.monotonic() + 20
    with EngineClient(dd.socket_path, timeout=10) as client:
        while client.status()["requests"] != {"decode:waiting_for_input": 1} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.status()["requests"] == {"decode:waiting_for_input": 1}
    token = fake.tokens["dd"]
    assert isinstance(token, bytes) and len(token) >= 16
    geo = decode[0].geometry
    per_token = 2 * geo.spec.num_layers * geo.spec.row_bytes // 2  # K and V, every layer, half the heads
    writers = [[0, 0], [1, 0]]
    fuzzer = DataFuzzer(random.Random(99), "legit-0", "dd", writers, per_token, token)
    # the legitimate first chunk of both writers
    for w in range(2):
        payload = oracle_payload("legit-0", w, 0, HELD)
        reply = exchange(dd.data_port, frame(fuzzer.header(0, HELD, src=writers[w])), payload, token=token)
        assert reply == {"op": "ack", "ok": True}, reply

    invalid_before = rr.metric(dd.metrics_url, "kvxferd_invalid_messages_total", endpoint="data")
    categories: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    messages = [fuzzer.message() for _ in range(MESSAGES)]
    started = time.monotonic()

    def one(item: tuple[str, bytes]) -> tuple[str, dict[str, Any] | None]:
        return item[0], exchange(dd.data_port, item[1], token=token)

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, messages, chunksize=50))
    refused = 0
    for kind, reply in results:
        categories[kind] += 1
        if reply is None:
            outcomes["no_reply"] += 1
        elif reply.get("ok") is True:
            outcomes["accepted"] += 1
        else:
            refused += 1
            outcomes[f"refused:{(reply.get('error') or {}).get('field')}"] += 1
    assert outcomes["accepted"] == 0, [(k, r) for k, r in results if r and r.get("ok")][:5]
    assert outcomes["no_reply"] == 0, [k for k, r in results if r is None][:20]

    # right headers whose payload stops short: bytes may land only in the destination's rows, the range
    # is released, and the real writer can still deliver it
    truncated = probes = 0
    for i in range(40):
        src = writers[i % 2]
        h = fuzzer.header(HELD, N_TOKENS, src=src, last=True)
        with data_connection(dd.data_port, token) as s:
            s.sendall(frame(h))
            s.sendall(random.Random(i).randbytes(random.Random(i + 1).randrange(0, h["nbytes"])))
        truncated += 1
        probe = {**h, "nbytes": h["nbytes"] + 1}  # refused for its size once the cut chunk is released
        deadline = time.monotonic() + 60
        while True:
            reply = exchange(dd.data_port, frame(probe), token=token)
            probes += 1
            assert reply and reply.get("ok") is False, reply
            refused += 1
            if reply and (reply.get("error") or {}).get("field") == "nbytes":
                break
            assert time.monotonic() < deadline, reply
            time.sleep(0.02)
    seconds = time.monotonic() - started
    categories["truncated_payload"] = truncated  # no answer: the sender hung up mid-payload
    categories["release_probe"] = probes
    sent = len(messages) + truncated + probes

    invalid_after = rr.metric(dd.metrics_url, "kvxferd_invalid_messages_total", endpoint="data")
    assert dd.proc.poll() is None
    assert "Traceback" not in dd.log()
    assert invalid_after - invalid_before == refused
    before_rest = canary(decode[0], [[DST, N_TOKENS]])
    assert before_rest["outside_bytes"] == 0, before_rest
    assert set(before_rest["changed_pages"]) <= set(DST), before_rest

    # the real writers send the rest: the request completes byte-exact despite the garbage the
    # cut-short chunks left in its rows
    for w in range(2):
        h = fuzzer.header(HELD, N_TOKENS, src=writers[w], last=True)
        if w == 0:
            h["aux"] = b"first-token"
        reply = exchange(dd.data_port, frame(h), oracle_payload("legit-0", w, HELD, N_TOKENS), token=token)
        assert reply == {"op": "ack", "ok": True}, reply
    dec = finished(decode[0], "legit-0")
    assert dec["event"] == "finished" and dec["state"] == "done" and dec["mismatched_bytes"] == 0, dec
    assert dec["aux"] == b"first-token".hex()
    after = canary(decode[0], [[DST, N_TOKENS]])
    assert after["outside_bytes"] == 0 and set(after["changed_pages"]) <= set(DST), after
    # replaying the whole request once it is done changes nothing
    replay = exchange(dd.data_port, frame(fuzzer.header(HELD, N_TOKENS, src=writers[0], last=True)),
                      oracle_payload("legit-0", 0, HELD, N_TOKENS), token=token)
    assert replay and replay["ok"] is False, replay
    with EngineClient(dd.socket_path, timeout=10) as client:
        assert client.call("ping")["ok"] is True
        assert wait_idle(client, 30) == {}
    assert canary(decode[0], [[DST, N_TOKENS]])["outside_bytes"] == 0
    rr.record("fuzz", "data_port", {
        "endpoint": "data", "messages": sent + 1, "answered": refused + 1,
        "invalid_metric_delta": int(invalid_after - invalid_before), "internal_errors": 0,
        "bytes_outside_destinations": after["outside_bytes"],
        "daemon_alive": True, "seconds": seconds, "categories": dict(categories), "error_codes": dict(outcomes)})


# -- digests: a data port of a decode daemon in integrity.mode = "full" --------------------------

DIGEST_REQUESTS = 120


def oracle_digests(request_id: str, writer: int, start: int, end: int, hash: str = "xxh3") -> list[int]:
    """The digest ``hash`` of each region's part of :func:`oracle_payload`, computed here from the
    oracle's logical cache with the oracles' digests (not kvxferd's): regions in wire order, layers
    then K and V."""
    logical = logical_cache(request_id, N_TOKENS, spec(), (0, spec().num_layers))
    part = logical[:, :, start:end, 2 * writer:2 * writer + 2, :]
    of = digest_oracles.wsum if hash == "wsum" else digest_oracles.xxh3
    return [of(part[layer, kind].contiguous().numpy().tobytes())
            for layer in range(part.shape[0]) for kind in range(part.shape[1])]


def test_no_wrong_digest_or_changed_byte_turns_into_done(request):
    """The test plays both prefill writers towards a decode daemon in integrity.mode = "full",
    request after request: the oracle's bytes with the oracle's digests must land ``done`` and
    byte-exact; a changed payload byte, a changed, missing, short or ill-typed digest list, a
    sample or picks that cover less than every slot (or are ill-formed, or picks without a
    sample), a header field changed after the header's own digest was taken (aux, last, the token
    range, the writer), or a changed or missing header digest must never: the chunk is refused (``ok: false``) and the request fails, with code
    ``integrity`` wherever the header itself was well formed. Each writer sends its digests in
    the header or, at random, in a frame after the payload (``trailer``, as a kvxferd source
    does when every slot is checked); a trailer frame with another op is refused too. Each writer's
    digests are XXH3 (``hash`` left out or named) or the device's word sums (``hash = "wsum"``): a
    digest no kvxferd knows is refused at the header, digests that are not the named one's fail."""
    fake = FakePrefillDaemon(spec(tp_size=2))
    rng = random.Random(5)
    try:
        with cluster_run(request) as c:
            dd = c.daemon("digest-decode-node", extra_toml=CONFIG + '[integrity]\nmode = "full"\n')
            decode = c.instance(dd, "dg", "decode", spec(), NUM_PAGES)
            geo = decode[0].geometry
            per_token = 2 * geo.spec.num_layers * geo.spec.row_bytes // 2
            writers = [[0, 0], [1, 0]]
            outcomes: Counter[str] = Counter()
            with EngineClient(dd.socket_path, timeout=10) as client:
                for i in range(DIGEST_REQUESTS):
                    rid = f"dg-{i}"
                    decode[0].command(cmd="expect", request_id=rid, pages=DST, n=N_TOKENS, source_instance="pp",
                                      source_address=fake.address)
                    deadline = time.monotonic() + 30
                    while client.status()["requests"] != {"decode:waiting_for_input": 1}:
                        assert time.monotonic() < deadline, client.status()["requests"]
                        time.sleep(0.01)
                    fuzzer = DataFuzzer(rng, rid, "dg", writers, per_token, fake.tokens["dg"])
                    kind = "clean" if i % 4 == 0 else rng.choice(
                        ("payload_byte", "digest_bit", "digest_missing", "digest_short", "digest_long",
                         "digest_type", "sample_narrow", "sample_type", "picks_narrow", "picks_type", "picks_alone",
                         "hash_type", "hash_swap", "header_field", "header_digest_bit", "header_digest_missing"))
                    bad_writer = rng.randrange(2)
                    trailing = [rng.random() < 0.5 for _ in range(2)]
                    if kind == "digest_missing" and trailing[bad_writer] and rng.random() < 0.5:
                        kind = "trailer_op"  # the digests frame comes under another op
                    trail_refused = trailing[bad_writer] and kind in ("digest_missing", "digest_type", "trailer_op")
                    refused = ("digest_type", "sample_type", "picks_type", "picks_alone", "hash_type")  # at the header
                    # each writer's digest: XXH3 unnamed or named, or the device's word sums
                    hashes = [rng.choice((None, "xxh3", "wsum")) for _ in range(2)]
                    replies = []
                    for w in range(2):
                        h = fuzzer.header(0, N_TOKENS, src=writers[w], last=True)
                        payload = bytearray(oracle_payload(rid, w, 0, N_TOKENS))
                        digests = oracle_digests(rid, w, 0, N_TOKENS, hashes[w] or "xxh3")
                        if hashes[w]:
                            h["hash"] = hashes[w]
                        if w == bad_writer and kind != "clean":
                            if kind == "payload_byte":
                                payload[rng.randrange(len(payload))] ^= 1 << rng.randrange(8)
                            elif kind == "digest_bit":
                                k = rng.randrange(len(digests))
                                digests[k] ^= 1 << rng.randrange(64)
                            elif kind == "digest_short":
                                digests = digests[:-1]
                            elif kind == "digest_long":
                                digests = digests + [rng.randrange(2**64)]
                            elif kind == "digest_type":
                                digests = rng.choice(([-1] + digests[1:], ["1"] + digests[1:], "x", [None],
                                                      [0.5] + digests[1:], [True] + digests[1:]))
                        tail = b""
                        if trailing[w]:
                            h["trailer"] = True
                            body = {"op": "digests", "digests": digests}
                            if w == bad_writer and kind == "digest_missing":
                                del body["digests"]
                            elif w == bad_writer and kind == "trailer_op":
                                body["op"] = "data"
                            tail = frame(body)
                        elif not (w == bad_writer and kind == "digest_missing"):
                            h["digests"] = digests
                        if w == bad_writer and kind == "sample_narrow":  # well formed, but not the full ask
                            period = rng.randrange(2, 64)
                            h["sample"] = [period, rng.randrange(period)]
                        elif w == bad_writer and kind == "sample_type":
                            h["sample"] = rng.choice(([0, 0], [3, 3], [2], [2, -1], "2", [1 << 17, 0], [2.0, 0]))
                        elif w == bad_writer and kind == "picks_narrow":  # well formed, picking no granule
                            h["sample"], h["picks"] = [2, 0], [0, bytes(rng.randrange(3))]
                        elif w == bad_writer and kind == "picks_type":
                            h["sample"] = [2, 0]
                            h["picks"] = rng.choice(([0], [-1, b"\x01"], [0, "x"], "p", [True, b""], [0, b"\x01", 1],
                                                     [0, bytes(MAX_PICK_BYTES + 1)]))
                        elif w == bad_writer and kind == "picks_alone":  # picks, and no sample they belong to
                            h["picks"] = [0, b"\xff"]
                        elif w == bad_writer and kind == "hash_type":  # a digest no kvxferd knows
                            h["hash"] = rng.choice(("crc32", "", "wsum2", 7, b"xxh3", ["wsum"]))
                        elif w == bad_writer and kind == "hash_swap":  # the digests are not the named one's
                            h["hash"] = "xxh3" if hashes[w] == "wsum" else "wsum"
                        try:  # the header's own digest, as a source sends it
                            h["header_digest"] = digest_oracles.header(h)
                        except (AssertionError, TypeError, ValueError):
                            assert kind in refused, kind  # a field no source sends (refused at the header anyway)
                        if w == bad_writer and kind == "header_field":  # a field changed after it: in flight
                            changed = rng.choice(("aux", "last", "start", "end", "src"))
                            h.update({"aux": {"aux": rng.randbytes(8)}, "last": {"last": False},
                                      "start": {"start": rng.randrange(1, N_TOKENS)},
                                      "end": {"end": rng.randrange(N_TOKENS)},
                                      "src": {"src": writers[1 - w]}}[changed])
                        elif w == bad_writer and kind == "header_digest_bit":
                            h["header_digest"] ^= 1 << rng.randrange(64)
                        elif w == bad_writer and kind == "header_digest_missing":
                            del h["header_digest"]
                        replies.append(exchange(dd.data_port, frame(h), bytes(payload) + tail,
                                                token=fake.tokens["dg"]))
                    if kind in refused or trail_refused:
                        # refused at the header or at the digests frame: the request waits; end it
                        assert replies[bad_writer]["ok"] is False, replies
                        field = {"trailer_op": "op"}.get(kind, kind.split("_")[0])
                        assert str(replies[bad_writer]["error"]["field"]).startswith(field), (kind, replies)
                        decode[0].command(cmd="abort", request_id=rid)
                    ev = finished(decode[0], rid)
                    outcomes[f"{kind}:{ev.get('state')}:{ev.get('code')}"] += 1
                    outcomes[f"trailer:{trailing[bad_writer]}:{ev.get('state')}:{ev.get('code')}"] += 1
                    if kind == "clean":
                        assert replies == [{"op": "ack", "ok": True}] * 2, replies
                        assert ev["state"] == "done" and ev["mismatched_bytes"] == 0, ev
                        continue
                    assert ev["state"] == "failed", (kind, ev)  # never done
                    if kind not in refused and not trail_refused:
                        assert ev["code"] == "integrity" and rid in ev["reason"], (kind, ev)
                        assert replies[bad_writer]["ok"] is False, (kind, replies)
                        assert replies[bad_writer]["error"]["code"] == "integrity", (kind, replies)
                    assert wait_idle(client, 30) == {}
            assert dd.proc.poll() is None and "Traceback" not in dd.log()
            assert outcomes["clean:done:None"] == DIGEST_REQUESTS // 4, outcomes
            assert sum(v for k, v in outcomes.items() if k.endswith(":integrity")
                       and not k.startswith("trailer:")) >= DIGEST_REQUESTS // 4, outcomes
            for kind in ("payload_byte", "digest_bit", "digest_short", "digest_long", "picks_narrow", "hash_swap",
                         "header_field", "header_digest_bit", "header_digest_missing"):
                assert outcomes[f"{kind}:failed:integrity"] > 0, (kind, outcomes)
            for kind in ("sample_type", "picks_type", "picks_alone", "hash_type"):
                assert outcomes[f"{kind}:failed:aborted"] > 0, (kind, outcomes)  # refused at the header
            for trailed in (True, False):  # both ways of sending digests landed clean, and failed closed
                assert outcomes[f"trailer:{trailed}:done:None"] > 0, outcomes
                assert outcomes[f"trailer:{trailed}:failed:integrity"] > 0, outcomes
            failures = sum(v for k, v in rr.scrape(dd.metrics_url).items()
                           if k.startswith("kvxferd_integrity_failures_total{") and 'transport="tcp"' in k)
            assert failures == sum(v for k, v in outcomes.items()
                                   if k.endswith(":integrity") and not k.startswith("trailer:")), (failures, outcomes)
            decode[0].close()
    finally:
        fake.close()

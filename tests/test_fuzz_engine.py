"""Fuzzing the engine endpoint (ipc://, ZeroMQ DEALER) of a running daemon.

Engines are local but not trusted to send well-formed messages (DESIGN: trust
boundaries). A fuzzing engine registers its own ranks over shared memory filled with the
canary, then throws structure-aware mutations of every engine op at the daemon in
pipelined batches: wrong types, missing and extra fields, huge and negative numbers,
out-of-range and overlapping pages, wrong versions, truncated msgpack, unknown request
ids, duplicates and replays. The daemon must answer every frame, count every schema error
in ``kvxferd_invalid_messages_total{endpoint="engine"}``, never crash, never write a byte
outside the destination rows of a legitimate request, and keep serving real engines.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e2e_util import Cluster, assert_verified, pages_for, spec, transfer
from kvxferd.model.geometry import RankGeometry
from kvxferd.sdk.client import EngineClient
from kvxferd.sdk.kv_cache import allocate_cpu
from kvxferd.tools.oracle import CANARY

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import reliability_report as rr  # noqa: E402

NUM_PAGES = 16
MESSAGES = 10_000
BATCH = 400
MAX_MESSAGE = 4 << 20
CLOSED_PORTS = (1, 9, 13)  # nothing listens there: links to them never come up
CONFIG = ("[timeouts]\nbootstrap_s = 1.5\nwaiting_for_input_s = 2.0\ntransfer_s = 4.0\ndrain_grace_s = 1.0\n"
          "handshake_retry_s = 0.2\n"
          f"[limits]\nmax_message_bytes = {MAX_MESSAGE}\nmax_inflight_requests = 512\n")


# -- shared by the three fuzz modules ---------------------------------------------------------

def canary(worker, allowed: list[list[Any]]) -> dict[str, Any]:
    """Ask a sim worker for every non-canary byte outside ``allowed`` ([pages, n] pairs)."""
    worker.command(cmd="canary", allowed=allowed)
    while True:
        ev = worker.next_event(60)
        if ev.get("event") == "canary":
            return ev
        if ev.get("event") == "exit":
            raise AssertionError("worker exited")


def local_canary(cache, allowed: list[list[Any]] = ()) -> dict[str, Any]:
    from kvxferd.tools.oracle import canary_report
    return canary_report(cache, cache.geometry, list(allowed))


def wait_idle(client: EngineClient, timeout: float) -> dict[str, int]:
    """Wait until the daemon holds no request entries; return what is left."""
    deadline = time.monotonic() + timeout
    while True:
        left = client.status()["requests"]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


JUNK: list[Any] = [None, True, False, 0, -1, 1, 2**31, 2**32 + 7, 2**40 + 1, 2**62 + 1, 2**63 - 1, 2**64 - 1,
                   -2**63, 0.5, -1e300, math.inf, -math.inf, math.nan, "", "x", "x" * 300, "x" * 5000,
                   "\u00e9\u4e2d\U0001f600", "../../etc/passwd", "/dev/shm/../../etc/passwd", b"", b"\x00\xff",
                   b"x" * 70000, [], [1], [[]], [None], ["a", 1], list(range(300)), {}, {"a": 1}, {"op": "ping"},
                   [[[[[[[[[[1]]]]]]]]]]]


def junk(rng: random.Random) -> Any:
    return rng.choice(JUNK)


def deep(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def encoded_mutations(rng: random.Random, payload: bytes) -> tuple[str, bytes]:
    """Byte-level damage to an encoded message."""
    kind = rng.choice(("truncate", "bitflip", "trailing", "random", "empty", "length_bomb", "ext", "deep",
                       "int_key", "non_map", "bad_utf8"))
    if kind == "truncate" and len(payload) > 1:
        return kind, payload[:rng.randrange(1, len(payload))]
    if kind == "bitflip":
        b = bytearray(payload)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        return kind, bytes(b)
    if kind == "trailing":
        return kind, payload + rng.choice((b"\x00", b"\xc1", msgpack.packb({"op": "ping"})))
    if kind == "random":
        return kind, rng.randbytes(rng.randint(1, 200))
    if kind == "empty":
        return kind, b""
    if kind == "length_bomb":  # headers that declare gigabytes of str/bin/array/map
        return kind, rng.choice((b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xffab", b"\xdd\xff\xff\xff\xff\x01",
                                 b"\xdf\xff\xff\xff\xff\xa2op", b"\x81\xa2op\xdb\x7f\xff\xff\xff"))
    if kind == "ext":
        return kind, msgpack.packb({"op": "ping", "x": msgpack.ExtType(5, b"abc")})
    if kind == "deep":
        return kind, msgpack.packb({"op": "ping", "x": deep(rng.choice((100, 500, 1000)))})
    if kind == "int_key":
        return kind, b"\x82\xa2op\xa4ping\x01\x02"  # {"op": "ping", 1: 2}: not a string key
    if kind == "non_map":
        return kind, msgpack.packb(rng.choice(([1, 2, 3], "op", 7, None, [{"op": "ping"}])))
    return "bad_utf8", b"\x81\xa2op\xa4p\xffng"


class EngineFuzzer:
    """Seeded generator of hostile engine messages around one fuzzing engine's own ranks."""

    def __init__(self, rng: random.Random, decode_rank: str, prefill_rank: str, decode_geo: dict[str, Any],
                 regions: list[dict[str, Any]], foreign_ranks: list[str]) -> None:
        self.rng = rng
        self.decode_rank = decode_rank
        self.prefill_rank = prefill_rank
        self.decode_geo = decode_geo
        self.regions = regions
        self.foreign = foreign_ranks
        self.request_ids = [f"fz-{i}" for i in range(150)] + ["", "x" * 256, "x" * 257, "\u4e2d/\u00e9 id",
                                                              "legit-before"]
        self.sent: list[Any] = []
        self.seq = 1 << 20

    # valid-looking bases -----------------------------------------------------------------
    def pages(self) -> Any:
        r = self.rng
        kind = r.random()
        if kind < 0.4:
            return r.sample(range(NUM_PAGES), r.randint(1, 4))
        return r.choice(([-1], [NUM_PAGES], [NUM_PAGES + 1000], [2**31], [2**63 - 1], [-2**63], [0, 0, 0],
                         [1, 2, 1], [], list(range(NUM_PAGES)) * 3, [0] * 60_000, [1.5], ["1"], [True],
                         [[1]], [None], {"0": 1}, "0,1", 3))

    def base(self) -> dict[str, Any]:
        r = self.rng
        op = r.choice(("ping", "status", "register", "unregister", "expect", "expect", "expect", "send", "send",
                       "send", "poll", "abort", "abort"))
        msg: dict[str, Any] = {"op": op}
        rid = r.choice(self.request_ids)
        if op == "register":
            geo = dict(self.decode_geo)
            regions = [dict(x) for x in self.regions]
            choice = r.random()
            if choice < 0.2:
                geo[r.choice(list(geo))] = junk(r)
            elif choice < 0.35:
                geo[r.choice(("num_layers", "pp_size", "tp_size", "total_kv_heads", "num_pages"))] = r.choice(
                    (0, -3, 2**20, 10**9, 2**40))
            elif choice < 0.6 and regions:
                x = r.choice(regions)
                field = r.choice(("offset", "nbytes", "path", "fd", "layer", "kind", "mem"))
                x[field] = r.choice((junk(r), -1, 2**47, x.get("offset", 0) + 2**30, "/etc/passwd",
                                     "/dev/shm/does-not-exist", "/dev/shm", "latent", "cuda_ipc", 7))
            elif choice < 0.7:
                regions = regions[:-1] if r.random() < 0.5 else regions + regions[:1]
            msg.update(instance=r.choice(("fz-d", "fz-d", "fz-x", "", "a/b", "x" * 129)),
                       role=r.choice(("decode", "decode", "prefill", "both", "")), geometry=geo, regions=regions)
            # CPU caches are memfds the daemon opens through the registering engine's pid
            if r.random() < 0.8:
                msg["pid"] = os.getpid() if r.random() < 0.8 else r.choice((1, 2**31 - 1, junk(r)))
        elif op == "unregister":
            msg.update(rank_id=r.choice(self.foreign + ["nobody/tp0/pp0", ""]))
        elif op == "expect":
            msg.update(rank_id=r.choice((self.decode_rank,) * 4 + (self.prefill_rank, *self.foreign)),
                       request_id=rid, source_instance=r.choice(("ghost", "fz-y", "", "x" * 200)),
                       pages=self.pages())
            if r.random() < 0.6:
                msg["num_tokens"] = r.choice((1, 3, 8, 64, 0, -1, 2**40, 2**41))
            if r.random() < 0.4:
                msg["source_address"] = r.choice([f"127.0.0.1:{p}" for p in CLOSED_PORTS]
                                                 + ["no-port", "127.0.0.1:", "127.0.0.1:port", ""])
            if r.random() < 0.2:
                msg["timeout_s"] = r.choice((0, -1, 0.0001, 1e12, "soon", math.nan))
        elif op == "send":
            start = r.choice((0, 0, 4, 8, 3, -1, 2**40, 2**41))
            end = r.choice((start + 4, start + 8, start, start - 1, 12, 2**31, 2**40))
            msg.update(rank_id=r.choice((self.prefill_rank,) * 4 + (self.decode_rank, *self.foreign)),
                       request_id=rid, pages=self.pages(), start=start, end=end,
                       last=r.choice((True, False, 1, None)))
            if r.random() < 0.2:
                msg["aux"] = r.choice((b"tok", b"x" * (1 << 20), b"x" * ((1 << 20) + 1), "text", 5))
            if r.random() < 0.2:  # a class above its instance's, unknown ones, budgets out of range
                msg["qos_class"] = r.choice(("latency", "bulk", "urgent", "", 1, None, "l" * 17))
            if r.random() < 0.2:
                msg["budget_ms"] = r.choice((0.5, 0.0, -1, 1e12, float("nan"), float("inf"), "5", True))
            if r.random() < 0.2:  # wall-clock deadlines: past, now, far ahead, out of range, not numbers
                msg["deadline_at"] = r.choice((0.0, time.time(), time.time() + 3600, 2.0**40, -1, float("nan"), "x"))
        elif op in ("poll", "abort"):
            msg.update(rank_id=r.choice((self.decode_rank, self.prefill_rank, *self.foreign, "x")), request_id=rid)
            if op == "abort" and r.random() < 0.3:
                msg["reason"] = r.choice(("fuzz", "", "r" * 600, 5))
        if r.random() < 0.7:
            self.seq += 1
            msg["seq"] = r.choice((self.seq, self.seq, -1, 2**64 - 1, "7", None))
        return msg

    # one message -------------------------------------------------------------------------
    def message(self) -> tuple[str, list[bytes]]:
        r = self.rng
        if self.sent and r.random() < 0.08:
            return "replay", self.sent[r.randrange(len(self.sent))]
        msg = self.base()
        roll = r.random()
        if roll < 0.25:
            category = "valid_shape"
        elif roll < 0.35:
            category = "missing_field"
            keys = [k for k in msg if k != "seq"]
            del msg[r.choice(keys)]
        elif roll < 0.45:
            category = "extra_field"
            msg[r.choice(("extra", "rank", "v2", "x" * 100, ""))] = junk(r)
        elif roll < 0.62:
            category = "wrong_type"
            keys = [k for k in msg if k != "seq"]
            msg[r.choice(keys)] = junk(r)
        elif roll < 0.67:
            category = "wrong_version"
            msg["v"] = r.choice((0, 2, 99, -1, "1", None))
        elif roll < 0.72:
            category = "bad_op"
            msg["op"] = r.choice(("", "nope", "PING", "handshake", "data", "event", 5, None, b"ping", "x" * 1000))
        elif roll < 0.77:
            category = "non_str_keys"
            msg[r.choice((b"extra", b"op", b"rank_id"))] = 1
            if r.random() < 0.5:
                msg["unknown"] = 2  # a str key and a bytes key that are both unknown
        else:
            category = "encoding"
            try:
                payload = msgpack.packb(msg, use_bin_type=True)
            except (ValueError, OverflowError):
                payload = b"\xc1"
            kind, payload = encoded_mutations(r, payload)
            frames = [payload]
            self.sent.append(frames)
            return f"encoding:{kind}", frames
        try:
            payload = msgpack.packb(msg, use_bin_type=True)
        except (ValueError, OverflowError, TypeError):
            category, payload = "unencodable", msgpack.packb({"op": "ping", "x": 1})
        frames = [payload]
        if r.random() < 0.03:
            category, frames = "multipart", [payload, payload] if r.random() < 0.5 else [b"", payload]
        self.sent.append(frames)
        if len(self.sent) > 500:
            self.sent = self.sent[-500:]
        return category, frames


def blast(sock: zmq.Socket, frames_list: list[list[bytes]], timeout_ms: int = 20_000) -> list[dict[str, Any]]:
    """Send a batch, then collect exactly one reply per frame (events are skipped): every part of
    a multipart message is a call of its own (a batch) and gets its own answer."""
    for frames in frames_list:
        sock.send_multipart(frames)
    replies: list[dict[str, Any]] = []
    want = sum(len(frames) for frames in frames_list)
    while len(replies) < want:
        if not sock.poll(timeout_ms):
            raise AssertionError(f"daemon answered {len(replies)} of {want} frames")
        reply = msgpack.unpackb(sock.recv(), raw=False)
        if reply.get("op") != "event":
            replies.append(reply)
    return replies


@pytest.fixture(scope="module")
def node():
    c = Cluster()
    geo = RankGeometry(spec(), 0, 0, NUM_PAGES)
    dcache = allocate_cpu(geo, name="fz-d", fill=CANARY)
    pcache = allocate_cpu(geo, name="fz-p", fill=CANARY)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:  # a failed set-up must stop what it started too
        d = c.daemon("fuzz-engine-node", extra_toml=CONFIG)
        prefill, decode = c.instances((d, "lp", "prefill", spec(), NUM_PAGES),
                                      (d, "ld", "decode", spec(), NUM_PAGES))
        sock.connect(f"ipc://{d.socket_path}")
        ranks = {}
        for inst, role, cache in (("fz-d", "decode", dcache), ("fz-p", "prefill", pcache)):
            sock.send(msgpack.packb({"op": "register", "seq": 1, "instance": inst, "role": role,
                                     "pid": os.getpid(), "geometry": geo.to_dict(),
                                     "regions": cache.descriptors()}))
            reply = msgpack.unpackb(sock.recv())
            assert reply["ok"], reply
            ranks[role] = reply["rank_id"]
        yield {"cluster": c, "daemon": d, "prefill": prefill, "decode": decode, "sock": sock, "geo": geo,
               "dcache": dcache, "pcache": pcache, "ranks": ranks, "allowed_decode": [], "allowed_prefill": []}
    finally:
        sock.close(0)
        dcache.close()
        pcache.close()
        c.close()
        shutil.rmtree(c.root, ignore_errors=True)


def legit(state: dict[str, Any], tag: str) -> None:
    rng = random.Random(tag)
    src, dst = pages_for(rng, NUM_PAGES, 13, 4), pages_for(rng, NUM_PAGES, 13, 4)
    dec, pre = transfer(state["prefill"], state["decode"], f"legit-{tag}", 13, src_pages=src, dst_pages=dst,
                        source_address=None, chunks=[[0, 8], [8, 13]])
    assert_verified(dec, pre)
    state["allowed_decode"].append([dst, 13])
    state["allowed_prefill"].append([src, 13])


def test_engine_endpoint_survives_10k_hostile_messages(node):
    d = node["daemon"]
    legit(node, "before")
    invalid_before = rr.metric(d.metrics_url, "kvxferd_invalid_messages_total", endpoint="engine")
    fds_before = rr.open_fds(d.proc.pid)
    fuzzer = EngineFuzzer(random.Random(20240611), node["ranks"]["decode"], node["ranks"]["prefill"],
                          node["geo"].to_dict(), node["dcache"].descriptors(),
                          [node["decode"][0].rank_id, node["prefill"][0].rank_id])
    categories: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    answered = bad_message = parts = 0
    started = time.monotonic()
    sent = 0
    while sent < MESSAGES:
        batch = []
        for _ in range(min(BATCH, MESSAGES - sent)):
            category, frames = fuzzer.message()
            categories[category.split(":")[0]] += 1
            batch.append(frames)
        replies = blast(node["sock"], batch)
        sent += len(batch)
        parts += sum(len(frames) for frames in batch)
        answered += len(replies)
        for reply in replies:
            if reply.get("ok") is True:
                codes["ok"] += 1
                continue
            code = (reply.get("error") or {}).get("code", "?")
            codes[code] += 1
            bad_message += code == "bad_message"
    # oversize frames: ZeroMQ drops the connection (MAXMSGSIZE); the daemon must not notice
    for size in (MAX_MESSAGE + 1, 4 * MAX_MESSAGE):
        big = zmq.Context.instance().socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(f"ipc://{d.socket_path}")
        big.send(msgpack.packb({"op": "ping", "pad": b"x" * size}))
        assert not big.poll(300), "an oversize message was answered"
        big.close(0)
        categories["oversize"] += 1
        sent += 1
    seconds = time.monotonic() - started

    with EngineClient(d.socket_path, timeout=10) as client:
        assert client.call("ping")["ok"] is True
        left = wait_idle(client, 30)
    invalid_after = rr.metric(d.metrics_url, "kvxferd_invalid_messages_total", endpoint="engine")
    assert d.proc.poll() is None, d.log()[-3000:]
    assert answered == parts  # every frame of every message but the oversize ones
    assert codes.get("internal", 0) == 0, [l for l in d.log().splitlines() if "crash" in l][:5]
    assert "Traceback" not in d.log(), d.log()[d.log().index("Traceback") - 200:][:3000]
    assert invalid_after - invalid_before == bad_message > 1000
    assert left == {}, left
    # the fuzzing engine's own memory: no byte of it was ever a destination of a real request
    outside = local_canary(node["dcache"])["outside_bytes"] + local_canary(node["pcache"])["outside_bytes"]
    assert outside == 0
    legit(node, "after")
    dec = canary(node["decode"][0], node["allowed_decode"])
    pre = canary(node["prefill"][0], node["allowed_prefill"])
    assert dec["outside_bytes"] == 0 and pre["outside_bytes"] == 0, (dec, pre)
    fds_after = rr.open_fds(d.proc.pid)
    node["invalid_mark"] = invalid_after
    rr.record("fuzz", "engine_seeded", {
        "endpoint": "engine", "messages": sent, "answered": answered,
        "invalid_metric_delta": int(invalid_after - invalid_before),
        "internal_errors": codes.get("internal", 0), "bytes_outside_destinations": outside + dec["outside_bytes"]
        + pre["outside_bytes"], "daemon_alive": True, "seconds": seconds, "categories": dict(categories),
        "error_codes": dict(codes), "fds_before": fds_before, "fds_after": fds_after,
        "notes": ["engine messages accept any 'v' field: only the peer handshake checks the protocol version",
                  f"{categories['oversize']} frames over limits.max_message_bytes were dropped by ZeroMQ "
                  "(MAXMSGSIZE closes the connection) without an answer or a count, as designed",
                  f"answers count frames: each part of the {categories['multipart']} multipart messages is a "
                  "call of its own (a batch) and has its own answer"]})


ENGINE_OPS = ("ping", "status", "register", "unregister", "expect", "send", "poll", "abort")
scalar = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**63, max_value=2**64 - 1),
                   st.floats(allow_nan=True), st.text(max_size=12), st.binary(max_size=12))
value = st.recursive(scalar, lambda children: st.one_of(st.lists(children, max_size=3),
                                                        st.dictionaries(st.sampled_from("abcdef"), children,
                                                                        max_size=3)),
                     max_leaves=6)
FIELDS = ("rank_id", "request_id", "pages", "start", "end", "last", "aux", "source_instance", "source_address",
          "num_tokens", "timeout_s", "instance", "role", "geometry", "regions", "reason", "seq", "v", "qos_class",
          "budget_ms", "deadline_at")


@st.composite
def engine_message(draw) -> bytes:
    msg: dict[str, Any] = {"op": draw(st.one_of(st.sampled_from(ENGINE_OPS), st.text(max_size=8)))}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=8, unique=True)):
        if name == "pages":
            msg[name] = draw(st.one_of(st.lists(st.integers(min_value=-2**63, max_value=2**63 - 1), max_size=8),
                                       value))
        elif name in ("start", "end", "num_tokens"):
            msg[name] = draw(st.one_of(st.integers(min_value=-2**63, max_value=2**64 - 1), value))
        elif name == "source_address":  # only loopback: never let the daemon dial out
            msg[name] = draw(st.one_of(st.just("127.0.0.1:1"), st.text(alphabet="abc./-", max_size=20)))
        else:
            msg[name] = draw(value)
    payload = msgpack.packb(msg, use_bin_type=True)
    if draw(st.booleans()) and len(payload) > 1:
        payload = payload[:draw(st.integers(min_value=1, max_value=len(payload) - 1))]
    return payload


HYPOTHESIS_COUNT = {"messages": 0, "bad_message": 0, "internal": 0, "seconds": 0.0}


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(batch=st.lists(engine_message(), min_size=20, max_size=20))
def test_engine_endpoint_answers_any_message_batch(node, batch):
    """Property: for any batch of (possibly truncated) maps of engine fields, every frame is answered
    and no answer is an internal error."""
    started = time.monotonic()
    replies = blast(node["sock"], [[p] for p in batch])
    HYPOTHESIS_COUNT["seconds"] += time.monotonic() - started
    codes = [(r.get("error") or {}).get("code") for r in replies if r.get("ok") is not True]
    HYPOTHESIS_COUNT["messages"] += len(batch)
    HYPOTHESIS_COUNT["bad_message"] += codes.count("bad_message")
    HYPOTHESIS_COUNT["internal"] += codes.count("internal")
    assert "internal" not in codes, replies


def test_engine_endpoint_hypothesis_summary(node):
    d = node["daemon"]
    with EngineClient(d.socket_path, timeout=10) as client:
        assert client.call("ping")["ok"] is True
        assert wait_idle(client, 30) == {}
    outside = local_canary(node["dcache"])["outside_bytes"] + local_canary(node["pcache"])["outside_bytes"]
    assert outside == 0
    delta = None
    if "invalid_mark" in node:  # the seeded run left its mark: the property run's schema errors were all counted
        delta = int(rr.metric(d.metrics_url, "kvxferd_invalid_messages_total", endpoint="engine")
                    - node["invalid_mark"])
        assert delta == HYPOTHESIS_COUNT["bad_message"]
    assert HYPOTHESIS_COUNT["messages"] >= 1000
    rr.record("fuzz", "engine_hypothesis", {
        "endpoint": "engine", "messages": HYPOTHESIS_COUNT["messages"], "answered": HYPOTHESIS_COUNT["messages"],
        "invalid_metric_delta": delta, "internal_errors": HYPOTHESIS_COUNT["internal"],
        "bytes_outside_destinations": outside, "daemon_alive": d.proc.poll() is None,
        "seconds": HYPOTHESIS_COUNT["seconds"]})


#: links of requests that can neither time out nor be abandoned while the test counts them
LINKS_CONFIG = ("[timeouts]\nbootstrap_s = 600.0\nwaiting_for_input_s = 600.0\ntransfer_s = 600.0\n"
                "drain_grace_s = 1.0\nhandshake_retry_s = 0.2\n")


def test_source_addresses_named_by_engines_do_not_pile_up_links():
    """Each source daemon address an engine names gets a peer link; dead links must give their
    sockets back, or an engine naming many addresses leaks one ZeroMQ socket (and descriptor)
    per address. A down link stays listed (memory only) while it is backed off.

    The requests cannot time out in their bootstrap while the links are counted; each ends by the
    engine's abort or, where the peer timeout came first, as peer_unreachable."""
    from kvxferd.tools.sim import free_port
    c = Cluster()
    started = time.monotonic()
    try:
        d = c.daemon("links-node", extra_toml=LINKS_CONFIG)
        [decode] = c.instance(d, "ld", "decode", spec(), NUM_PAGES)
        with EngineClient(d.socket_path, timeout=30) as client:
            links_before = len(client.status()["peers"])
            fds_before = rr.open_fds(d.proc.pid)
            for i in range(40):
                decode.command(cmd="expect", request_id=f"link-{i}", pages=[1], n=2, source_instance="ghost",
                               source_address=f"127.0.0.1:{free_port()}")
            deadline = time.monotonic() + 60
            while (st := client.status())["requests"] != {"decode:bootstrapping": 40}:
                assert time.monotonic() < deadline, st["requests"]
                time.sleep(0.05)
            peak = len(st["peers"])  # every request still waits on its link: none can have gone
            for i in range(40):
                decode.command(cmd="abort", request_id=f"link-{i}", reason="test")
            aborted = [decode.next_event(60) for _ in range(40)]
            assert all(e.get("state") == "failed" and e.get("code") in ("aborted", "peer_unreachable")
                       for e in aborted), aborted

            def open_links() -> int:
                return sum(1 for p in client.status()["peers"] if p["state"] != "down")

            deadline = time.monotonic() + 60  # declared down after peer_timeout_s: its socket closed
            while open_links() > links_before:
                assert time.monotonic() < deadline, client.status()["peers"]
                time.sleep(0.1)
            links_after = open_links()
            assert wait_idle(client, 30) == {}
        deadline = time.monotonic() + 30  # ZeroMQ's reaper thread frees closed sockets' descriptors
        while rr.open_fds(d.proc.pid) > fds_before + 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        fds_after = rr.open_fds(d.proc.pid)
        assert peak == links_before + 40, peak
        assert links_after <= links_before, links_after
        assert fds_after <= fds_before + 4, (fds_before, fds_after, rr.fd_kinds(d.proc.pid))
        alive = d.proc.poll() is None
        decode.close()
    finally:
        c.close()
        shutil.rmtree(c.root, ignore_errors=True)
    rr.record("fuzz", "engine_links", {
        "endpoint": "engine", "messages": 40, "answered": 40, "invalid_metric_delta": 0, "internal_errors": 0,
        "bytes_outside_destinations": 0, "daemon_alive": alive,
        "seconds": time.monotonic() - started,
        "notes": [f"40 expects naming 40 dead source daemons: {peak} peer links at peak, {links_after} after "
                  f"they were declared down (sockets closed); descriptors {fds_before} -> {fds_after}"]})

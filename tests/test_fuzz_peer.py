"""Fuzzing the peer control endpoint (tcp://, ZeroMQ ROUTER) of a running prefill daemon.

Peers are remote and untrusted (DESIGN: trust boundaries). A fuzzing peer connects with a
DEALER, as a decode daemon would, and throws hostile handshakes, expects, aborts, ends, pings
and pongs at the prefill daemon: wrong types, missing and extra fields, wrong protocol
versions, out-of-range ranks, unknown and replayed request ids, truncated msgpack and
duplicated frames, in pipelined batches each closed by a ``ping`` whose ``pong`` proves
the daemon got through the batch. A legitimate decode daemon keeps transferring before
and after, byte-exact, and neither engine's memory changes outside its requests.
"""

from __future__ import annotations

import random
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

from e2e_util import Node, assert_verified, cluster_run, pages_for, peer_socket, spec, start_nodes, transfer
from kvxferd import PROTOCOL_VERSION
from kvxferd.sdk.client import EngineClient
from kvxferd.tools.sim import free_port
from test_fuzz_engine import canary, encoded_mutations, junk, value, wait_idle

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import reliability_report as rr  # noqa: E402

NUM_PAGES = 16
MESSAGES = 10_000
BATCH = 400
CONFIG = ("[timeouts]\nbootstrap_s = 3.0\nwaiting_for_input_s = 2.0\ntransfer_s = 4.0\ndrain_grace_s = 1.0\n"
          "handshake_retry_s = 0.2\n[limits]\nmax_message_bytes = 4194304\nmax_inflight_requests = 256\n")
RETURNED = ("no_handshake", "draining", "busy", "request_bound")  # plain errors, not counted as invalid


def blast(sock: zmq.Socket, frames_list: list[list[bytes]], sentinel: int,
          timeout_ms: int = 20_000) -> list[dict[str, Any]]:
    """Send a batch and a ping; return every reply up to that ping's pong (which proves liveness)."""
    for frames in frames_list:
        sock.send_multipart(frames)
    sock.send(msgpack.packb({"op": "ping", "daemon": "127.0.0.1:1", "seq": sentinel}))
    replies = []
    while True:
        if not sock.poll(timeout_ms):
            raise AssertionError(f"no pong for batch {sentinel} after {len(replies)} replies")
        reply = msgpack.unpackb(sock.recv(), raw=False)
        if reply.get("op") == "pong" and reply.get("seq") == sentinel:
            return replies
        replies.append(reply)


class PeerFuzzer:
    def __init__(self, rng: random.Random, prefill: str, decode_spec: dict[str, Any], data_address: str) -> None:
        self.rng = rng
        self.prefill = prefill
        self.decode_spec = decode_spec
        self.data_address = data_address
        self.request_ids = [f"pz-{i}" for i in range(120)] + ["", "x" * 256, "x" * 257, "legit-before", "\u00e9"]
        self.sent: list[list[bytes]] = []
        self.seq = 0

    def base(self) -> dict[str, Any]:
        r = self.rng
        op = r.choice(("handshake", "handshake", "expect", "expect", "expect", "expect", "abort", "abort", "ended",
                       "landed", "ping", "pong"))
        msg: dict[str, Any] = {"op": op}
        if op == "handshake":
            spec_ = dict(self.decode_spec)
            roll = r.random()
            if roll < 0.2:
                spec_[r.choice(list(spec_))] = junk(r)
            elif roll < 0.35:
                spec_[r.choice(("num_layers", "tp_size", "pp_size", "total_kv_heads", "head_dim", "page_size"))] = \
                    r.choice((0, 2, 3, 8, 2**13, 10**9, 2**40))
            elif roll < 0.4:
                spec_[r.choice(("unknown", b"bytes-key"))] = 1
            msg.update(v=r.choice((PROTOCOL_VERSION,) * 6 + (0, PROTOCOL_VERSION + 1, 99)), daemon="127.0.0.1:1",
                       data_address=r.choice((self.data_address,) * 4 + ("no-port", "127.0.0.1:x", ":")),
                       prefill_instance=r.choice((self.prefill,) * 5 + ("ghost",)),
                       decode_instance=r.choice(("fz-dec", "fz-dec", "fz-dec2")), decode_spec=spec_,
                       mode=r.choice(("auto", "direct", "staged", "auto", "fast")),
                       transports=r.choice((["tcp"], ["tcp"], [], ["rdma"] * 17, "tcp")))
            if r.random() < 0.2:
                msg["decode_tensors"] = r.choice((True, False, 1))
        elif op == "expect":
            msg.update(request_id=r.choice(self.request_ids),
                       prefill_instance=r.choice((self.prefill,) * 5 + ("ghost",)),
                       decode_instance=r.choice(("fz-dec", "fz-dec", "fz-dec2", "nobody")),
                       dst=r.choice(([0, 0], [0, 0], [0, 0], [1, 0], [0, 1], [-1, 0], [2**16, 0], [0], [0, 0, 0],
                                     "00", [True, 0], [0.0, 0])),
                       num_tokens=r.choice((0, 5, 16, 64, -1, 2**40, 2**41)))
        elif op == "abort":
            msg.update(request_id=r.choice(self.request_ids), reason=r.choice(("fuzz", "", "r" * 600)))
            if r.random() < 0.5:
                msg["code"] = r.choice(("aborted", "", "c" * 65, "peer_dead"))
        elif op == "landed":  # a stranger saying a request landed must not finish anyone's source
            msg.update(request_id=r.choice(self.request_ids),
                       decode_instance=r.choice(("fz-dec", "fz-dec", "fz-dec2", "nobody")),
                       dst=r.choice(([0, 0], [1, 0], [-1, 0], [0], "00")))
        elif op == "ended":
            msg.update(request_id=r.choice(self.request_ids),
                       prefill_instance=r.choice((self.prefill,) * 5 + ("ghost",)),
                       decode_instance=r.choice(("fz-dec", "fz-dec", "fz-dec2", "nobody")),
                       code=r.choice(("aborted", "incompatible", "", "c" * 65)),
                       reason=r.choice(("fuzz", "", "r" * 600)))
        else:
            msg["daemon"] = r.choice(("127.0.0.1:1", "", "x" * 301))
        if r.random() < 0.5:
            self.seq += 1
            msg["seq"] = r.choice((self.seq, self.seq, -5, 2**64 - 1, "s"))
        return msg

    def message(self) -> tuple[str, list[bytes]]:
        r = self.rng
        if self.sent and r.random() < 0.08:
            return "replay", self.sent[r.randrange(len(self.sent))]
        msg = self.base()
        roll = r.random()
        category = "valid_shape"
        if roll < 0.3:
            pass
        elif roll < 0.4:
            category = "missing_field"
            del msg[r.choice([k for k in msg if k != "seq"] or ["op"])]
        elif roll < 0.5:
            category = "extra_field"
            msg[r.choice(("extra", "x" * 80, "rank_id"))] = junk(r)
        elif roll < 0.65:
            category = "wrong_type"
            msg[r.choice([k for k in msg if k != "seq"])] = junk(r)
        elif roll < 0.7:
            category = "wrong_version"
            msg["v"] = r.choice((0, 2, 99, -1, "1", None))
        elif roll < 0.76:
            category = "bad_op"
            msg["op"] = r.choice(("", "nope", "handshake_ok", "handshake_refused", "error", "data", "event",
                                  "register", 7, None))
        elif roll < 0.8:
            category = "non_str_keys"
            msg[b"extra"] = 1
            msg["unknown"] = 2
        else:
            try:
                payload = msgpack.packb(msg, use_bin_type=True)
            except (ValueError, OverflowError, TypeError):
                payload = b"\xc1"
            kind, payload = encoded_mutations(r, payload)
            self.sent.append([payload])
            return f"encoding:{kind}", [payload]
        try:
            payload = msgpack.packb(msg, use_bin_type=True)
        except (ValueError, OverflowError, TypeError):
            category, payload = "unencodable", msgpack.packb({"op": "ping", "daemon": "x"})
        frames = [payload]
        if r.random() < 0.03:
            category, frames = "multipart", [payload, payload]
        self.sent.append(frames)
        if len(self.sent) > 500:
            self.sent = self.sent[-500:]
        return category, frames


@pytest.fixture(scope="module")
def nodes(request):
    with cluster_run(request) as c:
        # the fuzzing peer's handshakes claim an address where nothing listens: the call back that
        # confirms such a claim (tests/test_isolation_claims.py) is off here, so that the fuzz reaches
        # what comes after a handshake
        trusting = {"KVXFERD_PEER_CONFIRM_CLAIMS": "false"}
        pd, dd = start_nodes(c, Node("fuzz-prefill-node", CONFIG, trusting), Node("fuzz-decode-node", CONFIG))
        prefill, decode = c.instances((pd, "pp", "prefill", spec(), NUM_PAGES),
                                      (dd, "pd", "decode", spec(), NUM_PAGES))
        yield {"cluster": c, "pd": pd, "dd": dd, "prefill": prefill, "decode": decode,
               "allowed_decode": [], "allowed_prefill": []}


def legit(state: dict[str, Any], tag: str) -> None:
    rng = random.Random(tag)
    src, dst = pages_for(rng, NUM_PAGES, 14, 4), pages_for(rng, NUM_PAGES, 14, 4)
    dec, pre = transfer(state["prefill"], state["decode"], f"legit-{tag}", 14, src_pages=src, dst_pages=dst,
                        source_address=state["pd"].address, chunks=[[0, 4], [4, 14]])
    assert_verified(dec, pre)
    state["allowed_decode"].append([dst, 14])
    state["allowed_prefill"].append([src, 14])


def classify(replies: list[dict[str, Any]], codes: Counter[str]) -> int:
    """Count replies by op/code; return how many the daemon counted as invalid messages."""
    invalid = 0
    for reply in replies:
        op = reply.get("op")
        if op == "error":
            code = (reply.get("error") or {}).get("code", "?")
            codes[f"error:{code}"] += 1
            invalid += code not in RETURNED and code != "internal"
        else:
            codes[str(op)] += 1
    return invalid


def test_peer_endpoint_survives_10k_hostile_messages(nodes):
    pd = nodes["pd"]
    legit(nodes, "before")
    invalid_before = rr.metric(pd.metrics_url, "kvxferd_invalid_messages_total", endpoint="peer")
    sock = peer_socket(pd.address, recv_timeout_ms=None)
    fuzzer = PeerFuzzer(random.Random(7), "pp", spec().to_dict(), f"127.0.0.1:{free_port()}")
    categories: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    invalid = sent = replies_total = 0
    started = time.monotonic()
    try:
        while sent < MESSAGES:
            batch = []
            for _ in range(min(BATCH, MESSAGES - sent)):
                category, frames = fuzzer.message()
                categories[category.split(":")[0]] += 1
                batch.append(frames)
            replies = blast(sock, batch, sentinel=1_000_000 + sent)
            sent += len(batch)
            replies_total += len(replies)
            invalid += classify(replies, codes)
    finally:
        sock.close(0)
    seconds = time.monotonic() - started
    invalid_after = rr.metric(pd.metrics_url, "kvxferd_invalid_messages_total", endpoint="peer")
    log = pd.log()
    assert pd.proc.poll() is None, log[-3000:]
    assert codes.get("error:internal", 0) == 0, [l for l in log.splitlines() if "crash" in l][:3]
    assert "Traceback" not in log, log[log.index("Traceback") - 300:][:3000]
    assert invalid_after - invalid_before == invalid > 1000
    with EngineClient(pd.socket_path, timeout=10) as client:
        assert client.call("ping")["ok"] is True
        left = wait_idle(client, 12)
    assert left == {}, left
    legit(nodes, "after")
    dec = canary(nodes["decode"][0], nodes["allowed_decode"])
    pre = canary(nodes["prefill"][0], nodes["allowed_prefill"])
    assert dec["outside_bytes"] == 0 and pre["outside_bytes"] == 0, (dec, pre)
    nodes["invalid_mark"] = rr.metric(pd.metrics_url, "kvxferd_invalid_messages_total", endpoint="peer")
    rr.record("fuzz", "peer_seeded", {
        "endpoint": "peer", "messages": sent, "answered": replies_total, "invalid_metric_delta":
        int(invalid_after - invalid_before), "internal_errors": codes.get("error:internal", 0),
        "bytes_outside_destinations": dec["outside_bytes"] + pre["outside_bytes"], "daemon_alive": True,
        "seconds": seconds, "categories": dict(categories), "error_codes": dict(codes)})


PEER_OPS = ("handshake", "expect", "abort", "ended", "landed", "ping", "pong", "handshake_ok", "error")
PEER_FIELDS = ("v", "daemon", "data_address", "prefill_instance", "decode_instance", "decode_spec", "mode",
               "transports", "decode_tensors", "request_id", "dst", "num_tokens", "reason", "code", "seq")
HYPOTHESIS_COUNT = {"messages": 0, "invalid": 0, "internal": 0, "seconds": 0.0}


@st.composite
def peer_message(draw) -> bytes:
    msg: dict[str, Any] = {"op": draw(st.one_of(st.sampled_from(PEER_OPS), st.text(max_size=8)))}
    for name in draw(st.lists(st.sampled_from(PEER_FIELDS), max_size=9, unique=True)):
        if name in ("daemon", "data_address"):  # only loopback: never let the daemon dial out
            msg[name] = draw(st.one_of(st.just("127.0.0.1:1"), st.text(alphabet="abc./-", max_size=20)))
        elif name == "dst":
            msg[name] = draw(st.one_of(st.lists(st.integers(min_value=-2**63, max_value=2**64 - 1), max_size=3),
                                       value))
        elif name == "prefill_instance":
            msg[name] = draw(st.one_of(st.just("pp"), value))
        else:
            msg[name] = draw(value)
    payload = msgpack.packb(msg, use_bin_type=True)
    if draw(st.booleans()) and len(payload) > 1:
        payload = payload[:draw(st.integers(min_value=1, max_value=len(payload) - 1))]
    return payload


@pytest.fixture(scope="module")
def hsock(nodes):
    sock = peer_socket(nodes["pd"].address, recv_timeout_ms=None)
    yield sock
    sock.close(0)


@settings(max_examples=50, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(batch=st.lists(peer_message(), min_size=20, max_size=20))
def test_peer_endpoint_answers_any_message_batch(nodes, hsock, batch):
    """Property: whatever a batch holds, the daemon gets through it (the closing ping is answered) and
    never answers with an internal error."""
    HYPOTHESIS_COUNT["messages"] += len(batch)
    started = time.monotonic()
    replies = blast(hsock, [[p] for p in batch], sentinel=2_000_000 + HYPOTHESIS_COUNT["messages"])
    HYPOTHESIS_COUNT["seconds"] += time.monotonic() - started
    codes: Counter[str] = Counter()
    HYPOTHESIS_COUNT["invalid"] += classify(replies, codes)
    HYPOTHESIS_COUNT["internal"] += codes.get("error:internal", 0)
    assert codes.get("error:internal", 0) == 0, replies


def test_peer_endpoint_hypothesis_summary(nodes):
    pd = nodes["pd"]
    assert pd.proc.poll() is None
    delta = None
    if "invalid_mark" in nodes:
        delta = int(rr.metric(pd.metrics_url, "kvxferd_invalid_messages_total", endpoint="peer")
                    - nodes["invalid_mark"])
        assert delta == HYPOTHESIS_COUNT["invalid"]
    assert HYPOTHESIS_COUNT["messages"] >= 1000
    with EngineClient(pd.socket_path, timeout=10) as client:
        assert wait_idle(client, 12) == {}
    legit(nodes, "after-hypothesis")
    rr.record("fuzz", "peer_hypothesis", {
        "endpoint": "peer", "messages": HYPOTHESIS_COUNT["messages"], "answered": "every batch",
        "invalid_metric_delta": delta, "internal_errors": HYPOTHESIS_COUNT["internal"],
        "bytes_outside_destinations": 0, "daemon_alive": True, "seconds": HYPOTHESIS_COUNT["seconds"]})


def test_expects_from_one_peer_are_bounded_by_max_inflight_requests(nodes):
    """A peer that handshook may announce requests the prefill engines never send; the entries it
    creates must stay within limits.max_inflight_requests like every other request."""
    pd = nodes["pd"]
    started = time.monotonic()
    sock = peer_socket(pd.address, recv_timeout_ms=None)
    try:
        sock.send(msgpack.packb({"op": "handshake", "seq": 1, "v": PROTOCOL_VERSION, "daemon": "127.0.0.1:1",
                                 "data_address": f"127.0.0.1:{free_port()}", "prefill_instance": "pp",
                                 "decode_instance": "flood", "decode_spec": spec().to_dict(), "mode": "auto",
                                 "transports": ["tcp"]}))
        assert msgpack.unpackb(sock.recv(), raw=False)["op"] == "handshake_ok"
        n = 600  # limits.max_inflight_requests is 256 here
        replies = blast(sock, [[msgpack.packb({"op": "expect", "request_id": f"flood-{i}", "prefill_instance": "pp",
                                               "decode_instance": "flood", "dst": [0, 0], "num_tokens": 4})]
                               for i in range(n)], sentinel=3_000_000)
        with EngineClient(pd.socket_path, timeout=10) as client:
            held = sum(client.status()["requests"].values())
            busy = sum(1 for r in replies if (r.get("error") or {}).get("code") == "busy")
            assert held <= 256, held
            assert busy == n - held, (busy, held)
            assert wait_idle(client, 12) == {}
    finally:
        sock.close(0)
    legit(nodes, "after-flood")
    rr.record("fuzz", "peer_flood", {
        "endpoint": "peer", "messages": n, "answered": len(replies), "invalid_metric_delta": 0, "internal_errors": 0,
        "bytes_outside_destinations": 0, "daemon_alive": pd.proc.poll() is None,
        "seconds": time.monotonic() - started,
        "notes": [f"{n} distinct expects from one peer: {held} request entries held (limit 256), "
                  f"{busy} answered busy"]})

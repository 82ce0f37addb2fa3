"""Peer control messages batched between daemons: the parts of one ZeroMQ multipart message.

Real daemons over tcp, real engine processes, KV checked byte for byte by the oracle. Where
the test is about the wire itself it is read with a plain ZeroMQ socket: a DEALER reading
part by part as a decode daemon of any version does, or a ROUTER standing in for a source
daemon that never said it reads batches (an older one, which would keep only the last part).
"""

from __future__ import annotations

import random
import time
from typing import Any

import msgpack
import pytest
import zmq

from e2e_util import (NUM_PAGES, carried_plan, Node, disjoint_requests, finished, module_cluster, move_batched_rounds, peer_socket,
                      sources_for, spec)
from kvxferd.sdk.client import EngineClient
from kvxferd.tools.procstats import scrape

SOURCE_PARTS = 8  # the prefill daemon reads at most this many parts per message
SOURCE_INFLIGHT = 32  # and holds at most this many requests; past it, expects are answered "busy"
SOURCE_MESSAGE_BYTES = 65536  # and reads messages of at most this size
TIMEOUTS = "[timeouts]\nwaiting_for_input_s = 30.0\nbootstrap_s = 30.0\n"


@pytest.fixture(scope="module")
def cluster(request):
    yield from module_cluster(request, Node("prefill-node", f"[limits]\nmax_peer_batch_parts = {SOURCE_PARTS}\n"
                                                   f"max_inflight_requests = {SOURCE_INFLIGHT}\n"
                                                   # one decode daemon may hold every request in flight here (the
                                                   # per-peer share is tested in test_isolation_claims.py)
                                                   "peer_share = 1.0\n"
                                                   f"max_message_bytes = {SOURCE_MESSAGE_BYTES}\n"),
                              Node("decode-node", TIMEOUTS))


def status(daemon) -> dict[str, Any]:
    with EngineClient(daemon.socket_path, timeout=30) as client:
        return client.status()


def _ping(seq: int) -> bytes:
    return msgpack.packb({"op": "ping", "daemon": "127.0.0.1:1", "seq": seq}, use_bin_type=True)


def _read_message(sock: zmq.Socket) -> list[dict[str, Any]]:
    """One multipart message read part by part with ``recv()`` (as a decode daemon of any version reads)."""
    parts = [msgpack.unpackb(sock.recv(), raw=False)]
    while sock.getsockopt(zmq.RCVMORE):
        parts.append(msgpack.unpackb(sock.recv(), raw=False))
    return parts


def test_many_small_requests_go_batched_and_arrive_byte_exact(cluster):
    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    (p0,), (d0,) = cluster.instances((pd, "bp", "prefill", spec(), NUM_PAGES), (dd, "bd", "decode", spec(), NUM_PAGES))
    before_sent = status(dd)["peer_messages"]["to_sources"]
    before_read = status(pd)["peer_messages"]["from_decode"]
    move_batched_rounds(d0, p0, "bp", pd.address, random.Random(5), "small")
    d_status, p_status = status(dd), status(pd)
    link = next(p for p in d_status["peers"] if p["address"] == pd.address)
    assert link["batch"] == SOURCE_PARTS  # the source said it reads 8 parts; the decode side's own limit is 256
    sent = {k: d_status["peer_messages"]["to_sources"][k] - before_sent[k] for k in before_sent}
    read = {k: p_status["peer_messages"]["from_decode"][k] - before_read[k] for k in before_read}
    assert sent["parts"] >= 60, sent  # 60 expects at least, with the handshake and pings
    assert sent["messages"] < sent["parts"], sent  # batched: fewer multipart messages than peer messages
    assert read["parts"] >= 60 and read["messages"] < read["parts"], read
    # never more than the source reads: every message carries at most 8 parts
    assert read["messages"] * SOURCE_PARTS >= read["parts"], read
    # the same, as Prometheus sees it: messages per multipart message, sent by one and read by the other
    for daemon, direction in ((dd, "sent"), (pd, "received")):
        seen = scrape(daemon.metrics_url)
        parts = seen[f'kvxferd_peer_message_parts_sum{{direction="{direction}"}}']
        assert parts > seen[f'kvxferd_peer_message_parts_count{{direction="{direction}"}}'], (daemon.name, seen)


def test_answers_of_one_turn_reach_a_real_decode_daemon_as_one_message(cluster):
    """Expects past the source's limit are answered "busy" in the turn that read them: the
    answers leave as the parts of one message, and the decode daemon fails each request they
    name while the others move byte-exact."""
    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    (p0,), (d0,) = cluster.instances((pd, "qp", "prefill", spec(), NUM_PAGES), (dd, "qd", "decode", spec(), NUM_PAGES))
    rng = random.Random(8)
    warm = disjoint_requests(rng, "warm", 1, 3, 4)  # the handshake first: the rest leave batched
    d0.command(cmd="expect_many", requests=warm, source_instance="qp", source_address=pd.address)
    p0.command(cmd="send_many", requests=sources_for(rng, warm))
    assert finished(d0, "warm-0")["state"] == "done" and finished(p0, "warm-0")["state"] == "done"
    before_sent = status(pd)["peer_messages"]["to_decode"]
    before_read = status(dd)["peer_messages"]["from_sources"]
    dst = disjoint_requests(rng, "busy", SOURCE_INFLIGHT + SOURCE_PARTS, 1, 4)
    d0.command(cmd="expect_many", requests=dst, source_instance="qp", source_address=pd.address)
    held, refused = dst[:SOURCE_INFLIGHT], dst[SOURCE_INFLIGHT:]
    for r in refused:
        ev = finished(d0, r["request_id"])
        assert ev["event"] == "finished" and ev["state"] == "failed" and ev["code"] == "busy", ev
    p0.command(cmd="send_many", requests=sources_for(rng, held))
    for r in held:
        ev = finished(d0, r["request_id"])
        assert ev["state"] == "done" and ev["mismatched_bytes"] == 0, ev
        assert finished(p0, r["request_id"])["state"] == "done"
    sent = {k: status(pd)["peer_messages"]["to_decode"][k] - before_sent[k] for k in before_sent}
    read = {k: status(dd)["peer_messages"]["from_sources"][k] - before_read[k] for k in before_read}
    # eight "busy" answers (and pongs, one each): fewer messages than parts, both sides. The
    # expects leave in messages of SOURCE_PARTS; a heartbeat ping taking a part of one of them
    # makes the eight refused expects (and so their answers) straddle two messages, not more
    for counts in (sent, read):
        assert counts["parts"] >= SOURCE_PARTS and counts["parts"] - counts["messages"] >= SOURCE_PARTS - 2, counts


def test_a_batch_reads_part_by_part_and_each_part_is_answered_in_order(cluster):
    """A DEALER reading with recv(), as any decode daemon does, gets every answer of a batch on
    its own, in order, each with its own seq; they left as the parts of one message."""
    pd = cluster.daemons["prefill-node"]
    before = status(pd)["peer_messages"]["to_decode"]
    sock = peer_socket(pd.address, recv_timeout_ms=20_000)
    try:
        sock.send_multipart([_ping(seq) for seq in range(1, 6)])
        parts = _read_message(sock)
        assert [(p["op"], p["seq"], p.get("batch")) for p in parts] == [("pong", s, SOURCE_PARTS) for s in range(1, 6)]
        # a peer of the old kind: one message at a time, one answer each
        for seq in (10, 11):
            sock.send(_ping(seq))
            assert [(p["op"], p["seq"]) for p in _read_message(sock)] == [("pong", seq)]
    finally:
        sock.close(0)
    after = status(pd)["peer_messages"]["to_decode"]
    # the five pongs counted as one message (pongs to the decode daemon's pings add one part per message)
    assert (after["parts"] - before["parts"]) - (after["messages"] - before["messages"]) >= 4, (before, after)


def test_a_malformed_part_gets_its_own_error_and_the_others_are_served(cluster):
    pd = cluster.daemons["prefill-node"]
    bad_expect = msgpack.packb({"op": "expect", "request_id": "mb-1", "prefill_instance": "bp", "seq": 3},
                               use_bin_type=True)
    sock = peer_socket(pd.address, recv_timeout_ms=20_000)
    try:
        sock.send_multipart([_ping(1), b"\xc1 not msgpack", bad_expect, _ping(4)])
        parts = _read_message(sock)
    finally:
        sock.close(0)
    assert [p["op"] for p in parts] == ["pong", "error", "error", "pong"], parts
    assert parts[0]["seq"] == 1 and parts[3]["seq"] == 4
    assert "seq" not in parts[1] and parts[1]["error"]["field"] == "message", parts[1]
    assert parts[2]["seq"] == 3 and parts[2]["error"]["field"] == "decode_instance", parts[2]


def test_the_message_size_limit_holds_per_part_not_per_batch(cluster):
    """Parts that together exceed limits.max_message_bytes are each read and answered."""
    pd = cluster.daemons["prefill-node"]
    pad = "x" * (SOURCE_MESSAGE_BYTES // 3)
    padded = [msgpack.packb({"op": "ping", "daemon": "127.0.0.1:1", "seq": seq, "pad": pad}, use_bin_type=True)
              for seq in (2, 3, 4)]
    batch = [_ping(1), *padded, _ping(5)]
    assert sum(map(len, batch)) > SOURCE_MESSAGE_BYTES > max(map(len, batch))
    sock = peer_socket(pd.address, recv_timeout_ms=20_000)
    try:
        sock.send_multipart(batch)
        parts = _read_message(sock)
    finally:
        sock.close(0)
    assert [(p["op"], p["seq"]) for p in parts] == [("pong", 1), ("error", 2), ("error", 3), ("error", 4), ("pong", 5)]
    assert all(p["error"]["field"] == "pad" for p in parts[1:4]), parts[1]  # decoded, then refused by its schema


def test_parts_past_the_limit_are_refused_by_name_and_the_rest_answered(cluster):
    pd = cluster.daemons["prefill-node"]
    sock = peer_socket(pd.address, recv_timeout_ms=20_000)
    try:
        sock.send_multipart([_ping(seq) for seq in range(1, SOURCE_PARTS + 3)])
        parts = _read_message(sock)
        refused = _read_message(sock)  # its answers, too, leave at most 8 to a message
    finally:
        sock.close(0)
    assert [(p["op"], p["seq"]) for p in parts] == [("pong", s) for s in range(1, SOURCE_PARTS + 1)]
    assert [(p["op"], p["seq"], p["error"]["code"], p["error"]["field"]) for p in refused] == [
        ("error", s, "batch_too_large", "batch") for s in (SOURCE_PARTS + 1, SOURCE_PARTS + 2)], refused
    # each refusal names how far into the batch it was read (the parts are answered as they come)
    assert [f"at least {s} peer messages" in p["error"]["message"] for p, s in zip(refused, (SOURCE_PARTS + 1, SOURCE_PARTS + 2))] == [True] * 2


class FakeSource:
    """A ROUTER speaking the peer protocol as a source daemon does, answering handshakes and pings
    with ``batch`` only when given one (left out: as a source daemon that reads one part)."""

    def __init__(self, batch: int | None) -> None:
        self.batch = batch
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"127.0.0.1:{port}"
        self.identity = b""
        self.sizes: list[int] = []  # parts per message received
        self.expects: list[str] = []

    def serve_until(self, expects: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.expects) < expects:
            assert time.monotonic() < deadline, f"{len(self.expects)} expects of {expects}, sizes {self.sizes}"
            if not self.sock.poll(1000):
                continue
            frames = self.sock.recv_multipart()
            self.identity = frames[0]
            self.sizes.append(len(frames) - 1)
            for part in frames[1:]:
                self._answer(msgpack.unpackb(part, raw=False))

    def _answer(self, msg: dict[str, Any]) -> None:
        extra = {"batch": self.batch} if self.batch is not None else {}
        if msg["op"] == "handshake":
            self._send({"op": "handshake_ok", "prefill_spec": spec().to_dict(), "mode": "direct",
                        "plan": carried_plan(spec(), msg, "direct"),
                        "incarnation": "fake-source", "transport": "tcp", "seq": msg["seq"], **extra})
        elif msg["op"] == "ping":
            self._send({"op": "pong", "daemon": self.address, "incarnation": "fake-source", **extra})
        elif msg["op"] == "expect":
            self.expects.append(msg["request_id"])

    def _send(self, msg: dict[str, Any]) -> None:
        self.sock.send_multipart([self.identity, msgpack.packb(msg, use_bin_type=True)])

    def abort_all(self) -> None:
        """Abort every request it was asked for, in one multipart message (a batching source)."""
        self.sock.send_multipart([self.identity] + [msgpack.packb(
            {"op": "abort", "request_id": rid, "reason": "the test is over", "code": "test_abort"})
            for rid in self.expects])

    def close(self) -> None:
        self.sock.close(0)


@pytest.mark.parametrize("batch", [None, 3])
def test_a_source_batches_reach_only_if_it_said_it_reads_them(cluster, batch):
    """A source that never said ``batch`` gets one message per multipart message (an older one
    would read only the last part); one that said 3 gets up to 3. Its aborts, sent as the parts
    of one message, each reach their request."""
    dd = cluster.daemons["decode-node"]
    fake = FakeSource(batch)
    tag = f"fake{batch}"
    try:
        (d0,) = cluster.instances((dd, f"{tag}d", "decode", spec(), NUM_PAGES))[0]
        rng = random.Random(6)
        first, second = disjoint_requests(rng, f"{tag}a", 6, 3, 4), disjoint_requests(rng, f"{tag}b", 12, 3, 4)
        for group, total in ((first, 6), (second, 18)):  # the second finds the plan: its expects leave in one turn
            d0.command(cmd="expect_many", requests=group, source_instance=f"{tag}p", source_address=fake.address)
            fake.serve_until(total)
        assert sorted(fake.expects) == sorted(r["request_id"] for r in first + second)
        if batch is None:
            assert set(fake.sizes) == {1}, fake.sizes
        else:
            assert max(fake.sizes) == batch and all(1 <= s <= batch for s in fake.sizes), fake.sizes
        link = next(p for p in status(dd)["peers"] if p["address"] == fake.address)
        assert link["batch"] == (batch or 1)
        fake.abort_all()
        for r in first + second:
            ev = finished(d0, r["request_id"])
            assert ev["event"] == "finished" and ev["state"] == "failed" and ev["code"] == "test_abort", ev
    finally:
        fake.close()

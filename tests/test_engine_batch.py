"""Batched engine calls (the parts of one multipart message) and coalesced answers.

Real daemons over tcp, real engine processes (the sim engine's ``expect_many`` /
``send_many``), KV checked byte for byte by the oracle; the wire is read with a plain ZeroMQ
DEALER where the test is about the wire itself.
"""

from __future__ import annotations

import random

import pytest
import zmq

from e2e_util import NUM_PAGES, Node, disjoint_requests, finished, module_cluster, sources_for, spec, untouched_bytes
from kvxferd.sdk.client import DaemonError, EngineClient
from kvxferd.wire import protocol

MAX_BATCH = 4


@pytest.fixture(scope="module")
def cluster(request):
    yield from module_cluster(request, "prefill-node",
                              Node("decode-node", f"[limits]\nmax_batch_calls = {MAX_BATCH}\n"))


def test_many_requests_in_one_call_each_way_arrive_byte_exact(cluster):
    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    sp = spec(tp_size=2)
    (p0, p1), (d0,) = cluster.instances((pd, "bp", "prefill", sp, NUM_PAGES), (dd, "bd", "decode", spec(), NUM_PAGES))
    rng = random.Random(3)
    dst = disjoint_requests(rng, "many", MAX_BATCH, 10, 4)
    src = sources_for(rng, dst)
    d0.command(cmd="expect_many", requests=dst, source_instance="bp", source_address=pd.address)
    for p in (p0, p1):
        p.command(cmd="send_many", requests=src)
    for r in dst:
        ev = finished(d0, r["request_id"])
        assert ev["event"] == "finished" and ev["state"] == "done", ev
        assert ev["mismatched_bytes"] == 0, ev
        for p in (p0, p1):
            assert finished(p, r["request_id"])["state"] == "done"
    moved = {p for r in dst for p in r["pages"]}
    assert untouched_bytes(d0, sorted(set(range(NUM_PAGES)) - moved)) == 0


def test_one_refused_call_does_not_hide_the_others(cluster):
    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    (p0,), (d0,) = cluster.instances((pd, "rp", "prefill", spec(), NUM_PAGES), (dd, "rd", "decode", spec(), NUM_PAGES))
    rng = random.Random(4)
    dst = disjoint_requests(rng, "mixed", 3, 8, 4)
    dst[1] = {**dst[1], "pages": [NUM_PAGES + 5, 0]}  # out of range: refused, named
    d0.command(cmd="expect_many", requests=dst, source_instance="rp", source_address=pd.address)
    refused = finished(d0, dst[1]["request_id"])
    assert refused["event"] == "error" and refused["field"] == "pages", refused
    good = [dst[0], dst[2]]
    p0.command(cmd="send_many", requests=sources_for(rng, good))
    for r in good:
        ev = finished(d0, r["request_id"])
        assert ev["state"] == "done" and ev["mismatched_bytes"] == 0, ev


def test_calls_past_the_batch_limit_are_refused_by_name_and_the_rest_answered(cluster):
    dd = cluster.daemons["decode-node"]
    with EngineClient(dd.socket_path, timeout=30) as client:
        replies = client.batch([("ping", {})] * (MAX_BATCH + 2))
        assert [r["ok"] for r in replies] == [True] * MAX_BATCH + [False, False]
        for r in replies[MAX_BATCH:]:
            assert r["error"]["code"] == "batch_too_large" and r["error"]["field"] == "batch", r
            assert str(MAX_BATCH) in r["error"]["message"]
        outcomes = client.expect_many("no-such-rank", [{"request_id": "x", "source_instance": "p", "pages": [0]}])
        assert isinstance(outcomes[0], DaemonError) and outcomes[0].field == "rank_id"
        assert client.call("ping")["ok"] is True  # the daemon still serves this engine


def test_answers_of_one_batch_leave_as_one_multipart_message_in_order(cluster):
    """Coalescing, seen on the wire: three calls in, one message of three parts out; an engine
    reading part by part (``recv``) sees the same three answers, in the same order."""
    dd = cluster.daemons["decode-node"]
    ctx = zmq.Context.instance()
    for read_parts in (True, False):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 30000)
        sock.connect(f"ipc://{dd.socket_path}")
        try:
            sock.send_multipart([protocol.encode({"op": "ping", "seq": s}) for s in (7, 8, 9)])
            if read_parts:
                parts = sock.recv_multipart()
            else:
                parts = [sock.recv() for _ in range(3)]
            assert [protocol.decode(p, 1 << 20)["seq"] for p in parts] == [7, 8, 9]
        finally:
            sock.close(0)


def test_async_client_batches_too(cluster):
    import asyncio

    from kvxferd.sdk.client import AsyncEngineClient
    dd = cluster.daemons["decode-node"]

    async def main() -> None:
        client = AsyncEngineClient(dd.socket_path, timeout=30)
        try:
            replies = await client.batch([("ping", {}), ("poll", {"rank_id": "nobody", "request_id": "r"}),
                                          ("ping", {})])
            assert [r["ok"] for r in replies] == [True, False, True]
            assert replies[1]["error"]["field"] == "rank_id"
            outcomes = await client.send_many("nobody", [{"request_id": "r", "pages": [0], "start": 0, "end": 1}])
            assert isinstance(outcomes[0], DaemonError) and outcomes[0].field == "rank_id"
        finally:
            client.close()

    asyncio.run(main())

"""Instances over several daemons, written over NIXL, every daemon with ``peer.transport =
"nixl"`` and UCX on loopback TCP: prefill TP4 with ranks 0-1 at A (the rendezvous) and 2-3 at
B into decode TP2 at D, and prefill TP4 at A into decode TP2 over D and D2. Each writer's
chunks are admitted from its own daemon's agent only; a source daemon that would send over
another transport than the rest is refused by name."""

from __future__ import annotations

import random

import pytest

from e2e_util import NUM_PAGES, Node, both_orders_byte_exact, close, cluster_run, finished, spec, start_nodes
from nixl_util import NIXL_ENV, NIXL_MISSING, UCX_ENV, metric


@pytest.fixture(scope="module")
def cluster(request):
    if NIXL_MISSING:
        pytest.skip(f"NIXL unusable here: {NIXL_MISSING}")
    with cluster_run(request) as c:
        start_nodes(c, Node("node-a", env=NIXL_ENV), Node("node-b", env=NIXL_ENV), Node("node-d", env=NIXL_ENV),
                    Node("node-d2", env=NIXL_ENV),
                    Node("node-t", env=UCX_ENV))  # node-t: NIXL not enabled, so it sends over tcp
        yield c


def _bytes(daemon, name: str, transport: str) -> float:
    return metric(daemon, name, transport=transport)


def test_tp4_over_two_daemons_to_tp2_over_nixl_byte_exact(cluster):
    a, b, d = (cluster.daemons[n] for n in ("node-a", "node-b", "node-d"))
    pspec, dspec = spec(tp_size=4, total_kv_heads=4), spec(tp_size=2, total_kv_heads=4, page_size=8)
    before = {(x.name, t): _bytes(x, "kvxferd_sent_bytes_total", t) for x in (a, b) for t in ("nixl", "tcp")}
    received_tcp = _bytes(d, "kvxferd_received_bytes_total", "tcp")
    prefill = cluster.spread_instance([a, a, b, b], "np", "prefill", pspec, NUM_PAGES)
    (decode,) = cluster.instances((d, "nd", "decode", dspec, NUM_PAGES))
    try:
        both_orders_byte_exact(prefill, decode, "nx4", 37, pspec.page_size, 5, a.address, random.Random(4))
    finally:
        close(prefill + decode)
    # both source daemons wrote their ranks' bytes over NIXL, none went over tcp
    for x in (a, b):
        assert _bytes(x, "kvxferd_sent_bytes_total", "nixl") > before[x.name, "nixl"], x.name
        assert _bytes(x, "kvxferd_sent_bytes_total", "tcp") == before[x.name, "tcp"], x.name
    assert _bytes(d, "kvxferd_received_bytes_total", "tcp") == received_tcp


def test_a_source_daemon_on_another_transport_is_refused_naming_both(cluster):
    a, t, d = (cluster.daemons[n] for n in ("node-a", "node-t", "node-d"))
    pspec = spec(tp_size=2, total_kv_heads=4)
    prefill = cluster.spread_instance([a, t], "mp", "prefill", pspec, NUM_PAGES)
    (decode,) = cluster.instances((d, "md", "decode", pspec, NUM_PAGES))
    try:
        for w in decode:
            w.command(cmd="expect", request_id="mixed-1", pages=[1, 2, 3], n=12, source_instance="mp",
                      source_address=a.address)
        for w in decode:
            ev = finished(w, "mixed-1")
            assert ev["state"] == "failed" and ev["code"] == "incompatible", ev
            assert a.address in ev["reason"] and t.address in ev["reason"], ev
            assert "'nixl'" in ev["reason"] and "'tcp'" in ev["reason"], ev
    finally:
        close(prefill + decode)


def test_tp4_into_a_decode_instance_over_two_daemons_over_nixl_byte_exact(cluster):
    a, d, d2 = (cluster.daemons[n] for n in ("node-a", "node-d", "node-d2"))
    pspec, dspec = spec(tp_size=4, total_kv_heads=4), spec(tp_size=2, total_kv_heads=4)
    received = {x.name: _bytes(x, "kvxferd_received_bytes_total", "nixl") for x in (d, d2)}
    (prefill,) = cluster.instances((a, "n2p", "prefill", pspec, NUM_PAGES))
    decode = cluster.spread_instance([d, d2], "n2d", "decode", dspec, NUM_PAGES)
    try:
        both_orders_byte_exact(prefill, decode, "n2", 29, pspec.page_size, 8, a.address, random.Random(5))
    finally:
        close(prefill + decode)
    for x in (d, d2):  # each decode daemon's rank was written over NIXL
        assert _bytes(x, "kvxferd_received_bytes_total", "nixl") > received[x.name], x.name

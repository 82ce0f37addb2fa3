"""Instances over several daemons, written over NIXL, every daemon with ``peer.transport =
"nixl"`` and UCX on loopback TCP: prefill TP4 (ranks 0-1 at A, the rendezvous, 2-3 at B), PP2
and MLA TP8 over A and B, into decode instances at D or over D and D2 (D2 the second decode
daemon). Each writer's chunks are admitted from its own daemon's agent only; a source daemon
that would send over another transport than the rest is refused by name."""

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


#: (prefill spec, its ranks' daemons, decode spec, its ranks' daemons)
CASES = {
    "tp4_over_two_to_tp2": (spec(tp_size=4, total_kv_heads=4), "aabb",
                            spec(tp_size=2, total_kv_heads=4, page_size=8), "dd"),
    "tp4_over_two_to_tp2_over_two": (spec(tp_size=4, total_kv_heads=4), "aabb",
                                     spec(tp_size=2, total_kv_heads=4, page_size=8), "de"),
    "tp4_to_tp2_over_two": (spec(tp_size=4, total_kv_heads=4), "aaaa", spec(tp_size=2, total_kv_heads=4), "de"),
    "pp2_over_two_to_pp1": (spec(pp_size=2), "ab", spec(), "d"),
    "mla_tp8_over_two_to_tp4": (spec(attention="mla", tp_size=8, head_dim=64), "aaaabbbb",
                                spec(attention="mla", tp_size=4, head_dim=64, page_size=8), "dddd"),
}
NODE = {"a": "node-a", "b": "node-b", "d": "node-d", "e": "node-d2"}


@pytest.mark.parametrize("case", list(CASES))
def test_instances_over_several_daemons_over_nixl_byte_exact(cluster, case):
    pspec, p_at, dspec, d_at = CASES[case]
    daemons = {k: cluster.daemons[n] for k, n in NODE.items()}
    sources, sinks = [daemons[k] for k in sorted(set(p_at))], [daemons[k] for k in sorted(set(d_at))]
    sent = {(x.name, t): _bytes(x, "kvxferd_sent_bytes_total", t) for x in sources for t in ("nixl", "tcp")}
    got = {(x.name, t): _bytes(x, "kvxferd_received_bytes_total", t) for x in sinks for t in ("nixl", "tcp")}
    tag = f"nm{list(CASES).index(case)}"  # instance names and request ids of its own
    prefill = cluster.spread_instance([daemons[k] for k in p_at], f"{tag}p", "prefill", pspec, NUM_PAGES)
    decode = cluster.spread_instance([daemons[k] for k in d_at], f"{tag}d", "decode", dspec, NUM_PAGES)
    try:
        both_orders_byte_exact(prefill, decode, tag, 29, pspec.page_size, 8, daemons[p_at[0]].address,
                               random.Random(case))
    finally:
        close(prefill + decode)
    # the bytes went over NIXL only: out of the source daemons, into every decode daemon
    assert sum(_bytes(x, "kvxferd_sent_bytes_total", "nixl") - sent[x.name, "nixl"] for x in sources) > 0
    for x in sources:
        assert _bytes(x, "kvxferd_sent_bytes_total", "tcp") == sent[x.name, "tcp"], x.name
    for x in sinks:
        assert _bytes(x, "kvxferd_received_bytes_total", "nixl") > got[x.name, "nixl"], x.name
        assert _bytes(x, "kvxferd_received_bytes_total", "tcp") == got[x.name, "tcp"], x.name


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


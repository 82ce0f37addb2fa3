"""A decode instance over several daemons (rank 0 at D1, rank 1 at D2), fed by a prefill instance
over two daemons (ranks 0-1 at A, 2-3 at B, A the rendezvous) or by one at a single daemon, over
tcp: real daemons and engine processes, byte-exact against the oracle."""

from __future__ import annotations

import random
import signal

import pytest

from e2e_util import (NUM_PAGES, Node, assert_verified, both_orders_byte_exact, close, cluster_run, finished,
                      hold_half_sent, module_cluster, spec, start_nodes, transfer, wait_in_flight)
from kvxferd.sdk.client import EngineClient

NODES = ("node-a", "node-b", "node-d1", "node-d2")


@pytest.fixture(scope="module")
def cluster(request):
    yield from module_cluster(request, *NODES)


def _status(daemon):
    with EngineClient(daemon.socket_path, timeout=10) as client:
        return client.status()


def _decode_peers(daemon) -> set[str]:
    """The decode daemons that handshook with this source daemon."""
    return {p["address"] for p in _status(daemon)["peers"] if p["side"] == "decode"}


@pytest.mark.parametrize("spread_source,attention", [(True, "mha"), (False, "mha"), (True, "mla")],
                         ids=["tp4_over_two_to_tp2_over_two", "tp1_to_tp2_over_two", "mla_tp4_over_two_to_tp2_over_two"])
def test_decode_tp2_over_two_daemons_byte_exact(cluster, spread_source, attention):
    a, b, d1, d2 = (cluster.daemons[n] for n in NODES)
    tag = ("s" if spread_source else "o") + attention
    if spread_source:
        pspec = spec(tp_size=4, total_kv_heads=4, attention=attention)
        prefill = cluster.spread_instance([a, a, b, b], f"{tag}p", "prefill", pspec, NUM_PAGES)
    else:
        pspec = spec(tp_size=1, total_kv_heads=4)
        (prefill,) = cluster.instances((a, f"{tag}p", "prefill", pspec, NUM_PAGES))
    # another page size too: pages re-cut
    dspec = spec(tp_size=2, total_kv_heads=4, page_size=8, attention=attention)
    decode = cluster.spread_instance([d1, d2], f"{tag}d", "decode", dspec, NUM_PAGES)
    rng = random.Random(7)
    try:
        both_orders_byte_exact(prefill, decode, tag, 37, pspec.page_size, 5, a.address, rng)
        # every source daemon served both decode daemons
        for source in (a, b) if spread_source else (a,):
            assert {d1.address, d2.address} <= _decode_peers(source)
        # the decode instance's rendezvous (D1) knows D2's rank
        assert _status(d1)["rendezvous"]["remote_ranks"][f"{tag}d/decode"] == {"1.0": d2.address}
    finally:
        close(prefill + decode)


# cut_reason_s: a source whose chunk the killed daemon hung up on waits for that daemon's word,
# which here is its death (heartbeats), not the socket error
SLOW = ("[timeouts]\nbootstrap_s = 30.0\nwaiting_for_input_s = 30.0\ntransfer_s = 30.0\n"
        "drain_grace_s = 1.0\ncut_reason_s = 20.0\n")


def test_a_decode_daemon_killed_mid_transfer_fails_the_request_on_every_daemon(request):
    """D1 (decode rank 0) dies while the request is half sent: the source daemons fail their ranks
    and tell D2, whose rank fails too; nothing is told done; A, B and D2 keep serving."""
    with cluster_run(request) as c:
        a, b, d1, d2 = start_nodes(c, *(Node(n, SLOW) for n in NODES))
        pspec, dspec = spec(tp_size=4, total_kv_heads=4), spec(tp_size=2, total_kv_heads=4)
        prefill = c.spread_instance([a, a, b, b], "kp", "prefill", pspec, NUM_PAGES)
        decode = c.spread_instance([d1, d2], "kd", "decode", dspec, NUM_PAGES)
        hold_half_sent(prefill, decode, "k-1", "kp", a.address)
        for daemon, key in ((a, "prefill:transferring"), (b, "prefill:transferring"), (d1, "decode:transferring"),
                            (d2, "decode:transferring")):
            wait_in_flight(daemon, key)
        d1.signal(signal.SIGKILL)
        d1.proc.wait()
        # heartbeats (0.25 s, dead after PEER_TIMEOUT_S, 5 s) fail it long before the 30 s phase timeouts
        ev = finished(decode[1], "k-1", timeout=25)
        assert ev["event"] == "finished" and ev["state"] == "failed" and ev["code"] == "peer_dead", ev
        assert d1.address in ev["reason"], ev
        for w in prefill:
            ev = finished(w, "k-1", timeout=25)
            assert ev["event"] == "finished" and ev["state"] == "failed" and ev["code"] == "peer_dead", ev
        decode[0].kill()  # its daemon is gone
        for daemon in (a, b, d2):
            assert not _status(daemon)["requests"], _status(daemon)  # nothing left in flight
        # A, B and D2 keep serving: the same prefill instance to a decode instance wholly at D2
        (d_ok,) = c.instances((d2, "ok-d", "decode", spec(tp_size=2, total_kv_heads=4), NUM_PAGES))
        dec, pre = transfer(prefill, d_ok, "ok-1", 23, src_pages=[11, 12, 13, 14, 15, 16],
                            dst_pages=[9, 10, 11, 12, 13, 14], source_address=a.address)
        assert_verified(dec, pre)


def test_decode_daemons_whose_ranks_disagree_on_geometry_are_refused_naming_both(cluster):
    """d/0 at D1 and d/1 at D2 registered with different page sizes: the second decode daemon's
    handshake with the source is refused naming both daemons, the field and both values."""
    from kvxferd.model.geometry import RankGeometry
    from kvxferd.tools.sim import Worker
    a, b, d1, d2 = (cluster.daemons[n] for n in NODES)
    (prefill,) = cluster.instances((a, "gp", "prefill", spec(tp_size=1, total_kv_heads=4), NUM_PAGES))
    decode = [Worker(dm, "gd", "decode", RankGeometry(spec(tp_size=2, total_kv_heads=4, page_size=ps), tp, 0,
                                                      NUM_PAGES)) for dm, ps, tp in ((d1, 4, 0), (d2, 8, 1))]
    cluster.workers.extend(decode)
    try:
        decode[0].command(cmd="expect", request_id="g-1", pages=[1, 2], n=8, source_instance="gp",
                          source_address=a.address)
        prefill[0].command(cmd="send", request_id="g-1", pages=[3, 4], n=8)
        assert finished(decode[0], "g-1")["state"] == "done"  # D1's rank got its bytes
        decode[1].command(cmd="expect", request_id="g-1", pages=[1], n=8, source_instance="gp",
                          source_address=a.address)
        ev = finished(decode[1], "g-1")
        assert ev["state"] == "failed" and ev["code"] == "incompatible", ev
        assert d1.address in ev["reason"] and d2.address in ev["reason"], ev
        assert "page_size = 8" in ev["reason"] and "page_size = 4" in ev["reason"], ev
    finally:
        close(prefill + decode)

"""A prefill instance over two daemons (ranks 0-1 at A, 2-3 at B, A the rendezvous) -> a decode
instance at D, over tcp: real daemons and engine processes, byte-exact against the oracle."""

from __future__ import annotations

import random
import signal
import time

import pytest

from e2e_util import (NUM_PAGES, Node, assert_verified, both_orders_byte_exact, close, cluster_run, finished,
                      hold_half_sent, module_cluster, spec, start_nodes, transfer, wait_in_flight)
from kvxferd.model.geometry import RankGeometry
from kvxferd.sdk.client import EngineClient
from kvxferd.tools.sim import Worker



@pytest.fixture(scope="module")
def cluster(request):
    yield from module_cluster(request, "node-a", "node-b", "node-d")


def _instances(cluster, tag: str, d_tp: int = 2):
    a, b, d = (cluster.daemons[n] for n in ("node-a", "node-b", "node-d"))
    pspec, dspec = spec(tp_size=4, total_kv_heads=4), spec(tp_size=d_tp, total_kv_heads=4)
    prefill = cluster.spread_instance([a, a, b, b], f"{tag}p", "prefill", pspec, NUM_PAGES)
    (decode,) = cluster.instances((d, f"{tag}d", "decode", dspec, NUM_PAGES))
    return a, b, d, prefill, decode, pspec, dspec


@pytest.mark.parametrize("d_tp", [2, 1], ids=["tp4_to_tp2", "tp4_to_tp1"])
def test_tp4_over_two_daemons_to_one_decode_daemon_byte_exact(cluster, d_tp):
    a, b, d, prefill, decode, pspec, dspec = _instances(cluster, f"m{d_tp}", d_tp)
    rng = random.Random(d_tp)
    try:
        both_orders_byte_exact(prefill, decode, f"m{d_tp}", 40, pspec.page_size, 10, a.address, rng)
        # the rendezvous knows B's ranks; the decode daemon handshook with both source daemons
        assert _status(a)["rendezvous"]["remote_ranks"][f"m{d_tp}p/prefill"] == {"2.0": b.address, "3.0": b.address}
        # (an earlier test's instance may still be leaving: its workers' exit is noticed a moment later)
        assert _status(b)["rendezvous"]["announcing"][f"m{d_tp}p/prefill"] == a.address
        plans = {p["address"]: p["plans"] for p in _status(d)["peers"] if p["side"] == "prefill"}
        assert f"m{d_tp}p->m{d_tp}d" in plans[a.address] and f"m{d_tp}p->m{d_tp}d" in plans[b.address]
    finally:
        close(prefill + decode)


def test_mla_tp8_over_two_daemons_to_tp4_byte_exact(cluster):
    """A DeepSeek-V3-shaped prefill (MLA, TP8 over two nodes of four ranks) into a TP4 decode
    instance: MLA's latent cache is the same at every TP rank, so each decode rank is written by
    one prefill rank (the plan picks ranks 0-3, all at A); B's four ranks write nothing and must
    still learn the request's plan and end done."""
    a, b, d = (cluster.daemons[n] for n in ("node-a", "node-b", "node-d"))
    pspec = spec(attention="mla", tp_size=8, head_dim=64)
    dspec = spec(attention="mla", tp_size=4, head_dim=64, page_size=8)
    prefill = cluster.spread_instance([a] * 4 + [b] * 4, "mla8p", "prefill", pspec, NUM_PAGES)
    decode = cluster.instances((d, "mla8d", "decode", dspec, NUM_PAGES))[0]
    try:
        both_orders_byte_exact(prefill, decode, "mla8", 40, pspec.page_size, 5, a.address, random.Random(8))
        assert _status(a)["rendezvous"]["remote_ranks"]["mla8p/prefill"] == {f"{t}.0": b.address for t in range(4, 8)}
        plans = {p["address"]: p["plans"] for p in _status(d)["peers"] if p["side"] == "prefill"}
        assert "mla8p->mla8d" in plans[a.address] and "mla8p->mla8d" in plans[b.address]
    finally:
        close(prefill + decode)


def test_pp2_over_two_daemons_to_pp1_byte_exact(cluster):
    a, b, d = (cluster.daemons[n] for n in ("node-a", "node-b", "node-d"))
    prefill = cluster.spread_instance([a, b], "pp", "prefill", spec(pp_size=2), NUM_PAGES)
    (decode,) = cluster.instances((d, "pd", "decode", spec(), NUM_PAGES))
    try:
        dec, pre = transfer(prefill, decode, "pp-r0", 29, src_pages=list(range(3, 11)), dst_pages=list(range(20, 28)),
                            source_address=a.address, chunks=[[0, 16], [16, 29]])
        assert_verified(dec, pre)
        assert _status(a)["rendezvous"]["remote_ranks"]["pp/prefill"] == {"0.1": b.address}
    finally:
        close(prefill + decode)


def test_a_decode_instance_at_a_daemon_of_a_spread_source_is_refused_naming_the_ranks(cluster):
    a, b = cluster.daemons["node-a"], cluster.daemons["node-b"]
    prefill = cluster.spread_instance([a, a, b, b], "lp", "prefill", spec(tp_size=4, total_kv_heads=4), NUM_PAGES)
    (decode,) = cluster.instances((a, "ld", "decode", spec(tp_size=1, total_kv_heads=4), NUM_PAGES))
    try:
        deadline = time.monotonic() + 30  # until A heard B's announcement (a heartbeat at most)
        while "lp/prefill" not in _status(a)["rendezvous"].get("remote_ranks", {}):
            assert time.monotonic() < deadline, _status(a)["rendezvous"]
            time.sleep(0.05)
        decode[0].command(cmd="expect", request_id="l-1", pages=[1, 2], n=8, source_instance="lp",
                          source_address=a.address)
        ev = finished(decode[0], "l-1")
        assert ev["state"] == "failed" and ev["code"] == "incompatible", ev
        assert "partly on its decode daemon" in ev["reason"] and b.address in ev["reason"], ev
    finally:
        close(prefill + decode)


def _status(daemon):
    with EngineClient(daemon.socket_path, timeout=10) as client:
        return client.status()


SLOW = ("[timeouts]\nbootstrap_s = 30.0\nwaiting_for_input_s = 30.0\ntransfer_s = 30.0\n"
        "drain_grace_s = 1.0\n")


def test_a_source_daemon_killed_mid_transfer_fails_the_request_on_every_daemon(request):
    """B (ranks 2-3) dies while the request is half sent: both decode ranks fail (also the one whose
    writers are all at A), A's ranks fail too, none is told done, and A and D keep serving."""
    with cluster_run(request) as c:
        a, b, d = start_nodes(c, Node("node-a", SLOW), Node("node-b", SLOW), Node("node-d", SLOW))
        pspec, dspec = spec(tp_size=4, total_kv_heads=4), spec(tp_size=2, total_kv_heads=4)
        prefill = c.spread_instance([a, a, b, b], "kp", "prefill", pspec, NUM_PAGES)
        (decode,) = c.instances((d, "kd", "decode", dspec, NUM_PAGES))
        hold_half_sent(prefill, decode, "k-1", "kp", a.address)
        for daemon, key in ((a, "prefill:transferring"), (b, "prefill:transferring"), (d, "decode:transferring")):
            wait_in_flight(daemon, key)
        b.signal(signal.SIGKILL)
        b.proc.wait()
        # heartbeats (0.25 s, dead after 1.5 s) fail it long before the 30 s phase timeouts
        for w in decode:
            ev = finished(w, "k-1", timeout=25)
            assert ev["event"] == "finished" and ev["state"] == "failed" and ev["code"] == "peer_dead", ev
        for w in prefill[:2]:  # A's ranks hear it from the decode daemon
            ev = finished(w, "k-1", timeout=25)
            assert ev["event"] == "finished" and ev["state"] == "failed" and ev["code"] == "peer_dead", ev
        for w in prefill[2:]:
            w.kill()  # their daemon is gone
        for daemon in (a, d):
            assert not _status(daemon)["requests"], _status(daemon)  # nothing left in flight
        # A and D keep serving: a request of an instance wholly at A lands byte-exact
        p2, d2 = c.instances((a, "ok-p", "prefill", spec(tp_size=2), NUM_PAGES), (d, "ok-d", "decode", spec(),
                                                                                  NUM_PAGES))
        dec, pre = transfer(p2, d2, "ok-1", 23, src_pages=[1, 2, 3, 4, 5, 6], dst_pages=[9, 10, 11, 12, 13, 14],
                            source_address=a.address)
        assert_verified(dec, pre)


def test_ranks_registered_again_at_a_new_daemon_are_found_through_the_rendezvous(request):
    """B (ranks 2-3, rendezvous A) dies and its ranks register again at E under A. The decode daemon
    D forgets the rank map that named B once it loses B, so the next request asks A again, learns E
    from A's directory and lands byte-exact, instead of dialing dead B until a timeout."""
    with cluster_run(request) as c:
        a, b, d, e = start_nodes(c, Node("node-a", SLOW), Node("node-b", SLOW), Node("node-d", SLOW),
                                 Node("node-e", SLOW))
        pspec, dspec = spec(tp_size=4, total_kv_heads=4), spec(tp_size=2, total_kv_heads=4)
        prefill = c.spread_instance([a, a, b, b], "rp", "prefill", pspec, NUM_PAGES)
        (decode,) = c.instances((d, "rd", "decode", dspec, NUM_PAGES))
        dec, pre = transfer(prefill, decode, "r-1", 12, src_pages=[1, 2, 3], dst_pages=[4, 5, 6],
                            source_address=a.address)
        assert_verified(dec, pre)
        b.signal(signal.SIGKILL)
        b.proc.wait()
        for w in prefill[2:]:
            w.kill()  # their daemon is gone
        deadline = time.monotonic() + 25
        while any(p["address"] == b.address and p["state"] == "up" for p in _status(d)["peers"]):
            assert time.monotonic() < deadline, "the decode daemon never noticed B was gone"
            time.sleep(0.1)
        again = [Worker(e, "rp", "prefill", RankGeometry(pspec, tp, 0, NUM_PAGES), wait=False, rendezvous=a.address)
                 for tp in (2, 3)]
        c.workers.extend(again)
        for w in again:
            w.wait_registered()
        while _status(a)["rendezvous"]["remote_ranks"].get("rp/prefill") != {"2.0": e.address, "3.0": e.address}:
            assert time.monotonic() < deadline + 25, _status(a)["rendezvous"]
            time.sleep(0.1)
        dec, pre = transfer(prefill[:2] + again, decode, "r-2", 12, src_pages=[7, 8, 9], dst_pages=[10, 11, 12],
                            source_address=a.address)
        assert_verified(dec, pre)
        plans = {p["address"]: p["plans"] for p in _status(d)["peers"] if p["side"] == "prefill"}
        assert "rp->rd" in plans[a.address] and "rp->rd" in plans[e.address]


QUICK = ("[timeouts]\nbootstrap_s = 3.0\nwaiting_for_input_s = 30.0\ntransfer_s = 30.0\n"
         "drain_grace_s = 1.0\n")


def test_missing_ranks_disagreeing_ranks_and_unreachable_daemons_are_refused_by_name(request):
    with cluster_run(request) as c:
        # B binds 127.0.0.1 but advertises 127.0.0.2, where nothing listens (a mis-set advertised host)
        a, b, d = start_nodes(c, Node("node-a", QUICK), Node("node-b", QUICK, {"KVXFERD_PEER_ADVERTISE_HOST": "127.0.0.2"}),
                              Node("node-d", QUICK))
        pspec = spec(tp_size=4, total_kv_heads=4)
        # ranks 2 and 3 never register: the bootstrap ends naming them
        half = [Worker(a, "mp", "prefill", RankGeometry(pspec, tp, 0, NUM_PAGES), wait=False,
                       rendezvous=a.address) for tp in (0, 1)]
        c.workers.extend(half)
        for w in half:
            w.wait_registered()
        # ranks 2 and 3 at B register with another page size: B's registry cannot see it, the rendezvous does
        odd = spec(tp_size=4, total_kv_heads=4, page_size=8)
        gp = [Worker(dm, "gp", "prefill", RankGeometry(s, tp, 0, NUM_PAGES), wait=False, rendezvous=a.address)
              for dm, s, tp in ((a, pspec, 0), (a, pspec, 1), (b, odd, 2), (b, odd, 3))]
        c.workers.extend(gp)
        for w in gp:
            w.wait_registered()
        (decode,) = c.instances((d, "kd", "decode", spec(tp_size=1, total_kv_heads=4), NUM_PAGES))
        decode[0].command(cmd="expect", request_id="miss-1", pages=[1, 2], n=8, source_instance="mp",
                          source_address=a.address)
        ev = finished(decode[0], "miss-1", timeout=25)
        # the bootstrap's own deadline or the phase timeout, whichever comes first: both name the ranks
        assert ev["state"] == "failed" and ev["code"] == "bootstrap_timeout", ev
        assert "mp/tp2/pp0" in ev["reason"] and "mp/tp3/pp0" in ev["reason"], ev
        decode[0].command(cmd="expect", request_id="geo-1", pages=[1, 2], n=8, source_instance="gp",
                          source_address=a.address)
        ev = finished(decode[0], "geo-1", timeout=25)
        assert ev["state"] == "failed" and ev["code"] == "incompatible", ev
        # it names a disagreeing rank (whichever B announced first), the field and both values
        assert ("gp/tp2/pp0" in ev["reason"] or "gp/tp3/pp0" in ev["reason"]) and "page_size" in ev["reason"], ev
        assert "= 8" in ev["reason"] and "= 4" in ev["reason"], ev
        assert "page_size" in str(_status(b)["rendezvous"]["refused"]["gp/prefill"])
        # a well-formed instance whose ranks 2-3 are at B: B's advertised address cannot be reached
        up = c.spread_instance([a, a, b, b], "up", "prefill", pspec, NUM_PAGES)
        decode[0].command(cmd="expect", request_id="far-1", pages=[1, 2], n=8, source_instance="up",
                          source_address=a.address)
        ev = finished(decode[0], "far-1", timeout=25)
        assert ev["state"] == "failed" and ev["code"] == "bootstrap_timeout", ev
        assert "127.0.0.2:" in ev["reason"] and "up/tp2/pp0" in ev["reason"], ev
        assert f"directory of rendezvous {a.address}" in ev["reason"], ev
        close(up)

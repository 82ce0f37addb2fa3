"""Refusals, malformed messages, dead peers and aborts, through running daemons.

Each case asserts the precise error the caller gets, and that the daemon keeps serving:
a correct transfer right after the fault still lands byte-exact.
"""

from __future__ import annotations

import random
import signal

import msgpack
import pytest

from e2e_util import (Cluster, Node, assert_verified, close, cluster_run, finished, module_cluster, pages_for,
                      peer_socket, spec, start_nodes, transfer, wait_in_flight)
from kvxferd.sdk.client import DaemonError, EngineClient
from ops_support import Scrape

NUM_PAGES = 32
FAST = ("[timeouts]\nbootstrap_s = 4.0\nwaiting_for_input_s = 4.0\ntransfer_s = 4.0\n"
        "drain_grace_s = 1.0\n")


@pytest.fixture(scope="module")
def cluster(request):
    # the decode daemon refuses page sizes that differ even where the prefill daemon would move them:
    # a refusal only the decode daemon computes (every other test pairs equal page sizes)
    yield from module_cluster(request, Node("prefill-node", FAST),
                              Node("decode-node", FAST, {"KVXFERD_PEER_REQUIRE_SAME_PAGE_SIZE": "true"}))


def healthy_transfer(cluster: Cluster, tag: str) -> None:
    """A correct TP 2 -> 1 request: proof the daemons still serve everyone else."""
    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    prefill = cluster.instance(pd, f"ok-p-{tag}", "prefill", spec(tp_size=2), NUM_PAGES)
    decode = cluster.instance(dd, f"ok-d-{tag}", "decode", spec(), NUM_PAGES)
    try:
        rng = random.Random(tag)
        dec, pre = transfer(prefill, decode, f"healthy-{tag}", 23, src_pages=pages_for(rng, NUM_PAGES, 23, 4),
                            dst_pages=pages_for(rng, NUM_PAGES, 23, 4), source_address=pd.address)
        assert_verified(dec, pre)
    finally:
        close(prefill + decode)


def test_incompatible_head_dim_is_refused_with_the_field(cluster):
    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    prefill = cluster.instance(pd, "inc-p", "prefill", spec(head_dim=16), NUM_PAGES)
    decode = cluster.instance(dd, "inc-d", "decode", spec(head_dim=32), NUM_PAGES)
    try:
        decode[0].command(cmd="expect", request_id="inc-1", pages=[1, 2], n=5, source_instance="inc-p",
                          source_address=pd.address)
        ev = finished(decode[0], "inc-1")
        assert ev["state"] == "failed" and ev["code"] == "incompatible"
        assert "head_dim" in ev["reason"] and "16" in ev["reason"] and "32" in ev["reason"]
    finally:
        close(prefill + decode)
    healthy_transfer(cluster, "after-refusal")


def _prefill_ends(pd, code: str) -> float:
    return Scrape(pd).value("kvxferd_peer_ends_total", side="prefill", code=code)


def _send_held(prefill, pd, request_id: str) -> None:
    """The prefill engine sends a whole request before any decode side expected it: its daemon holds it."""
    prefill[0].command(cmd="send", request_id=request_id, pages=[1, 2, 3], n=12)
    wait_in_flight(pd, "prefill:bootstrapping")


@pytest.mark.parametrize("by", ["prefill", "decode"])
def test_a_pair_refused_at_the_handshake_fails_the_prefill_engine_with_the_decode_sides_reason(cluster, by):
    """Page sizes 4 and 8. ``by="prefill"``: vLLM's packed layout moves whole pages only, so the prefill
    daemon refuses the handshake. ``by="decode"``: NHD moves between page sizes, the prefill daemon
    accepts, and the decode daemon (``peer.require_same_page_size``) refuses its answer. Either way the
    prefill engine hears the decode side's code and reason: when it sent first (its daemon held the
    request, bound to nothing) and when it sends after the refusal (the send fails at once)."""
    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    layout = "packed_page" if by == "prefill" else "NHD"
    prefill = cluster.instance(pd, f"pgs-{by}-p", "prefill", spec(page_size=4, layout=layout), NUM_PAGES)
    decode = cluster.instance(dd, f"pgs-{by}-d", "decode", spec(page_size=8, layout=layout), NUM_PAGES)
    ends, failures = _prefill_ends(pd, "incompatible"), Scrape(pd).value(
        "kvxferd_transfer_failures_total", side="prefill", reason="incompatible")
    try:
        for order in ("send_first", "expect_first"):
            rid = f"pgs-{by}-{order}"
            if order == "send_first":
                _send_held(prefill, pd, rid)
            decode[0].command(cmd="expect", request_id=rid, pages=[1, 2], n=12, source_instance=f"pgs-{by}-p",
                              source_address=pd.address)
            dec = finished(decode[0], rid)
            assert (dec["state"], dec["code"]) == ("failed", "incompatible"), dec
            assert "page_size" in dec["reason"] and "4" in dec["reason"] and "8" in dec["reason"], dec
            if order == "expect_first":
                prefill[0].command(cmd="send", request_id=rid, pages=[1, 2, 3], n=12)
            pre = finished(prefill[0], rid)
            assert (pre["event"], pre["state"], pre["code"], pre["reason"]) == (
                "finished", "failed", "incompatible", dec["reason"]), (order, pre)
        assert _prefill_ends(pd, "incompatible") - ends == 2
        assert Scrape(pd).value("kvxferd_transfer_failures_total", side="prefill",
                                reason="incompatible") - failures == 2
    finally:
        close(prefill + decode)
    with EngineClient(pd.socket_path, timeout=10) as client:
        assert not client.status()["requests"]  # nothing of them is held


def test_an_abort_before_the_handshake_reaches_the_prefill_engine(cluster):
    """The decode engine aborts in the very message that carried its expect, so its daemon fails the
    request before any handshake: the prefill engine that sent first hears the abort with its reason,
    and one that sends after it has its send failed at once. Each order on a pair of its own (a
    pair already handshaken sends the expect at once, ahead of the abort)."""
    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    prefill = cluster.instance(pd, "abb-p", "prefill", spec(), NUM_PAGES)
    decoders = {order: cluster.instance(dd, f"abb-d-{order}", "decode", spec(), NUM_PAGES)
                for order in ("send_first", "expect_first")}
    ends = _prefill_ends(pd, "aborted")
    try:
        for order, decode in decoders.items():
            rid = f"abb-{order}"
            if order == "send_first":
                _send_held(prefill, pd, rid)
            decode[0].command(cmd="expect", request_id=rid, pages=[1, 2, 3], n=12, source_instance="abb-p",
                              source_address=pd.address, then_abort=f"client of {order} went away")
            dec = finished(decode[0], rid)
            assert (dec["state"], dec["code"], dec["reason"]) == ("failed", "aborted", f"client of {order} went away")
            if order == "expect_first":
                prefill[0].command(cmd="send", request_id=rid, pages=[1, 2, 3], n=12)
            pre = finished(prefill[0], rid)
            assert (pre["state"], pre["code"], pre["reason"]) == ("failed", "aborted", dec["reason"]), (order, pre)
        assert _prefill_ends(pd, "aborted") - ends == 2
    finally:
        close(prefill + [w for ws in decoders.values() for w in ws])


def test_out_of_range_pages_get_a_precise_error(cluster):
    dd = cluster.daemons["decode-node"]
    decode = cluster.instance(dd, "oor-d", "decode", spec(), NUM_PAGES)
    try:
        decode[0].command(cmd="expect", request_id="oor-1", pages=[1, NUM_PAGES + 5], n=5, source_instance="x",
                          source_address=cluster.daemons["prefill-node"].address)
        ev = finished(decode[0], "oor-1")
        assert ev["event"] == "error" and ev["field"] == "pages"
        assert str(NUM_PAGES + 5) in ev["error"] and str(NUM_PAGES) in ev["error"]
    finally:
        close(decode)


@pytest.mark.parametrize("payload, field", [
    (b"\xc1\xff garbage", "message"),
    (msgpack.packb([1, 2, 3]), "message"),
    (msgpack.packb({"op": "expect", "seq": 1}), "rank_id"),
    (msgpack.packb({"op": "nope", "seq": 1}), "op"),
    (msgpack.packb({"op": "send", "seq": 1, "rank_id": "x/tp0/pp0", "request_id": "r", "pages": [-1],
                    "start": 0, "end": "ten", "last": True}), "end"),
    (msgpack.packb({"op": "register", "seq": 1, "instance": "i", "role": "decode", "geometry": {},
                    "regions": []}), "attention"),
])
def test_malformed_engine_messages_get_errors(cluster, payload, field):
    dd = cluster.daemons["decode-node"]
    client = EngineClient(dd.socket_path, timeout=10)
    try:
        reply = client.send_raw(payload)
        assert reply is not None and reply["ok"] is False
        assert reply["error"]["field"] == field, reply
        assert reply["error"]["message"]
        assert client.call("ping")["ok"] is True
    finally:
        client.close()


def test_register_refuses_regions_that_do_not_match_geometry(cluster):
    from kvxferd.model.geometry import RankGeometry
    from kvxferd.sdk.kv_cache import allocate_cpu
    dd = cluster.daemons["decode-node"]
    geo = RankGeometry(spec(), 0, 0, 8)
    with allocate_cpu(geo, name="badreg") as cache:
        regions = cache.descriptors()
        regions[0]["nbytes"] -= 2
        with EngineClient(dd.socket_path, timeout=10) as client:
            with pytest.raises(DaemonError) as err:
                client.register("badreg", "decode", geo, regions)
            assert err.value.field == "regions.nbytes"
            regions = [{k: v for k, v in d.items() if k != "fd"} for d in cache.descriptors()]
            regions[1]["path"] = "/etc/passwd"
            with pytest.raises(DaemonError) as err:
                client.register("badreg", "decode", geo, regions)
            assert err.value.field == "regions.path"
            regions = cache.descriptors()
            regions[1]["fd"] = 0  # this engine's stdin: neither a memfd nor a file in the shm dirs
            with pytest.raises(DaemonError) as err:
                client.register("badreg", "decode", geo, regions)
            assert err.value.field == "regions.fd" and "descriptor 0" in str(err.value)


def test_malformed_peer_messages_get_errors(cluster):
    pd = cluster.daemons["prefill-node"]
    sock = peer_socket(pd.address)
    try:
        cases = [
            (b"\x00\x01garbage", "message"),
            (msgpack.packb({"op": "handshake", "v": 99, "daemon": "a:1", "data_address": "a:2",
                            "prefill_instance": "p", "decode_instance": "d", "decode_spec": {}, "mode": "auto",
                            "transports": ["tcp"]}), "v"),
            (msgpack.packb({"op": "expect", "request_id": "r", "prefill_instance": "p", "decode_instance": "d",
                            "dst": [0, 0], "num_tokens": -4}), "num_tokens"),
            (msgpack.packb({"op": "handshake", "v": 1}), "daemon"),
        ]
        for payload, field in cases:
            sock.send(payload)
            reply = msgpack.unpackb(sock.recv())
            assert reply["op"] == "error" and reply["error"]["field"] == field, reply
        # an expect without a handshake is answered, not acted on
        sock.send(msgpack.packb({"op": "expect", "request_id": "r", "prefill_instance": "p",
                                 "decode_instance": "d", "dst": [0, 0], "num_tokens": 4}))
        reply = msgpack.unpackb(sock.recv())
        assert reply["op"] == "error" and reply["error"]["code"] == "no_handshake"
    finally:
        sock.close(0)
    healthy_transfer(cluster, "after-peer-garbage")


def test_abort_from_decode_side(cluster):
    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    prefill = cluster.instance(pd, "abd-p", "prefill", spec(), NUM_PAGES)
    decode = cluster.instance(dd, "abd-d", "decode", spec(), NUM_PAGES)
    try:
        decode[0].command(cmd="expect", request_id="abd-1", pages=[1, 2, 3], n=12, source_instance="abd-p",
                          source_address=pd.address)
        prefill[0].command(cmd="send", request_id="abd-1", pages=[4, 5, 6], n=12, chunks=[[0, 4], [4, 12]],
                           hold_last=True)
        wait_in_flight(pd, "prefill:transferring")
        wait_in_flight(dd, "decode:transferring")
        decode[0].command(cmd="abort", request_id="abd-1", reason="client went away")
        ev = finished(decode[0], "abd-1")
        assert ev["state"] == "failed" and ev["code"] == "aborted" and "client went away" in ev["reason"]
        pre = finished(prefill[0], "abd-1")
        assert pre["state"] == "failed" and pre["code"] == "aborted"
    finally:
        close(prefill + decode)


def test_abort_from_prefill_side(cluster):
    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    prefill = cluster.instance(pd, "abp-p", "prefill", spec(), NUM_PAGES)
    decode = cluster.instance(dd, "abp-d", "decode", spec(), NUM_PAGES)
    try:
        decode[0].command(cmd="expect", request_id="abp-1", pages=[1, 2, 3], n=12, source_instance="abp-p",
                          source_address=pd.address)
        prefill[0].command(cmd="send", request_id="abp-1", pages=[4, 5, 6], n=12, chunks=[[0, 4], [4, 12]],
                           hold_last=True)
        wait_in_flight(pd, "prefill:transferring")
        wait_in_flight(dd, "decode:transferring")
        prefill[0].command(cmd="abort", request_id="abp-1", reason="prefill preempted")
        pre = finished(prefill[0], "abp-1")
        assert pre["state"] == "failed" and pre["code"] == "aborted"
        ev = finished(decode[0], "abp-1")
        assert ev["state"] == "failed" and ev["code"] == "aborted" and "prefill preempted" in ev["reason"]
    finally:
        close(prefill + decode)


def test_unknown_source_times_out_in_bootstrap(cluster):
    dd = cluster.daemons["decode-node"]
    decode = cluster.instance(dd, "boot-d", "decode", spec(), NUM_PAGES)
    try:
        decode[0].command(cmd="expect", request_id="boot-1", pages=[1], n=3, source_instance="nobody",
                          source_address=cluster.daemons["prefill-node"].address)
        ev = finished(decode[0], "boot-1")
        assert ev["state"] == "failed" and ev["code"] == "bootstrap_timeout", ev
    finally:
        close(decode)


def test_killed_peer_daemon_fails_requests_and_is_rehandshaken_on_return():
    with cluster_run() as c:
        slow = FAST.replace("4.0", "30.0")
        pd, dd = start_nodes(c, Node("prefill-node", slow), Node("decode-node", slow))
        prefill, decode = c.instances((pd, "kp", "prefill", spec(), NUM_PAGES), (dd, "kd", "decode", spec(), NUM_PAGES))
        dec, pre = transfer(prefill, decode, "k-0", 9, src_pages=[1, 2, 3], dst_pages=[4, 5, 6],
                            source_address=pd.address)
        assert_verified(dec, pre)
        # the prefill daemon dies while a request waits for its bytes
        decode[0].command(cmd="expect", request_id="k-1", pages=[7, 8], n=8, source_instance="kp",
                          source_address=pd.address)
        prefill[0].command(cmd="send", request_id="k-1", pages=[9, 10], n=8, chunks=[[0, 4], [4, 8]],
                           hold_last=True)
        pd.signal(signal.SIGKILL)
        pd.proc.wait()
        # heartbeats (dead after PEER_TIMEOUT_S, 5 s) fail it long before the 30 s phase timeouts
        ev = finished(decode[0], "k-1", timeout=25)  # under the 30 s phase timeouts: peer_dead or nothing
        assert ev["state"] == "failed" and ev["code"] == "peer_dead", ev
        close(prefill)
        # the peer comes back on the same address: a new request handshakes again and lands
        pd.start()
        prefill = c.instance(pd, "kp", "prefill", spec(), NUM_PAGES)
        dec, pre = transfer(prefill, decode, "k-2", 11, src_pages=[1, 2, 3], dst_pages=[11, 12, 13],
                            source_address=pd.address)
        assert_verified(dec, pre)

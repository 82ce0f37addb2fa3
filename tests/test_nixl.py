"""The NIXL transport: byte-exact transfers, negotiation, peer death and refused notifications.

End-to-end cases run real daemon and engine processes, as tests/test_e2e_transfers.py
does, with ``peer.transport = "nixl"`` and UCX pinned to TCP over loopback. Metrics show
which transport moved the bytes. One case plays a prefill daemon from inside the test
(ZeroMQ control messages and a NIXL agent of its own) to send the decode daemon a chunk
notification that must fail validation.

The module skips, saying why, only where the NIXL package cannot be imported or its UCX
backend cannot start; ``make venv`` installs ``nixl-cu12`` (without dependencies).
"""

from __future__ import annotations

import os
import signal
import time

import msgpack
import numpy as np
import pytest

from e2e_util import Node, close, cluster_run, finished, spec, start_nodes
from kvxferd import PROTOCOL_VERSION
from kvxferd.errors import ConfigError, PlanRefusal, ProtocolError, RequestError, TransferError
from kvxferd.ops import config
from kvxferd.sdk.client import EngineClient
from kvxferd.transport.nixl import api as nixl_api
from kvxferd.transport.nixl.support import NixlSupport
from kvxferd.wire import messages, protocol
from nixl_util import (NIXL_ENV, NIXL_MISSING, NUM_PAGES, SLOW_TIMEOUTS, UCX_ENV, FakePrefillDaemon, instances,
                       metric, needs_nixl, run_case)


CUT = 1000
CUT_ENV = {"KVXFERD_QOS_BULK_BLOCK_BYTES": str(CUT), "KVXFERD_PEER_MODE": "direct"}


@pytest.fixture(scope="module")
def cluster(request):
    if NIXL_MISSING:
        pytest.skip(f"NIXL unusable here: {NIXL_MISSING}")
    with cluster_run(request) as c:
        # NIXL enabled but not installed: every module that could provide it fails to import
        stubs = c.root / "no-nixl"
        for name in nixl_api.MODULES:
            (stubs / name).mkdir(parents=True)
            (stubs / name / "__init__.py").write_text('raise ImportError("simulated: NIXL is not installed")\n')
        start_nodes(c, Node("prefill-nixl", env=NIXL_ENV), Node("decode-nixl", env=NIXL_ENV),
                    # bulk chunks cut into WRITEs of at most CUT bytes (qos.bulk_block_bytes), direct
                    # asked outright so that the tests' short page runs are written in place
                    *(Node(name, env={**NIXL_ENV, **CUT_ENV, **extra}) for name, extra in (
                        ("prefill-cut", {}), ("prefill-cut-full", {"KVXFERD_INTEGRITY_MODE": "full"}))),
                    Node("prefill-tcp", env=UCX_ENV),  # NIXL not enabled: negotiation must fall back to tcp
                    Node("decode-no-nixl", env={**NIXL_ENV, "PYTHONPATH": os.pathsep.join(
                        [str(stubs), *filter(None, [os.environ.get("PYTHONPATH")])])}))
        yield c


# -- byte-exact transfers over NIXL ----------------------------------------------------

@needs_nixl
def test_tp1_to_tp1(cluster):
    pd, dd = cluster.daemons["prefill-nixl"], cluster.daemons["decode-nixl"]
    before = {(d, t): metric(cluster.daemons[d], name, transport=t)
              for d, name in (("prefill-nixl", "kvxferd_sent_bytes_total"),
                              ("decode-nixl", "kvxferd_received_bytes_total")) for t in ("nixl", "tcp")}
    run_case(cluster, spec(), spec(), n_tokens=37)
    per_request = 37 * 4 * 2 * 4 * 16 * 2  # tokens x layers x (k, v) x heads x head_dim x bf16
    assert metric(pd, "kvxferd_sent_bytes_total", transport="nixl") - before["prefill-nixl", "nixl"] == 2 * per_request
    assert metric(dd, "kvxferd_received_bytes_total", transport="nixl") - before["decode-nixl", "nixl"] == \
        2 * per_request
    assert metric(pd, "kvxferd_sent_bytes_total", transport="tcp") == before["prefill-nixl", "tcp"]
    assert metric(dd, "kvxferd_received_bytes_total", transport="tcp") == before["decode-nixl", "tcp"]


@needs_nixl
def test_tp2_to_tp1_chunked_not_page_aligned(cluster):
    # head slices of two writers per destination token; chunks cut pages in the middle
    run_case(cluster, spec(tp_size=2), spec(), n_tokens=50, chunks=[[0, 7], [7, 30], [30, 50]])


@needs_nixl
def test_tp1_to_tp2_send_before_expect(cluster):
    run_case(cluster, spec(), spec(tp_size=2), n_tokens=33, order="send_first")


@needs_nixl
def test_pp_and_page_size_mismatch(cluster):
    pspec = spec(num_layers=5, pp_size=2, layer_splits=((0, 1), (1, 5)), page_size=3)
    dspec = spec(num_layers=5, tp_size=2, page_size=8)
    run_case(cluster, pspec, dspec, n_tokens=41, chunks=[[0, 9], [9, 41]], requests=1)


@needs_nixl
@pytest.mark.parametrize("prefill", ["prefill-cut", "prefill-cut-full"])
def test_a_bulk_chunk_cut_into_many_writes_lands_byte_exact(cluster, prefill):
    """``qos.bulk_block_bytes``: a bulk chunk's direct WRITE goes as WRITEs of at most that many
    bytes (rows split where a cut falls inside them), its header (with its digests, where the
    pair checks every chunk) told after the last: every byte lands where one WRITE put it."""
    def direct() -> dict:
        with EngineClient(cluster.daemons[prefill].socket_path, timeout=5) as client:
            return client.status()["transports"].get("direct", {"chunks": 0, "writes": 0})  # agent not started yet

    before = direct()
    run_case(cluster, spec(), spec(), prefill=prefill, n_tokens=37)  # two requests, one chunk each
    after = direct()
    chunks, writes = after["chunks"] - before["chunks"], after["writes"] - before["writes"]
    per_chunk = 37 * 4 * 2 * 4 * 16 * 2  # tokens x layers x (k, v) x heads x head_dim x bf16
    assert chunks == 2 and writes >= chunks * -(-per_chunk // CUT), (chunks, writes)


# -- negotiation -----------------------------------------------------------------------

@needs_nixl
def test_falls_back_to_tcp_when_the_decode_side_has_no_nixl_installed(cluster):
    pd, dd = cluster.daemons["prefill-nixl"], cluster.daemons["decode-no-nixl"]
    tcp0, nixl0 = metric(pd, "kvxferd_sent_bytes_total", transport="tcp"), metric(pd, "kvxferd_sent_bytes_total",
                                                                                  transport="nixl")
    run_case(cluster, spec(tp_size=2), spec(), decode="decode-no-nixl", n_tokens=21, requests=1)
    assert metric(pd, "kvxferd_sent_bytes_total", transport="tcp") > tcp0
    assert metric(pd, "kvxferd_sent_bytes_total", transport="nixl") == nixl0
    assert metric(dd, "kvxferd_received_bytes_total", transport="nixl") == 0
    assert "event=nixl_unavailable" in dd.log() and "simulated: NIXL is not installed" in dd.log()
    assert "transport=tcp" in pd.log() and "transport=tcp" in dd.log()
    with EngineClient(dd.socket_path, timeout=5) as client:
        nixl_state = client.status()["transports"]
    assert nixl_state["preference"] == ["nixl", "tcp"] and "simulated" in nixl_state["nixl"]
    # the fallback is never silent: each side counts it by reason, logs it once and shows it per pair
    assert metric(pd, "kvxferd_transport_fallbacks_total", side="prefill", preferred="nixl", chosen="tcp",
                  reason="not_offered") >= 1
    assert metric(dd, "kvxferd_transport_fallbacks_total", side="decode", preferred="nixl", chosen="tcp",
                  reason="unavailable_here") >= 1
    assert "event=transport_fallback side=prefill" in pd.log() and "reason=not_offered" in pd.log()
    assert "event=transport_fallback side=decode" in dd.log() and "reason=unavailable_here" in dd.log()
    with EngineClient(pd.socket_path, timeout=5) as client:
        pairs = [p for p in client.status()["transports"]["pairs"] if p["peer"] == dd.address]
    assert pairs and all(p["transport"] == "tcp" and p["preferred"] == "nixl" and p["reason"] == "not_offered"
                         and "offers ['tcp']" in p["detail"] for p in pairs), pairs
    before = pd.log().count("event=transport_fallback")
    run_case(cluster, spec(tp_size=2), spec(), decode="decode-no-nixl", n_tokens=21, requests=1)  # new pair
    assert pd.log().count("event=transport_fallback") == before + 1  # once per pair, not per request


@needs_nixl
def test_falls_back_to_tcp_when_the_prefill_side_does_not_enable_nixl(cluster):
    # the decode daemon offers ["nixl", "tcp"]; a prefill daemon configured for tcp picks tcp
    pd, dd = cluster.daemons["prefill-tcp"], cluster.daemons["decode-nixl"]
    tcp0, nixl0 = (metric(dd, "kvxferd_received_bytes_total", transport=t) for t in ("tcp", "nixl"))
    run_case(cluster, spec(), spec(), prefill="prefill-tcp", decode="decode-nixl", n_tokens=19, requests=1)
    assert metric(dd, "kvxferd_received_bytes_total", transport="tcp") > tcp0
    assert metric(dd, "kvxferd_received_bytes_total", transport="nixl") == nixl0
    assert metric(pd, "kvxferd_sent_bytes_total", transport="nixl") == 0
    assert metric(pd, "kvxferd_transport_fallbacks_total") == 0  # tcp is all it prefers
    assert metric(dd, "kvxferd_transport_fallbacks_total", side="decode", chosen="tcp", reason="peer_chose") >= 1
    with EngineClient(dd.socket_path, timeout=5) as client:
        pairs = [p for p in client.status()["transports"]["pairs"] if p["peer"] == pd.address]
    assert pairs and pairs[-1]["reason"] == "peer_chose" and "chose tcp" in pairs[-1]["detail"], pairs


# -- faults ----------------------------------------------------------------------------

@needs_nixl
def test_killed_nixl_peer_daemons_fail_their_requests_within_the_deadline():
    """SIGKILL a prefill daemon, then a decode daemon, each with a request half delivered over NIXL."""
    with cluster_run() as c:
        pa, pb, dd = start_nodes(c, *(Node(name, SLOW_TIMEOUTS, NIXL_ENV)
                                      for name in ("prefill-a", "prefill-b", "decode-node")))
        prefill_a, prefill_b, decode_a, decode_b = instances(
            c, (pa, "ka", "prefill", spec()), (pb, "kb", "prefill", spec(tp_size=2)),
            (dd, "kda", "decode", spec()), (dd, "kdb", "decode", spec()))
        try:
            # both requests get their first chunk through; the rest stays with the prefill engines
            decode_a[0].command(cmd="expect", request_id="k-a", pages=[1, 2, 3, 4], n=16, source_instance="ka",
                                source_address=pa.address)
            prefill_a[0].command(cmd="send", request_id="k-a", pages=[11, 12, 13, 14], n=16,
                                 chunks=[[0, 4], [4, 16]], hold_last=True)
            decode_b[0].command(cmd="expect", request_id="k-b", pages=[1, 2, 3], n=12, source_instance="kb",
                                source_address=pb.address)
            for w in prefill_b:
                w.command(cmd="send", request_id="k-b", pages=[4, 5, 6], n=12, chunks=[[0, 4], [4, 12]],
                          hold_last=True)
            deadline = time.monotonic() + 20
            while metric(dd, "kvxferd_received_bytes_total", transport="nixl") < 2 * 4 * 1024:
                assert time.monotonic() < deadline, "first chunks never landed"
                time.sleep(0.05)

            # the prefill daemon of k-b dies: the decode side fails k-b (heartbeats: dead after PEER_TIMEOUT_S)
            pb.signal(signal.SIGKILL)
            pb.proc.wait()
            # waited for less than the 30 s phase timeouts: peer_dead (the heartbeats) or nothing
            ev = finished(decode_b[0], "k-b", timeout=25)
            assert ev["state"] == "failed" and ev["code"] == "peer_dead", ev

            # the decode daemon freezes (SIGSTOP: no reset reaches the sender, the WRITE just stalls),
            # then dies; the heartbeat fails k-a long before the 30 s transfer timeout
            dd.signal(signal.SIGSTOP)
            prefill_a[0].command(cmd="send_chunks", request_id="k-a", pages=[11, 12, 13, 14], n=16,
                                 chunks=[[4, 16, True]])
            ev = finished(prefill_a[0], "k-a", timeout=25)  # under the 30 s transfer timeout
            dd.signal(signal.SIGKILL)
            dd.proc.wait()
            if ev["event"] == "finished":
                assert ev["state"] == "failed" and ev["code"] in ("peer_dead", "transfer"), ev
                assert "NIXL" in ev["reason"] or "unresponsive" in ev["reason"], ev
            else:  # the heartbeat failed it before the last chunk was handed over
                assert ev["code"] == "request_finished" and "peer_dead" in ev["error"], ev
        finally:
            for w in prefill_b + decode_a + decode_b:
                w.kill()  # their daemons are gone: nothing will finish their requests


@needs_nixl
def test_a_request_failed_on_the_decode_side_waits_for_its_source_to_fence_it(cluster):
    pd, dd = cluster.daemons["prefill-nixl"], cluster.daemons["decode-nixl"]
    confirmed0 = metric(dd, "kvxferd_fences_total", outcome="confirmed")
    unconfirmed0 = metric(dd, "kvxferd_fences_total", outcome="unconfirmed")
    received0 = metric(dd, "kvxferd_received_bytes_total", transport="nixl")
    prefill, decode = instances(cluster, (pd, "fence-p", "prefill", spec()), (dd, "fence-d", "decode", spec()))
    try:
        decode[0].command(cmd="expect", request_id="fence-1", pages=[1, 2, 3, 4], n=16, source_instance="fence-p",
                          source_address=pd.address)
        prefill[0].command(cmd="send", request_id="fence-1", pages=[5, 6, 7, 8], n=16, chunks=[[0, 4], [4, 16]],
                           hold_last=True)
        deadline = time.monotonic() + 20
        while metric(dd, "kvxferd_received_bytes_total", transport="nixl") < received0 + 4 * 4 * 2 * 4 * 16 * 2:
            assert time.monotonic() < deadline, "first chunk never landed"
            time.sleep(0.05)
        decode[0].command(cmd="abort", request_id="fence-1", reason="client went away")
        ev = finished(decode[0], "fence-1", timeout=15)
        assert ev["state"] == "failed" and ev["code"] == "aborted", ev
        # told only after the prefill daemon answered the fence (no timeout, no silent source)
        assert metric(dd, "kvxferd_fences_total", outcome="confirmed") == confirmed0 + 1
        assert metric(dd, "kvxferd_fences_total", outcome="unconfirmed") == unconfirmed0
        pre = finished(prefill[0], "fence-1", timeout=15)
        assert pre["state"] == "failed", pre
    finally:
        close(prefill + decode)


@needs_nixl
def test_a_daemon_that_ran_nixl_exits_cleanly_with_every_ucx_module_loaded():
    # UCX_MODULES=all undoes the test-wide exclusion of UCX's InfiniBand module, which
    # crashes at process exit where libibverbs is installed without an RDMA device
    with cluster_run() as c:
        d = c.daemon("exit-nixl", env={**NIXL_ENV, "UCX_MODULES": "all"})
        ranks = c.instance(d, "exit-d", "decode", spec(), 8)  # the first rank starts the NIXL agent
        with EngineClient(d.socket_path, timeout=5) as client:
            assert client.status()["transports"]["nixl"].startswith("ready"), client.status()["transports"]
        close(ranks)
        d.signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0, d.log()[-2000:]


# -- a notification that fails validation --------------------------------------------

@needs_nixl
def test_notification_failing_validation_fails_the_request_with_the_reason(cluster, monkeypatch):
    for key, value in UCX_ENV.items():
        monkeypatch.setenv(key, value)
    dd = cluster.daemons["decode-nixl"]
    fake = FakePrefillDaemon(spec())
    decode = cluster.instance(dd, "fake-d", "decode", spec(), NUM_PAGES)
    try:
        hs = fake.engage(decode[0], "bad-1", pages=[1, 2], n=8)
        assert hs["transports"][0] == "nixl" and hs["nixl_agent"]
        assert fake.expects[0]["dst_pages"] == [1, 2]
        assert {tuple(r[:4]) for r in hs["nixl_regions"]} == {(0, 0, layer, kind) for layer in range(4)
                                                               for kind in ("k", "v")}
        header = {"op": "data", "request_id": "bad-1", "decode_instance": "fake-d", "dst": [0, 0], "src": [0, 0],
                  "start": 0, "end": 8, "last": True, "nbytes": 12345, "token": hs["data_token"]}
        fake.agent.send_notif(hs["nixl_agent"], msgpack.packb(header, use_bin_type=True))
        ev = finished(decode[0], "bad-1", timeout=15)
        assert ev["state"] == "failed" and ev["code"] == "peer_refused", ev
        assert "12345" in ev["reason"] and "geometry says 8192" in ev["reason"], ev
        deadline = time.monotonic() + 5
        while not fake.aborts:  # the source is told, so it stops writing
            assert time.monotonic() < deadline, "no abort reached the source"
            time.sleep(0.02)
        assert fake.aborts[0]["request_id"] == "bad-1"
        # the source was asked to fence the request; it never answered, and the failure was told anyway
        assert [f["request_id"] for f in fake.fences][:1] == ["bad-1"]
        assert metric(dd, "kvxferd_fences_total", outcome="unconfirmed") >= 1
        assert "event=fence_unconfirmed request=bad-1" in dd.log()
    finally:
        close(decode)
        fake.close()


# -- pieces without processes ------------------------------------------------------------

def test_config_names_the_transport_keys():
    assert config.transport_preference(config.load(None, {}).peer) == ["tcp"]
    assert config.transport_preference(config.load(None, {"KVXFERD_PEER_TRANSPORT": "nixl"}).peer) == ["nixl", "tcp"]
    assert config.transport_preference(config.load(None, {"KVXFERD_PEER_TRANSPORTS": "nixl,tcp"}).peer) == [
        "nixl", "tcp"]
    for env, field in (({"KVXFERD_PEER_TRANSPORT": "rdma"}, "peer.transport"),
                       ({"KVXFERD_PEER_TRANSPORTS": "nixl,udp"}, "peer.transports"),
                       ({"KVXFERD_PEER_TRANSPORTS": "tcp,tcp"}, "peer.transports"),
                       ({"KVXFERD_PEER_TRANSPORTS": "tcp", "KVXFERD_PEER_TRANSPORT": "nixl"}, "peer.transports")):
        with pytest.raises(ConfigError) as err:
            config.load(None, env)
        assert err.value.field == field and field in str(err.value)


def test_peer_schemas_bound_the_nixl_fields():
    base = {"op": "expect", "request_id": "r", "prefill_instance": "p", "decode_instance": "d", "dst": [0, 0],
            "num_tokens": 4}
    ok = messages.check_peer({**base, "dst_pages": [3, 4], "nixl_md": [b"md"],
                              "nixl_regions": [[0, 0, 1, "k", 4096, 8192, -1]]})
    assert ok["dst_pages"] == [3, 4]
    for extra, field in (({"dst_pages": list(range(protocol.MAX_DST_PAGES + 1))}, "dst_pages"),
                         ({"dst_pages": [1, "x"]}, "dst_pages"),
                         ({"nixl_regions": [[0, 0, 1, "q", 1, 1, -1]]}, "nixl_regions[0]"),
                         ({"nixl_regions": [[0, 0, 1, "k", 0, 1, -1]]}, "nixl_regions[0]"),
                         ({"nixl_regions": [[0, 0]]}, "nixl_regions[0]"),
                         ({"nixl_md": [b"x" * (protocol.MAX_NIXL_MD + 1)]}, "nixl_md[0]")):
        with pytest.raises(ProtocolError) as err:
            messages.check_peer({**base, **extra})
        assert err.value.field == field
    hs = {"op": "handshake", "v": PROTOCOL_VERSION, "daemon": "a:1", "data_address": "a:2", "prefill_instance": "p",
          "decode_instance": "d", "decode_spec": {}, "mode": "auto", "transports": ["nixl", "tcp"],
          "nixl_agent": "agent-a", "nixl_md": [b"md"], "nixl_regions": []}
    assert messages.check_peer(hs)["nixl_agent"] == "agent-a"


def test_remote_bases_and_descriptors_are_built_in_wire_order():
    peer = nixl_api.NixlPeer("agent", spec(page_size=4, head_dim=32))
    assert peer.spec.page_bytes == 4 * 256
    peer.update([[1, 0, layer, kind, 1 << 20 | (layer << 12) | (kind == "v") << 8, 64 * 1024, -1]
                 for layer in range(3) for kind in ("k", "v")])
    assert peer.num_pages((1, 0)) == 64 and peer.num_pages((0, 0)) is None
    bases, limit, device = peer.bases((1, 0), (1, 3), ("k", "v"))
    assert bases.tolist() == [1 << 20 | 1 << 12, 1 << 20 | 1 << 12 | 256, 1 << 20 | 2 << 12,
                              1 << 20 | 2 << 12 | 256]
    assert limit == 64 * 1024 and device == -1
    with pytest.raises(TransferError) as err:
        peer.bases((1, 0), (2, 4), ("k", "v"))
    assert "layer 3" in str(err.value)
    descs = nixl_api._descs(np.array([1000, 5000], dtype=np.uint64), np.array([0, 40]), np.array([8, 16]), -1)
    assert descs.tolist() == [[1000, 8, 0], [1040, 16, 0], [5000, 8, 0], [5040, 16, 0]]


def test_strided_decode_regions_are_addressed_by_their_stride_and_must_agree_on_it():
    dspec = spec(page_size=4, head_dim=32)  # 256-byte rows, 1 KiB pages
    peer = nixl_api.NixlPeer("agent", dspec)
    stride = 3 * dspec.page_bytes
    peer.update([[0, 0, layer, kind, 1 << 20, 7 * stride + dspec.page_bytes, -1, stride]
                 for layer in range(4) for kind in ("k", "v")])
    assert peer.num_pages((0, 0)) == 8  # (span - page) // stride + 1, not span // page
    # token 5 of a request on pages [6, 2] is row 1 of page 2: slot 2 * (stride // row) + 1
    assert peer.dst_slots((0, 0), "", np.array([6, 2]), 5, 7).tolist() == [2 * 12 + 1, 2 * 12 + 2]
    assert peer.dst_slots((1, 0), "", np.array([6, 2]), 5, 7).tolist() == [2 * 4 + 1, 2 * 4 + 2]  # dense rank
    with pytest.raises(TransferError) as err:
        peer.update([[1, 0, 0, "k", 1 << 21, 8 * dspec.page_bytes, -1, 0],
                     [1, 0, 0, "v", 1 << 22, 8 * dspec.page_bytes, -1, stride]])
    assert err.value.field == "nixl_regions" and f"[0, {stride}]" in str(err.value)


def test_negotiation_refuses_a_pair_without_a_common_transport():
    support = NixlSupport("unit", ["nixl"], inbox=None, timeout_s=1, max_header_bytes=1 << 20,
                                   max_pages=1 << 10)
    support.unavailable = "simulated: not installed"  # never starts an agent in this process
    with pytest.raises(PlanRefusal) as err:
        support.choose({"daemon": "d:1", "transports": ["tcp"]}, spec(), "auto")
    assert err.value.field == "peer.transports" and "simulated" in str(err.value)
    tcp_only = NixlSupport("unit", ["nixl", "tcp"], inbox=None, timeout_s=1, max_header_bytes=1 << 20,
                                    max_pages=1 << 10)
    tcp_only.unavailable = "simulated"
    assert tcp_only.offered() == ["tcp"]
    chosen, remote, fallback = tcp_only.choose({"daemon": "d:1", "transports": ["nixl", "tcp"], "nixl_agent": "a",
                                                "nixl_md": [b"x"]}, spec(), "auto")
    assert (chosen, remote, fallback.code) == ("tcp", None, "unavailable_here") and "simulated" in fallback.detail
    chosen, remote, fallback = tcp_only.choose({"daemon": "d:1", "transports": ["tcp"]}, spec(), "auto")
    assert fallback.code == "unavailable_here"  # the first reason the preferred one was passed over
    tcp_first = NixlSupport("unit", ["tcp", "nixl"], inbox=None, timeout_s=1, max_header_bytes=1 << 20,
                            max_pages=1 << 10)
    tcp_first.unavailable = "simulated"
    assert tcp_first.choose({"daemon": "d:1", "transports": ["tcp"]}, spec(), "auto") == ("tcp", None, None)
    no_ring = NixlSupport("unit", ["nixl", "tcp"], inbox=None, timeout_s=1, max_header_bytes=1 << 20,
                          max_pages=1 << 10)
    no_ring.get = lambda: object()  # an agent that is never asked for anything here
    chosen, _, fallback = no_ring.choose({"daemon": "d:1", "transports": ["nixl", "tcp"], "nixl_agent": "a",
                                          "nixl_md": [b"x"]}, spec(), "staged")
    assert (chosen, fallback.code) == ("tcp", "no_landing_ring") and "landing ring" in fallback.detail
    # a decode daemon that keeps its engines' memory private and gave no ring: NIXL cannot carry the pair
    chosen, _, fallback = no_ring.choose({"daemon": "d:1", "transports": ["nixl", "tcp"], "nixl_agent": "a",
                                          "nixl_md": [], "nixl_private": True}, spec(), "auto")
    assert (chosen, fallback.code) == ("tcp", "private_no_ring") and "peer.nixl_engine_memory" in fallback.detail
    assert tcp_only.describe() == {"preference": ["nixl", "tcp"], "nixl_engine_memory": "private",
                                   "nixl": "simulated"}


def test_a_rank_nixl_would_not_register_moves_its_pairs_to_tcp_saying_why():
    """A registration NIXL refuses (UCX taking GPU memory for host memory did this) must not leave
    the instance's pairs on NIXL, failing request after request: the pair takes the next
    transport, with reason ``register_failed`` naming the rank, whichever side's rank it was."""
    from types import SimpleNamespace

    class Refusing:  # the agent's verb that fails; nothing else is asked of it here
        def register_rank(self, rank):
            raise RuntimeError("nixlBackendError: NIXL_ERR_BACKEND")

        def deregister_rank(self, rank):
            pass

        def offer(self, decode_instance, source):  # an instance whose ranks all registered
            return {"nixl_agent": "agent-d"}, {}

    def support():
        s = NixlSupport("unit", ["nixl", "tcp"], inbox=None, timeout_s=1, max_header_bytes=1 << 20,
                        max_pages=1 << 10)
        s.transport = Refusing()
        return s

    rank = SimpleNamespace(id="d/tp1/pp0", instance="d")
    decode = support()
    decode.register(rank)
    offer = decode.handshake_fields("p:1", "p", "d")
    assert set(offer) == {"nixl_unusable"} and "d/tp1/pp0" in offer["nixl_unusable"]
    assert "NIXL_ERR_BACKEND" in offer["nixl_unusable"]
    assert decode.handshake_fields("p:1", "p", "other") == {"nixl_agent": "agent-d"}  # others unaffected
    prefill = support()
    msg = {"daemon": "d:1", "prefill_instance": "p", "transports": ["nixl", "tcp"], **offer}
    chosen, remote, fallback = prefill.choose(msg, spec(), "auto")
    assert (chosen, remote, fallback.code) == ("tcp", None, "register_failed")
    assert "decode daemon" in fallback.detail and "d/tp1/pp0" in fallback.detail
    prefill.register(SimpleNamespace(id="p/tp0/pp0", instance="p"))
    chosen, _, fallback = prefill.choose({**msg, "nixl_unusable": None}, spec(), "auto")
    assert (chosen, fallback.code) == ("tcp", "register_failed") and "here" in fallback.detail
    prefill.deregister(SimpleNamespace(id="p/tp0/pp0", instance="p"))
    decode.deregister(rank)
    assert not prefill.unusable_for("p") and not decode.unusable_for("d")


def test_expect_over_nixl_is_checked_before_any_write():
    support = NixlSupport("unit", ["nixl", "tcp"], inbox=None, timeout_s=1, max_header_bytes=1 << 20,
                                   max_pages=8)
    loaded = []
    support.transport = type("Loader", (), {
        "load": lambda self, agent, mds, regions=None: loaded.append((agent, mds))})()
    peer = nixl_api.NixlPeer("agent-d", spec(page_size=4, head_dim=32))
    assert peer.spec.page_bytes == 1024
    peer.update([[0, 0, 0, "k", 1 << 20, 16 * 1024, -1], [0, 0, 0, "v", 2 << 20, 16 * 1024, -1]])
    assert support.expect_pages(peer, (0, 0), {"dst_pages": [0, 15]}).tolist() == [0, 15]
    cases = [({"dst_pages": [0, 16]}, RequestError, "dst_pages"),  # past the 16 pages of the region
             ({"dst_pages": [-1]}, RequestError, "dst_pages"),
             ({"dst_pages": list(range(9))}, RequestError, "dst_pages"),  # limits.max_pages_per_request
             ({}, ProtocolError, "dst_pages"),
             ({"dst_pages": [1], "nixl_regions": [[1, 0, 0, "k", 1, 1, -1]]}, ProtocolError, "nixl_regions")]
    for msg, kind, field in cases:
        with pytest.raises(kind) as err:
            support.expect_pages(peer, (0, 0), msg)
        assert err.value.field == field, msg
    with pytest.raises(RequestError) as err:
        support.expect_pages(peer, (1, 0), {"dst_pages": [0]})  # a rank never described
    assert err.value.field == "nixl_regions"
    # a rank registered after the handshake arrives with its metadata and regions
    support.expect_pages(peer, (1, 0), {"dst_pages": [3], "nixl_md": [b"md-1"],
                                        "nixl_regions": [[1, 0, 0, "k", 3 << 20, 8 * 1024, -1]]})
    assert loaded == [("agent-d", [b"md-1"])] and peer.num_pages((1, 0)) == 8

"""SGLang's prefill and decode call sequences on the kvxferd backend, against real daemons.

Every transfer is checked byte for byte against an oracle computed head by head from the
prefill pools (``harness.expected_decode``), including rows that must stay untouched
(other pages, the decode prefix), and the MetadataBuffers row is compared with what the
prefill side's ``set_buf`` wrote.

The TP-mismatched, the MLA and the decode-prefix transfers run over each transport (``transport_util``): tcp
on the conftest's daemons, and NIXL on two daemons that accept NIXL alone; their metrics must
count every KV byte the decode pools took on that transport, and none on the other.
"""

from __future__ import annotations

import random

import pytest
import torch

from e2e_util import Node, module_cluster
from kvxferd.sdk.client import EngineClient
from nixl_util import metric
from harness import (KVPoll, Model, Request, assert_bytes_equal, bootstrap_server, close_all, expected_decode,
                     free_port, make_rank, new_senders, run_decode_until_metadata, run_prefill, sglang_wait)
from transport_util import ONLY_NIXL, Carried, daemons, transport  # noqa: F401 - fixtures


@pytest.fixture(scope="module")
def nixl_cluster(request):
    """The conftest's "pd" and "dd", accepting NIXL alone."""
    yield from module_cluster(request, Node("pd", env=ONLY_NIXL), Node("dd", env=ONLY_NIXL))


@pytest.fixture(scope="module")
def checksum_cluster(request):
    """Daemons in integrity.mode "off": whatever is checked, an instance asked for. On "dd-bad" one
    landed byte of every chunk that carries digests is flipped before the check (fault injection)."""
    yield from module_cluster(request, "pd", "dd", Node("dd-bad", '[integrity]\ncorrupt_landed_every = 1\n'))


def kv_bytes(decode, req) -> int:
    """What a request moves into the decode pools: one row of every region per token past the prefix."""
    return sum((req.n_tokens - req.prefix) * buf[0].nbytes for d in decode for buf in d.buffers().values())


def deployment(cluster, model, *, tp_p=1, tp_d=1, pp_p=1, pp_d=1, ps_p=4, ps_d=4, pages_p=32, pages_d=32, seed=1,
               decode_daemon="dd", prefill_args=None, decode_args=None):
    """``prefill_args``, ``decode_args``: SGLang server arguments of either side's ranks."""
    bport = free_port()
    server = bootstrap_server(bport)
    prefill = [make_rank("prefill", cluster.daemons["pd"], model, tp_rank=t, tp_size=tp_p, pp_rank=p, pp_size=pp_p,
                         page_size=ps_p, num_pages=pages_p, port=free_port(), bootstrap_port=bport,
                         seed=seed * 100 + p * 10 + t, **(prefill_args or {}))
               for p in range(pp_p) for t in range(tp_p)]
    dport = free_port()
    decode = [make_rank("decode", cluster.daemons[decode_daemon], model, tp_rank=t, tp_size=tp_d, pp_rank=p,
                        pp_size=pp_d, page_size=ps_d, num_pages=pages_d, port=dport, bootstrap_port=bport,
                        seed=seed * 100 + 50 + p * 10 + t, **(decode_args or {}))
              for p in range(pp_d) for t in range(tp_d)]
    return server, prefill, decode, f"127.0.0.1:{bport}"


def transfer_and_check(model, prefill, decode, addr, req, *, group, tp_p, tp_d, chunk_ends=None, seed=0):
    rng = random.Random(seed)
    before = [{k: v.clone() for k, v in d.buffers().items()} for d in decode]
    senders = new_senders(prefill, addr, req)
    for s in senders:  # SGLang's bootstrap queue polls before init(): no request at the daemon yet
        assert s.poll() == KVPoll.Bootstrapping
    receivers = run_decode_until_metadata(decode, addr, req, rng)
    pslots = run_prefill(prefill, senders, req, rng, chunk_ends=chunk_ends)
    assert sglang_wait(senders, group) == [KVPoll.Success] * len(senders), [s.failure for s in senders]
    for (recv, dslots), d, old in zip(receivers, decode, before):
        assert sglang_wait([recv], group, decode_metadata=d.metadata) == [KVPoll.Success], recv.failure
        want = expected_decode(d, old, dslots, prefill, pslots, req, model, tp_p, tp_d)
        assert any(not torch.equal(want[k], old[k]) for k in want), "the oracle expects no change"
        assert_bytes_equal(d.buffers(), want)
        src = prefill[0].metadata.get_buf(5)
        got = d.metadata.get_buf(3)
        for a, b in zip(src, got):
            assert (a is None and b is None) or torch.equal(a, b)
        assert int(d.metadata.bootstrap_room[3, 0]) == req.room  # SGLang's metadata gate passes
        assert int(d.metadata.output_ids[3, 0]) == req.first_token


@pytest.mark.parametrize("tp_p,tp_d", [(2, 1), (1, 2)], ids=["tp2to1", "tp1to2"])
def test_tp_mismatch_chunked(daemons, transport, gloo, tp_p, tp_d):
    model = Model()
    server, prefill, decode, addr = deployment(daemons, model, tp_p=tp_p, tp_d=tp_d)
    try:
        carried = Carried([daemons.daemons["pd"]], [daemons.daemons["dd"]])
        req = Request(room=1001 + tp_p, n_tokens=29)
        transfer_and_check(model, prefill, decode, addr, req, group=gloo, tp_p=tp_p, tp_d=tp_d, chunk_ends=[10, 21])
        carried.assert_only(transport, kv_bytes(decode, req))
    finally:
        close_all(*prefill, *decode)
        server.close()


def test_pp_stages_and_page_sizes_that_differ(cluster, gloo):
    """Prefill PP 2 (SGLang's layer partition: the last stage holds the extra layer), decode
    PP 1 with twice the page size, chunked."""
    model = Model(num_layers=5)
    server, prefill, decode, addr = deployment(cluster, model, pp_p=2, ps_p=4, ps_d=8, seed=2)
    try:
        assert [tuple(p.manager.geometry.layers) for p in prefill] == [(0, 2), (2, 5)]
        transfer_and_check(model, prefill, decode, addr, Request(room=2001, n_tokens=37), group=gloo,
                           tp_p=1, tp_d=1, chunk_ends=[16])
    finally:
        close_all(*prefill, *decode)
        server.close()


def test_mla_tp2_to_pp2(daemons, transport, gloo):
    """MLA latent rows (kv_lora_rank + rope_dim), every prefill TP rank holding the same
    latent as SGLang computes it; decode split over 2 PP stages with a smaller page. One
    prefill rank writes each latent row: the bytes sent equal the bytes received."""
    model = Model(mla=True, num_layers=3)
    server, prefill, decode, addr = deployment(daemons, model, tp_p=2, pp_d=2, ps_p=8, ps_d=2, seed=3)
    try:
        for p in prefill[1:]:  # the latent is the same on every TP rank
            for k, t in p.buffers().items():
                t.copy_(prefill[0].buffers()[k])
        assert prefill[0].manager.geometry.spec.attention == "mla"
        carried = Carried([daemons.daemons["pd"]], [daemons.daemons["dd"]])
        req = Request(room=3001, n_tokens=21)
        transfer_and_check(model, prefill, decode, addr, req, group=gloo, tp_p=2, tp_d=1, chunk_ends=[9])
        carried.assert_only(transport, kv_bytes(decode, req))
    finally:
        close_all(*prefill, *decode)
        server.close()


def test_decode_prefix_moves_only_the_suffix(daemons, transport, gloo):
    """decode_prefix_len 8: the decode side holds tokens [0, 8) already (its pages must stay
    as they were); prefill sends the whole prompt and only [8, 27) lands, and is all that
    goes over the wire."""
    model = Model()
    server, prefill, decode, addr = deployment(daemons, model, tp_p=2, tp_d=1, seed=4)
    try:
        carried = Carried([daemons.daemons["pd"]], [daemons.daemons["dd"]])
        req = Request(room=4001, n_tokens=27, prefix=8)
        transfer_and_check(model, prefill, decode, addr, req, group=gloo, tp_p=2, tp_d=1, chunk_ends=[12])
        carried.assert_only(transport, kv_bytes(decode, req))
    finally:
        close_all(*prefill, *decode)
        server.close()


def test_bare_last_chunk_carries_the_metadata_row(cluster, gloo):
    """A prompt of whole pages whose last prefill chunk is empty: SGLang still sends it
    (should_send_kv_chunk), and it alone ends the request and carries the aux row."""
    model = Model()
    server, prefill, decode, addr = deployment(cluster, model, seed=5)
    try:
        transfer_and_check(model, prefill, decode, addr, Request(room=4501, n_tokens=24), group=gloo,
                           tp_p=1, tp_d=1, chunk_ends=[24])
    finally:
        close_all(*prefill, *decode)
        server.close()


CHECKSUM = {"disaggregation_enable_kv_checksum": True}


@pytest.mark.parametrize("sides", ["both", "decode"])
def test_kv_checksum_flag_runs_with_kvxferd_checking_every_chunk(checksum_cluster, gloo, sides):
    """--disaggregation-enable-kv-checksum on SGLang's ranks (on both sides, or on decode alone):
    the kvxferd backend takes it, registers the ranks with integrity "full", and every chunk of a
    TP-mismatched transfer is checked over the landed bytes, which are byte-exact."""
    model = Model()
    pd, dd = checksum_cluster.daemons["pd"], checksum_cluster.daemons["dd"]
    server, prefill, decode, addr = deployment(checksum_cluster, model, tp_p=2, tp_d=1, seed=6,
                                               prefill_args=CHECKSUM if sides == "both" else None,
                                               decode_args=CHECKSUM)
    try:
        with EngineClient(dd.socket_path) as kv:
            ranks = {r["rank_id"]: r for r in kv.status()["ranks"]}
        assert ranks[decode[0].manager.rank_id].get("integrity") == "full"
        checked = metric(dd, "kvxferd_integrity_checked_chunks_total")
        transfer_and_check(model, prefill, decode, addr, Request(room=6001 + len(sides), n_tokens=29), group=gloo,
                           tp_p=2, tp_d=1, chunk_ends=[10, 21])
        # three chunks from each of the two prefill ranks
        assert metric(dd, "kvxferd_integrity_checked_chunks_total") - checked == 6
        assert metric(pd, "kvxferd_integrity_failures_total") == metric(dd, "kvxferd_integrity_failures_total") == 0
    finally:
        close_all(*prefill, *decode)
        server.close()


def test_kv_checksum_flag_fails_a_request_whose_landed_bytes_changed(checksum_cluster, gloo):
    """The same flag towards a decode daemon that flips a landed byte: SGLang's decode receiver
    polls Failed with kvxferd's integrity error, and so do the prefill senders; never Success."""
    model = Model()
    bad = checksum_cluster.daemons["dd-bad"]
    server, prefill, decode, addr = deployment(checksum_cluster, model, tp_p=2, tp_d=1, seed=7, decode_daemon="dd-bad",
                                               prefill_args=CHECKSUM, decode_args=CHECKSUM)
    try:
        failures = metric(bad, "kvxferd_integrity_failures_total")
        req = Request(room=7001, n_tokens=29)
        senders = new_senders(prefill, addr, req)
        [(recv, _)] = run_decode_until_metadata(decode, addr, req, random.Random(7))
        run_prefill(prefill, senders, req, random.Random(8))
        assert sglang_wait([recv], gloo, decode_metadata=decode[0].metadata) == [KVPoll.Failed]
        assert "integrity" in str(recv.failure), recv.failure
        assert sglang_wait(senders, gloo) == [KVPoll.Failed] * len(senders), [s.failure for s in senders]
        assert metric(bad, "kvxferd_integrity_failures_total") > failures
    finally:
        close_all(*prefill, *decode)
        server.close()


def test_a_requests_priority_reaches_its_sender_and_asks_the_latency_class(cluster, gloo, monkeypatch):
    """SGLang builds senders without the request: the plugin's hook on PrefillBootstrapQueue._process_req
    (SGLang's real method, run on a real Req) hands the sender the request's priority, and with
    KVXFERD_SGLANG_LATENCY_PRIORITY its first chunk asks its daemon for the latency class: the prefill
    daemon runs every byte of it as latency work, byte-exact at decode."""
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    monkeypatch.setenv("KVXFERD_SGLANG_LATENCY_PRIORITY", "5")
    model = Model()
    server, prefill, decode, addr = deployment(cluster, model, seed=7)
    try:
        req = Request(room=4701, n_tokens=20)
        senders = new_senders(prefill, addr, req)
        queue = object.__new__(PrefillBootstrapQueue)
        for sender, priority in zip(senders, (7,)):
            sglang_req = Req(rid="r4701", origin_input_text="", origin_input_ids=list(range(20)),
                             sampling_params=SamplingParams(max_new_tokens=8), priority=priority)
            sglang_req.disagg_kv_sender = sender
            queue._process_req(sglang_req)
            assert sender.priority == 7 and sglang_req.sampling_params.max_new_tokens == 1  # SGLang's own part ran
        assert prefill[0].manager.qos_class(7) == "latency" and prefill[0].manager.qos_class(4) == "bulk"
        pd = cluster.daemons["pd"]
        latency = metric(pd, "kvxferd_transfer_class_bytes_total", **{"class": "latency"})
        rng = random.Random(3)
        receivers = run_decode_until_metadata(decode, addr, req, rng)
        run_prefill(prefill, senders, req, rng)
        assert sglang_wait(senders, gloo) == [KVPoll.Success], [s.failure for s in senders]
        assert sglang_wait([receivers[0][0]], gloo, decode_metadata=decode[0].metadata) == [KVPoll.Success]
        assert metric(pd, "kvxferd_transfer_class_bytes_total", **{"class": "latency"}) - latency == kv_bytes(decode, req)
    finally:
        close_all(*prefill, *decode)
        server.close()

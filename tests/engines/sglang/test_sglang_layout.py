"""The adapter's pure rules: head resolution, page and token arithmetic, poll mapping, routes."""

from __future__ import annotations

import pytest

from kvxferd.adapters.sglang import polling
from kvxferd.adapters.sglang.bootstrap import reachable_address
from kvxferd.adapters.sglang.layout import (PoolFacts, RankFacts, aux_row_spans, build_geometry, chunk_window,
                                            expect_pages, resolve_heads)
from kvxferd.errors import GeometryError, RegistrationError


def pool(heads=2, attention="mha", rows=68, start=0, layers=4, page=4):
    return PoolFacts(attention=attention, dtype="float16", rows=rows, local_heads=heads, head_dim=16, page_size=page,
                     start_layer=start, num_layers=layers)


def rank(tp=2, tp_rank=0, kv=None, total=None, model=None, pp=1, pp_rank=0, splits=((0, 4),)):
    return RankFacts(tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank, pp_size=pp, layer_splits=splits, kv_head_num=kv,
                     total_kv_head_num=total, model_total_kv_heads=model)


@pytest.mark.parametrize("facts,total", [
    (rank(kv=2, total=4), 4),  # prefill: KVArgs has both
    (rank(model=4), 4),  # decode 0.5.23: KVArgs has neither, the model config does
    (rank(), 4),  # nothing but the pool: 2 heads per rank cannot be replicas
])
def test_heads_resolved_from_every_source(facts, total):
    assert resolve_heads(pool(), facts) == total


def test_replicated_heads_come_from_the_model():
    assert resolve_heads(pool(heads=1), rank(tp=4, model=2)) == 2


def test_heads_refused_only_when_nothing_gives_them():
    with pytest.raises(GeometryError, match="Cannot resolve total_kv_heads") as info:
        resolve_heads(pool(heads=1), rank(tp=2))
    assert info.value.field == "total_kv_head_num"


@pytest.mark.parametrize("facts,field", [(rank(kv=4, total=8), "kv_head_num"),  # KVArgs vs the tensors
                                          (rank(total=4, model=8), "total_kv_head_num"),  # two totals
                                          (rank(model=8), "kv_head_num")])  # 8 / 2 != 2 in the pool
def test_contradictions_name_the_field(facts, field):
    with pytest.raises(GeometryError) as info:
        resolve_heads(pool(), facts)
    assert info.value.field == field


def test_mla_is_one_latent_and_pp_stages_use_sglangs_partition():
    g = build_geometry(pool(heads=1, attention="mla", start=2, layers=3), rank(tp=2, pp=2, pp_rank=1,
                                                                                splits=((0, 2), (2, 5))))
    assert g.spec.attention == "mla" and tuple(g.layers) == (2, 5) and g.num_pages == 17
    with pytest.raises(GeometryError) as info:
        build_geometry(pool(start=0, layers=3), rank(pp=2, pp_rank=0, splits=((0, 2), (2, 5))))
    assert info.value.field == "prefill_start_layer"


def test_pages_and_tokens():
    assert expect_pages([7, 3], prefix_len=8, page_size=4) == [0, 0, 7, 3]
    with pytest.raises(RegistrationError):
        expect_pages([7], prefix_len=6, page_size=4)
    assert chunk_window(8, 5, 2, 4) == (8, 13)
    assert chunk_window(8, 0, 0, 4) == (8, 8)  # an empty last chunk
    assert chunk_window(0, None, 3, 4) == (0, 12)
    with pytest.raises(RegistrationError):
        chunk_window(8, 9, 2, 4)  # 9 tokens do not fit 2 pages of 4
    with pytest.raises(RegistrationError):
        chunk_window(6, 2, 1, 4)  # a chunk must start on a page boundary
    assert aux_row_spans([64, 512], 3) == [(192, 64), (1536, 512)]


def test_poll_order_sglang_expects():
    p = polling
    assert p.sender_poll(None, sent=False) == p.BOOTSTRAPPING  # before the decode expect arrived
    assert p.sender_poll("waiting_for_input", sent=False) == p.WAITING_FOR_INPUT
    assert p.sender_poll("waiting_for_input", sent=True) == p.TRANSFERRING
    assert p.sender_poll("done", sent=True) == p.SUCCESS
    assert p.sender_poll("failed", sent=True) == p.FAILED
    assert p.receiver_poll(None, inited=False, metadata_sent=False, aux_landed=False) == p.BOOTSTRAPPING
    assert p.receiver_poll(None, inited=True, metadata_sent=False, aux_landed=False) == p.WAITING_FOR_INPUT
    assert p.receiver_poll("done", inited=True, metadata_sent=True, aux_landed=False) == p.TRANSFERRING
    assert p.receiver_poll("done", inited=True, metadata_sent=True, aux_landed=True) == p.SUCCESS
    from sglang.srt.disaggregation.base.conn import KVPoll

    assert (p.FAILED, p.BOOTSTRAPPING, p.WAITING_FOR_INPUT, p.TRANSFERRING, p.SUCCESS) == (
        KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success)


def test_wildcard_daemon_host_is_reached_at_the_bootstrap_host():
    assert reachable_address("0.0.0.0:5557", "10.1.2.3") == "10.1.2.3:5557"
    assert reachable_address("prefill-a:5557", "10.1.2.3") == "prefill-a:5557"


def test_bootstrap_server_serves_one_deployment():
    from kvxferd.adapters.sglang.bootstrap import BootstrapHTTPServer, get_route, put_route

    server = BootstrapHTTPServer("127.0.0.1", 0)
    addr = f"127.0.0.1:{server.port}"
    try:
        assert get_route(addr) is None  # no prefill rank registered yet: decode retries
        route = {"instance": "prefill-a", "daemon_address": "0.0.0.0:5557", "dp_size": 1,
                 "follow_bootstrap_room": True}
        assert put_route(addr, "prefill-a", "0.0.0.0:5557") == route
        assert put_route(addr, "prefill-a", "0.0.0.0:5557")["instance"] == "prefill-a"  # every rank, same answer
        clash = put_route(addr, "prefill-b", "10.0.0.2:5557")
        assert clash["status"] == 409 and "prefill-a" in clash["error"]
        other_dp = put_route(addr, "prefill-a", "0.0.0.0:5557", dp_size=2)  # a rank with another DP size
        assert other_dp["status"] == 409 and "'dp_size': 1" in other_dp["error"]
        assert get_route(addr) == route
    finally:
        server.close()
    assert get_route(addr, timeout=0.5) is None  # gone: decode sees "not yet", not an exception


def test_bootstrap_server_keeps_dp_ranks_of_rooms_as_sglang_asks_for_them():
    """SGLang's decode asks ``/query_dp_ranks`` (CommonKVReceiver.query_prefill_dp_ranks) for the
    DP rank each prefill sender filed at ``/register_dp_rank``; a bad body is refused, the
    table is bounded (oldest room forgotten first)."""
    import urllib.error
    import urllib.request

    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    from kvxferd.adapters.sglang import bootstrap
    from kvxferd.adapters.sglang.bootstrap import BootstrapHTTPServer, post_dp_rank

    server = BootstrapHTTPServer("127.0.0.1", 0)
    addr = f"127.0.0.1:{server.port}"
    try:
        assert post_dp_rank(addr, 11, 1) == {"ok": True}
        assert post_dp_rank(addr, 12, 0) == {"ok": True}
        assert CommonKVReceiver.query_prefill_dp_ranks(addr, [11, 12, 13]) == {"11": 1, "12": 0}
        req = urllib.request.Request(f"http://{addr}/register_dp_rank", data=b'{"bootstrap_room": "x"}',
                                     method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=5)
        assert err.value.code == 400
        old = bootstrap.MAX_ROOMS
        bootstrap.MAX_ROOMS = 2
        try:
            assert post_dp_rank(addr, 14, 1) == {"ok": True}
        finally:
            bootstrap.MAX_ROOMS = old
        assert CommonKVReceiver.query_prefill_dp_ranks(addr, [11, 12, 14]) == {"12": 0, "14": 1}
    finally:
        server.close()

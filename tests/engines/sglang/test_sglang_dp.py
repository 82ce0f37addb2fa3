"""Data-parallel attention prefill deployments on the kvxferd backend, against real daemons.

SGLang's parallel context is set for DP attention the way its launcher publishes it
(``attn_dp_size`` in the server args; ``tp_rank``, ``attn_dp_rank``, ``attn_tp_rank`` per
rank), its real ``_init_kv_manager`` fills KVArgs, and the decode side resolves each request's
prefill DP rank with SGLang's own code: ``DecodePreallocQueue._resolve_prefill_dp_rank``
(the room rule) and ``CommonKVReceiver.query_prefill_dp_ranks`` (a query to the bootstrap
server). Every DP rank holds other KV bytes, so a request read from the wrong DP rank fails
the byte-exact check against the oracle of the DP rank that ran it.

The byte-exact transfers run over each transport (``transport_util``): tcp on the module's
daemons, and NIXL on the same three daemons accepting NIXL alone; their metrics must count
every KV byte the decode pools took on that transport, sent and received, and none on the
other. The refusals and the routing rules without a transfer run on tcp only.
"""

from __future__ import annotations

import random
import types

import pytest
import torch

from e2e_util import Node, module_cluster
from harness import (BACKEND, KVPoll, Model, Request, assert_bytes_equal, bootstrap_server, close_all,
                     expected_decode, free_port, make_rank, new_senders, run_prefill, slots_of, wait_poll)
from kvxferd.errors import RegistrationError
from kvxferd.sdk.client import EngineClient
from test_sglang_transfers import kv_bytes
from transport_util import ONLY_NIXL, Carried, daemons, transport  # noqa: F401 - fixtures

from sglang.srt.disaggregation.common.conn import CommonKVReceiver
from sglang.srt.disaggregation.decode import DecodePreallocQueue
from sglang.srt.disaggregation.utils import KVClassType, get_kv_class
from sglang.srt.mem_cache.common import kv_to_page_indices

PREFILL = "sgl-dp-prefill"


@pytest.fixture(scope="module")
def cluster(request):
    """Two prefill daemons (two nodes of one deployment) and a decode daemon."""
    yield from module_cluster(request, "pd", "pd2", "dd")


@pytest.fixture(scope="module")
def nixl_cluster(request):
    """The same three daemons, accepting NIXL alone."""
    yield from module_cluster(request, *(Node(n, env=ONLY_NIXL) for n in ("pd", "pd2", "dd")))


def dp_prefill(daemons, model, bport, *, seed, **server_args):
    """One prefill deployment of 2 attention-DP ranks (attention TP 1 each), DP rank k at daemons[k]."""
    return [make_rank("prefill", d, model, tp_rank=k, tp_size=2, attn_dp=(k, 2), page_size=4, num_pages=32,
                      port=free_port(), bootstrap_port=bport, seed=seed + k, **server_args)
            for k, d in enumerate(daemons)]


def resolve_dp_rank(decode_mgr, addr: str, room: int) -> int | None:
    """SGLang's decode prealloc queue: the room rule, or (None) ask the bootstrap server."""
    queue = object.__new__(DecodePreallocQueue)
    queue.kv_manager = decode_mgr
    host, port = addr.rsplit(":", 1)
    req = types.SimpleNamespace(bootstrap_host=host, bootstrap_port=int(port), bootstrap_room=room,
                                disagg_prefill_dp_rank=None)
    return queue._resolve_prefill_dp_rank(req)


def move(model, owner, decode, addr, req, resolve, *, tp_d, others, seed):
    """SGLang's sequence for one request that ran on prefill DP rank ``owner`` (its sender is
    built first, as the prefill side gets the request at once); decode's receivers are
    initialised with the DP rank ``resolve()`` finds; byte-exact check."""
    rng = random.Random(seed)
    before = [{k: v.clone() for k, v in d.buffers().items()} for d in decode]
    senders = new_senders([owner], addr, req)
    assert senders[0].poll() == KVPoll.Bootstrapping
    dp_rank = resolve()
    assert dp_rank == owner.manager.dp[0]
    receivers = []
    for d in decode:
        recv = get_kv_class(BACKEND, KVClassType.RECEIVER)(mgr=d.manager, bootstrap_addr=addr,
                                                          bootstrap_room=req.room)
        recv.init(dp_rank)
        pages = d.take_pages(-(-req.n_tokens // d.page_size), rng)
        slots = slots_of(pages, req.n_tokens, d.page_size)
        d.metadata.clear_slot(3)
        recv.send_metadata(kv_to_page_indices(slots, d.page_size), 3, [], decode_prefix_len=0)
        receivers.append((recv, slots))
    pslots = run_prefill([owner], senders, req, rng, chunk_ends=[9])
    for (recv, dslots), d, old in zip(receivers, decode, before):
        assert wait_poll(recv, {KVPoll.Success}) == KVPoll.Success, recv.failure
        want = expected_decode(d, old, dslots, [owner], pslots, req, model, 1, tp_d)
        assert any(not torch.equal(want[k], old[k]) for k in want), "the oracle expects no change"
        assert_bytes_equal(d.buffers(), want)
        for other in others:  # what the other DP rank's cache would have put there differs
            wrong = expected_decode(d, old, dslots, [other], pslots, req, model, 1, tp_d)
            assert any(not torch.equal(wrong[k], d.buffers()[k]) for k in wrong)
        assert int(d.metadata.bootstrap_room[3, 0]) == req.room
        assert int(d.metadata.output_ids[3, 0]) == req.first_token
    assert wait_poll(senders[0], {KVPoll.Success}) == KVPoll.Success, senders[0].failure


def test_dp_attention_prefill_routed_by_room(daemons, transport):
    """Prefill DP 2 on one daemon, decode TP 1: room r runs on DP rank r % 2 (SGLang's
    follow_bootstrap_room), decode resolves that rank with SGLang's code and its expect names
    it; each request lands byte-exact from the DP rank that ran it. A request whose room
    names the other DP rank is refused at the prefill sender."""
    model = Model()
    bport = free_port()
    server = bootstrap_server(bport)
    addr = f"127.0.0.1:{bport}"
    pd, dd = daemons.daemons["pd"], daemons.daemons["dd"]
    prefill = dp_prefill([pd, pd], model, bport, seed=700, load_balance_method="follow_bootstrap_room")
    decode = [make_rank("decode", dd, model, tp_rank=0, tp_size=1, page_size=4, num_pages=32,
                        port=free_port(), bootstrap_port=bport, seed=750)]
    try:
        assert [p.manager.dp for p in prefill] == [(0, 2), (1, 2)]
        assert [p.manager.geometry.tp_rank for p in prefill] == [0, 0]
        assert [p.manager.geometry.spec.tp_size for p in prefill] == [1, 1]  # attention TP of one DP rank
        with EngineClient(pd.socket_path) as kv:
            mine = {r["rank_id"]: r for r in kv.status()["ranks"] if r["rank_id"] in
                    {p.manager.rank_id for p in prefill}}
        assert sorted(r["instance"] for r in mine.values()) == [f"{prefill[0].manager.instance}@dp0",
                                                                f"{prefill[0].manager.instance}@dp1"]
        assert {r["dp_size"] for r in mine.values()} == {2}
        assert decode[0].manager.try_ensure_parallel_info(addr)
        info = decode[0].manager.prefill_info_table[addr]
        assert (info.dp_size, info.follow_bootstrap_room) == (2, True)
        for room in (7000, 7001):
            req = Request(room=room, n_tokens=19, first_token=room % 100)
            carried = Carried([pd], [dd])
            move(model, prefill[room % 2], decode, addr, req,
                 lambda: resolve_dp_rank(decode[0].manager, addr, req.room), tp_d=1,
                 others=[prefill[1 - room % 2]], seed=room)
            carried.assert_only(transport, kv_bytes(decode, req))
        stray = new_senders([prefill[1]], addr, Request(room=7002, n_tokens=8))[0]
        assert stray.poll() == KVPoll.Failed
        code, reason = stray.failure
        assert code == "dp_rank" and "implies prefill DP rank 0" in reason and "DP rank 1" in reason, stray.failure
    finally:
        close_all(*prefill, *decode)
        server.close()


def test_dp_ranks_on_two_daemons_routed_by_query(daemons, transport, monkeypatch):
    """Prefill DP rank 0 at one daemon and DP rank 1 at another (two nodes), both naming the
    first's daemon as rendezvous; round-robin DP routing, so the prefill sender posts the
    request's DP rank and decode (TP 2) asks the bootstrap server with SGLang's own query;
    the decode daemon learns DP rank 1's rank from the rendezvous and the KV lands byte-exact."""
    model = Model()
    bport = free_port()
    server = bootstrap_server(bport)
    addr = f"127.0.0.1:{bport}"
    pd, pd2, dd = daemons.daemons["pd"], daemons.daemons["pd2"], daemons.daemons["dd"]
    monkeypatch.setenv("KVXFERD_SGLANG_INSTANCE", PREFILL)
    monkeypatch.setenv("KVXFERD_SGLANG_RENDEZVOUS", pd.address)
    prefill = dp_prefill([pd, pd2], model, bport, seed=800, load_balance_method="round_robin")
    monkeypatch.delenv("KVXFERD_SGLANG_RENDEZVOUS")
    monkeypatch.delenv("KVXFERD_SGLANG_INSTANCE")
    dport = free_port()  # one decode deployment: its ranks share the port its instance name comes from
    decode = [make_rank("decode", dd, model, tp_rank=t, tp_size=2, page_size=4, num_pages=32,
                        port=dport, bootstrap_port=bport, seed=850 + t) for t in range(2)]
    try:
        assert [p.manager.rendezvous for p in prefill] == [pd.address, pd.address]
        assert [p.manager.own_address for p in prefill] == [pd.address, pd2.address]
        assert decode[0].manager.rendezvous is None  # one node: its own daemon
        for d in decode:
            assert d.manager.try_ensure_parallel_info(addr)
        info = decode[0].manager.prefill_info_table[addr]
        assert (info.instance, info.daemon_address, info.dp_size, info.follow_bootstrap_room) == (
            PREFILL, pd.address, 2, False)
        req = Request(room=8000, n_tokens=23, first_token=11)  # room % 2 is 0; it runs on DP rank 1

        def resolve() -> int:
            assert resolve_dp_rank(decode[0].manager, addr, req.room) is None  # not by room: SGLang asks
            found = CommonKVReceiver.query_prefill_dp_ranks(addr, [req.room, 8001])
            assert found == {str(req.room): 1}  # 8001 ran nowhere
            return found[str(req.room)]

        carried = Carried([pd, pd2], [dd])  # DP rank 1 (on pd2) sends it all, to both decode TP ranks
        move(model, prefill[1], decode, addr, req, resolve, tp_d=2, others=[prefill[0]], seed=req.room)
        carried.assert_only(transport, kv_bytes(decode, req))
    finally:
        close_all(*prefill, *decode)
        server.close()


def test_attention_context_parallel_refused(cluster):
    with EngineClient(cluster.daemons["pd"].socket_path) as kv:
        ranks_before = len(kv.status()["ranks"])
    with pytest.raises(RegistrationError) as info:
        make_rank("prefill", cluster.daemons["pd"], Model(), tp_rank=0, tp_size=2, page_size=4, num_pages=8,
                  port=free_port(), bootstrap_port=free_port(), attn_cp_size=2)
    assert info.value.field == "attn_cp_size" and "attn_cp_size is 2" in str(info.value)
    assert "attn_cp_size 1" in info.value.fix
    with EngineClient(cluster.daemons["pd"].socket_path) as kv:
        assert len(kv.status()["ranks"]) == ranks_before


def test_forced_query_files_every_request(cluster, monkeypatch):
    """SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK: even with the room rule a prefill
    sender files its DP rank (as SGLang's own senders do), and decode is told to query."""
    monkeypatch.setenv("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK", "1")
    bport = free_port()
    server = bootstrap_server(bport)
    addr = f"127.0.0.1:{bport}"
    pd = cluster.daemons["pd"]
    prefill = dp_prefill([pd, pd], Model(), bport, seed=900, load_balance_method="follow_bootstrap_room")
    try:
        assert [p.manager.follow_bootstrap_room for p in prefill] == [False, False]
        sender = new_senders([prefill[1]], addr, Request(room=9000, n_tokens=8))[0]  # room % 2 is 0
        assert sender.poll() == KVPoll.Bootstrapping  # not refused: it was filed instead
        assert CommonKVReceiver.query_prefill_dp_ranks(addr, [9000]) == {"9000": 1}
        sender.abort()
    finally:
        close_all(*prefill)
        server.close()


def test_dp_attention_decode_ranks_each_load_their_requests(daemons, transport):
    """Decode with attention DP 2 (each DP rank an attention-TP-1 pool of its own) from a
    prefill TP 2 without DP: each decode DP rank registers as a DP rank of the decode
    instance and loads the request SGLang gave it, byte-exact; the other DP rank's pool keeps
    its bytes."""
    model = Model()
    bport = free_port()
    server = bootstrap_server(bport)
    addr = f"127.0.0.1:{bport}"
    pd, dd = daemons.daemons["pd"], daemons.daemons["dd"]
    prefill = [make_rank("prefill", pd, model, tp_rank=t, tp_size=2, page_size=4, num_pages=32,
                         port=free_port(), bootstrap_port=bport, seed=950 + t) for t in range(2)]
    dport = free_port()
    decode = [make_rank("decode", dd, model, tp_rank=k, tp_size=2, attn_dp=(k, 2), page_size=4,
                        num_pages=32, port=dport, bootstrap_port=bport, seed=960 + k) for k in range(2)]
    try:
        assert [d.manager.dp for d in decode] == [(0, 2), (1, 2)]
        for k, d in enumerate(decode):
            assert d.manager.try_ensure_parallel_info(addr)
            assert d.manager.prefill_info_table[addr].dp_size == 1  # the prefill has no DP ranks
            other = decode[1 - k]
            untouched = {key: t.clone() for key, t in other.buffers().items()}
            rng = random.Random(k)
            req = Request(room=9100 + k, n_tokens=17, first_token=20 + k)
            before = {key: t.clone() for key, t in d.buffers().items()}
            carried = Carried([pd], [dd])
            senders = new_senders(prefill, addr, req)
            recv = get_kv_class(BACKEND, KVClassType.RECEIVER)(mgr=d.manager, bootstrap_addr=addr,
                                                              bootstrap_room=req.room)
            recv.init(0)  # SGLang's _resolve_prefill_dp_rank: dp_size 1 gives 0
            assert recv.prefill_dp_rank is None  # so the expect names no source DP rank
            pages = d.take_pages(5, rng)
            dslots = slots_of(pages, req.n_tokens, d.page_size)
            d.metadata.clear_slot(3)
            recv.send_metadata(kv_to_page_indices(dslots, d.page_size), 3, [], decode_prefix_len=0)
            pslots = run_prefill(prefill, senders, req, rng, chunk_ends=[8])
            assert wait_poll(recv, {KVPoll.Success}) == KVPoll.Success, recv.failure
            assert_bytes_equal(d.buffers(), expected_decode(d, before, dslots, prefill, pslots, req, model, 2, 1))
            assert_bytes_equal(other.buffers(), untouched)
            assert int(d.metadata.output_ids[3, 0]) == req.first_token
            for sender in senders:  # their sends are acknowledged, so counted on the prefill side too
                assert wait_poll(sender, {KVPoll.Success}) == KVPoll.Success, sender.failure
            carried.assert_only(transport, kv_bytes([d], req))  # this DP rank's pool alone
    finally:
        close_all(*prefill, *decode)
        server.close()


def test_multi_node_settings_give_node_zero_its_own_daemon_as_rendezvous(cluster):
    """``--nnodes 2 --node-rank 0 --dist-init-addr``: a node-0 rank names its own daemon's
    advertised address as the rendezvous (the daemon then keeps the instance's directory) and
    reaches the bootstrap server at the dist-init host. Other nodes' derivation (dist-init
    host, local peer port) needs a second host: test_sglang_topology.py checks the rule."""
    bport = free_port()
    server = bootstrap_server(bport)
    pd = cluster.daemons["pd"]
    rank = make_rank("prefill", pd, Model(), tp_rank=0, tp_size=1, page_size=4, num_pages=8, port=free_port(),
                     bootstrap_port=bport, nnodes=2, node_rank=0, dist_init_addr=f"localhost:{free_port()}")
    try:
        assert (rank.manager.rendezvous, rank.manager.daemon_address) == (pd.address, pd.address)
        # the dist-init host, not --host (127.0.0.1 here); it registered there (the manager exists)
        assert rank.manager.bootstrap_address() == f"localhost:{bport}"
        with EngineClient(pd.socket_path) as kv:
            status = kv.status()
        # the daemon keeps the instance's directory (it lists only instances it is the rendezvous of)
        assert status["rendezvous"]["rank_map"][f"{rank.manager.instance}/prefill"] == {"0.0": pd.address}
    finally:
        close_all(rank)
        server.close()

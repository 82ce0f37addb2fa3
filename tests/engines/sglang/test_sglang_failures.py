"""Failures through the SGLang backend: aborts from either side, a dead peer daemon, a head
count the handshake refuses, and the decode side's missing kv_head_num (sglang 0.5.23).

The abort after a chunk went out meets the data path: it runs over each transport
(``transport_util``), tcp and NIXL alone, and the other transport must carry nothing. The
rest run on tcp only: they end before any KV moves (refusals, aborts before a send,
registration), or, for the dead prefill daemon, end by the peer heartbeat's timeout, which
the daemon tests cover on NIXL (tests/test_nixl.py), at some 10 s a run."""

from __future__ import annotations

import random
import signal

import pytest
import torch

from sglang.srt.disaggregation.common.conn import KVTransferError
from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class
from sglang.srt.mem_cache.common import kv_to_page_indices

from harness import (KVPoll, Model, Request, bootstrap_server, close_all, free_port, make_rank, new_senders,
                     run_decode_until_metadata, slots_of, wait_poll)
from kvxferd.errors import GeometryError, RegistrationError
from kvxferd.sdk.client import EngineClient
from test_sglang_transfers import deployment
from transport_util import Carried, daemons, transport  # noqa: F401 - fixtures


def snapshot(rank):
    return {k: v.clone() for k, v in rank.buffers().items()}


def unchanged(rank, before) -> bool:
    return all(torch.equal(rank.buffers()[k].view(torch.uint8), v.view(torch.uint8)) for k, v in before.items())


@pytest.mark.parametrize("how", ["abort", "ensure_abort_notified"])
def test_abort_from_decode_reaches_prefill(cluster, how):
    """The decode scheduler ends a request with abort(), or, when it releases one that
    failed, with ensure_abort_notified(); both reach the prefill ranks through the daemons."""
    model = Model()
    server, prefill, decode, addr = deployment(cluster, model, tp_p=2, tp_d=1, seed=11)
    try:
        req = Request(room=5001 if how == "abort" else 5011, n_tokens=20)
        before = snapshot(decode[0])
        senders = new_senders(prefill, addr, req)
        [(recv, _)] = run_decode_until_metadata(decode, addr, req, random.Random(1))
        for s in senders:
            assert wait_poll(s, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
        assert recv.require_staging is False and recv.abort_notified is False
        if how == "abort":
            recv.abort()
        else:
            recv.ensure_abort_notified(force_arm=True)
            assert recv.abort_notified is False  # nothing to wait for: kvxferd fails only once writes stopped
        assert recv.poll() == KVPoll.Failed
        with pytest.raises(KVTransferError, match="code=aborted"):
            recv.failure_exception()
        for s in senders:
            assert wait_poll(s, {KVPoll.Success}) == KVPoll.Failed
            assert s.failure[0] == "aborted", s.failure
            with pytest.raises(KVTransferError, match="code=aborted"):
                s.failure_exception()
        assert unchanged(decode[0], before)
    finally:
        close_all(*prefill, *decode)
        server.close()


def only_on(carried: Carried, transport: str, at_most: int) -> None:
    """No transport but ``transport`` carried a byte, and it at most ``at_most`` each way (how much
    of the chunk went out before the abort depends on timing)."""
    got = carried.delta()
    assert all(v == 0 for k, v in got.items() if k.split("-")[1] != transport), got
    assert got[f"sent-{transport}"] <= at_most and got[f"received-{transport}"] <= at_most, (got, at_most)


def test_abort_from_prefill_after_a_chunk_reaches_decode(daemons, transport):
    model = Model()
    server, prefill, decode, addr = deployment(daemons, model, seed=12)
    carried = Carried([daemons.daemons["pd"]], [daemons.daemons["dd"]])
    try:
        req = Request(room=5002, n_tokens=24)
        [sender] = new_senders(prefill, addr, req)
        [(recv, _)] = run_decode_until_metadata(decode, addr, req, random.Random(2))
        assert wait_poll(sender, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
        sender.init(6, 5)
        slots = slots_of(prefill[0].take_pages(6, random.Random(3)), 24, 4)
        sender.send(kv_to_page_indices(slots[:8], 4), None, num_kv_tokens=8)  # a first chunk, not the last
        sender.abort()
        assert sender.poll() == KVPoll.Failed
        assert wait_poll(recv, {KVPoll.Success}) == KVPoll.Failed
        assert recv.failure[0] == "aborted", recv.failure
        assert int(decode[0].metadata.bootstrap_room[3, 0]) == 0  # no metadata row landed
        # the first chunk's rows at most: nothing past the chunk the sender was given
        only_on(carried, transport, 8 * sum(buf[0].nbytes for buf in decode[0].buffers().values()))
    finally:
        close_all(*prefill, *decode)
        server.close()


def test_dead_prefill_daemon_fails_decode(cluster):
    model = Model()
    dead = cluster.daemon("pd-dead")
    bport = free_port()
    server = bootstrap_server(bport)
    prefill = [make_rank("prefill", dead, model, tp_rank=0, tp_size=1, page_size=4, num_pages=16, port=free_port(),
                         bootstrap_port=bport, seed=13)]
    decode = [make_rank("decode", cluster.daemons["dd"], model, tp_rank=0, tp_size=1, page_size=4, num_pages=16,
                        port=free_port(), bootstrap_port=bport, seed=14)]
    addr = f"127.0.0.1:{bport}"
    try:
        req = Request(room=5003, n_tokens=12)
        before = snapshot(decode[0])
        [sender] = new_senders(prefill, addr, req)
        [(recv, _)] = run_decode_until_metadata(decode, addr, req, random.Random(4))
        assert wait_poll(sender, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
        dead.signal(signal.SIGKILL)
        dead.proc.wait(10)
        assert wait_poll(recv, {KVPoll.Success}) == KVPoll.Failed
        assert recv.failure[0] == "peer_dead", recv.failure
        assert unchanged(decode[0], before)
        assert sender.poll() == KVPoll.Failed  # its own daemon is gone: the call fails, typed
    finally:
        close_all(*prefill, *decode)
        server.close()


def test_head_count_mismatch_refused_at_handshake(cluster):
    """The decode side's expect is refused at the handshake, so it never reaches the prefill daemon;
    the prefill sender, polling Bootstrapping (SGLang sends nothing before WaitingForInput), still
    hears the refusal from the decode daemon: it polls Failed with the decode side's code and reason,
    and so does a sender of the request made after the refusal."""
    bport = free_port()
    server = bootstrap_server(bport)
    prefill = [make_rank("prefill", cluster.daemons["pd"], Model(total_kv_heads=4), tp_rank=0, tp_size=1,
                         page_size=4, num_pages=16, port=free_port(), bootstrap_port=bport, seed=15)]
    decode = [make_rank("decode", cluster.daemons["dd"], Model(total_kv_heads=2), tp_rank=0, tp_size=1,
                        page_size=4, num_pages=16, port=free_port(), bootstrap_port=bport, seed=16)]
    addr = f"127.0.0.1:{bport}"
    try:
        req = Request(room=5004, n_tokens=8)
        [sender] = new_senders(prefill, addr, req)
        assert sender.poll() == KVPoll.Bootstrapping
        [(recv, _)] = run_decode_until_metadata(decode, addr, req, random.Random(5))
        assert wait_poll(recv, {KVPoll.Success}) == KVPoll.Failed
        code, reason = recv.failure
        assert code == "incompatible" and "total_kv_heads" in reason, recv.failure
        assert wait_poll(sender, {KVPoll.WaitingForInput}) == KVPoll.Failed
        assert sender.failure == (code, reason)
        with pytest.raises(KVTransferError, match="code=incompatible"):
            sender.failure_exception()
        [late] = new_senders(prefill, addr, req)
        assert late.poll() == KVPoll.Failed and late.failure == (code, reason)
    finally:
        close_all(*prefill, *decode)
        server.close()


def test_decode_kv_head_num_gap_is_filled_from_the_pool_and_model(cluster):
    """sglang 0.5.23's DecodePreallocQueue._init_kv_manager leaves kv_head_num and
    total_kv_head_num unset without its staging buffer; the backend resolves them."""
    model = Model(total_kv_heads=4)
    rank = make_rank("decode", cluster.daemons["dd"], model, tp_rank=1, tp_size=2, page_size=4, num_pages=8,
                     port=free_port(), bootstrap_port=free_port(), seed=17)
    try:
        args = rank.manager.kv_args
        assert getattr(args, "kv_head_num", None) is None and getattr(args, "total_kv_head_num", None) is None
        spec = rank.manager.geometry.spec
        assert (spec.total_kv_heads, spec.local_heads, rank.manager.geometry.tp_rank) == (4, 2, 1)
    finally:
        close_all(rank)


def test_refused_at_manager_start_only_when_nothing_gives_the_heads(cluster):
    """One head per rank over TP 2 may be a replicated head, and neither KVArgs nor the model
    config says how many the model has: refused when the manager starts, naming field and fix,
    and nothing stays registered or in shared memory."""
    with EngineClient(cluster.daemons["dd"].socket_path) as kv:
        ranks_before = len(kv.status()["ranks"])
    with pytest.raises(GeometryError, match="Cannot resolve total_kv_heads") as info:
        make_rank("decode", cluster.daemons["dd"], Model(total_kv_heads=2), tp_rank=0, tp_size=2, page_size=4,
                  num_pages=8, port=free_port(), bootstrap_port=free_port(), give_heads=False)
    assert info.value.field == "total_kv_head_num" and "SGLANG_DISAGG_STAGING_BUFFER" in str(info.value)
    with EngineClient(cluster.daemons["dd"].socket_path) as kv:
        assert len(kv.status()["ranks"]) == ranks_before


def test_fake_backend_control_moves_nothing(cluster):
    """SGLang's own fake backend through the same call sequence reports Success but moves no
    byte: the byte checks of the kvxferd tests would catch a backend that did the same."""
    model = Model()
    server, prefill, decode, addr = deployment(cluster, model, seed=18)
    try:
        fake = TransferBackend.FAKE
        mgr_cls = get_kv_class(fake, KVClassType.MANAGER)
        before = snapshot(decode[0])
        dmgr = mgr_cls(decode[0].manager.kv_args, DisaggregationMode.DECODE, None, False)
        pmgr = mgr_cls(prefill[0].manager.kv_args, DisaggregationMode.PREFILL, None, False)
        recv = get_kv_class(fake, KVClassType.RECEIVER)(dmgr, addr, 6001)
        recv.init(0)
        recv.send_metadata(kv_to_page_indices(slots_of([1, 2, 3], 12, 4), 4), 3, [], 0)
        sender = get_kv_class(fake, KVClassType.SENDER)(pmgr, addr, 6001)
        sender.init(3, 5)
        sender.send(kv_to_page_indices(slots_of([4, 5, 6], 12, 4), 4), [], num_kv_tokens=12)
        assert sender.poll() == KVPoll.Success and recv.poll() == KVPoll.Success
        assert unchanged(decode[0], before)
    finally:
        close_all(*prefill, *decode)
        server.close()


def test_kvargs_point_into_kvxferd_shared_memory(cluster):
    """The real PrefillBootstrapQueue._init_kv_manager filled KVArgs after the hook moved the
    pool: its pointers, the pool's own pointer tables and the registered regions agree, and
    the shared-memory file's name is already gone (the daemon holds its mapping)."""
    model = Model(total_kv_heads=4)
    bport = free_port()
    server = bootstrap_server(bport)
    rank = make_rank("prefill", cluster.daemons["pd"], model, tp_rank=0, tp_size=2, page_size=4, num_pages=8,
                     port=free_port(), bootstrap_port=bport, seed=19)
    try:
        args = rank.manager.kv_args
        assert (args.kv_head_num, args.total_kv_head_num, args.page_size) == (2, 4, 4)
        k, v = rank.pool.k_buffer, rank.pool.v_buffer
        assert list(args.kv_data_ptrs) == [t.data_ptr() for t in k] + [t.data_ptr() for t in v]
        assert rank.pool.k_data_ptrs.tolist() == [t.data_ptr() for t in k]
        maps = open("/proc/self/maps").read().splitlines()
        ptr = k[0].data_ptr()
        [line] = [ln for ln in maps if int(ln.split()[0].split("-")[0], 16) <= ptr < int(ln.split()[0].split("-")[1], 16)]
        assert "/memfd:kvxferd-sglang-prefill-tp0-pp0-" in line and line.endswith("(deleted)")
        with EngineClient(cluster.daemons["pd"].socket_path) as kv:
            ranks = {r["rank_id"]: r for r in kv.status()["ranks"]}
        mine = ranks[rank.manager.rank_id]
        assert (mine["role"], mine["regions"], mine["geometry"]["num_pages"]) == ("prefill", 8, 8)
    finally:
        close_all(rank)
        server.close()


def test_prefill_rank_without_its_bootstrap_server_is_refused_and_unregistered(cluster, monkeypatch):
    monkeypatch.setenv("KVXFERD_SGLANG_BOOTSTRAP_WAIT_S", "0.5")
    with EngineClient(cluster.daemons["pd"].socket_path) as kv:
        ranks_before = len(kv.status()["ranks"])
    with pytest.raises(RegistrationError, match="could not register") as info:
        make_rank("prefill", cluster.daemons["pd"], Model(), tp_rank=0, tp_size=1, page_size=4, num_pages=8,
                  port=free_port(), bootstrap_port=free_port(), seed=20)
    assert info.value.field == "disaggregation_bootstrap_port"
    with EngineClient(cluster.daemons["pd"].socket_path) as kv:
        assert len(kv.status()["ranks"]) == ranks_before


@pytest.mark.parametrize("option,value", [("disaggregation_decode_allocation_policy", "prefill_complete")])
def test_unsupported_sglang_options_refused_at_start(cluster, option, value):
    with pytest.raises(RegistrationError) as info:
        make_rank("decode", cluster.daemons["dd"], Model(), tp_rank=0, tp_size=1, page_size=4, num_pages=8,
                  port=free_port(), bootstrap_port=free_port(), **{option: value})
    assert info.value.field == option and info.value.fix

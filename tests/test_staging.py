"""Staged mode: slot packing, the bounded pool, and staged transfers through daemons."""

from __future__ import annotations

import random
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from e2e_util import Node, assert_verified, close, finished, module_cluster, spec, transfer
from kvxferd.datapath.staging import StagingPool, block_bytes, pack
from kvxferd.errors import TransferError


@settings(max_examples=200, deadline=None)
@given(regions=st.integers(1, 6), tokens=st.integers(0, 40), slice_bytes=st.integers(1, 64),
       extra=st.integers(0, 200))
def test_pack_covers_every_slice_once_in_wire_order(regions, tokens, slice_bytes, extra):
    slot = slice_bytes + extra
    blocks = pack(regions, tokens, slice_bytes, slot)
    stream = []
    for block in blocks:
        assert 0 < block_bytes(block, slice_bytes) <= slot
        offset = 0
        for piece in block:
            assert piece.offset == offset  # pieces are contiguous inside a slot
            offset += (piece.hi - piece.lo) * slice_bytes
            stream.extend((piece.region, t) for t in range(piece.lo, piece.hi))
    assert stream == [(r, t) for r in range(regions) for t in range(tokens)]
    # slots are filled before a new one starts: only the last block may be short
    for block in blocks[:-1]:
        assert block_bytes(block, slice_bytes) == slot // slice_bytes * slice_bytes


def test_pack_refuses_a_slice_larger_than_a_slot():
    with pytest.raises(TransferError) as err:
        pack(2, 5, 100, 64)
    assert err.value.code == "staging_too_small" and err.value.field == "limits.staging_slot_bytes"
    assert "100" in str(err.value) and "64" in str(err.value)


def test_pool_is_bounded_and_makes_waiters_wait():
    waits = []
    pool = StagingPool(total_bytes=2 * 1024, slot_bytes=1024, on_wait=lambda: waits.append(1))
    a, b = pool.acquire(1), pool.acquire(1)
    assert pool.in_use == 2
    got = []

    def third() -> None:
        got.append(pool.acquire(5))

    t = threading.Thread(target=third)
    t.start()
    time.sleep(0.2)
    assert not got and waits == [1]  # blocked: the pool holds only two slots
    pool.release(a)
    t.join(5)
    assert got and got[0].data_ptr() == a.data_ptr()  # the freed slot is reused, nothing new allocated
    pool.release(b)
    pool.release(got[0])
    assert pool.in_use == 0


def test_sibling_pool_has_its_own_slot_size_under_the_same_byte_bound():
    waits = []
    tcp = StagingPool(total_bytes=6 * 1024, slot_bytes=4 * 1024, on_wait=lambda: waits.append("tcp"))
    nixl = tcp.sibling(2 * 1024)
    assert (tcp.capacity, nixl.capacity) == (1, 3)  # 6 KiB each: one 4 KiB slot, three 2 KiB slots
    held = [nixl.acquire(1) for _ in range(3)]
    assert {t.numel() for t in held} == {2 * 1024} and tcp.in_use == 0
    with pytest.raises(TransferError):
        nixl.acquire(0.01)  # bounded: a fourth slot would pass the byte bound
    assert waits == ["tcp"]  # its waits count where the first pool's do
    for t in held:
        nixl.release(t)


def test_pool_times_out_with_a_clear_error():
    pool = StagingPool(total_bytes=1024, slot_bytes=1024)
    held = pool.acquire(1)
    with pytest.raises(TransferError) as err:
        pool.acquire(0.1)
    assert err.value.code == "staging_timeout" and err.value.field == "limits.staging_bytes"
    pool.release(held)


SMALL_POOL = "[limits]\nstaging_bytes = 512\nstaging_slot_bytes = 256\n"


@pytest.fixture(scope="module")
def staged_cluster(request):
    env = {"KVXFERD_PEER_MODE": "staged"}
    yield from module_cluster(request, Node("prefill-node", SMALL_POOL, env), Node("decode-node", SMALL_POOL, env))


@pytest.mark.parametrize("pspec, dspec, chunks", [
    (spec(tp_size=2), spec(), [[0, 12], [12, 29]]),
    (spec(), spec(tp_size=2), None),
    (spec(tp_size=4, total_kv_heads=2), spec(total_kv_heads=2), [[0, 8], [8, 29]]),
], ids=["tp2-to-tp1-chunked", "tp1-to-tp2", "tp4-replicated-to-tp1-chunked"])
def test_staged_transfers_with_a_pool_small_enough_to_wait(staged_cluster, pspec, dspec, chunks):
    pd, dd = staged_cluster.daemons["prefill-node"], staged_cluster.daemons["decode-node"]
    tag = f"{pspec.tp_size}-{dspec.tp_size}-{bool(chunks)}"
    prefill = staged_cluster.instance(pd, f"sp-{tag}", "prefill", pspec, 32)
    decode = staged_cluster.instance(dd, f"sd-{tag}", "decode", dspec, 32)
    rng = random.Random(tag)
    try:
        # several requests in flight at once, so writers compete for two slots
        ids = [f"st-{tag}-{i}" for i in range(4)]
        # disjoint pages per request on both sides: requests are in flight together
        plans = {rid: (rng.sample(range(i * 8, i * 8 + 8), 8), rng.sample(range(i * 8, i * 8 + 8), 8))
                 for i, rid in enumerate(ids)}
        for rid, (src, dst) in plans.items():
            for w in decode:
                w.command(cmd="expect", request_id=rid, pages=dst, n=29, source_instance=prefill[0].instance,
                          source_address=pd.address)
        for rid, (src, dst) in plans.items():
            for w in prefill:
                w.command(cmd="send", request_id=rid, pages=src, n=29, chunks=chunks)
        for rid in ids:
            assert_verified([finished(w, rid) for w in decode], [finished(w, rid) for w in prefill])
    finally:
        close(prefill + decode)


def test_chunk_that_can_never_fit_fails_only_its_own_request(staged_cluster):
    pd, dd = staged_cluster.daemons["prefill-node"], staged_cluster.daemons["decode-node"]
    big_p = staged_cluster.instance(pd, "big-p", "prefill", spec(tp_size=2, head_dim=128), 16)
    big_d = staged_cluster.instance(dd, "big-d", "decode", spec(head_dim=128), 16)
    small_p = staged_cluster.instance(pd, "small-p", "prefill", spec(tp_size=2, head_dim=8), 16)
    small_d = staged_cluster.instance(dd, "small-d", "decode", spec(head_dim=8), 16)
    try:
        # a 2-head slice of head_dim 128 in bf16 is 512 bytes: larger than a 256-byte slot
        dec, pre = transfer(big_p, big_d, "big-1", 9, src_pages=[1, 2, 3], dst_pages=[4, 5, 6],
                            source_address=pd.address)
        assert dec[0]["state"] == "failed" and dec[0]["code"] == "staging_too_small", dec
        assert "staging_slot_bytes" in dec[0]["reason"]
        dec, pre = transfer(small_p, small_d, "small-1", 9, src_pages=[1, 2, 3], dst_pages=[4, 5, 6],
                            source_address=pd.address)
        assert_verified(dec, pre)
    finally:
        close(big_p + big_d + small_p + small_d)

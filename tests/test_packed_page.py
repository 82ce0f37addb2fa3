"""The packed_page layout (vLLM's CPU attention): geometry, segments, plan, and real transfers.

A packed region is ``[pages, heads, 2 * page_size * head_dim]``: per (page, head) one opaque
unit (K transposed, then V). The oracles here own whole (page, head) units and never ask
the planner or the segment code what should land where.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e2e_util import close, finished, module_cluster
from e2e_util import run_case as _run_case
from kvxferd.errors import GeometryError, PlanRefusal, RequestError
from kvxferd.model.geometry import InstanceSpec, RankGeometry
from kvxferd.model.planner import make_plan
from kvxferd.model.segments import (check_whole_pages, clip_slots, paired_segments, slot_count, slots,
                                    unit_slots)
from kvxferd.sdk.client import DaemonError, EngineClient
from kvxferd.sdk.kv_cache import allocate_cpu, region_shape

NUM_PAGES = 24
_ids = itertools.count()


def packed(**overrides) -> InstanceSpec:
    base = dict(attention="mha", num_layers=3, total_kv_heads=4, head_dim=16, dtype="bfloat16", page_size=8,
                layout="packed_page")
    base.update(overrides)
    return InstanceSpec(**base)


# -- geometry and segments -----------------------------------------------------------------

def test_geometry_of_a_packed_rank():
    s = packed(tp_size=2)
    assert s.region_kinds == ("kv",)
    assert s.slot_tokens == 8
    unit = 2 * 8 * 16 * 2  # K and V of 8 tokens of one 16-wide bf16 head
    assert s.head_slot_bits == unit * 8
    assert s.row_bytes == s.page_bytes == 2 * unit  # 2 local heads
    geo = RankGeometry(s, 1, 0, 5)
    assert geo.region_bytes == 5 * 2 * unit
    assert geo.region_names() == [(0, "kv"), (1, "kv"), (2, "kv")]
    assert region_shape(geo) == (5, 2, 8, 32)  # vLLM's [num_blocks, heads, block_size, 2 * head_size]
    with allocate_cpu(geo, name="packed-geo") as cache:
        assert tuple(cache.tensors[(2, "kv")].shape) == (5, 2, 8, 32)
        assert cache.descriptors()[0]["nbytes"] == geo.region_bytes


def test_packed_is_mha_only():
    with pytest.raises(GeometryError) as err:
        InstanceSpec("mla", 2, 64, "bfloat16", 8, layout="packed_page")
    assert err.value.field == "layout" and "'mla'" in str(err.value) and "NHD" in err.value.fix


def test_nhd_geometry_is_unchanged():
    s = InstanceSpec("mha", 2, 16, "bfloat16", 8, total_kv_heads=4)
    assert (s.slot_tokens, s.row_bytes, s.page_bytes, s.region_kinds) == (1, 4 * 16 * 2, 8 * 4 * 16 * 2, ("k", "v"))


def test_token_ranges_become_whole_pages():
    s = packed()
    table = np.array([9, 4, 7, 1], dtype=np.int64)
    assert unit_slots(s, table, 0, 30).tolist() == [9, 4, 7, 1]  # the partial last page moves whole
    assert unit_slots(s, table, 8, 17).tolist() == [4, 7]
    assert unit_slots(s, table[1:], 8, 16, origin=8).tolist() == [4]  # a chunk's own table
    assert unit_slots(s, table, 5, 5).size == 0
    assert [slot_count(s, a, b) for a, b in ((0, 30), (8, 17), (16, 24), (3, 3))] == [4, 2, 1, 0]
    with pytest.raises(RequestError) as err:
        unit_slots(s, table, 0, 33)
    assert err.value.field == "pages"
    chunk = unit_slots(s, table, 0, 30)
    assert clip_slots(chunk, s, 0, 16).tolist() == [7, 1]
    nhd = InstanceSpec("mha", 1, 16, "bfloat16", 8, total_kv_heads=4)
    assert np.array_equal(unit_slots(nhd, table, 3, 12), slots(table, 8, 3, 12))  # NHD: token rows as before
    assert slot_count(nhd, 3, 12) == 9


def test_chunk_boundaries_must_be_pages():
    s = packed()
    check_whole_pages(s, 0, 16, False)
    check_whole_pages(s, 16, 21, True)  # only the last chunk may end mid-page
    with pytest.raises(RequestError) as err:
        check_whole_pages(s, 0, 12, False)
    assert err.value.field == "end" and "12" in str(err.value) and "page_size 8" in str(err.value)
    assert "multiples of page_size 8" in err.value.fix
    with pytest.raises(RequestError) as err:
        check_whole_pages(s, 4, 16, True)
    assert err.value.field == "start" and "token 4" in str(err.value)
    check_whole_pages(InstanceSpec("mha", 1, 16, "bfloat16", 8, total_kv_heads=4), 3, 5, False)  # NHD: any


def test_tp_mismatch_moves_contiguous_head_slices_of_pages():
    plan = make_plan(packed(tp_size=2), packed())
    (dest,) = plan.destinations
    unit = 2 * 8 * 16 * 2
    assert [(w.tp_rank, w.heads, w.dst_head_offset, w.slice_bytes) for w in dest.writers] == \
        [(0, (0, 2), 0, 2 * unit), (1, (2, 4), 2, 2 * unit)]
    w = dest.writers[1]
    segs = paired_segments(np.array([3, 0]), np.array([5, 2]), w)
    # one contiguous run per page: source page p, whole row; destination page q, heads [2, 4)
    assert segs.src.tolist() == [3 * 2 * unit, 0] and segs.dst.tolist() == [5 * 4 * unit + 2 * unit, 2 * 4 * unit + 2 * unit]
    assert segs.lengths.tolist() == [2 * unit, 2 * unit]
    assert plan.fragments_per_page() == 2  # two writers, one piece each


# -- an independent oracle over (page, head) units, through plan + segments ----------------

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@given(heads=st.sampled_from([1, 2, 4, 8]), tp_p=st.sampled_from([1, 2, 4, 8]), tp_d=st.sampled_from([1, 2, 4, 8]),
       page_size=st.sampled_from([1, 2, 4, 16]), n_pages=st.integers(1, 6), tail=st.integers(0, 15),
       cut_pages=st.lists(st.integers(1, 5), unique=True, max_size=3), start_pages=st.integers(0, 5),
       seed=st.integers(0, 2**31))
@PROPERTY
def test_packed_transfer_property(heads, tp_p, tp_d, page_size, n_pages, tail, cut_pages, start_pages, seed):
    if not all(heads % t == 0 or t % heads == 0 for t in (tp_p, tp_d)):
        return
    n_tokens = (n_pages - 1) * page_size + 1 + tail % page_size  # the last page may be partial
    start = min(start_pages, n_pages - 1) * page_size
    p, d = packed(total_kv_heads=heads, tp_size=tp_p, page_size=page_size, head_dim=2, dtype="int8", num_layers=1), \
        packed(total_kv_heads=heads, tp_size=tp_d, page_size=page_size, head_dim=2, dtype="int8", num_layers=1)
    plan = make_plan(p, d)
    unit = 2 * page_size * 2
    rng = np.random.default_rng(seed)
    logical = rng.integers(0, 256, size=(n_pages, heads, unit), dtype=np.uint8)  # [page, head, unit]

    def ref_heads(total, tp, rank):
        if tp <= total:
            return rank * (total // tp), (rank + 1) * (total // tp)
        h = rank // (tp // total)
        return h, h + 1

    pool = n_pages + 3
    src_tables, src_regions = {}, {}
    for tp in range(tp_p):
        table = rng.permutation(pool)[:n_pages]
        h0, h1 = ref_heads(heads, tp_p, tp)
        region = rng.integers(0, 256, size=(pool, h1 - h0, unit), dtype=np.uint8)
        region[table] = logical[:, h0:h1]
        src_tables[tp], src_regions[tp] = table, region.reshape(-1)
    for tp_dst in range(tp_d):
        table = rng.permutation(pool)[:n_pages]
        h0, h1 = ref_heads(heads, tp_d, tp_dst)
        region = np.full((pool, h1 - h0, unit), 0xA5, dtype=np.uint8)
        flat = region.reshape(-1)
        cuts = sorted({0, n_tokens, *(c * page_size for c in cut_pages if c * page_size < n_tokens)})
        for w in plan.destination(tp_dst, 0).writers:
            for a, b in zip(cuts, cuts[1:]):
                if b <= start:
                    continue
                a2 = max(a, start)
                src = clip_slots(unit_slots(p, src_tables[w.tp_rank][a // page_size:], a, b, a), p, a, a2)
                dst = unit_slots(d, table, a2, b, 0)
                segs = paired_segments(src, dst, w)
                for s_off, d_off, n in zip(segs.src, segs.dst, segs.lengths):
                    flat[d_off:d_off + n] = src_regions[w.tp_rank][s_off:s_off + n]
        first = start // page_size
        assert np.array_equal(region[table[first:]], logical[first:, h0:h1])
        untouched = np.setdiff1d(np.arange(pool), table[first:])
        assert (region[untouched] == 0xA5).all()


# -- planner refusals ----------------------------------------------------------------------

def test_packed_page_sizes_must_match():
    with pytest.raises(PlanRefusal) as err:
        make_plan(packed(page_size=16), packed(page_size=32))
    e = err.value
    assert e.field == "page_size" and (e.prefill_value, e.decode_value) == (16, 32)
    assert "16" in e.message and "32" in e.message and "whole" in e.fix


def test_packed_and_nhd_do_not_pair():
    nhd = InstanceSpec("mha", 3, 16, "bfloat16", 8, total_kv_heads=4)
    for prefill, decode in ((packed(), nhd), (nhd, packed())):
        with pytest.raises(PlanRefusal) as err:
            make_plan(prefill, decode)
        e = err.value
        assert e.field == "layout" and {e.prefill_value, e.decode_value} == {"packed_page", "NHD"}
        assert "'packed_page'" in e.message and "'NHD'" in e.message and e.fix


# -- real daemons, real engine processes ---------------------------------------------------

@pytest.fixture(scope="module")
def cluster(request):
    yield from module_cluster(request, "prefill-node", "decode-node")


def run_case(cluster, pspec, dspec, *, transport="tcp", n_tokens, chunks=None, requests=2):
    """Byte-exact requests (the first with aux bytes); pages never a destination keep the canary, and
    nothing outside the requests' whole pages changed: not the padding between regions, not another
    layer's region, not another page."""
    def whole_pages_only(decode, moved):
        for w in decode:
            report = canary(w, moved)
            assert report["outside_bytes"] == 0, report
            assert set(report["changed_pages"]) == {p for dst, _ in moved for p in dst}

    _run_case(cluster, pspec, dspec, transport=transport, n_tokens=n_tokens, chunks=chunks, requests=requests,
              aux=b"pk", tag="pk-", num_pages=NUM_PAGES, check=whole_pages_only)


def canary(worker, allowed):
    worker.command(cmd="canary", allowed=allowed)
    while True:
        ev = worker.next_event(60)
        if ev.get("event") == "canary":
            return ev
        assert ev.get("event") != "exit", "worker exited"


@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_packed_tp2_to_tp1(cluster, transport):
    run_case(cluster, packed(tp_size=2), packed(), transport=transport, n_tokens=29)


def test_packed_tp1_to_tp2(cluster):
    run_case(cluster, packed(), packed(tp_size=2), n_tokens=21)


def test_packed_tp2_to_tp1_wide_head_slices(cluster):
    """Head slices of 8 KiB: the plan goes direct and tcp moves them straight from page views."""
    wide = dict(head_dim=64, dtype="float32", page_size=16, num_layers=2)
    assert make_plan(packed(tp_size=2, **wide), packed(**wide)).mode == "direct"
    run_case(cluster, packed(tp_size=2, **wide), packed(**wide), n_tokens=40)


def test_packed_tp2_to_tp1_chunked_on_page_boundaries(cluster):
    run_case(cluster, packed(tp_size=2), packed(), n_tokens=37, chunks=[[0, 16], [16, 37]])


def test_packed_mid_page_chunk_boundary_is_refused(cluster):
    pd = cluster.daemons["prefill-node"]
    (w,) = cluster.instance(pd, f"pp{next(_ids)}", "prefill", packed(), NUM_PAGES)
    try:
        w.command(cmd="send", request_id="pk-mid", pages=[1, 2, 3], n=20, chunks=[[0, 12], [12, 20]])
        ev = finished(w, "pk-mid")
        assert ev["event"] == "error" and ev["field"] == "end", ev
        assert "ends at token 12" in ev["error"] and "page_size 8" in ev["error"]
        assert "multiples of page_size 8" in ev["error"]
    finally:
        close([w])


def test_packed_decode_start_must_be_page_aligned(cluster):
    dd = cluster.daemons["decode-node"]
    geo = RankGeometry(packed(), 0, 0, 4)
    with allocate_cpu(geo, name="pk-start") as cache, EngineClient(dd.socket_path) as client:
        rank = client.register("pk-start-d", "decode", geo, cache.descriptors())
        with pytest.raises(DaemonError) as err:
            client.expect(rank, "pk-s", source_instance="x", pages=[0, 1, 2], num_tokens=20, start=12)
        assert err.value.field == "start" and "start 12" in str(err.value) and "page_size 8" in str(err.value)
        assert "(8)" in str(err.value)  # the page boundary to round down to


def _refused_at_handshake(cluster, pspec, dspec, request_id):
    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    tag = next(_ids)
    prefill = cluster.instance(pd, f"pp{tag}", "prefill", pspec, NUM_PAGES)
    decode = cluster.instance(dd, f"pd{tag}", "decode", dspec, NUM_PAGES)
    try:
        for w in decode:
            w.command(cmd="expect", request_id=request_id, pages=[0, 1, 2], n=20,
                      source_instance=prefill[0].instance, source_address=pd.address)
        return [finished(w, request_id) for w in decode]
    finally:
        close(prefill + decode)


def test_packed_page_size_mismatch_refused_at_handshake(cluster):
    (ev,) = _refused_at_handshake(cluster, packed(page_size=8), packed(page_size=16), "pk-ps")
    assert ev["state"] == "failed" and ev["code"] == "incompatible", ev
    assert "page_size differs: prefill has 8, decode has 16" in ev["reason"]


def test_packed_vs_nhd_refused_at_handshake(cluster):
    nhd = InstanceSpec("mha", 3, 16, "bfloat16", 8, total_kv_heads=4)
    (ev,) = _refused_at_handshake(cluster, packed(), nhd, "pk-layout")
    assert ev["state"] == "failed" and ev["code"] == "incompatible", ev
    assert "layout differs: prefill has 'packed_page', decode has 'NHD'" in ev["reason"]


def test_vllm_cpu_cache_shared_and_described_moves_byte_exact(cluster):
    """vLLM's CPU layer tensors (views of one storage, K^T then V per block and head), put in
    shared memory with share_in_place and registered with describe_tensors."""
    from kvxferd.sdk.engine_memory import describe_tensors, share_in_place

    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    s = packed(num_layers=2, total_kv_heads=2, head_dim=32, dtype="float32", page_size=32)
    blocks, heads, bs, hd = 6, 2, 32, 32

    def engine(name):
        raw = torch.zeros(2 * blocks * heads * bs * 2 * hd)  # one allocation, like vLLM's
        layers = [raw.view(2, blocks, heads, bs, 2 * hd)[i] for i in range(2)]
        pool = share_in_place(layers, name=name)
        return layers, pool

    src_layers, src_pool = engine("pk-vllm-p")
    dst_layers, dst_pool = engine("pk-vllm-d")
    g = torch.Generator().manual_seed(5)
    for t in src_layers:
        t.copy_(torch.randn(t.shape, generator=g))
    pc, dc = EngineClient(pd.socket_path), EngineClient(dd.socket_path)
    try:
        geo = RankGeometry(s, 0, 0, blocks)
        p_rank = pc.register("pk-vllm-p", "prefill", geo, describe_tensors({(i, "kv"): t for i, t in enumerate(src_layers)}))
        d_rank = dc.register("pk-vllm-d", "decode", geo, describe_tensors({(i, "kv"): t for i, t in enumerate(dst_layers)}))
        n, src_blocks, dst_blocks = 40, [4, 1], [2, 5]
        dc.expect(d_rank, "pk-v", source_instance="pk-vllm-p", source_address=pd.address, pages=dst_blocks, num_tokens=n)
        pc.send(p_rank, "pk-v", pages=src_blocks, start=0, end=n, last=True)
        assert dc.wait(d_rank, "pk-v", timeout=60)["state"] == "done"
        assert pc.wait(p_rank, "pk-v", timeout=60)["state"] == "done"
        for src, dst in zip(src_layers, dst_layers):
            for sb, db in zip(src_blocks, dst_blocks):
                assert torch.equal(dst[db], src[sb])  # whole blocks, every head, K^T and V
            for other in (0, 1, 3, 4):
                assert int(dst[other].count_nonzero()) == 0
        # a prefix of one block already on the decode side: the prefill sends all three blocks in
        # chunks on block boundaries, only blocks 2 and 3 of the request land
        for t in dst_layers:
            t.fill_(7.0)
        n, src_blocks, dst_blocks = 80, [0, 3, 5], [4, 1, 3]
        dc.expect(d_rank, "pk-v2", source_instance="pk-vllm-p", source_address=pd.address, pages=dst_blocks,
                  num_tokens=n, start=32)
        for a, b, last in ((0, 32, False), (32, 64, False), (64, 80, True)):
            pc.send(p_rank, "pk-v2", pages=src_blocks[a // 32:-(-b // 32)], start=a, end=b, last=last)
        assert dc.wait(d_rank, "pk-v2", timeout=60)["state"] == "done"
        assert pc.wait(p_rank, "pk-v2", timeout=60)["state"] == "done"
        for src, dst in zip(src_layers, dst_layers):
            assert bool((dst[4] == 7.0).all())  # the cached block is untouched
            assert torch.equal(dst[1], src[3]) and torch.equal(dst[3], src[5])
            assert all(bool((dst[b] == 7.0).all()) for b in (0, 2, 5))
    finally:
        pc.close()
        dc.close()
        src_pool.close()
        dst_pool.close()

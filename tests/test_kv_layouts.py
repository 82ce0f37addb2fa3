"""The layouts vLLM's GPU backends use, in kvxferd's core: ``NHD_kv``, ``HND_kv`` and strided pages.

``NHD_kv``: one region per layer of token rows, each head's K then V (vLLM LBNHC).
``HND_kv``: one region per layer of head-major pages (vLLM LBHNC), moved like packed_page.
``page_stride``: a rank whose pages are not back to back (vLLM's block-outer layouts put
every layer's page of a block together). The oracles are index arithmetic written here
and the simulated engines' own byte oracle; none asks the segment code where bytes go.
vLLM's own views of these layouts are tested in tests/engines/vllm/test_vllm_gpu_layouts.py.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from e2e_util import module_cluster
from e2e_util import run_case as _run_case
from kvxferd.datapath.regions import MemoryMapper
from kvxferd.errors import GeometryError, RegistrationError
from kvxferd.model.geometry import InstanceSpec, RankGeometry
from kvxferd.model.planner import make_plan
from kvxferd.model.segments import page_slots, slots, unit_slots
from kvxferd.sdk.client import EngineClient
from kvxferd.sdk.engine_memory import describe_tensors, share_in_place
from kvxferd.sdk.kv_cache import allocate_cpu, region_shape

NUM_PAGES = 20
_ids = itertools.count()


def kv(layout: str = "NHD_kv", **overrides) -> InstanceSpec:
    base = dict(attention="mha", num_layers=3, total_kv_heads=4, head_dim=8, dtype="float16", page_size=8,
                layout=layout)
    base.update(overrides)
    return InstanceSpec(**base)


# -- geometry --------------------------------------------------------------------------------

def test_nhd_kv_rows_hold_k_and_v_of_every_head():
    s = kv(tp_size=2)
    assert s.region_kinds == ("kv",) and s.slot_tokens == 1 and not s.packed
    assert s.head_slot_bits == 2 * 8 * 16  # K and V of one fp16 head of width 8
    assert s.row_bytes == 2 * 32 and s.page_bytes == 8 * 64
    geo = RankGeometry(s, 1, 0, 5)
    assert region_shape(geo) == (5, 8, 2, 16)  # vLLM's LBNHC block: [block_size, heads, 2 * head_size]
    assert geo.region_names() == [(0, "kv"), (1, "kv"), (2, "kv")]


def test_hnd_kv_is_moved_like_packed_pages():
    s, p = kv("HND_kv"), kv("packed_page")
    assert s.packed and s.slot_tokens == 8
    assert (s.row_bytes, s.page_bytes, s.head_slot_bits) == (p.row_bytes, p.page_bytes, p.head_slot_bits)
    assert region_shape(RankGeometry(s, 0, 0, 3)) == (3, 4, 8, 16)  # [blocks, heads, block_size, 2 * head]


@pytest.mark.parametrize("layout", ["NHD_kv", "HND_kv"])
def test_kv_layouts_are_mha_only(layout):
    with pytest.raises(GeometryError) as err:
        InstanceSpec("mla", 2, 64, "bfloat16", 8, layout=layout)
    assert err.value.field == "layout" and repr(layout) in str(err.value)


def test_page_stride_is_checked_and_dense_is_the_default():
    s = kv()
    dense = RankGeometry(s, 0, 0, 4, page_stride=s.page_bytes)
    assert dense.page_stride is None and dense.slot_pitch is None and dense.region_bytes == 4 * s.page_bytes
    strided = RankGeometry(s, 0, 0, 4, page_stride=3 * s.page_bytes)
    assert s.row_bytes == 128 and strided.slot_pitch == 3 * 8 and strided.region_bytes == 3 * 3 * s.page_bytes + s.page_bytes
    back = RankGeometry.from_dict(strided.to_dict())
    assert back.page_stride == 3 * s.page_bytes and back.to_dict() == strided.to_dict()
    with pytest.raises(GeometryError) as err:
        RankGeometry(s, 0, 0, 4, page_stride=s.page_bytes - 64)
    assert err.value.field == "page_stride" and f">= {s.page_bytes}" in str(err.value)
    with pytest.raises(GeometryError) as err:
        RankGeometry(s, 0, 0, 4, page_stride=s.page_bytes + 2)
    assert err.value.field == "page_stride" and "multiple of one slot (128 bytes)" in str(err.value)
    with pytest.raises(GeometryError) as err:  # a packed slot is a page: strides are whole pages
        RankGeometry(kv("HND_kv"), 0, 0, 4, page_stride=kv("HND_kv").page_bytes + 64)
    assert err.value.field == "page_stride"


def test_pitched_slots_follow_the_page_stride():
    rng = random.Random(3)
    for _ in range(200):
        ps = rng.choice([1, 4, 8])
        pitch = rng.choice([None, ps, ps * 2, ps * 3 + 5])
        pages = np.array(rng.sample(range(30), 6), dtype=np.int64)
        origin = rng.randrange(0, 2 * ps) // ps * ps
        start = origin + rng.randrange(0, ps)
        end = rng.randrange(start, origin + 6 * ps + 1)
        want = [int(pages[(t - origin) // ps]) * (pitch or ps) + t % ps for t in range(start, end)]
        assert slots(pages, ps, start, end, origin, pitch).tolist() == want
    pages = np.array([4, 0, 7])
    assert page_slots(pages, 8, 0, 20, 0, 3).tolist() == [12, 0, 21]
    assert unit_slots(kv("HND_kv"), pages, 8, 20, 0, 3).tolist() == [0, 21]


def test_mapper_bounds_account_for_the_stride(tmp_path):
    s = InstanceSpec("mha", 2, 8, "float16", 4, total_kv_heads=2)
    geo = RankGeometry(s, 0, 0, 3, page_stride=4 * s.page_bytes)
    span = 2 * 4 * s.page_bytes + s.page_bytes
    path = tmp_path / "kv"
    path.write_bytes(b"\0" * (span + 3 * s.page_bytes))
    mapper = MemoryMapper([str(tmp_path)])
    names = geo.region_names()
    ok = [{"layer": layer, "kind": kind, "mem": "shm", "path": str(path), "offset": i * s.page_bytes,
           "nbytes": span} for i, (layer, kind) in enumerate(names)]
    mapped = mapper.map_regions(geo, ok)
    assert all(m.nbytes == span for m in mapped.values())
    dense = [dict(r, nbytes=3 * s.page_bytes) for r in ok]
    with pytest.raises(RegistrationError) as err:
        mapper.map_regions(geo, dense)
    assert err.value.field == "regions.nbytes" and f"every {4 * s.page_bytes} bytes" in str(err.value)
    past = [dict(r, offset=4 * s.page_bytes) for r in ok]
    with pytest.raises(RegistrationError) as err:
        mapper.map_regions(geo, past)
    assert err.value.field == "regions.offset"


def test_plans_pair_kv_layouts_only_with_themselves():
    assert make_plan(kv(tp_size=2), kv(page_size=16)).destinations  # re-cut pages, head slices
    with pytest.raises(Exception) as err:
        make_plan(kv(), kv("HND_kv"))
    assert "layout differs: prefill has 'NHD_kv', decode has 'HND_kv'" in str(err.value)
    with pytest.raises(Exception) as err:
        make_plan(kv("HND_kv"), kv("HND_kv", page_size=16))
    assert "page_size differs: prefill has 8, decode has 16" in str(err.value)


# -- real daemons, simulated engines ---------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(request):
    yield from module_cluster(request, "prefill-node", "decode-node")


def run_case(cluster, pspec, dspec, *, n_tokens, chunks=None):
    """One request, byte-exact; pages that were not its destination keep the canary."""
    _run_case(cluster, pspec, dspec, n_tokens=n_tokens, chunks=chunks, requests=1, tag="kl-", num_pages=NUM_PAGES)


def test_nhd_kv_tp2_to_tp1_with_page_size_mismatch(cluster):
    run_case(cluster, kv(tp_size=2, page_size=4), kv(page_size=16), n_tokens=37, chunks=[[0, 13], [13, 37]])


def test_hnd_kv_tp1_to_tp2(cluster):
    run_case(cluster, kv("HND_kv"), kv("HND_kv", tp_size=2), n_tokens=29, chunks=[[0, 16], [16, 29]])


def test_strided_prefill_pages_move_byte_exact(cluster):
    """A prefill rank whose layers' pages are interleaved block by block (page_stride = layers x
    kinds x page) sends to a dense decode rank; K and V regions, 8- and 4-token pages."""
    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    spec8 = InstanceSpec("mha", 2, 8, "float16", 8, total_kv_heads=2)
    spec4 = InstanceSpec("mha", 2, 8, "float16", 4, total_kv_heads=2)
    blocks, page = 6, spec8.page_bytes
    raw = torch.randint(0, 256, (blocks, 2, 2, page), dtype=torch.uint8)  # [block, layer, kind, page]
    pool = share_in_place([raw], name="kl-strided")
    names = [(layer, kind) for layer in range(2) for kind in ("k", "v")]
    geo = RankGeometry(spec8, 0, 0, blocks, page_stride=4 * page)
    span = geo.region_bytes
    flat = raw.view(-1)
    regions = describe_tensors({(layer, kind): flat[i * page:i * page + span] for i, (layer, kind) in
                                enumerate(names)})
    dense_geo = RankGeometry(spec4, 0, 0, 2 * blocks)
    tag = next(_ids)
    with allocate_cpu(dense_geo, name="kl-dense") as cache, EngineClient(pd.socket_path) as pc, \
            EngineClient(dd.socket_path) as dc:
        try:
            strided_rank = pc.register(f"kl-s{tag}", "prefill", geo, regions)
            dense_rank = dc.register(f"kl-d{tag}", "decode", dense_geo, cache.descriptors())
            n, src, dst = 21, [5, 0, 3], [9, 2, 11, 7, 4, 6]
            dc.expect(dense_rank, "kl-st", source_instance=f"kl-s{tag}", source_address=pd.address, pages=dst,
                      num_tokens=n)
            pc.send(strided_rank, "kl-st", pages=src, start=0, end=n, last=True)
            assert dc.wait(dense_rank, "kl-st", timeout=60)["state"] == "done"
            assert pc.wait(strided_rank, "kl-st", timeout=60)["state"] == "done"
            row = spec8.row_bytes
            for i, (layer, kind) in enumerate(names):
                got = cache.tensors[(layer, kind)].view(torch.uint8).reshape(-1, row)
                for t in range(n):
                    want = raw[src[t // 8], layer, ("k", "v").index(kind), (t % 8) * row:(t % 8 + 1) * row]
                    assert torch.equal(got[dst[t // 4] * 4 + t % 4], want), (layer, kind, t)
                untouched = [p for p in range(2 * blocks) if p not in dst]
                assert int(cache.tensors[(layer, kind)][untouched].count_nonzero()) == 0
        finally:
            pool.close()

"""vLLM's GPU KV layouts: the connector's layout decision, and real transfers of them.

The per-layer views here are made by vLLM 0.32's own allocation code
(``compute_layout_strides`` + ``create_kv_cache_views``, the functions its GPU model runner
calls), on CPU tensors: the same shapes and strides a GPU worker hands
``register_kv_caches``. The connector's pure steps (``layout.decide``, ``rank_geometry``,
``layer_span``) turn them into a kvxferd geometry and regions, the buffers go into shared
memory with ``share_in_place``, and real daemons move them over tcp, and the transfers also
over NIXL (``transport_util``: two daemons that accept NIXL alone, whose metrics must count
exactly the bytes of the request's decode tokens on NIXL, and none on tcp).

The oracle is vLLM's own reading of the cache: FlashAttention's split
``kv_cache.transpose(1, 2).split(head_size, -1)`` (MHA) or the latent view (MLA). Expected
destination buffers are built by assigning through those views, and every byte of the
destination allocation is compared, so a wrong stride, a wrong head offset or a write into
another layer's interleaved page all fail.

Not exercised here: CUDA IPC (``describe_tensors`` sends the storage's IPC handle for CUDA
tensors; the spans it describes are the same views), and real GPU attention kernels (the
views are vLLM's, the kernels that fill them are not run).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from e2e_util import Node, module_cluster
from kvxferd.adapters.vllm.layout import LayerLayout, decide, layer_span, rank_geometry, same_for_all
from kvxferd.errors import ConfigError
from kvxferd.sdk.client import EngineClient
from kvxferd.sdk.engine_memory import describe_tensors, share_in_place
from transport_util import ONLY_NIXL, Carried, daemons, transport  # noqa: F401 - fixtures

LAYERS, BLOCKS = 3, 10
_ids = itertools.count()


class VllmCache:
    """One rank's KV allocation exactly as vLLM 0.32's GPU model runner lays it out."""

    def __init__(self, layout: str, *, heads: int, block_size: int, head: int, dtype=torch.float16,
                 mla: bool = False, kernel_block: int | None = None, blocks: int = BLOCKS) -> None:
        if mla:
            self.spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=head, dtype=dtype)
        else:
            self.spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head, dtype=dtype)
        self.layout = KVCacheLayout[layout]
        self.mla, self.head, self.block_size, self.blocks = mla, head, block_size, blocks
        page = self.spec.page_size_bytes
        # what get_kv_cache_config_from_groups does for one group of uniform layers
        interleaved = LAYERS * page if self.layout.is_block_outermost else None
        layer_stride, block_stride, *_ = compute_layout_strides(
            self.spec, blocks, LAYERS, self.layout, fixed_strides=(None, interleaved, None, None, None))
        self.raw = torch.zeros(LAYERS * page * blocks, dtype=torch.int8)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        tensor = KVCacheTensor(size=self.raw.numel(), layers=names, layer_stride=layer_stride,
                               block_stride=block_stride)
        self.views = create_kv_cache_views(self.raw, self.spec, blocks, self.layout, tensor,
                                           kernel_block_size=kernel_block)
        self.pool = None

    def decide(self) -> LayerLayout:
        return same_for_all({i: decide(tuple(v.shape), tuple(v.stride()), v.element_size(),
                                       block_size=self.block_size, mla=self.mla, on_cpu=False, backend="FLASH_ATTN")
                             for i, v in enumerate(self.views)})

    def token(self, layer: int, block: int, slot: int, head: int) -> tuple[torch.Tensor, ...]:
        """vLLM's own reading of one (block, token, head): (K, V) for MHA, (latent,) for MLA."""
        v = self.views[layer]
        ratio = self.block_size // v.shape[2]  # kernel blocks per block
        kb, n = block * ratio + slot // v.shape[2], slot % v.shape[2]
        if self.mla:
            return (v[kb, 0, n],)
        k, val = v.transpose(1, 2).split(self.head, dim=-1)  # FlashAttention's split
        return k[kb, n, head], val[kb, n, head]

    def fill_random(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.raw.copy_(torch.randint(-100, 100, self.raw.shape, dtype=torch.int8, generator=g))

    def share(self, name: str) -> None:
        self.pool = share_in_place([self.raw, *self.views], name=name)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


# -- the decision, against vLLM's own addressing ---------------------------------------------

@pytest.mark.parametrize("name,expected,interleaved", [
    ("LBNHC", "NHD_kv", False), ("BLNHC", "NHD_kv", True), ("LBHNC", "HND_kv", False), ("BLHNC", "HND_kv", True)])
def test_decide_matches_vllm_addressing(name, expected, interleaved):
    heads, bs, head = 4, 16, 8
    cache = VllmCache(name, heads=heads, block_size=bs, head=head)
    lay = cache.decide()
    page = cache.spec.page_size_bytes
    assert (lay.layout, lay.kind, lay.num_pages, lay.heads, lay.page_size, lay.head_dim) == \
        (expected, "kv", BLOCKS, heads, bs, head)
    assert lay.page_bytes == page
    assert lay.page_stride == (LAYERS * page if interleaved else page)
    geo = rank_geometry(lay, "float16", num_layers=LAYERS, total_kv_heads=heads, tp_size=1, pp_size=1,
                        layer_splits=None, tp_rank=0, pp_rank=0)
    assert geo.page_stride == (LAYERS * page if interleaved else None)
    e, unit = 2, 2 * head * 2  # fp16; one head's K and V of one token
    for layer, v in enumerate(cache.views):
        base = layer_span(v, lay.span_bytes).data_ptr()
        assert base == v.data_ptr()
        for b, n, h in ((0, 0, 0), (3, 5, 2), (BLOCKS - 1, bs - 1, heads - 1)):
            k, val = cache.token(layer, b, n, h)
            if expected == "NHD_kv":   # token rows: a slot is (block, token), a head a unit of it
                off = b * lay.page_stride + n * heads * unit + h * unit
            else:                      # whole pages, a head a contiguous unit of bs tokens
                off = b * lay.page_stride + h * bs * unit + n * unit
            assert k.data_ptr() - base == off and val.data_ptr() - base == off + head * e


def test_kernel_blocks_fold_into_manager_blocks():
    """A 64-token block split into 16-token kernel blocks is still one run of token rows."""
    cache = VllmCache("LBNHC", heads=2, block_size=64, head=8, kernel_block=16, blocks=4)
    assert tuple(cache.views[0].shape) == (16, 2, 16, 16)  # kernel-block granular, as vLLM hands it
    lay = cache.decide()
    assert (lay.layout, lay.num_pages, lay.page_size, lay.page_stride) == ("NHD_kv", 4, 64, cache.spec.page_size_bytes)
    base = cache.views[0].data_ptr()
    k, _ = cache.token(0, 2, 37, 1)
    assert k.data_ptr() - base == 2 * lay.page_stride + 37 * 2 * 32 + 32


def test_mla_is_one_latent_per_token():
    cache = VllmCache("LBNHC", heads=1, block_size=16, head=40, mla=True)
    lay = cache.decide()
    assert (lay.layout, lay.kind, lay.heads, lay.head_dim, lay.page_stride) == ("NHD", "latent", 1, 40, 16 * 40 * 2)
    geo = rank_geometry(lay, "float16", num_layers=LAYERS, total_kv_heads=1, tp_size=2, pp_size=1,
                        layer_splits=None, tp_rank=1, pp_rank=0)
    assert geo.spec.attention == "mla" and geo.spec.row_bytes == 80 and geo.page_stride is None


@pytest.mark.parametrize("name", ["LHBNC", "BHLNC"])
def test_heads_outside_the_block_are_refused_naming_the_fix(name):
    cache = VllmCache(name, heads=4, block_size=16, head=8)
    with pytest.raises(ConfigError) as err:
        cache.decide()
    assert err.value.field == "kv_caches.layout"
    assert "LHBNC or BHLNC" in str(err.value) and "FLASH_ATTN" in str(err.value)
    assert "VLLM_KV_CACHE_LAYOUT" in err.value.fix and "LBNHC" in err.value.fix


def test_head_major_kernel_blocks_are_refused_naming_the_block_size():
    cache = VllmCache("LBHNC", heads=2, block_size=64, head=8, kernel_block=16, blocks=4)
    with pytest.raises(ConfigError) as err:
        cache.decide()
    assert err.value.field == "kv_caches.block_size" and "--block-size 16" in err.value.fix


def test_cpu_takes_only_the_cpu_backends_head_major_layout():
    cache = VllmCache("LBNHC", heads=2, block_size=16, head=8)
    v = cache.views[0]
    with pytest.raises(ConfigError) as err:
        decide(tuple(v.shape), tuple(v.stride()), 2, block_size=16, mla=False, on_cpu=True)
    assert "head-major" in str(err.value)
    cpu = VllmCache("LBHNC", heads=2, block_size=16, head=8)
    v = cpu.views[0]
    assert decide(tuple(v.shape), tuple(v.stride()), 2, block_size=16, mla=False, on_cpu=True).layout == "packed_page"


def test_other_shapes_are_refused_naming_shape():
    with pytest.raises(ConfigError) as err:
        decide((2, 100, 16, 8, 128), (1,) * 5, 2, block_size=16, mla=False, on_cpu=False, backend="X")
    assert err.value.field == "kv_caches.shape" and "[2, 100, 16, 8, 128]" in str(err.value)


# -- real daemons, byte-exact -----------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(request):
    yield from module_cluster(request, "prefill-node", "decode-node")


@pytest.fixture(scope="module")
def nixl_cluster(request):
    """The same two daemons, accepting NIXL alone."""
    yield from module_cluster(request, Node("prefill-node", env=ONLY_NIXL), Node("decode-node", env=ONLY_NIXL))


class Rank:
    """One engine rank: a vLLM cache in shared memory, registered like the connector does."""

    def __init__(self, daemon, instance: str, role: str, cache: VllmCache, *, total_heads: int, tp: int = 1,
                 tp_rank: int = 0) -> None:
        self.cache = cache
        self.lay = cache.decide()
        self.geometry = rank_geometry(self.lay, str(cache.spec.dtype).removeprefix("torch."), num_layers=LAYERS,
                                      total_kv_heads=total_heads, tp_size=tp, pp_size=1, layer_splits=None,
                                      tp_rank=tp_rank, pp_rank=0)
        cache.share(f"vgl-{instance}-{tp_rank}")
        regions = describe_tensors({(i, self.lay.kind): layer_span(v, self.lay.span_bytes)
                                    for i, v in enumerate(cache.views)})
        self.client = EngineClient(daemon.socket_path)
        self.rank = self.client.register(instance, role, self.geometry, regions)

    def close(self) -> None:
        try:
            self.client.unregister(self.rank)
        finally:
            self.client.close()
            self.cache.close()


def kv_bytes(cache: VllmCache, n: int) -> int:
    """What ``n`` tokens occupy in a cache, by vLLM's page size: whole blocks when head-major
    (a head's tokens of a block are one run), token rows otherwise."""
    page, bs = cache.spec.page_size_bytes, cache.block_size
    per_layer = -(-n // bs) * page if cache.layout.name.endswith("HNC") else n * page // bs
    return LAYERS * per_layer


def transfer(cluster, prefill_caches, decode_cache, *, n: int, src_blocks, dst_blocks, total_heads: int,
             chunks=None, transport: str = "tcp"):
    """Move ``n`` tokens from the prefill rank(s) into the decode rank; ``transport`` (the
    cluster's) carried exactly their bytes, the other none."""
    tag = next(_ids)
    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    carried = Carried([pd], [dd])
    tp = len(prefill_caches)
    pre = [Rank(pd, f"vgl-p{tag}", "prefill", c, total_heads=total_heads, tp=tp, tp_rank=r)
           for r, c in enumerate(prefill_caches)]
    dec = Rank(dd, f"vgl-d{tag}", "decode", decode_cache, total_heads=total_heads)
    try:
        rid = f"vgl-{tag}"
        dec.client.expect(dec.rank, rid, source_instance=f"vgl-p{tag}", source_address=pd.address,
                          pages=dst_blocks, num_tokens=n)
        bs = prefill_caches[0].block_size
        for p in pre:
            for a, b in chunks or [(0, n)]:
                p.client.send(p.rank, rid, pages=src_blocks[a // bs:-(-b // bs)], start=a, end=b, last=b == n)
        final = dec.client.wait(dec.rank, rid, timeout=60)
        assert final["state"] == "done", final
        for p in pre:
            assert p.client.wait(p.rank, rid, timeout=60)["state"] == "done"
        carried.assert_only(transport, kv_bytes(decode_cache, n))
    finally:
        for r in [*pre, dec]:
            r.close()


def expected_decode(prefill_caches, decode_cache, *, n, src_blocks, dst_blocks, heads_per_src):
    """The decode allocation after the transfer, assigned through vLLM's own views."""
    want = VllmCache(decode_cache.layout.name, heads=decode_cache.spec.num_kv_heads, block_size=decode_cache.block_size,
                     head=decode_cache.head, dtype=decode_cache.spec.dtype, mla=decode_cache.mla,
                     blocks=decode_cache.blocks)
    want.raw.copy_(decode_cache.raw)
    ps, ds = prefill_caches[0].block_size, decode_cache.block_size
    for layer in range(LAYERS):
        for t in range(n):
            for h in range(decode_cache.spec.num_kv_heads):
                src = prefill_caches[h // heads_per_src]
                got = src.token(layer, src_blocks[t // ps], t % ps, h % heads_per_src)
                for dst_part, src_part in zip(want.token(layer, dst_blocks[t // ds], t % ds, h), got):
                    dst_part.copy_(src_part)
    return want.raw


@pytest.mark.parametrize("p_layout,d_layout", [("LBNHC", "LBNHC"), ("BLNHC", "LBNHC"), ("LBNHC", "BLNHC")])
def test_nhd_kv_moves_byte_exact_dense_and_interleaved(daemons, transport, p_layout, d_layout):
    """Token rows; the two sides' page strides differ (block-outer vs layer-outer) and so do
    their block sizes (16 vs 32): kvxferd re-cuts pages, each side addresses its own."""
    p = VllmCache(p_layout, heads=4, block_size=16, head=8)
    d = VllmCache(d_layout, heads=4, block_size=32, head=8)
    p.fill_random(1)
    n, src, dst = 45, [7, 2, 9], [4, 1]
    transfer(daemons, [p], d, n=n, src_blocks=src, dst_blocks=dst, total_heads=4, chunks=[(0, 20), (20, 45)],
             transport=transport)
    want = expected_decode([p], d, n=n, src_blocks=src, dst_blocks=dst, heads_per_src=4)
    assert torch.equal(d.raw, want)
    assert int(d.raw.count_nonzero()) > 0


def test_nhd_kv_tp2_to_tp1_moves_head_slices(daemons, transport):
    ps = [VllmCache("LBNHC", heads=2, block_size=16, head=8) for _ in range(2)]
    d = VllmCache("BLNHC", heads=4, block_size=16, head=8)
    for i, p in enumerate(ps):
        p.fill_random(10 + i)
    n, src, dst = 37, [5, 0, 8], [2, 9, 6]
    transfer(daemons, ps, d, n=n, src_blocks=src, dst_blocks=dst, total_heads=4, transport=transport)
    assert torch.equal(d.raw, expected_decode(ps, d, n=n, src_blocks=src, dst_blocks=dst, heads_per_src=2))


def test_hnd_kv_moves_whole_pages_dense_to_interleaved(daemons, transport):
    """Head-major blocks (what FlashInfer needs on compute capability 10) move as whole pages,
    TP 2 -> 1 in per-head units; the last page moves whole, tail included."""
    ps = [VllmCache("LBHNC", heads=2, block_size=16, head=8) for _ in range(2)]
    d = VllmCache("BLHNC", heads=4, block_size=16, head=8)
    for i, p in enumerate(ps):
        p.fill_random(20 + i)
    n, src, dst = 40, [3, 6, 1], [8, 0, 5]
    transfer(daemons, ps, d, n=n, src_blocks=src, dst_blocks=dst, total_heads=4, chunks=[(0, 16), (16, 40)],
             transport=transport)
    # whole pages: the oracle owns every token of the three blocks
    assert torch.equal(d.raw, expected_decode(ps, d, n=48, src_blocks=src, dst_blocks=dst, heads_per_src=2))


def test_mla_latent_moves_byte_exact(daemons, transport):
    p = VllmCache("BLNHC", heads=1, block_size=16, head=40, mla=True)
    d = VllmCache("LBNHC", heads=1, block_size=16, head=40, mla=True)
    p.fill_random(3)
    n, src, dst = 30, [4, 9], [0, 7]
    transfer(daemons, [p], d, n=n, src_blocks=src, dst_blocks=dst, total_heads=1, transport=transport)
    assert torch.equal(d.raw, expected_decode([p], d, n=n, src_blocks=src, dst_blocks=dst, heads_per_src=1))


def test_nhd_kv_and_hnd_kv_are_refused_at_the_handshake_naming_both(cluster):
    tag = next(_ids)
    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    p = Rank(pd, f"vgl-p{tag}", "prefill", VllmCache("LBNHC", heads=4, block_size=16, head=8), total_heads=4)
    d = Rank(dd, f"vgl-d{tag}", "decode", VllmCache("LBHNC", heads=4, block_size=16, head=8), total_heads=4)
    try:
        d.client.expect(d.rank, "vgl-x", source_instance=f"vgl-p{tag}", source_address=pd.address,
                        pages=[0, 1], num_tokens=20)
        final = d.client.wait(d.rank, "vgl-x", timeout=60)
        assert final["state"] == "failed" and final["code"] == "incompatible", final
        assert "layout differs: prefill has 'NHD_kv', decode has 'HND_kv'" in final["reason"]
        assert int(d.cache.raw.count_nonzero()) == 0
    finally:
        p.close()
        d.close()


def test_the_connector_asks_vllm_for_token_rows():
    """What get_required_kvcache_layout returns is, in vLLM's own naming, LBNHC: the layout
    registered as NHD_kv (MLA states no preference: one head, every layout is token rows)."""
    from types import SimpleNamespace

    from vllm.config.cache import _layout_from_name

    from kvxferd.adapters.vllm import KvxferdConnector

    asked = KvxferdConnector.get_required_kvcache_layout(SimpleNamespace(model_config=SimpleNamespace(use_mla=False)))
    assert _layout_from_name(asked) is KVCacheLayout.LBNHC
    assert VllmCache(KVCacheLayout.LBNHC.name, heads=2, block_size=16, head=8).decide().layout == "NHD_kv"
    assert KvxferdConnector.get_required_kvcache_layout(SimpleNamespace(model_config=SimpleNamespace(use_mla=True))) is None

"""vLLM's per-layer KV views -> kvxferd geometry and region spans. Pure: no vLLM import, no I/O.

What vLLM 0.32 hands ``register_kv_caches`` (vllm/v1/kv_cache_interface.py
``create_kv_cache_views``): for every attention layer one 4-D view ``[B, H, N, C]`` of a
shared int8 allocation, viewed as the cache dtype, with strides set by the resolved
``KVCacheLayout`` (a permutation of ``[L, B, H, N, C]``):

- ``B`` blocks (kernel blocks; a manager block may be split into several), ``H`` KV heads
  of this rank, ``N`` tokens per (kernel) block, ``C`` elements per (head, token).
- MHA: ``C = head_size + head_size_v``, K first then V (FlashAttention splits it with
  ``kv_cache.transpose(1, 2).split(head_size, -1)``). MLA: ``H = 1``, ``C`` = the latent.
- ``C`` is always innermost. Inside a block, ``...NHC`` layouts store tokens then heads
  (token rows), ``...HNC`` heads then tokens. ``L`` outside ``B`` (``LB..``) gives every
  layer one dense region; ``B`` outside ``L`` (``BL..``) interleaves the layers' pages block
  by block, so a layer's pages lie ``L * page`` apart. ``H`` outside the block (``LHBNC``,
  ``BHLNC``) splits a block's heads far apart.

:func:`decide` reads shape and strides only (the same numbers on CPU and GPU) and says
how kvxferd registers the layer, or refuses naming what to change; :func:`layer_span` is
the one step that touches a tensor (a byte view of the layer's span, no copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ...errors import ConfigError
from ...model.geometry import InstanceSpec, RankGeometry
from ...model.groups import Group

#: what the connector asks vLLM for (alias of LBNHC in vLLM 0.32): token rows, dense layers
REQUIRED_LAYOUT = "NHD"
LAYOUT_FIX = ("let vLLM use the layout the kvxferd connector asks for (LBNHC, alias NHD): unset "
              "VLLM_KV_CACHE_LAYOUT or set it to LBNHC, and pick an attention backend that supports it "
              "(FLASH_ATTN, TRITON_ATTN, or FLASHINFER before compute capability 10)")


@dataclass(frozen=True)
class LayerLayout:
    """How every layer of one rank is registered."""

    layout: str           # kvxferd layout: "NHD_kv", "HND_kv", "packed_page" (MHA) or "NHD" (MLA latent)
    kind: str             # region kind: "kv" or "latent"
    num_pages: int        # manager blocks
    heads: int
    page_size: int        # tokens per manager block
    head_dim: int         # elements of K (MHA: C // 2) or of the latent (MLA: C)
    element_size: int
    page_stride: int      # bytes between the starts of consecutive manager blocks of one layer
    vllm_layout: str      # what vLLM's strides say, for logs and messages

    @property
    def page_bytes(self) -> int:
        return self.heads * self.page_size * (self.head_dim * (1 if self.kind == "latent" else 2)) * self.element_size

    @property
    def span_bytes(self) -> int:
        """Bytes from the layer's first block to the end of its last one."""
        return (self.num_pages - 1) * self.page_stride + self.page_bytes


def _refuse(message: str, field: str = "kv_caches.layout", fix: str = LAYOUT_FIX) -> ConfigError:
    return ConfigError(message, field=field, fix=fix)


def decide(shape: Sequence[int], stride: Sequence[int], element_size: int, *, block_size: int,
           mla: bool, on_cpu: bool, backend: str = "?") -> LayerLayout:
    """One layer view ``[B, H, N, C]`` with element strides -> how kvxferd registers it.

    ``block_size`` is the manager block size (``cache_config.block_size``, what block ids
    count in); a view whose ``N`` is smaller holds kernel blocks, folded back into manager
    blocks here. ``backend`` only names the attention backend in refusals.
    """
    dims = tuple(int(d) for d in shape)
    st = tuple(int(s) for s in stride)
    if len(dims) != 4 or len(st) != 4:
        raise _refuse(f"vLLM handed a {len(dims)}-D KV view of shape {list(dims)} (backend {backend}); kvxferd "
                      "registers vLLM 0.32's per-layer [num_blocks, heads, block_size, content] views",
                      field="kv_caches.shape", fix="use vLLM 0.32 with a standard attention backend")
    b, h, n, c = dims
    sb, sh, sn, sc = st
    where = f"KV view of shape {list(dims)} strides {list(st)} (backend {backend})"
    if c > 1 and sc != 1:
        raise _refuse(f"{where}: the per-token content is not contiguous")
    token_major = (h == 1 or sh == c) and (n == 1 or sn == h * c)
    head_major = (n == 1 or sn == c) and (h == 1 or sh == n * c)
    if not (token_major or head_major):
        raise _refuse(f"{where}: the heads of one block are not stored together (layout LHBNC or BHLNC); "
                      "kvxferd moves blocks as contiguous pages")
    kernel_page = h * n * c
    if b > 1 and sb < kernel_page:
        raise _refuse(f"{where}: blocks overlap (block stride {sb} < page {kernel_page} elements)")
    if block_size % n or (block_size // n > 1 and b % (block_size // n)):
        raise _refuse(f"{where}: {n}-token kernel blocks do not tile {block_size}-token blocks",
                      field="kv_caches.block_size", fix="report this configuration to kvxferd's maintainers")
    ratio = block_size // n
    if ratio > 1 and not token_major:
        raise _refuse(f"{where}: vLLM splits each {block_size}-token block into {ratio} head-major kernel "
                      f"blocks of {n} tokens, so a block's tokens are not one page per head",
                      field="kv_caches.block_size", fix=f"run vLLM with --block-size {n}, or {LAYOUT_FIX}")
    if ratio > 1 and sb != kernel_page:
        raise _refuse(f"{where}: split kernel blocks are not dense", field="kv_caches.block_size",
                      fix=f"run vLLM with --block-size {n}")
    num_pages = b // ratio
    page_stride = (sb * ratio if num_pages > 1 else kernel_page * ratio) * element_size
    interior = "NHC" if token_major else "HNC"
    outer = "LB" if page_stride == kernel_page * ratio * element_size else "BL (or padded pages)"
    vllm_layout = f"{outer}{interior}"
    if mla:
        if h != 1:
            raise _refuse(f"{where}: an MLA cache with {h} heads per rank; kvxferd moves MLA as one latent "
                          "per token", field="kv_caches.heads", fix="report this model to kvxferd's maintainers")
        return LayerLayout("NHD", "latent", num_pages, 1, block_size, c, element_size, page_stride, vllm_layout)
    if c % 2:
        raise _refuse(f"{where}: per-token content of {c} elements is not K and V of equal width",
                      field="kv_caches.head_size", fix="serve a model whose K and V heads have equal size")
    if on_cpu:
        if not head_major:
            raise _refuse(f"{where}: vLLM's CPU attention keeps blocks head-major ([blocks, heads, block_size, "
                          "2 * head_size])", fix="use vLLM's CPU attention backend unchanged")
        return LayerLayout("packed_page", "kv", num_pages, h, block_size, c // 2, element_size, page_stride,
                           vllm_layout)
    if token_major:
        return LayerLayout("NHD_kv", "kv", num_pages, h, block_size, c // 2, element_size, page_stride,
                           vllm_layout)
    return LayerLayout("HND_kv", "kv", num_pages, h, block_size, c // 2, element_size, page_stride, vllm_layout)


def same_for_all(layouts: dict[int, LayerLayout]) -> LayerLayout:
    """Every layer must be registered alike: one geometry per rank."""
    items = sorted(layouts.items())
    first_layer, first = items[0]
    for layer, other in items[1:]:
        if other != first:
            raise ConfigError(f"layer {layer} is laid out as {other}, layer {first_layer} as {first}; kvxferd "
                              "needs one KV layout for every layer of a rank", field="kv_caches.shape",
                              fix="serve a model with uniform attention layers")
    return first


def layer_span(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A flat byte view of ``nbytes`` from the layer view's first element: the region kvxferd
    registers (a view, no copy; ``describe_tensors`` finds its file or CUDA IPC handle)."""
    start = t.storage_offset() * t.element_size()
    storage = t.untyped_storage()
    if start + nbytes > storage.nbytes():
        raise ConfigError(f"a layer's KV span [{start}, {start + nbytes}) runs past its allocation of "
                          f"{storage.nbytes()} bytes", field="kv_caches.shape",
                          fix="report this layout to kvxferd's maintainers")
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.set_(storage, start, (nbytes,))


def rank_geometry(layout: LayerLayout, dtype: str, *, num_layers: int, total_kv_heads: int, tp_size: int,
                  pp_size: int, layer_splits: tuple[tuple[int, int], ...] | None, tp_rank: int,
                  pp_rank: int, groups: tuple[Group, ...] = (),
                  group_pages: dict[str, int] | None = None) -> RankGeometry:
    """The geometry a rank registers: the model's numbers plus what :func:`decide` read
    (``groups``: vLLM's other KV cache groups as kvxferd cache groups, their page counts)."""
    mla = layout.kind == "latent"
    spec = InstanceSpec(attention="mla" if mla else "mha", num_layers=num_layers,
                        total_kv_heads=None if mla else total_kv_heads, head_dim=layout.head_dim, dtype=dtype,
                        page_size=layout.page_size, tp_size=tp_size, pp_size=pp_size, layer_splits=layer_splits,
                        layout=layout.layout, groups=groups)
    if spec.local_heads != layout.heads:
        raise ConfigError(f"vLLM's KV tensor holds {layout.heads} heads per rank, kvxferd expects "
                          f"{spec.local_heads} ({spec.kv_heads} KV heads over tp {tp_size})",
                          field="kv_caches.heads", fix="report this layout to kvxferd's maintainers")
    return RankGeometry(spec, tp_rank=tp_rank, pp_rank=pp_rank, num_pages=layout.num_pages,
                        page_stride=layout.page_stride, group_pages=tuple(sorted((group_pages or {}).items())))


@dataclass(frozen=True)
class HybridPart:
    """One of vLLM's KV cache groups kvxferd moves, laid out: its layers' views in model order."""

    name: str                 # kvxferd group name, "" for the default group
    index: int                # vLLM's group index, for messages
    kind: str                 # "" (default), "draft" or "window"
    window: int | None
    layout: LayerLayout
    layers: Sequence[torch.Tensor]


def hybrid_geometry(parts: Sequence[HybridPart], *, total_kv_heads: int, tp_size: int, tp_rank: int,
                    pp_size: int) -> tuple[RankGeometry, dict[tuple[int, str], tuple[Any, int]]]:
    """A rank of several vLLM KV cache groups -> (its geometry, ``{(layer, kind): (view, span bytes)}``).

    The default group (``parts[0]``) is the instance's KV with its layers numbered from 0
    among themselves; every other group a kvxferd cache group in the same layout (one
    allocation, the same page size), registered as ``(layer, "<group>.<kind>")``. vLLM
    overlays the groups on one allocation, so regions of different groups may span the same
    bytes: a block id belongs to one group at a time, and only named pages are touched.
    """
    base = parts[0].layout
    spans: dict[tuple[int, str], tuple[Any, int]] = {}
    groups = []
    for part in parts:
        lay = part.layout
        where = f"kv_cache_config.kv_cache_groups[{part.index}]"
        if (lay.layout, lay.kind, lay.page_size) != (base.layout, base.kind, base.page_size):
            raise ConfigError(f"vLLM KV cache group {part.index} is laid out as {lay.layout} with {lay.page_size}-token "
                              f"pages, the full-attention group as {base.layout} with {base.page_size}", field=where,
                              fix=LAYOUT_FIX)
        if part.name and lay.page_stride != lay.page_bytes:
            raise ConfigError(f"vLLM KV cache group {part.index}'s pages lie {lay.page_stride} bytes apart, not back "
                              f"to back ({lay.page_bytes}); kvxferd's cache groups take dense pages",
                              field="kv_caches.layout", fix=LAYOUT_FIX)
        kind = f"{part.name}.{lay.kind}" if part.name else lay.kind
        spans.update({(i, kind): (t, lay.span_bytes) for i, t in enumerate(part.layers)})
        if part.name:
            # the model's KV heads, unless this group's layers hold another count (heads x TP then)
            heads = total_kv_heads if lay.heads == max(1, total_kv_heads // tp_size) else lay.heads * tp_size
            groups.append(Group(name=part.name, kind=part.kind, num_layers=len(part.layers),
                                dtype=str(part.layers[0].dtype).removeprefix("torch."), head_dim=lay.head_dim,
                                total_kv_heads=heads, page_size=lay.page_size, window=part.window))
    default = parts[0]
    geometry = rank_geometry(base, str(default.layers[0].dtype).removeprefix("torch."),
                             num_layers=len(default.layers), total_kv_heads=total_kv_heads, tp_size=tp_size,
                             pp_size=pp_size, layer_splits=None, tp_rank=tp_rank, pp_rank=0, groups=tuple(groups),
                             group_pages={p.name: p.layout.num_pages for p in parts[1:]})
    return geometry, spans

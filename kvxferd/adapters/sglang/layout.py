"""SGLang's KV pool and KVArgs as kvxferd geometry; page and token arithmetic (pure).

SGLang (0.5.23) keeps KV per layer in NHD tensors: MHA ``k_buffer[l]``/``v_buffer[l]`` of
``[size + page_size, heads_per_rank, head_dim]``, MLA ``kv_buffer[l]`` of
``[size + page_size, 1, kv_lora_rank + rope_dim]``. Row ``r`` is token slot ``r``; page
``p`` is rows ``[p * page_size, (p + 1) * page_size)`` and page 0 is padding the allocator
never hands out. That is kvxferd's NHD region with ``num_pages = rows // page_size``, so the
engine's own tensors are registered as they are: no copy, no staging buffer of SGLang's.

Nothing here does I/O or imports SGLang, so every rule is testable on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...errors import GeometryError, RegistrationError
from ...model.geometry import DTYPE_BITS, InstanceSpec, RankGeometry

HEADS_FIX = ("start SGLang with a model config that has num_key_value_heads, or set "
             "SGLANG_DISAGG_STAGING_BUFFER=1 so SGLang fills kv_head_num/total_kv_head_num")


@dataclass(frozen=True)
class PoolFacts:
    """What one rank's KV pool tensors say (read from the tensors, not from flags)."""

    attention: str  # "mha" or "mla"
    dtype: str  # kvxferd dtype name
    rows: int  # rows of every per-layer buffer: token slots plus the padding page
    local_heads: int  # heads in this rank's buffers (1 for MLA)
    head_dim: int  # last dimension (kv_lora_rank + rope_dim for MLA)
    page_size: int
    start_layer: int  # first global layer this rank holds
    num_layers: int


@dataclass(frozen=True)
class RankFacts:
    """What SGLang says about the rank: KVArgs fields and the parallel layout."""

    tp_rank: int  # rank inside the attention TP group
    tp_size: int  # attention TP size
    pp_rank: int
    pp_size: int
    layer_splits: tuple[tuple[int, int], ...]  # [start, end) per PP stage (a hybrid pool: of its full layers)
    kv_head_num: int | None = None  # KVArgs.kv_head_num (unset on the decode side in 0.5.23)
    total_kv_head_num: int | None = None  # KVArgs.total_kv_head_num (likewise)
    model_total_kv_heads: int | None = None  # model_config.get_total_num_kv_heads()


def _positive(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def resolve_heads(pool: PoolFacts, rank: RankFacts) -> int:
    """The model's total KV head count, from every source there is; refuse only when none gives it.

    Sources: KVArgs.total_kv_head_num, the model config, and (when heads cannot be
    replicated) the pool's heads per rank times the attention TP size. KVArgs.kv_head_num,
    when set, must agree with the pool's tensors, which are what really gets moved.
    """
    if pool.attention == "mla":
        return 1
    given = _positive(rank.kv_head_num)
    if given is not None and given != pool.local_heads:
        raise GeometryError(
            f"KVArgs.kv_head_num is {given} but the KV pool tensors hold {pool.local_heads} heads per rank",
            field="kv_head_num", fix="register the pool KVArgs describes (its k_buffer shape is [rows, heads, dim])")
    totals = {name: v for name, v in (("total_kv_head_num", _positive(rank.total_kv_head_num)),
                                      ("model_config", _positive(rank.model_total_kv_heads))) if v is not None}
    if len(set(totals.values())) > 1:
        raise GeometryError(f"total KV heads disagree: {totals}", field="total_kv_head_num",
                            fix="use the same model on every rank")
    if totals:
        total = next(iter(totals.values()))
    elif pool.local_heads > 1 or rank.tp_size == 1:
        # with more than one head per rank no head is replicated, so the product is the total
        total = pool.local_heads * rank.tp_size
    else:
        raise GeometryError(
            f"Cannot resolve total_kv_heads: KVArgs.total_kv_head_num is unset, the model config gives none, "
            f"and {pool.local_heads} head per rank over attention TP {rank.tp_size} may be a replicated head",
            field="total_kv_head_num", fix=HEADS_FIX)
    expected = max(1, total // rank.tp_size)
    if expected != pool.local_heads:
        raise GeometryError(
            f"the model's {total} KV heads over attention TP {rank.tp_size} give {expected} heads per rank, "
            f"but the KV pool tensors hold {pool.local_heads}", field="kv_head_num",
            fix="check the attention TP size and the model config this rank runs with")
    return total


def build_geometry(pool: PoolFacts, rank: RankFacts) -> RankGeometry:
    """The rank's kvxferd geometry; every refusal names the field and the fix."""
    if pool.dtype not in DTYPE_BITS:
        raise GeometryError(f"KV dtype {pool.dtype!r} is not one kvxferd moves", field="kv_cache_dtype",
                            fix=f"use one of {sorted(DTYPE_BITS)}")
    if pool.rows % pool.page_size:
        raise GeometryError(f"KV buffers have {pool.rows} rows, not a whole number of {pool.page_size}-token pages",
                            field="page_size", fix="size the pool in whole pages")
    if not 0 <= rank.pp_rank < rank.pp_size or len(rank.layer_splits) != rank.pp_size:
        raise GeometryError(f"pp_rank {rank.pp_rank} and {len(rank.layer_splits)} layer splits do not fit "
                            f"pp_size {rank.pp_size}", field="pp_rank", fix="start ranks with one PP layout")
    own = rank.layer_splits[rank.pp_rank]
    held = (pool.start_layer, pool.start_layer + pool.num_layers)
    if own != held:
        raise GeometryError(
            f"PP stage {rank.pp_rank} should hold layers [{own[0]}, {own[1]}) by SGLang's partition, "
            f"the KV pool holds [{held[0]}, {held[1]})", field="prefill_start_layer",
            fix="check SGLANG_PP_LAYER_PARTITION is the same on every rank")
    total = resolve_heads(pool, rank)
    spec = InstanceSpec(attention=pool.attention, num_layers=rank.layer_splits[-1][1], head_dim=pool.head_dim,
                        dtype=pool.dtype, page_size=pool.page_size, tp_size=rank.tp_size, pp_size=rank.pp_size,
                        total_kv_heads=None if pool.attention == "mla" else total,
                        layer_splits=tuple(rank.layer_splits))
    return RankGeometry(spec, rank.tp_rank, rank.pp_rank, pool.rows // pool.page_size)


def expect_pages(suffix_pages: Sequence[int], prefix_len: int, page_size: int) -> list[int]:
    """Pages from token 0 for ``expect``, given SGLang's pages for the suffix only.

    The decode side sends the pages of ``[decode_prefix_len, len)`` (the prefix is already
    in its cache, page-aligned). kvxferd's expect takes pages from token 0 plus ``start``,
    so the prefix pages are filled with page 0, SGLang's padding page: nothing is written
    below ``start``, so they are never touched.
    """
    if prefix_len % page_size:
        raise RegistrationError(f"decode_prefix_len {prefix_len} is not a multiple of page_size {page_size}",
                                field="decode_prefix_len", fix="send a page-aligned prefix length")
    return [0] * (prefix_len // page_size) + [int(p) for p in suffix_pages]


def chunk_window(cursor: int, num_kv_tokens: int | None, num_pages: int, page_size: int) -> tuple[int, int]:
    """Token range ``[start, end)`` of one ``send``: it starts where the last one ended.

    SGLang sends page indices of ``[start_send_idx, end_idx)`` with ``num_kv_tokens`` its
    length; ``start_send_idx`` is page-aligned, so the first page holds token ``cursor``.
    Without ``num_kv_tokens`` (older callers) the pages are taken as full.
    """
    if cursor % page_size:
        raise RegistrationError(f"chunk starts at token {cursor}, not on a page boundary of {page_size}",
                                field="num_kv_tokens", fix="end every chunk but the last on a page boundary")
    n = num_pages * page_size if num_kv_tokens is None else int(num_kv_tokens)
    if n < 0 or -(-n // page_size) != num_pages:
        raise RegistrationError(f"{num_pages} pages cannot hold exactly {n} tokens of page size {page_size}",
                                field="num_kv_tokens", fix="send the pages of exactly num_kv_tokens tokens")
    return cursor, cursor + n


def aux_row_spans(item_lens: Sequence[int], index: int) -> list[tuple[int, int]]:
    """(byte offset inside each aux buffer, length) of metadata row ``index``."""
    return [(index * int(n), int(n)) for n in item_lens]

"""SGLang's KV token pool as kvxferd sees it: its buffers, their facts, and the hand-off to the manager.

SGLang builds a KV manager from KVArgs (raw pointers) alone; kvxferd registers the pool's
own tensors, so the plugin's hook parks the pool here (:data:`CURRENT_POOL`) for the
manager SGLang builds next, and these helpers read what the pool holds.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ...errors import RegistrationError
from .layout import PoolFacts


@dataclass
class PoolContext:
    """What the plugin's hook on ``_init_kv_manager`` hands the manager SGLang builds inside it.

    SGLang gives a manager only KVArgs (pointers); kvxferd registers tensors, so the hook
    passes the pool (already moved into shared memory on CPU) and the model's KV head count.
    """

    pool: Any
    metadata_buffers: Any
    model_total_kv_heads: int | None
    num_hidden_layers: int
    shared: Any = None  # kvxferd.sdk.engine_memory.SharedPool of a CPU pool (a named file is unlinked once registered)
    draft_pool: Any = None  # the speculative draft model's token pool (draft_token_to_kv_pool), if any
    sliding_window: int | None = None  # the scheduler's sliding_window_size (tokens), for an SWA pool
    model_config: Any = None  # the scheduler's model config: every layer of each kind, for PP stages (see .stages)


CURRENT_POOL: contextvars.ContextVar[Optional[PoolContext]] = contextvars.ContextVar("kvxferd_sglang_pool",
                                                                                      default=None)

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
           torch.int8: "int8", torch.uint8: "uint8"}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _name


def full_pool(pool: Any) -> Any:
    """The full-attention token pool: a composite pool's ``full_kv_pool`` (hybrid Mamba, SWA), else the pool.

    """
    inner = getattr(pool, "full_kv_pool", None)
    return inner if inner is not None else pool


def mamba_pool(pool: Any) -> Any:
    """The MambaPool of a hybrid linear-attention KV pool (HybridLinearKVPool), else None."""
    inner = getattr(pool, "mamba_pool", None)
    if inner is None or getattr(pool, "full_kv_pool", None) is None:
        return None
    return inner


def swa_pool(pool: Any) -> Any:
    """The sliding-window layers' token pool of an SWA pool (SWAKVPool.swa_kv_pool), else None."""
    return getattr(pool, "swa_kv_pool", None)


def composite_layer_ids(pool: Any, *, swa: bool) -> list[int]:
    """Model layers of an SWA pool's sliding-window (or full) sub-pool, in the sub-pool's dense order.

    ``SWAKVPool.layers_mapping`` maps each model layer of the stage to ``(index, is_swa)``.
    """
    mapping = getattr(pool, "layers_mapping", None) or {}
    return [layer for layer, (_, is_swa) in sorted(mapping.items(), key=lambda kv: kv[1][0]) if bool(is_swa) == swa]


def state_tensors(pool: Any) -> list[torch.Tensor]:
    """Per (state tensor, Mamba layer) ``[slots, ...]`` views, in the order KVArgs' state entries list them.

    SGLang's own ``MambaPool._iter_transfer_state_entries`` yields them; it is what
    ``get_contiguous_buf_infos`` (and so KVArgs) is built from.
    """
    inner = mamba_pool(pool)
    if inner is None:
        return []
    return [t for _, t, _, _ in inner._iter_transfer_state_entries()]


def state_base_tensors(pool: Any) -> list[torch.Tensor]:
    """The Mamba pool's base state tensors (what moves into shared memory; entries are views of them)."""
    inner = mamba_pool(pool)
    if inner is None:
        return []
    cache = inner.mamba_cache
    return [*cache.conv, cache.temporal]


def pool_buffers(pool: Any) -> tuple[str, dict[str, list[torch.Tensor]]]:
    """(attention kind, {region kind: per-layer tensors}) of an MHA or MLA token pool."""
    pool = full_pool(pool)
    if getattr(pool, "kv_buffer", None) is not None:
        return "mla", {"latent": list(pool.kv_buffer)}
    if getattr(pool, "k_buffer", None) is not None and getattr(pool, "v_buffer", None) is not None:
        return "mha", {"k": list(pool.k_buffer), "v": list(pool.v_buffer)}
    raise RegistrationError(f"KV pool {type(pool).__name__} has neither k_buffer/v_buffer nor kv_buffer",
                            field="token_to_kv_pool", fix="use an MHA or MLA token pool (MHATokenToKVPool, "
                                                          "MLATokenToKVPool)")


def pool_facts(pool: Any) -> PoolFacts:
    attention, buffers = pool_buffers(pool)
    pool = full_pool(pool)
    if getattr(pool, "use_hnd", False):
        raise RegistrationError("the KV pool is laid out HND; kvxferd registers NHD buffers in place",
                                field="kv_cache_layout", fix="start SGLang without an HND kv cache layout")
    first = next(iter(buffers.values()))[0]
    if first.dim() != 3:
        raise RegistrationError(f"KV buffers have shape {list(first.shape)}, expected [rows, heads, head_dim]",
                                field="token_to_kv_pool", fix="use an NHD MHA or MLA token pool")
    shapes = {tuple(t.shape) for ts in buffers.values() for t in ts}
    dtypes = {t.dtype for ts in buffers.values() for t in ts}
    if len(shapes) != 1 or len(dtypes) != 1:
        raise RegistrationError(f"KV buffers differ in shape {sorted(shapes)} or dtype {sorted(map(str, dtypes))}",
                                field="token_to_kv_pool", fix="use a pool whose K and V have one head_dim")
    dtype = _DTYPES.get(first.dtype)
    if dtype is None:
        raise RegistrationError(f"KV buffer dtype {first.dtype} is not one kvxferd moves", field="kv_cache_dtype",
                                fix=f"use one of {sorted(_DTYPES.values())}")
    rows, heads, dim = first.shape
    return PoolFacts(attention=attention, dtype=dtype, rows=int(rows), local_heads=int(heads), head_dim=int(dim),
                     page_size=int(pool.page_size), start_layer=int(getattr(pool, "start_layer", 0) or 0),
                     num_layers=len(next(iter(buffers.values()))))


def pool_region_tensors(pool: Any, facts: PoolFacts) -> dict[tuple[int, str], torch.Tensor]:
    _, buffers = pool_buffers(pool)
    return {(facts.start_layer + i, kind): t for kind, ts in buffers.items() for i, t in enumerate(ts)}


def dtype_name(t: torch.Tensor, field: str) -> str:
    """kvxferd's name of a tensor's dtype; refused naming ``field`` when kvxferd does not move it."""
    name = _DTYPES.get(t.dtype)
    if name is None:
        raise RegistrationError(f"{field} dtype {t.dtype} is not one kvxferd moves", field=field,
                                fix=f"use one of {sorted(_DTYPES.values())}")
    return name

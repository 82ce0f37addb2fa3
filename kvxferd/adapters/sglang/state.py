"""SGLang's Mamba / linear-attention state (KVArgs ``state_*`` fields) as kvxferd state groups (pure).

sglang 0.5.23 describes a hybrid model's per-request state in KVArgs, one *component* per
``state_types`` entry. A ``StateType.MAMBA`` component lists one entry per (state tensor,
Mamba layer), tensor-major: every conv tensor over the Mamba layers, then the temporal
(SSM) tensor over them. Per entry it gives:

- ``state_item_lens``: bytes of one slot of this rank (the local, TP-split tensor);
- ``state_data_lens``: bytes of the whole buffer (slots = data_len / item_len);
- ``state_dim_per_tensor``: the *local* size of the dimension TP splits (0: the state is
  replicated over attention TP);
- ``state_slice_outer_counts``: rows before that dimension (Kimi's conv ``[K - 1, dim]``);
- ``state_conv_shard_groups``: the *full* sizes of the parts the split dimension
  concatenates, each split by TP on its own (GDN's conv ``q|k|v``), or None;
- ``state_layer_ids``: the global layer of each entry.

Each state tensor becomes one kvxferd state group (``mamba_<t>``) whose layers are the
Mamba layers in SGLang's order, with the full shape ``(outer, dim * tp, inner)`` split on
the middle dimension: the same slicing SGLang's own heterogeneous-TP path does
(``compute_mamba_state_slice_blocks``), so both sides of a pair describe one shape whatever
their TP. Nothing here imports SGLang or does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ...errors import RegistrationError
from ...model.groups import Group

GROUP_PREFIX = "mamba_"


@dataclass(frozen=True)
class StateTensor:
    """One Mamba state tensor over the Mamba layers: its group and its KVArgs entries."""

    group: Group
    entries: tuple[int, ...]  # indexes into the component's lists, one per group layer
    slots: int  # state slots of the buffer (SGLang's mamba pool size + 1)


def _entry_list(name: str, values: Sequence[Any] | None, n: int) -> list[Any]:
    values = list(values or [])
    if values and len(values) != n:
        raise RegistrationError(f"KVArgs.{name} has {len(values)} entries, state_data_ptrs {n}",
                                field=name, fix="fill KVArgs with SGLang's setup_state_kv_args")
    return values or [None] * n


def mamba_groups(*, item_lens: Sequence[int], data_lens: Sequence[int], dims: Sequence[int] | None,
                 outer_counts: Sequence[int] | None, shard_groups: Sequence[Any] | None,
                 layer_ids: Sequence[int] | None, itemsizes: Sequence[int], dtypes: Sequence[str],
                 tp_size: int) -> list[StateTensor]:
    """The state groups of one ``StateType.MAMBA`` component; every refusal names its KVArgs field."""
    n = len(item_lens)
    if n == 0:
        raise RegistrationError("the Mamba state component lists no buffers (state_data_ptrs)", field="state_data_ptrs",
                                fix="serve a model whose KV pool has Mamba state, or none")
    if len(data_lens) != n or len(itemsizes) != n or len(dtypes) != n:
        raise RegistrationError(f"KVArgs.state_data_lens has {len(data_lens)} entries and the pool {len(itemsizes)} "
                                f"state tensors, state_item_lens {n}", field="state_data_lens",
                                fix="fill KVArgs from the registered pool")
    dims_l = _entry_list("state_dim_per_tensor", dims, n)
    outer_l = _entry_list("state_slice_outer_counts", outer_counts, n)
    groups_l = _entry_list("state_conv_shard_groups", shard_groups, n)
    layers_l = _entry_list("state_layer_ids", layer_ids, n)
    layers = list(dict.fromkeys(layers_l)) if layers_l[0] is not None else [0]
    per = len(layers) if layers_l[0] is not None else 1
    if n % per or (layers_l[0] is not None and any(layers_l[i] != layers[i % per] for i in range(n))):
        raise RegistrationError(f"state_layer_ids {layers_l} are not the same Mamba layers for every state tensor",
                                field="state_layer_ids", fix="fill KVArgs with SGLang's setup_state_kv_args")
    out: list[StateTensor] = []
    for t in range(n // per):
        idx = tuple(range(t * per, (t + 1) * per))
        keys = {(int(item_lens[i]), dims_l[i], outer_l[i], tuple(groups_l[i] or ()), dtypes[i], int(itemsizes[i]),
                 int(data_lens[i])) for i in idx}
        if len(keys) != 1:
            raise RegistrationError(f"Mamba state tensor {t} differs between its layers (state_item_lens, dims, "
                                    f"dtypes): {sorted(map(str, keys))}",
                                    field="state_item_lens", fix="use one state shape per tensor over all Mamba layers")
        item, dim, outer, parts, dtype, size, data = next(iter(keys))
        if item <= 0 or data % item:
            raise RegistrationError(f"state buffer of {data} bytes (state_data_lens) is not whole slots of {item} "
                                    "bytes",
                                    field="state_data_lens", fix="register the pool's state buffers whole")
        group = _state_group(t, per, item, int(dim or 0), int(outer or 1), parts, dtype, size, tp_size)
        out.append(StateTensor(group, idx, data // item))
    return out


def _state_group(t: int, per: int, item: int, dim: int, outer: int, parts: tuple, dtype: str, size: int,
                 tp_size: int) -> Group:
    """State tensor ``t`` as a kvxferd state group: replicated (``dim`` 0) or split on its channels."""
    if item % size:
        raise RegistrationError(f"state slot of {item} bytes (state_item_lens) is not whole {dtype} elements",
                                field="state_item_lens", fix="register the pool's state buffers as they are")
    elems = item // size
    if dim == 0:
        if parts:
            raise RegistrationError(f"replicated state tensor {t} has state_conv_shard_groups {list(parts)}",
                                    field="state_conv_shard_groups", fix="fill KVArgs with SGLang's own pool")
        return Group(f"{GROUP_PREFIX}{t}", "state", per, shape=(elems,), split_dim=None, dtype=dtype)
    if outer <= 0 or elems % (outer * dim):
        raise RegistrationError(
            f"state tensor {t}: {elems} elements per slot are not {outer} rows (state_slice_outer_counts) x "
            f"{dim} split channels (state_dim_per_tensor) x an integer inner size",
            field="state_dim_per_tensor",
            fix="fill KVArgs with SGLang's setup_state_kv_args for this pool")
    inner = elems // (outer * dim)
    full = dim * tp_size
    split_parts = tuple(int(p) for p in parts) or None
    if split_parts is not None and sum(split_parts) != full:
        raise RegistrationError(
            f"state tensor {t}: state_conv_shard_groups {list(split_parts)} add up to {sum(split_parts)}, "
            f"but {dim} local channels x attention TP {tp_size} are {full}",
            field="state_conv_shard_groups", fix="run every rank with the attention TP size the pool was "
                                                 "built for")
    shape = (full, inner) if outer == 1 else (outer, full, inner)
    return Group(f"{GROUP_PREFIX}{t}", "state", per, shape=shape, split_dim=0 if outer == 1 else 1,
                 split_parts=split_parts, dtype=dtype)


def state_slot(value: Any, state_type: str) -> int:
    """A request's state slot from SGLang's ``state_indices`` entry (``[array(slot)]`` for Mamba)."""
    try:
        flat = np.concatenate([np.asarray(v, dtype=np.int64).reshape(-1) for v in value]) if isinstance(
            value, (list, tuple)) else np.asarray(value, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise RegistrationError(f"state_indices for {state_type} is not a list of integers: {exc}",
                                field="state_indices", fix="pass SGLang's own state payload") from None
    if flat.size != 1:
        raise RegistrationError(f"state_indices for {state_type} names {flat.size} slots, a request has one",
                                field="state_indices", fix="pass the request's one Mamba slot")
    return int(flat[0])

"""Pairing the cache groups of two instances: one sub-plan per group, refusals naming the group.

A group is moved as an ordinary instance spec (:mod:`kvxferd.model.groups`), so its sub-plan is
the :func:`~kvxferd.model.pairing.pair` of the two sides' group specs; its writers carry the group's name, which
is how the lifecycle, the inbox and the data headers tell its chunks from the default
group's. Before that, the groups themselves are compared field by field, so a refusal says
``groups.<name>.<field>`` with both values rather than the field of the derived spec.
Pure, like the planner.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..errors import PlanRefusal
from .geometry import InstanceSpec
from .groups import Group
from .pairing import pair
from .plan import Destination, GroupPlan


def _refuse(group: str, field: str, prefill: Any, decode: Any, fix: str) -> PlanRefusal:
    return PlanRefusal(f"cache group {group!r}: {field} differs (groups.{group}.{field}): prefill has {prefill!r}, "
                       f"decode has {decode!r}",
                       field=f"groups.{group}.{field}", prefill=prefill, decode=decode, fix=fix)


def check_groups(prefill: InstanceSpec, decode: InstanceSpec) -> None:
    """Raise :class:`PlanRefusal` for the first group that differs between the two sides."""
    p_names = [g.name for g in prefill.groups]
    d_names = [g.name for g in decode.groups]
    for name in p_names + [n for n in d_names if n not in p_names]:
        if name not in p_names or name not in d_names:
            side, other = ("prefill", "decode") if name in p_names else ("decode", "prefill")
            raise PlanRefusal(f"cache group {name!r} (groups.{name}) exists on the {side} side only: "
                              f"prefill has groups "
                              f"{p_names}, decode has {d_names}", field=f"groups.{name}",
                              prefill=p_names, decode=d_names,
                              fix=f"register the same cache groups on both instances (add {name!r} to the {other} "
                                  "geometry, or remove it)")
        pg, dg = prefill.group(name), decode.group(name)
        p_fields, d_fields = pg.compared(prefill), dg.compared(decode)
        for field in sorted(set(p_fields) | set(d_fields), key=_order):
            if p_fields.get(field) != d_fields.get(field):
                raise _refuse(name, field, p_fields.get(field), d_fields.get(field), _fix(pg, field))


def _order(field: str) -> tuple[int, str]:
    first = ("kind", "num_layers", "attention", "window", "shape", "split_dim", "total_kv_heads", "head_dim", "dtype")
    return (first.index(field) if field in first else len(first), field)


def _fix(group: Group, field: str) -> str:
    if field == "window":
        return "pair instances of the same model: the sliding window is the model's sliding_window"
    if field in ("shape", "split_dim"):
        return "pair instances of the same model, with the state tensor described the same way on both sides"
    if field == "dtype":
        return f"use the same dtype for group {group.name!r} on both sides; kvxferd does not convert dtypes"
    return f"pair instances of the same model (group {group.name!r} must have the same {field})"


def group_plans(prefill: InstanceSpec, decode: InstanceSpec, mode: str,
                prefill_tensors: bool, decode_tensors: bool) -> tuple[GroupPlan, ...]:
    """One :class:`GroupPlan` per group, in the prefill side's order (the groups are equal)."""
    check_groups(prefill, decode)
    out = []
    for g in prefill.groups:
        p_spec, d_spec = prefill.group_spec(g.name), decode.group_spec(g.name)
        try:
            sub = pair(p_spec, d_spec, mode=mode, prefill_tensors=prefill_tensors, decode_tensors=decode_tensors)
            parts = g.parts()
            if len(parts) > 1:
                writers = _part_writers(g.name, parts, p_spec, d_spec, mode, prefill_tensors, decode_tensors)
            else:
                writers = {d.rank: [replace(w, group=g.name) for w in d.writers] for d in sub.destinations}
        except PlanRefusal as refusal:
            where = "shape" if g.kind == "state" and refusal.field in ("head_dim", "total_kv_heads") else refusal.field
            raise PlanRefusal(f"cache group {g.name!r} (groups.{g.name}.{where}): {refusal.message}",
                              field=f"groups.{g.name}.{where}",
                              prefill=refusal.prefill_value, decode=refusal.decode_value, fix=refusal.fix) from None
        dests = tuple(Destination(d.tp_rank, d.pp_rank, d.heads, d.layers, tuple(writers[d.rank]))
                      for d in sub.destinations)
        out.append(GroupPlan(g.name, g.kind, g.window, replace(sub, destinations=dests)))
    return tuple(out)


def _part_writers(name: str, parts: tuple[int, ...], p_spec: InstanceSpec, d_spec: InstanceSpec, mode: str,
                  prefill_tensors: bool, decode_tensors: bool) -> dict[tuple[int, int], list[Any]]:
    """Writers of a state whose split dimension concatenates parts split by TP one by one: each
    part is planned as a state of its own; its writers then address the whole row, shifted by
    the parts before it (their local sizes on each side), in units of one channel."""
    if p_spec.head_slot_bits % 8:
        raise PlanRefusal(f"one channel of the state is {p_spec.head_slot_bits} bits: parts cannot start on a byte",
                          field="head_dim", prefill=p_spec.head_slot_bits, decode=d_spec.head_slot_bits,
                          fix="describe the state with whole-byte channels (a wider dtype or a larger inner size)")
    out: dict[tuple[int, int], list[Any]] = {}
    before = 0
    for i, size in enumerate(parts):
        one = {"attention": p_spec.attention, "num_layers": p_spec.num_layers, "head_dim": p_spec.head_dim,
               "dtype": p_spec.dtype, "page_size": p_spec.page_size, "total_kv_heads": size}
        sub = pair(InstanceSpec(tp_size=p_spec.tp_size, pp_size=p_spec.pp_size, layer_splits=p_spec.splits, **one),
                   InstanceSpec(tp_size=d_spec.tp_size, pp_size=d_spec.pp_size, layer_splits=d_spec.splits, **one),
                   mode=mode, prefill_tensors=prefill_tensors, decode_tensors=decode_tensors)
        for d in sub.destinations:
            out.setdefault(d.rank, []).extend(
                replace(w, group=name, part=i, heads=(before + w.heads[0], before + w.heads[1]),
                        src_head_offset=before // p_spec.tp_size + w.src_head_offset,
                        dst_head_offset=before // d_spec.tp_size + w.dst_head_offset,
                        src_row_bytes=p_spec.row_bytes, dst_row_bytes=d_spec.row_bytes)
                for w in d.writers)
        before += size
    return out


def window_origin(num_tokens: int, window: int, start: int) -> int:
    """First token a sliding-window group moves: the last ``window`` tokens of the prompt, and
    nothing the decode side already holds (``start``)."""
    return max(start, num_tokens - window, 0)

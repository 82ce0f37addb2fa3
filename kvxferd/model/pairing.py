"""Pairing two instance geometries: who writes which heads and layers of whom.

:func:`pair` plans one pair of specs: an instance's full-attention KV, or one cache group
moved as a spec of its own (:mod:`kvxferd.model.group_plan`); :func:`~kvxferd.model.planner.make_plan`
adds the groups. ``pair`` is a pure function of the prefill and decode :class:`InstanceSpec`.
The source daemon computes it from the handshake and sends it (:mod:`kvxferd.model.plan_wire`);
it is deterministic and depends on nothing but the two specs and the requested mode.

Rules:
- every destination (head, layer) cell has exactly one writer;
- replicated prefill heads (tp > kv heads) are spread over replicas by destination rank;
- the writer set per destination is the smallest possible: one per overlapping
  (prefill head group, prefill layer range);
- page sizes may differ, the segment generator works in token runs (NHD); the
  packed_page layout moves whole pages, so there both page sizes must be equal.
"""

from __future__ import annotations

from typing import Any

from ..errors import PlanRefusal
from .geometry import InstanceSpec
from .plan import Destination, Plan, Writer

MODES = ("auto", "direct", "staged")

#: auto picks staged when one token row is cut into slices of at most this many bytes
STAGED_SLICE_BYTES = 4096


def _check_equal(field: str, prefill: Any, decode: Any, fix: str) -> None:
    if prefill != decode:
        raise PlanRefusal(f"{field} differs: prefill has {prefill!r}, decode has {decode!r}",
                          field=field, prefill=prefill, decode=decode, fix=fix)


def check_compatible(prefill: InstanceSpec, decode: InstanceSpec, *,
                     require_same_page_size: bool = False) -> None:
    """Raise :class:`PlanRefusal` for the first field that makes the pair unusable."""
    _check_equal("attention", prefill.attention, decode.attention,
                 "run both instances with the same model and attention backend")
    if prefill.model and decode.model:
        _check_equal("model", prefill.model, decode.model, "pair instances that serve the same model")
    _check_equal("num_layers", prefill.num_layers, decode.num_layers,
                 "pair instances of the same model (same layer count)")
    _check_equal("total_kv_heads", prefill.kv_heads, decode.kv_heads,
                 "pair instances of the same model, or fix total_kv_heads on the wrong side")
    _check_equal("head_dim", prefill.head_dim, decode.head_dim,
                 "pair instances of the same model (same head_dim / latent width)")
    _check_equal("dtype", prefill.dtype, decode.dtype,
                 "use the same kv-cache dtype on both sides; kvxferd does not convert dtypes")
    _check_equal("layout", prefill.layout, decode.layout,
                 "use the same KV layout on both sides (the same attention backend and device type)")
    if prefill.packed:
        _check_equal("page_size", prefill.page_size, decode.page_size,
                     f"run both instances with the same page (block) size: the {prefill.layout} layout stores "
                     "K and V of a whole page together, so pages move whole and cannot be re-cut")
    if require_same_page_size:
        _check_equal("page_size", prefill.page_size, decode.page_size,
                     "use equal page sizes or allow page-size mismatch")
    p_cover = _coverage(prefill)
    d_cover = _coverage(decode)
    if p_cover != d_cover:
        raise PlanRefusal(
            "Destination KV descriptors do not match prefill pp configuration: prefill layer_splits "
            f"{[list(s) for s in prefill.splits]} cover layers {p_cover}, decode layer_splits "
            f"{[list(s) for s in decode.splits]} cover {d_cover}",
            field="layer_splits", prefill=[list(s) for s in prefill.splits],
            decode=[list(s) for s in decode.splits],
            fix="make both instances' PP layer splits cover the same layers")


def _coverage(spec: InstanceSpec) -> list[list[int]]:
    merged: list[list[int]] = []
    for start, end in spec.splits:
        if merged and merged[-1][1] == start:
            merged[-1][1] = end
        else:
            merged.append([start, end])
    return merged


def _slice_bytes(heads: int, spec: InstanceSpec, prefill: InstanceSpec, decode: InstanceSpec) -> int:
    """Bytes per token of a ``heads``-wide slice.

    A slice narrower than a row on either side is cut at head boundaries, and the segment
    generator places it at ``head offset x bytes per head``, so one head must be whole
    bytes (DESIGN: page bytes / page_size / heads_per_rank), not only the slice.
    """
    head_bits = spec.head_slot_bits
    bits = heads * head_bits
    sliced = heads != prefill.local_heads or heads != decode.local_heads
    unit = head_bits if sliced else bits
    if unit < 8 or unit % 8:
        what = "zero" if unit < 8 else "a non-integral number of bytes"
        raise PlanRefusal(
            f"Head slice size evaluates to {what}: one head is head_dim {spec.head_dim} x "
            f"{spec.bits} bits = {head_bits} bits, and rows are cut into {heads}-head slices "
            f"(prefill tp_size {prefill.tp_size}, decode tp_size {decode.tp_size})",
            field="head_dim", prefill=prefill.tp_size, decode=decode.tp_size,
            fix="use tp sizes whose head slices are whole bytes, or a wider kv-cache dtype")
    return bits // 8


def pair(prefill: InstanceSpec, decode: InstanceSpec, *, mode: str = "auto",
         prefill_tensors: bool = True, decode_tensors: bool = True,
         require_same_page_size: bool = False) -> Plan:
    """Match one prefill spec to one decode spec (their cache groups left out), or raise
    :class:`PlanRefusal`.

    ``prefill_tensors``/``decode_tensors`` say whether the daemon holds a mapped tensor
    view of that side's KV buffers; staging gathers and scatters through them.
    """
    if mode not in MODES:
        raise PlanRefusal(f"mode must be one of {MODES}, got {mode!r}", field="mode",
                          prefill=mode, decode=mode, fix="use auto, direct or staged")
    check_compatible(prefill, decode, require_same_page_size=require_same_page_size)

    destinations = []
    for d_pp in range(decode.pp_size):
        d_layers = decode.layer_range(d_pp)
        for d_tp in range(decode.tp_size):
            d_heads = decode.head_range(d_tp)
            writers = []
            for p_pp in range(prefill.pp_size):
                p_layers = prefill.layer_range(p_pp)
                layers = (max(p_layers[0], d_layers[0]), min(p_layers[1], d_layers[1]))
                if layers[0] >= layers[1]:
                    continue
                for group_start in range(0, prefill.tp_size, prefill.replication):
                    p_heads = prefill.head_range(group_start)
                    heads = (max(p_heads[0], d_heads[0]), min(p_heads[1], d_heads[1]))
                    if heads[0] >= heads[1]:
                        continue
                    # spread destinations over the replicas of this head group
                    p_tp = group_start + d_tp % prefill.replication
                    writers.append(Writer(
                        tp_rank=p_tp, pp_rank=p_pp, heads=heads, layers=layers,
                        src_head_offset=heads[0] - p_heads[0], dst_head_offset=heads[0] - d_heads[0],
                        slice_bytes=_slice_bytes(heads[1] - heads[0], prefill, prefill, decode),
                        src_row_bytes=prefill.row_bytes, dst_row_bytes=decode.row_bytes))
            destinations.append(Destination(d_tp, d_pp, d_heads, d_layers, tuple(writers)))

    sliced = any(not w.whole_rows for d in destinations for w in d.writers)
    if mode == "auto":
        small = any(not w.whole_rows and w.slice_bytes <= STAGED_SLICE_BYTES
                    for d in destinations for w in d.writers)
        resolved = "staged" if sliced and small and prefill_tensors and decode_tensors else "direct"
    else:
        resolved = mode
    if resolved == "staged" and not (prefill_tensors and decode_tensors):
        missing = [name for name, held in (("prefill", prefill_tensors), ("decode", decode_tensors))
                   if not held]
        side = " and ".join(missing) + (" sides" if len(missing) > 1 else " side")
        raise PlanRefusal(
            f"kv_buffer_tensors is None on the {side}: staged mode gathers and scatters "
            "through the daemon's mapped view of the KV buffers, and none was registered there",
            field="kv_buffer_tensors", prefill=prefill_tensors, decode=decode_tensors,
            fix="register the ranks' KV buffers as shared memory or CUDA IPC regions, or use mode=direct")
    return Plan(prefill=prefill, decode=decode, destinations=tuple(destinations), mode=resolved)

"""Pairing two instance geometries: who writes which heads and layers of whom.

``make_plan`` is a pure function of the prefill and decode :class:`InstanceSpec`. Both
daemons of a pair compute it independently from the handshake and must agree, so it is
deterministic and depends on nothing but the two specs and the requested mode.

Rules (see DESIGN.md):
- every destination (head, layer) cell has exactly one writer;
- replicated prefill heads (tp > kv heads) are spread over replicas by destination rank;
- the writer set per destination is the smallest possible: one per overlapping
  (prefill head group, prefill layer range);
- page sizes may differ, the segment generator works in token runs (NHD); the
  packed_page layout moves whole pages, so there both page sizes must be equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import PlanRefusal
from .geometry import InstanceSpec

if TYPE_CHECKING:
    from .group_plan import GroupPlan

MODES = ("auto", "direct", "staged")

#: auto picks staged when one token row is cut into slices of at most this many bytes
STAGED_SLICE_BYTES = 4096


@dataclass(frozen=True)
class Writer:
    """One prefill rank writing one rectangle (heads x layers) of one decode rank."""

    tp_rank: int
    pp_rank: int
    heads: tuple[int, int]
    layers: tuple[int, int]
    src_head_offset: int  # first head of the slice, counted inside the source rank
    dst_head_offset: int  # ... and inside the destination rank
    slice_bytes: int      # bytes of the slice per token per layer per kind
    src_row_bytes: int
    dst_row_bytes: int
    group: str = ""  # the cache group it moves ("": the instance's full-attention KV)
    part: int = 0  # a state group's part (groups.Group.split_parts): one writer per part and rank

    @property
    def src(self) -> tuple[int, int]:
        return (self.tp_rank, self.pp_rank)

    @property
    def key(self) -> tuple[Any, ...]:
        """The writer's key at its destination: its rank, and its group when it has one."""
        return group_key(self.src, self.group, self.part)

    @property
    def whole_rows(self) -> bool:
        return self.slice_bytes == self.src_row_bytes == self.dst_row_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"tp_rank": self.tp_rank, "pp_rank": self.pp_rank, "heads": list(self.heads),
                "layers": list(self.layers), "src_head_offset": self.src_head_offset,
                "dst_head_offset": self.dst_head_offset, "slice_bytes": self.slice_bytes,
                **({"group": self.group} if self.group else {}), **({"part": self.part} if self.part else {})}


def group_key(coords: tuple[int, int], group: str, part: int = 0) -> tuple[Any, ...]:
    """Rank coordinates, extended by a group name (and a state part) for a cache group's chunks
    (a key of the per-writer and per-target bookkeeping on both sides)."""
    if not group:
        return coords
    return (*coords, group) if not part else (*coords, group, part)


@dataclass(frozen=True)
class Destination:
    tp_rank: int
    pp_rank: int
    heads: tuple[int, int]
    layers: tuple[int, int]
    writers: tuple[Writer, ...]

    @property
    def rank(self) -> tuple[int, int]:
        return (self.tp_rank, self.pp_rank)

    def to_dict(self) -> dict[str, Any]:
        return {"tp_rank": self.tp_rank, "pp_rank": self.pp_rank, "heads": list(self.heads),
                "layers": list(self.layers), "writers": [w.to_dict() for w in self.writers]}


@dataclass(frozen=True)
class Plan:
    prefill: InstanceSpec
    decode: InstanceSpec
    destinations: tuple[Destination, ...]
    mode: str  # "direct" or "staged": the resolved mode
    groups: tuple["GroupPlan", ...] = ()  # one sub-plan per cache group (kvxferd.group_plan)

    def destination(self, tp_rank: int, pp_rank: int) -> Destination:
        return self.destinations[pp_rank * self.decode.tp_size + tp_rank]

    def writers_of(self, tp_rank: int, pp_rank: int) -> list[Writer]:
        """Every writer of a decode rank, the cache groups' included."""
        out = list(self.destination(tp_rank, pp_rank).writers)
        for g in self.groups:
            out += g.plan.destination(tp_rank, pp_rank).writers
        return out

    def all_targets_of(self, tp_rank: int, pp_rank: int) -> list[tuple[Destination, Writer]]:
        """Every (destination, writer) a prefill rank is responsible for, in every group."""
        out = self.targets_of(tp_rank, pp_rank)
        for g in self.groups:
            out += g.plan.targets_of(tp_rank, pp_rank)
        return out

    def group(self, name: str) -> "GroupPlan":
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def group_kind(self, name: str) -> str:
        """``full`` for the default group, else the group's kind (a bounded metric label)."""
        return self.group(name).kind if name else "full"

    def targets_of(self, tp_rank: int, pp_rank: int) -> list[tuple[Destination, Writer]]:
        """Every (destination, writer) a prefill rank is responsible for."""
        return [(d, w) for d in self.destinations for w in d.writers if w.src == (tp_rank, pp_rank)]

    @property
    def sliced(self) -> bool:
        """True when some token rows travel as head slices (TP mismatch on MHA)."""
        return any(not w.whole_rows for d in self.destinations for w in d.writers)

    def fragments_per_page(self) -> int:
        """Most contiguous pieces one destination page (of one layer and kind) is written in.

        Counted for requests that start at token 0 on both sides with scattered pages: a
        whole-row writer contributes one piece per source page the destination page
        overlaps, a head-slice writer one piece per token.
        """
        ps_d, ps_p = self.decode.page_size, self.prefill.page_size
        period = ps_p // math.gcd(ps_p, ps_d)
        whole = max(len({t // ps_p for t in range(k * ps_d, (k + 1) * ps_d)}) for k in range(period))
        worst = 1
        for dest in self.destinations:
            per_layer: dict[int, int] = {}
            for w in dest.writers:
                # a packed page is one slot: a writer's head slice of it is one contiguous piece
                pieces = whole if w.whole_rows else ps_d // self.decode.slot_tokens
                per_layer[w.layers[0]] = per_layer.get(w.layers[0], 0) + pieces
            worst = max([worst, *per_layer.values()])
        return worst

    def to_dict(self) -> dict[str, Any]:
        out = {"compatible": True, "mode": self.mode, "sliced": self.sliced,
               "fragments_per_page": self.fragments_per_page(),
               "prefill": self.prefill.to_dict(), "decode": self.decode.to_dict(),
               "destinations": [d.to_dict() for d in self.destinations]}
        if self.groups:
            spec = self.decode
            out["bytes_per_token"] = (spec.num_layers * len(spec.region_kinds) * spec.kv_heads * spec.head_slot_bits
                                    // 8 // spec.slot_tokens)
            out["groups"] = [g.to_dict() for g in self.groups]
        return out


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


def make_plan(prefill: InstanceSpec, decode: InstanceSpec, *, mode: str = "auto",
              prefill_tensors: bool = True, decode_tensors: bool = True,
              require_same_page_size: bool = False) -> Plan:
    """Match a prefill instance to a decode instance, or raise :class:`PlanRefusal`.

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
    groups: tuple[GroupPlan, ...] = ()
    if prefill.groups or decode.groups:
        from .group_plan import group_plans
        groups = group_plans(prefill, decode, mode if mode == "auto" else resolved, prefill_tensors, decode_tensors)
        if mode == "auto" and any(g.plan.mode == "staged" for g in groups):
            resolved = "staged"  # one mode per pair: a group's small head slices make it staged
    return Plan(prefill=prefill, decode=decode, destinations=tuple(destinations), mode=resolved, groups=groups)

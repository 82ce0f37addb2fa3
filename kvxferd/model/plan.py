"""What a plan says: which prefill rank (a writer) writes which heads and layers of which
decode rank, for the instance's full-attention KV and for each cache group.

A plan is made by :func:`~kvxferd.model.planner.make_plan` and is a pure value: the source daemon
makes it from the two specs and sends it to the decode daemon (:mod:`kvxferd.model.plan_wire`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .geometry import InstanceSpec


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
    groups: tuple["GroupPlan", ...] = ()  # one sub-plan per cache group (kvxferd.model.group_plan)

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


@dataclass(frozen=True)
class GroupPlan:
    """The sub-plan of one cache group; its writers are tagged with ``name``."""

    name: str
    kind: str
    window: int | None
    plan: "Plan"

    def bytes_per_unit(self) -> int:
        """Bytes the whole group moves per token (KV groups) or per request (state groups),
        counted once per head (replicas not counted twice)."""
        spec = self.plan.decode
        kinds = len(spec.region_kinds)
        per_slot = spec.num_layers * kinds * spec.kv_heads * spec.head_slot_bits // 8
        # a packed slot is a whole page of tokens
        return per_slot * spec.page_size if self.kind == "state" else per_slot // spec.slot_tokens

    def to_dict(self) -> dict[str, Any]:
        unit = "request" if self.kind == "state" else "token"
        out: dict[str, Any] = {"name": self.name, "kind": self.kind, "sliced": self.plan.sliced,
                               f"bytes_per_{unit}": self.bytes_per_unit(),
                               "destinations": [d.to_dict() for d in self.plan.destinations]}
        if self.window is not None:
            out["window"] = self.window
            # a packed layout moves whole pages: the window's tokens may touch one page more
            unit = self.plan.decode.slot_tokens
            tokens = self.window if unit == 1 else (-(-(self.window - 1) // unit) + 1) * unit
            out["max_bytes_per_request"] = self.bytes_per_unit() * tokens
        return out

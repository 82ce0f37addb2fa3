"""Cache groups beyond the full-attention KV: sliding-window KV, draft-model KV, per-request state.

Models in use no longer hold one uniform KV cache. An instance's full-attention KV (what
:class:`~kvxferd.model.geometry.InstanceSpec` describes on its own) is its *default group*; a
:class:`Group` describes one more:

- ``window``: sliding-window attention layers (gpt-oss, Gemma): KV pages of their own
  (their own page table per request), of which only the last ``window`` tokens of the
  prompt move;
- ``draft``: a speculative-decoding draft model's KV: its own layers, heads, head_dim and
  page table, moved whole like the default group;
- ``state``: per-request fixed-size tensors of state-space / linear-attention layers
  (Mamba conv and SSM state), one per layer, addressed by a *state slot*; ``shape`` is the
  unsplit per-request tensor and ``split_dim`` the dimension TP splits (like KV heads),
  ``None`` when every TP rank holds it whole.

Every group is mapped onto an ordinary :class:`~kvxferd.model.geometry.InstanceSpec` (the
instance's TP and PP, the group's own layers split over the stages), so the planner, the
segment generator and the transports move it unchanged:

- a KV group is that spec with its own layers, heads, head_dim, dtype and page size, in the
  instance's layout (its pages sit in the same engine memory as the instance's own KV);
- a state group of shape ``(d0, .., dk)`` split on ``s`` is attention ``state`` (one region
  kind, ``state``) with ``page_size = d0*..*d(s-1)`` rows per slot, ``total_kv_heads = ds``
  and ``head_dim = d(s+1)*..*dk``: a state slot is one "page", a TP split of ``ds`` is a
  head slice of every row, so heterogeneous TP cuts it exactly like KV heads.

Regions of a group are registered as ``(layer, "<group>.<kind>")`` with the group's own
layer numbers ``[0, num_layers)``. Pure data and validation; nothing here does I/O.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import GeometryError

GROUP_KINDS = ("window", "draft", "state")
#: the label of the default (full-attention) group in plans and metrics
DEFAULT_GROUP = "full"
STATE_ATTENTION = "state"
MAX_GROUPS = 16
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,23}$")

_COMMON = ("name", "kind", "num_layers", "dtype", "layer_splits")
_FIELDS = {
    "window": _COMMON + ("attention", "head_dim", "total_kv_heads", "page_size", "window"),
    "draft": _COMMON + ("attention", "head_dim", "total_kv_heads", "page_size"),
    "state": _COMMON + ("shape", "split_dim", "split_parts"),
}


def qualified_kind(group: str, kind: str) -> str:
    """The region kind a group's region is registered under (``swa.k``, ``conv.state``)."""
    return f"{group}.{kind}" if group else kind


def _int(group: str, name: str, value: Any, minimum: int, maximum: int = 1 << 16) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise GeometryError(f"group {group!r}: {name} must be an integer in [{minimum}, {maximum}], got {value!r}",
                            field=f"groups.{group}.{name}",
                            fix=f"set {name} of group {group!r} to an integer in [{minimum}, {maximum}]")
    return value


@dataclass(frozen=True)
class Group:
    """One cache group of an instance beside its full-attention KV (see the module doc)."""

    name: str
    kind: str
    num_layers: int
    dtype: str | None = None  # KV groups: the instance's dtype when unset
    attention: str = "mha"
    head_dim: int | None = None
    total_kv_heads: int | None = None
    page_size: int | None = None  # KV groups: the instance's page size when unset
    window: int | None = None
    shape: tuple[int, ...] | None = None
    split_dim: int | None = None
    #: sizes of the parts ``split_dim`` concatenates, each split by TP on its own (Mamba2's conv
    #: channels x|B|C, Qwen3-Next's q|k|v): a rank holds its slice of every part, part after part
    split_parts: tuple[int, ...] | None = None
    #: PP: ``[start, end)`` of the group's own layers on each stage, like the instance's
    #: ``layer_splits`` (None: split evenly, the first stages one more). A fact of one instance,
    #: never compared with the peer's: the planner cuts PP mismatches per group as for the KV
    layer_splits: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise GeometryError(f"group name {self.name!r} must be 1-24 characters of a-z, 0-9 and _, "
                                "starting with a letter", field="groups.name",
                                fix="name the group like 'swa', 'draft', 'conv'")
        if self.kind not in GROUP_KINDS:
            raise GeometryError(f"group {self.name!r}: kind {self.kind!r} is not one of {GROUP_KINDS}",
                                field=f"groups.{self.name}.kind", fix=f"use one of {GROUP_KINDS}")
        _int(self.name, "num_layers", self.num_layers, 1)
        if isinstance(self.layer_splits, list):  # hashable like the rest; the instance spec checks the ranges
            object.__setattr__(self, "layer_splits", tuple(tuple(r) if isinstance(r, list) else r
                                                           for r in self.layer_splits))
        if self.kind == "state":
            self._check_state()
        else:
            self._check_kv()

    def _check_kv(self) -> None:
        if self.attention not in ("mha", "mla"):
            raise GeometryError(f"group {self.name!r}: attention {self.attention!r} is not 'mha' or 'mla'",
                                field=f"groups.{self.name}.attention", fix="use 'mha' or 'mla'")
        if self.head_dim is None:
            raise GeometryError(f"group {self.name!r} ({self.kind}) has no head_dim",
                                field=f"groups.{self.name}.head_dim", fix="give the group's head_dim")
        _int(self.name, "head_dim", self.head_dim, 1)
        if self.kind == "window":
            if self.window is None:
                raise GeometryError(f"group {self.name!r} is a sliding-window group without a window",
                                    field=f"groups.{self.name}.window",
                                    fix="give the window size in tokens (the model's sliding_window)")
            _int(self.name, "window", self.window, 1, 1 << 40)
        elif self.window is not None:
            raise GeometryError(f"group {self.name!r} of kind {self.kind} has a window ({self.window})",
                                field=f"groups.{self.name}.window", fix="use kind 'window' or drop window")
        if self.shape is not None or self.split_dim is not None:
            raise GeometryError(f"group {self.name!r} of kind {self.kind} has a state shape",
                                field=f"groups.{self.name}.shape", fix="use kind 'state' for state tensors")

    def _check_state(self) -> None:
        if self.dtype is None:
            raise GeometryError(f"state group {self.name!r} has no dtype", field=f"groups.{self.name}.dtype",
                                fix="give the state tensor's dtype (e.g. float32)")
        shape = self.shape
        if (not isinstance(shape, tuple) or not 1 <= len(shape) <= 8
                or not all(isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= 1 << 24 for d in shape)):
            raise GeometryError(f"state group {self.name!r}: shape must list 1 to 8 integers in "
                                f"[1, 2^24], got {shape!r}", field=f"groups.{self.name}.shape",
                                fix="give the per-request, per-layer state tensor's full (unsplit) shape")
        if self.split_dim is not None and not (isinstance(self.split_dim, int) and not isinstance(self.split_dim, bool)
                                               and 0 <= self.split_dim < len(shape)):
            raise GeometryError(f"state group {self.name!r}: split_dim {self.split_dim!r} is not a dimension of "
                                f"shape {list(shape)}", field=f"groups.{self.name}.split_dim",
                                fix=f"give a dimension in [0, {len(shape)}) or omit it (not split by TP)")
        if self.split_parts is not None:
            parts = self.split_parts
            if (self.split_dim is None or not isinstance(parts, tuple) or not 1 <= len(parts) <= 16
                    or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 1 for p in parts)
                    or sum(parts) != shape[self.split_dim]):
                size = shape[self.split_dim] if self.split_dim is not None else None
                raise GeometryError(f"state group {self.name!r}: split_parts {parts!r} must be 1 to 16 positive sizes "
                                    f"adding up to dimension split_dim ({size})",
                                    field=f"groups.{self.name}.split_parts",
                                    fix="list the sizes of the parts the split dimension concatenates, or omit it")
        for name in ("head_dim", "total_kv_heads", "page_size", "window"):
            if getattr(self, name) is not None:
                raise GeometryError(f"state group {self.name!r} has {name}", field=f"groups.{self.name}.{name}",
                                    fix="describe a state group by shape, split_dim and dtype only")

    # -- the group as an ordinary instance spec ---------------------------------------------
    def spec_fields(self, instance: Any) -> dict[str, Any]:
        """Keyword arguments of the :class:`InstanceSpec` this group is moved as: the instance's TP
        and PP, the group's own layers split over the PP stages (each stage holds its own layers of
        every group, a state group's included)."""
        tp = instance.tp_size
        stages = dict(pp_size=instance.pp_size, layer_splits=self.layer_splits)
        if self.kind == "state":
            assert self.shape is not None
            split = self.split_dim
            if split is None:  # every rank holds it whole: one "head" replicated over TP
                rows, heads, inner = 1, 1, math.prod(self.shape)
            else:
                rows, heads, inner = (math.prod(self.shape[:split]), self.shape[split],
                                      math.prod(self.shape[split + 1:]))
                for part in self.split_parts or ():
                    if part % tp:
                        raise GeometryError(
                            f"state group {self.name!r}: part {part} of split_parts {list(self.split_parts or ())} "
                            f"is not divisible by tp_size {tp}", field=f"groups.{self.name}.split_parts",
                            fix="use a tp_size that divides every part (parts are split by TP one by one)")
                if heads % tp and tp % heads:
                    raise GeometryError(
                        f"state group {self.name!r}: dimension {split} of shape {list(self.shape)} has {heads} "
                        f"entries, which tp_size {tp} can neither divide nor replicate evenly",
                        field=f"groups.{self.name}.split_dim",
                        fix="split the state along a dimension whose size tp_size divides (or is a multiple of), "
                            "or set split_dim to null if every rank holds it whole")
            return dict(attention=STATE_ATTENTION, num_layers=self.num_layers, head_dim=inner,
                        dtype=self.dtype, page_size=rows, tp_size=tp, total_kv_heads=heads, **stages)
        heads = self.total_kv_heads
        if self.attention == "mha" and heads is None:
            raise GeometryError(f"group {self.name!r} ({self.kind}) has no total_kv_heads",
                                field=f"groups.{self.name}.total_kv_heads",
                                fix="give the group's number of KV heads (num_key_value_heads)")
        # a KV group lives in the same engine memory as the instance's own KV, so it has its
        # layout (vLLM's CPU packed pages, its GPU NHD_kv); SGLang's NHD is the default
        return dict(attention=self.attention, num_layers=self.num_layers, head_dim=self.head_dim,
                    dtype=self.dtype or instance.dtype, page_size=self.page_size or instance.page_size,
                    tp_size=tp, total_kv_heads=heads, layout=instance.layout, **stages)

    @property
    def per_request(self) -> bool:
        """State groups move once per request (the state after the last token), not per token."""
        return self.kind == "state"

    def compared(self, instance: Any) -> dict[str, Any]:
        """What must be equal on both sides of a pair, with resolved defaults."""
        out = {k: getattr(self, k) for k in _FIELDS[self.kind] if k not in ("name", "page_size", "layer_splits")}
        if self.kind != "state":
            out["dtype"] = self.dtype or instance.dtype
        if self.shape is not None:
            out["shape"] = list(self.shape)
        if self.kind == "state":
            out["split_parts"] = list(self.split_parts or ()) or None
        return out

    def parts(self) -> tuple[int, ...]:
        """Sizes along the split dimension that TP splits one by one (one part unless split_parts)."""
        if self.kind != "state" or self.split_dim is None or self.shape is None:
            return ()
        return self.split_parts or (self.shape[self.split_dim],)

    # -- (de)serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in _FIELDS[self.kind]:
            value = getattr(self, name)
            if value is None or (name == "attention" and value == "mha"):
                continue
            if name == "layer_splits":
                value = [list(r) for r in value]
            out[name] = list(value) if name in ("shape", "split_parts") else value
        if self.kind == "state" and self.split_dim is None:
            out["split_dim"] = None
        return out

    @classmethod
    def from_dict(cls, data: Any) -> "Group":
        if not isinstance(data, Mapping):
            raise GeometryError(f"a group must be a mapping, got {type(data).__name__}", field="groups",
                                fix="send each group as a dict of its fields")
        name = data.get("name")
        kind = data.get("kind")
        label = name if isinstance(name, str) else "?"
        if kind not in GROUP_KINDS:
            raise GeometryError(f"group {label!r}: kind {kind!r} is not one of {GROUP_KINDS}",
                                field=f"groups.{label}.kind", fix=f"use one of {GROUP_KINDS}")
        data = {k: v for k, v in data.items() if v is not None}  # an explicit null is the default
        unknown = sorted(set(data) - set(_FIELDS[kind]), key=str)
        if unknown:
            raise GeometryError(f"group {label!r}: unknown field(s) {unknown} for kind {kind}",
                                field=f"groups.{label}.{unknown[0]}", fix=f"use only {list(_FIELDS[kind])}")
        kwargs = dict(data)
        for key in ("shape", "split_parts"):
            if isinstance(kwargs.get(key), list):
                kwargs[key] = tuple(kwargs[key])
        for key in ("dtype", "attention"):
            if key in kwargs and kwargs[key] is not None and not isinstance(kwargs[key], str):
                raise GeometryError(f"group {label!r}: {key} must be a string, got {kwargs[key]!r}",
                                    field=f"groups.{label}.{key}", fix=f"give {key} as a string")
        if "num_layers" not in kwargs:
            raise GeometryError(f"group {label!r} has no num_layers", field=f"groups.{label}.num_layers",
                                fix="give the number of layers in the group")
        return cls(**kwargs)


def parse_groups(raw: Any) -> tuple[Group, ...]:
    """A geometry's ``groups`` list, validated; names unique."""
    if raw is None:
        return ()
    if not isinstance(raw, (list, tuple)) or len(raw) > MAX_GROUPS:
        raise GeometryError(f"groups must be a list of at most {MAX_GROUPS} groups, got {type(raw).__name__}",
                            field="groups", fix="send groups as a list of dicts")
    groups = tuple(g if isinstance(g, Group) else Group.from_dict(g) for g in raw)
    names = [g.name for g in groups]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise GeometryError(f"group name {dup[0]!r} is used twice", field=f"groups.{dup[0]}.name",
                            fix="give every group its own name")
    return groups

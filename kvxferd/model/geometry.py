"""KV-cache geometry: what an instance's and a rank's cache look like.

An :class:`InstanceSpec` is what every rank of one engine deployment shares (model shape,
parallel layout, page size); a :class:`RankGeometry` adds the rank's coordinates and its
page count. Everything here is pure and validated at construction, so the planner and the
daemon never see a geometry that cannot be laid out in memory.

Layouts (``InstanceSpec.layout``):

- ``NHD`` (SGLang, vLLM on GPU): per local layer one tensor ``[num_pages, page_size,
  heads_per_rank, head_dim]`` for K and one for V (MHA), or one latent tensor (MLA,
  treated as a single KV "head" of width ``head_dim`` that every TP rank holds in full).
  Every token is addressable: a *slot* is one token row.
- ``packed_page`` (vLLM's CPU attention): per local layer ONE region, kind ``kv``, of
  ``[num_pages, heads_per_rank, 2 * page_size * head_dim]`` elements: inside a (page,
  head) K is stored transposed and V after it, so tokens are not addressable one by one.
  A slot is one whole page; a head is a contiguous unit of ``2 * page_size * head_dim``
  elements inside it, so head slices (TP mismatch) are still contiguous runs. MHA only.
- ``NHD_kv`` (vLLM's GPU attention backends, cache layout ``LBNHC``, alias ``NHD``): per
  local layer ONE region, kind ``kv``, of ``[num_pages, page_size, heads_per_rank,
  2 * head_dim]`` elements: each token row holds, head after head, that head's K then its
  V. A slot is one token row; a head is a contiguous unit of ``2 * head_dim`` elements of
  it, so head slices are contiguous runs as in ``NHD``. MHA only.
- ``HND_kv`` (vLLM's GPU layout ``LBHNC``, alias ``HND``): per local layer ONE region of
  ``[num_pages, heads_per_rank, page_size, 2 * head_dim]``: the same bytes per (page, head)
  as ``packed_page`` (a contiguous unit of ``2 * page_size * head_dim`` elements), with K
  and V interleaved per token inside it instead of CPU attention's packing. Moved exactly
  like ``packed_page``: whole pages, equal page sizes. A distinct name, so a CPU engine and
  a GPU engine never pair (their page interiors differ). MHA only.

Everything downstream (planner, segments, transports) works in slots of ``row_bytes``;
:attr:`InstanceSpec.slot_tokens` is the one place that says how many tokens a slot holds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from ..errors import GeometryError
from .groups import STATE_ATTENTION, Group, parse_groups, qualified_kind

ATTENTION_KINDS = ("mha", "mla")
LAYOUTS = ("NHD", "packed_page", "NHD_kv", "HND_kv")
PACKED = "packed_page"
#: layouts whose slot is a whole page ([pages, heads, unit]): tokens are not addressable
PACKED_LAYOUTS = (PACKED, "HND_kv")
#: layouts with ONE region per layer (kind "kv") holding K and V of every head
KV_LAYOUTS = (PACKED, "NHD_kv", "HND_kv")

#: bits per element; sub-byte types are packed, so a head slice can be non-integral bytes.
DTYPE_BITS: dict[str, int] = {
    "float32": 32,
    "float16": 16,
    "bfloat16": 16,
    "float8_e4m3fn": 8,
    "float8_e5m2": 8,
    "int8": 8,
    "uint8": 8,
    "float4_e2m1fn_x2": 4,
    "int4": 4,
}

#: region kinds per attention kind, in the order they travel on the wire.
REGION_KINDS: dict[str, tuple[str, ...]] = {"mha": ("k", "v"), "mla": ("latent",), STATE_ATTENTION: ("state",)}


def even_layer_splits(num_layers: int, pp_size: int) -> tuple[tuple[int, int], ...]:
    """Split layers over PP ranks; the first ``num_layers % pp_size`` ranks get one more."""
    base, extra = divmod(num_layers, pp_size)
    splits = []
    start = 0
    for rank in range(pp_size):
        end = start + base + (1 if rank < extra else 0)
        splits.append((start, end))
        start = end
    return tuple(splits)


def _require_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise GeometryError(f"{name} must be an integer, got {value!r}", field=name,
                            fix=f"set {name} to an integer >= {minimum}")
    if value < minimum:
        raise GeometryError(f"{name} must be >= {minimum}, got {value}", field=name,
                            fix=f"set {name} to an integer >= {minimum}")
    return value


@dataclass(frozen=True)
class InstanceSpec:
    """The KV-cache layout shared by all ranks of one engine instance."""

    attention: str
    num_layers: int
    head_dim: int
    dtype: str
    page_size: int
    tp_size: int = 1
    pp_size: int = 1
    total_kv_heads: int | None = None
    heads_per_rank: int | None = None
    layer_splits: tuple[tuple[int, int], ...] | None = None
    layout: str = "NHD"
    model: str | None = None
    #: cache groups beside the full-attention KV (kvxferd.model.groups); empty for a uniform cache
    groups: tuple[Group, ...] = ()
    kv_heads: int = field(init=False, repr=False)
    splits: tuple[tuple[int, int], ...] = field(init=False, repr=False)
    group_specs: tuple[tuple[str, "InstanceSpec"], ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        # "state" is what a state group is moved as (kvxferd.model.groups), never an instance's own attention
        if self.attention not in ATTENTION_KINDS and not (self.attention == STATE_ATTENTION and not self.groups):
            raise GeometryError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}",
                                field="attention", fix="use 'mha' (separate K and V) or 'mla' (one latent)")
        _require_int("num_layers", self.num_layers, 1)
        _require_int("head_dim", self.head_dim, 1)
        _require_int("page_size", self.page_size, 1)
        _require_int("tp_size", self.tp_size, 1)
        _require_int("pp_size", self.pp_size, 1)
        if self.dtype not in DTYPE_BITS:
            raise GeometryError(f"dtype {self.dtype!r} is not supported", field="dtype",
                                fix=f"use one of {sorted(DTYPE_BITS)}")
        if self.layout not in LAYOUTS:
            raise GeometryError(f"layout {self.layout!r} is not supported", field="layout",
                                fix=f"use one of {LAYOUTS}")
        if self.layout in KV_LAYOUTS and self.attention != "mha":
            raise GeometryError(f"layout {self.layout!r} holds K and V of MHA; attention is {self.attention!r}",
                                field="layout", fix="use layout 'NHD' for MLA caches")
        object.__setattr__(self, "kv_heads", self._resolve_kv_heads())
        object.__setattr__(self, "splits", self._resolve_splits())
        # rows must be whole bytes, or no page can be addressed
        bits = self.local_heads * self.head_dim * DTYPE_BITS[self.dtype]
        if bits % 8 and not self.packed:
            raise GeometryError(
                f"one token row of a rank is {bits} bits ({self.local_heads} heads x head_dim "
                f"{self.head_dim} x {DTYPE_BITS[self.dtype]} bits), not whole bytes",
                field="head_dim", fix="use an even head_dim with packed 4-bit dtypes")
        if self.groups:
            self._resolve_groups()

    # -- groups ------------------------------------------------------------------------
    def _resolve_groups(self) -> None:
        groups = parse_groups(self.groups)
        object.__setattr__(self, "groups", groups)
        specs = []
        for g in groups:
            if g.layer_splits is None and g.num_layers < self.pp_size:
                # every stage holds at least one layer of every group (a stage without any would
                # hold nothing of it to send or expect)
                raise GeometryError(
                    f"group {g.name!r} has num_layers {g.num_layers}, fewer than pp_size {self.pp_size}: every PP "
                    "stage must hold at least one layer of every group", field=f"groups.{g.name}.num_layers",
                    fix=f"run group {g.name!r} with a pp_size of at most {g.num_layers}, or leave the group out")
            try:
                specs.append((g.name, InstanceSpec(**g.spec_fields(self))))
            except GeometryError as exc:
                if exc.field and exc.field.startswith("groups."):
                    raise
                where = ("shape" if g.kind == "state" and exc.field not in ("layer_splits", "pp_size")
                         else exc.field)
                raise GeometryError(f"group {g.name!r}: {exc.message}", field=f"groups.{g.name}.{where}",
                                    fix=exc.fix) from None
        object.__setattr__(self, "group_specs", tuple(specs))

    def group(self, name: str) -> Group:
        for g in self.groups:
            if g.name == name:
                return g
        raise GeometryError(f"no cache group {name!r}; this instance has {[g.name for g in self.groups]}",
                            field="groups", fix="name a group of the instance's geometry")

    def group_spec(self, name: str) -> "InstanceSpec":
        """The InstanceSpec a group is moved as (``""``: the instance's own full-attention KV)."""
        if not name:
            return self
        for n, spec in self.group_specs:
            if n == name:
                return spec
        self.group(name)
        raise AssertionError(name)

    # -- heads -------------------------------------------------------------------------
    def _resolve_kv_heads(self) -> int:
        if self.attention == "mla":
            if self.total_kv_heads not in (None, 1):
                raise GeometryError(f"MLA caches one latent per token, so total_kv_heads must be 1, "
                                    f"got {self.total_kv_heads}", field="total_kv_heads",
                                    fix="omit total_kv_heads for MLA or set it to 1")
            return 1
        total = self.total_kv_heads
        if total is None:
            if self.heads_per_rank is None:
                raise GeometryError(
                    "Cannot resolve total_kv_heads: neither total_kv_heads nor heads_per_rank is set",
                    field="total_kv_heads",
                    fix="set total_kv_heads to the model's number of KV heads (num_key_value_heads)")
            _require_int("heads_per_rank", self.heads_per_rank, 1)
            # heads_per_rank * tp is only the model total when no head is replicated
            total = self.heads_per_rank * self.tp_size
        _require_int("total_kv_heads", total, 1)
        if self.tp_size <= total:
            if total % self.tp_size:
                raise GeometryError(f"total_kv_heads {total} is not divisible by tp_size {self.tp_size}",
                                    field="tp_size", fix="use a tp_size that divides the KV head count")
        elif self.tp_size % total:
            raise GeometryError(f"tp_size {self.tp_size} exceeds total_kv_heads {total} but is not a "
                                "multiple of it, so heads cannot be replicated evenly",
                                field="tp_size", fix="use a tp_size that is a multiple of the KV head count")
        expected = max(1, total // self.tp_size)
        if self.heads_per_rank is not None and self.heads_per_rank != expected:
            raise GeometryError(f"heads_per_rank {self.heads_per_rank} does not match total_kv_heads "
                                f"{total} over tp_size {self.tp_size} (expected {expected})",
                                field="heads_per_rank", fix=f"set heads_per_rank to {expected} or omit it")
        return total

    @property
    def local_heads(self) -> int:
        """KV heads each TP rank holds (1 when heads are replicated)."""
        return max(1, self.kv_heads // self.tp_size)

    @property
    def replication(self) -> int:
        """How many TP ranks hold each head (1 unless tp_size > kv_heads)."""
        return max(1, self.tp_size // self.kv_heads)

    def head_range(self, tp_rank: int) -> tuple[int, int]:
        """Global ``[start, end)`` of KV heads held by ``tp_rank``."""
        if not 0 <= tp_rank < self.tp_size:
            raise GeometryError(f"tp_rank {tp_rank} outside [0, {self.tp_size})", field="tp_rank",
                                fix="use a tp_rank below tp_size")
        start = (tp_rank // self.replication) * self.local_heads
        return start, start + self.local_heads

    # -- layers ------------------------------------------------------------------------
    def _resolve_splits(self) -> tuple[tuple[int, int], ...]:
        if self.layer_splits is None:
            if self.num_layers < self.pp_size:
                raise GeometryError(f"num_layers {self.num_layers} is smaller than pp_size {self.pp_size}",
                                    field="pp_size", fix="use a pp_size no larger than num_layers")
            return even_layer_splits(self.num_layers, self.pp_size)
        raw = self.layer_splits
        if not isinstance(raw, (list, tuple)) or len(raw) != self.pp_size:
            raise GeometryError(f"layer_splits must list one [start, end) per PP rank ({self.pp_size}), "
                                f"got {raw!r}", field="layer_splits", fix="give pp_size ranges")
        splits: list[tuple[int, int]] = []
        previous_end = 0
        for rank, item in enumerate(raw):
            if (not isinstance(item, (list, tuple)) or len(item) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in item)):
                raise GeometryError(f"layer_splits[{rank}] must be [start, end), got {item!r}",
                                    field="layer_splits", fix="give integer pairs")
            start, end = item
            if not (previous_end <= start < end <= self.num_layers):
                raise GeometryError(
                    f"layer_splits[{rank}] = [{start}, {end}) must be non-empty, in order, not overlap "
                    f"the previous range and lie within [0, {self.num_layers})",
                    field="layer_splits", fix="list ascending, disjoint ranges inside the model")
            splits.append((start, end))
            previous_end = end
        return tuple(splits)

    def layer_range(self, pp_rank: int) -> tuple[int, int]:
        if not 0 <= pp_rank < self.pp_size:
            raise GeometryError(f"pp_rank {pp_rank} outside [0, {self.pp_size})", field="pp_rank",
                                fix="use a pp_rank below pp_size")
        return self.splits[pp_rank]

    # -- bytes -------------------------------------------------------------------------
    @property
    def bits(self) -> int:
        return DTYPE_BITS[self.dtype]

    @property
    def packed(self) -> bool:
        """Slots are whole pages (``packed_page``, ``HND_kv``): pages move whole."""
        return self.layout in PACKED_LAYOUTS

    @property
    def region_kinds(self) -> tuple[str, ...]:
        if self.layout in KV_LAYOUTS:
            return ("kv",)
        return REGION_KINDS[self.attention]

    @property
    def slot_tokens(self) -> int:
        """Tokens in one addressable slot: 1 (a token row) or page_size (a packed page)."""
        return self.page_size if self.packed else 1

    @property
    def head_slot_bits(self) -> int:
        """Bits of one head in one slot: a head's K (or V, or latent) of one token (NHD); its
        K and V of one token (NHD_kv); its K and V of page_size tokens (packed layouts)."""
        per_token = self.head_dim * self.bits
        if self.packed:
            return 2 * self.page_size * per_token
        return 2 * per_token if self.layout in KV_LAYOUTS else per_token

    @property
    def row_bytes(self) -> int:
        """Bytes of one slot of one layer of one region kind on one rank (NHD: one token row)."""
        return self.local_heads * self.head_slot_bits // 8

    @property
    def page_bytes(self) -> int:
        return self.page_size // self.slot_tokens * self.row_bytes

    # -- (de)serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("kv_heads")
        data.pop("splits")
        data.pop("group_specs")
        if self.groups:  # left out when empty: a uniform cache's geometry is what it always was
            data["groups"] = [g.to_dict() for g in self.groups]
        else:
            data.pop("groups")
        data["total_kv_heads"] = self.kv_heads
        data["layer_splits"] = [list(s) for s in self.splits]
        data.pop("heads_per_rank")
        return {k: v for k, v in data.items() if v is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "InstanceSpec":
        if not isinstance(data, Mapping):
            raise GeometryError(f"geometry must be a mapping, got {type(data).__name__}",
                                field="geometry", fix="send a dict of geometry fields")
        known = {"attention", "num_layers", "head_dim", "dtype", "page_size", "tp_size", "pp_size",
                 "total_kv_heads", "heads_per_rank", "layer_splits", "layout", "model", "groups"}
        unknown = sorted(set(data) - known - {"tp_rank", "pp_rank", "num_pages", "page_stride", "group_pages"})
        if unknown:
            raise GeometryError(f"unknown geometry field(s) {unknown}", field=unknown[0],
                                fix=f"use only {sorted(known)}")
        missing = [k for k in ("attention", "num_layers", "head_dim", "dtype", "page_size") if k not in data]
        if missing:
            raise GeometryError(f"geometry is missing {missing}", field=missing[0],
                                fix="give every required geometry field")
        kwargs = {k: data[k] for k in known if k in data}
        splits = kwargs.get("layer_splits")
        if isinstance(splits, (list, tuple)):
            kwargs["layer_splits"] = tuple(tuple(s) if isinstance(s, (list, tuple)) else s for s in splits)
        model = kwargs.get("model")
        if model is not None and not isinstance(model, str):
            raise GeometryError(f"model must be a string, got {model!r}", field="model", fix="name the model")
        for name in ("attention", "dtype", "layout"):
            if name in kwargs and not isinstance(kwargs[name], str):
                raise GeometryError(f"{name} must be a string, got {kwargs[name]!r}", field=name,
                                    fix=f"give {name} as a string")
        if kwargs["attention"] not in ATTENTION_KINDS:
            raise GeometryError(f"attention must be one of {ATTENTION_KINDS}, got {kwargs['attention']!r}",
                                field="attention", fix="use 'mha' (separate K and V) or 'mla' (one latent)")
        kwargs["groups"] = parse_groups(kwargs.get("groups"))
        return cls(**kwargs)


def rank_id(instance: str, tp_rank: int, pp_rank: int) -> str:
    """How engines, logs and the directory name one rank of an instance."""
    return f"{instance}/tp{tp_rank}/pp{pp_rank}"


@dataclass(frozen=True)
class RankGeometry:
    """One engine rank's cache: the instance spec plus where this rank sits in it."""

    spec: InstanceSpec
    tp_rank: int = 0
    pp_rank: int = 0
    num_pages: int = 1
    #: bytes from one page's start to the next inside each region, when pages are not packed
    #: back to back (an engine that interleaves other data between them: vLLM's block-outer
    #: layouts hold every layer's page of a block together, MLA pages may be padded). None
    #: (or page_bytes) is the dense case. A property of this rank's memory only: peers never
    #: see it, every offset is derived on the side that owns the region.
    page_stride: int | None = None
    #: pages (KV groups) or state slots (state groups) per group, by name; num_pages when unset
    group_pages: tuple[tuple[str, int], ...] = ()
    group_geometries: tuple[tuple[str, "RankGeometry"], ...] = field(init=False, repr=False, compare=False,
                                                                     default=())
    #: kinds_of per group, derived once: asked for on every chunk moved
    _kinds: dict[str, tuple[str, ...]] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        _require_int("tp_rank", self.tp_rank, 0)
        _require_int("pp_rank", self.pp_rank, 0)
        _require_int("num_pages", self.num_pages, 1)
        self.spec.head_range(self.tp_rank)
        self.spec.layer_range(self.pp_rank)
        self._resolve_group_pages()
        if self.page_stride is not None:
            page = self.spec.page_bytes
            _require_int("page_stride", self.page_stride, page)
            if self.page_stride % self.spec.row_bytes:
                raise GeometryError(
                    f"page_stride {self.page_stride} is not a multiple of one slot ({self.spec.row_bytes} bytes): "
                    "slots of a page would not stay aligned from page to page", field="page_stride",
                    fix=f"give the engine's real byte distance between pages (a multiple of {self.spec.row_bytes})")
            if self.page_stride == page:
                object.__setattr__(self, "page_stride", None)  # dense: the one fast path

    def _resolve_group_pages(self) -> None:
        raw = self.group_pages
        items = list(raw.items()) if isinstance(raw, Mapping) else list(raw or ())
        names = {g.name for g in self.spec.groups}
        pages: dict[str, int] = {}
        for item in items:
            if not isinstance(item, (list, tuple)) or len(item) != 2 or item[0] not in names:
                raise GeometryError(f"group_pages names {item!r}, not a group of this instance ({sorted(names)})",
                                    field="group_pages", fix="give pages only for the instance's groups, by name")
            pages[item[0]] = _require_int(f"group_pages.{item[0]}", item[1], 1)
        object.__setattr__(self, "group_pages", tuple(sorted(pages.items())))
        object.__setattr__(self, "group_geometries", tuple(
            (g.name, RankGeometry(self.spec.group_spec(g.name), self.tp_rank, self.pp_rank,
                                  pages.get(g.name, self.num_pages)))
            for g in self.spec.groups))

    def group(self, name: str) -> "RankGeometry":
        """This rank's view of one group as an ordinary rank geometry (``""``: itself)."""
        if not name:
            return self
        for n, geometry in self.group_geometries:
            if n == name:
                return geometry
        self.spec.group(name)
        raise AssertionError(name)

    def kinds_of(self, group: str = "") -> tuple[str, ...]:
        """Region kinds of a group, as registered (``swa.k``, ``conv.state``)."""
        kinds = self._kinds.get(group)
        if kinds is None:  # an unknown group raises here, and is never cached
            kinds = self._kinds[group] = tuple(qualified_kind(group, k)
                                               for k in self.spec.group_spec(group).region_kinds)
        return kinds

    def region_nbytes(self, kind: str) -> int:
        """Bytes of one region of ``kind`` (a group's kinds are ``<group>.<kind>``)."""
        group, _, base = kind.rpartition(".")
        return self.group(group).region_bytes

    @property
    def slot_pitch(self) -> int | None:
        """Slots from one page's first slot to the next page's, or None when pages are dense."""
        return None if self.page_stride is None else self.page_stride // self.spec.row_bytes

    @property
    def heads(self) -> tuple[int, int]:
        return self.spec.head_range(self.tp_rank)

    @property
    def layers(self) -> tuple[int, int]:
        return self.spec.layer_range(self.pp_rank)

    @property
    def region_bytes(self) -> int:
        """Span of one region (one kind of one layer) on this rank: first page to end of last."""
        if self.page_stride is None:
            return self.num_pages * self.spec.page_bytes
        return (self.num_pages - 1) * self.page_stride + self.spec.page_bytes

    def region_names(self) -> list[tuple[int, str]]:
        """``(global layer, kind)`` for every region this rank must register, in wire order."""
        start, end = self.layers
        names = [(layer, kind) for layer in range(start, end) for kind in self.spec.region_kinds]
        for group, geometry in self.group_geometries:
            names += [(layer, qualified_kind(group, kind)) for layer in range(*geometry.layers)
                      for kind in geometry.spec.region_kinds]
        return names

    def to_dict(self) -> dict[str, Any]:
        data = self.spec.to_dict()
        data.update(tp_rank=self.tp_rank, pp_rank=self.pp_rank, num_pages=self.num_pages)
        if self.page_stride is not None:
            data["page_stride"] = self.page_stride
        if self.group_pages:
            data["group_pages"] = dict(self.group_pages)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RankGeometry":
        spec = InstanceSpec.from_dict(data)
        return cls(spec=spec, tp_rank=data.get("tp_rank", 0), pp_rank=data.get("pp_rank", 0),
                   num_pages=data.get("num_pages", 1), page_stride=data.get("page_stride"),
                   group_pages=_group_pages(data.get("group_pages")))


def _group_pages(raw: Any) -> tuple[tuple[str, int], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise GeometryError(f"group_pages must map group names to page counts, got {type(raw).__name__}",
                            field="group_pages", fix="send group_pages as {group: pages}")
    return tuple(raw.items())

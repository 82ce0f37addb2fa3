"""The DESIGN.md correctness oracle, as hypothesis properties.

A random logical KV cache ``[kind, layer, token, head, unit]`` is split into prefill rank
caches by an *independent* reference layout (our own head/layer/page arithmetic, never
``InstanceSpec.head_range``/``layer_range``), moved with ``make_plan`` +
``request_segments`` and a plain numpy copier, and compared byte for byte with the decode
layout of the same logical cache. Pages that were not destinations must keep their canary.

Values are random bytes rather than random floats: the copy is dtype-agnostic, and every
bit pattern (NaN payloads, negative zero) must survive, which a value compare could miss.
Packed 4-bit dtypes are modelled as one nibble per element, packed two per byte.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvxferd.errors import GeometryError, PlanRefusal
from kvxferd.model.geometry import InstanceSpec
from kvxferd.model.plan import Plan, Writer
from kvxferd.model.plan_wire import plan_from_wire, plan_to_wire
from kvxferd.model.planner import make_plan
from kvxferd.model.segments import Segments, request_segments

#: bits per element, restated here so a wrong table in geometry.py cannot hide itself
REF_BITS = {"bfloat16": 16, "float16": 16, "float32": 32, "int8": 8, "float8_e4m3fn": 8,
            "float8_e5m2": 8, "int4": 4, "float4_e2m1fn_x2": 4}
REF_KINDS = {"mha": ("k", "v"), "mla": ("latent",)}
PAGE_SIZES = (1, 2, 3, 4, 8, 16)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- independent reference layout ---------------------------------------------------------


def ref_heads(total: int, tp: int, rank: int) -> tuple[int, int]:
    """Heads of a TP rank: even split, or one replicated head when tp > heads."""
    if tp <= total:
        n = total // tp
        return rank * n, rank * n + n
    head = rank // (tp // total)
    return head, head + 1


def ref_even_splits(layers: int, pp: int) -> list[tuple[int, int]]:
    """Even PP split; the first ``layers % pp`` ranks hold one extra layer."""
    out, start = [], 0
    for rank in range(pp):
        size = layers // pp + (1 if rank < layers % pp else 0)
        out.append((start, start + size))
        start += size
    return out


def ref_slots(table: np.ndarray, page_size: int, tokens: np.ndarray) -> np.ndarray:
    """Slot (page * page_size + offset) of each token, for a table starting at token 0."""
    return table[tokens // page_size] * page_size + tokens % page_size


@dataclass(frozen=True)
class Side:
    """One instance's layout as the oracle sees it."""

    tp: int
    pp: int
    splits: tuple[tuple[int, int], ...]      # reference splits, one per PP rank
    layer_splits: tuple[tuple[int, int], ...] | None  # what the spec is given
    page_size: int
    give_total: bool                         # total_kv_heads, or heads_per_rank only

    def local_heads(self, total: int) -> int:
        return max(1, total // self.tp)


@dataclass(frozen=True)
class Case:
    attention: str
    heads: int
    head_dim: int
    dtype: str
    layers: int
    tokens: int
    prefill: Side
    decode: Side
    mode: str
    cuts: tuple[int, ...]    # chunk boundaries inside (0, tokens)
    seed: int

    @property
    def kinds(self) -> tuple[str, ...]:
        return REF_KINDS[self.attention]

    @property
    def bits(self) -> int:
        return REF_BITS[self.dtype]

    @property
    def units(self) -> int:
        """Units per head in the logical cache: bytes, or nibbles for 4-bit dtypes."""
        return self.head_dim if self.bits == 4 else self.head_dim * self.bits // 8

    def row_bytes(self, side: Side) -> int:
        return side.local_heads(self.heads) * self.head_dim * self.bits // 8

    def spec(self, side: Side) -> InstanceSpec:
        heads: dict[str, int] = {}
        if self.attention == "mha":
            if side.give_total:
                heads["total_kv_heads"] = self.heads
            else:
                heads["heads_per_rank"] = self.heads // side.tp
        return InstanceSpec(self.attention, self.layers, self.head_dim, self.dtype, side.page_size,
                            tp_size=side.tp, pp_size=side.pp, layer_splits=side.layer_splits, **heads)


@st.composite
def sides(draw: st.DrawFn, heads: int, attention: str, layers: int,
          coverage: tuple[tuple[int, int], ...] | None) -> Side:
    """A TP/PP layout; ``coverage`` None means all layers, split evenly or explicitly."""
    valid = [tp for tp in range(1, 9) if attention == "mla" or heads % tp == 0 or tp % heads == 0]
    tp = draw(st.sampled_from(valid))
    if coverage is None and draw(st.booleans()):
        pp = draw(st.integers(1, min(3, layers)))
        splits, given = tuple(ref_even_splits(layers, pp)), None
    else:
        intervals = coverage or ((0, layers),)
        inner = [x for a, b in intervals for x in range(a + 1, b)]
        most = max(0, min(3 - len(intervals), len(inner)))
        cuts = set(draw(st.lists(st.sampled_from(inner), unique=True, max_size=most))) if inner else set()
        edges = sorted({x for iv in intervals for x in iv} | cuts)
        splits = tuple((a, b) for a, b in zip(edges, edges[1:])
                       if any(lo <= a and b <= hi for lo, hi in intervals))
        pp, given = len(splits), splits
    # heads_per_rank alone only names the model's total when no head is replicated
    give_total = attention == "mha" and (tp > heads or draw(st.booleans()))
    return Side(tp=tp, pp=pp, splits=splits, layer_splits=given,
                page_size=draw(st.sampled_from(PAGE_SIZES)), give_total=give_total)


def _intervals(mask: list[bool]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for layer, covered in enumerate(mask):
        if covered:
            if out and out[-1][1] == layer:
                out[-1] = (out[-1][0], layer + 1)
            else:
                out.append((layer, layer + 1))
    return tuple(out)


@st.composite
def cases(draw: st.DrawFn, dtypes: tuple[str, ...] = tuple(REF_BITS)) -> Case:
    # MHA with several heads is where TP mismatch slices rows, so it gets most examples
    attention = draw(st.sampled_from(["mha", "mha", "mha", "mla"]))
    heads = 1 if attention == "mla" else draw(st.sampled_from([1, 2, 3, 4, 4, 6, 8, 8]))
    layers = draw(st.integers(1, 6))
    coverage = None
    if draw(st.integers(0, 3)) == 0:  # a shared, possibly gappy, subset of layers
        mask = draw(st.lists(st.booleans(), min_size=layers, max_size=layers))
        mask[draw(st.integers(0, layers - 1))] = True  # at least one layer travels
        coverage = _intervals(mask)
        if len(coverage) > 3:
            coverage = coverage[:3]
    prefill = draw(sides(heads, attention, layers, coverage))
    decode = draw(sides(heads, attention, layers, coverage))
    tokens = draw(st.integers(1, 70))
    cuts = tuple(sorted(draw(st.lists(st.integers(1, tokens - 1), unique=True, max_size=4)))) if tokens > 1 else ()
    return Case(attention=attention, heads=heads, head_dim=draw(st.sampled_from([1, 2, 3, 4, 8])),
                dtype=draw(st.sampled_from(dtypes)), layers=layers, tokens=tokens, prefill=prefill,
                decode=decode, mode=draw(st.sampled_from(["auto", "direct", "staged"])), cuts=cuts,
                seed=draw(st.integers(0, 2**32 - 1)))


# -- the oracle ---------------------------------------------------------------------------


def rows(case: Case, logical: np.ndarray, kind: int, layer: int, heads: tuple[int, int]) -> np.ndarray:
    """Token rows ``[tokens, row_bytes]`` of heads ``[a, b)``, as a rank stores them."""
    flat = logical[kind, layer, :, heads[0]:heads[1], :].reshape(case.tokens, -1)
    if case.bits == 4:
        flat = (flat[:, 0::2] | (flat[:, 1::2] << 4)).astype(np.uint8)
    return flat


def page_table(rng: np.random.Generator, tokens: int, page_size: int) -> tuple[np.ndarray, int]:
    """Distinct random pages out of a pool bigger than needed, and the pool size."""
    need = -(-tokens // page_size)
    pool = need + int(rng.integers(1, 4))
    return rng.permutation(pool)[:need].astype(np.int64), pool


def canary(size: int, salt: int) -> np.ndarray:
    """A position-dependent pattern, so shifted or stray writes never match it by luck."""
    return ((np.arange(size, dtype=np.int64) * 37 + salt * 101 + 11) % 251).astype(np.uint8)


def salt(*key: int) -> int:
    """A per-region canary salt that is stable across runs."""
    return sum(v * 7 ** i for i, v in enumerate(key)) % 997


def flat_index(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Every byte index covered by ``(start, length)`` runs, in order."""
    total = int(lengths.sum())
    run_base = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return run_base + np.arange(total, dtype=np.int64)


def expected_segment_count(writer: Writer, src: np.ndarray, dst: np.ndarray) -> int:
    """Maximal coalescing: whole rows merge while both slots advance by one; slices never."""
    if src.size == 0:
        return 0
    if not writer.whole_rows:
        return int(src.size)
    return 1 + int(np.count_nonzero((np.diff(src) != 1) | (np.diff(dst) != 1)))


def check_segments(segs: Segments, writer: Writer, count: int, src_size: int, dst_size: int) -> None:
    """Lengths, bounds, total bytes and coalescing of one request's segments."""
    assert len(segs) == len(segs.src) == len(segs.dst)
    assert (segs.lengths > 0).all()
    assert int(segs.lengths.sum()) == count * writer.slice_bytes
    if len(segs):
        assert segs.src.min() >= 0 and (segs.src + segs.lengths).max() <= src_size
        assert segs.dst.min() >= 0 and (segs.dst + segs.lengths).max() <= dst_size
        end_src = segs.src[:-1] + segs.lengths[:-1]
        end_dst = segs.dst[:-1] + segs.lengths[:-1]
        mergeable = (end_src == segs.src[1:]) & (end_dst == segs.dst[1:])
        assert not mergeable.any(), "adjacent segments left unmerged"


def expected_refusal(case: Case, err: Exception) -> bool:
    """Refusals the oracle accepts: packed 4-bit heads that would have to be cut in half."""
    p, d = case.prefill.local_heads(case.heads), case.decode.local_heads(case.heads)
    half_heads = case.bits == 4 and case.head_dim % 2 == 1
    sliced = case.attention == "mha" and p != d
    return isinstance(err, PlanRefusal) and err.field == "head_dim" and half_heads and sliced


def run_oracle(case: Case) -> None:
    """Split, plan, copy, gather, compare (see the module docstring)."""
    for side in (case.prefill, case.decode):
        row_bits = side.local_heads(case.heads) * case.head_dim * case.bits
        if row_bits % 8:  # geometry must refuse rows that are not whole bytes
            try:
                case.spec(side)
            except GeometryError as err:
                assert err.field == "head_dim"
                event("geometry refused half-byte rows")
                return
            raise AssertionError(f"geometry accepted {row_bits}-bit rows")
    pspec, dspec = case.spec(case.prefill), case.spec(case.decode)
    try:
        plan = make_plan(pspec, dspec, mode=case.mode)
    except PlanRefusal as err:
        assert expected_refusal(case, err), f"unexpected refusal: {err}"
        event("plan refused half-byte head slices")
        return
    event(f"mode={plan.mode} sliced={plan.sliced}")
    # the decode daemon gets the plan over the wire and checks it: the oracle runs on what it rebuilt
    carried = plan_from_wire(plan_to_wire(plan), pspec, dspec, plan.mode)
    assert carried == plan
    plan = carried

    rng = np.random.default_rng(case.seed)
    kinds, T = case.kinds, case.tokens
    logical = rng.integers(0, 16 if case.bits == 4 else 256,
                           size=(len(kinds), case.layers, T, case.heads, case.units), dtype=np.uint8)
    all_tokens = np.arange(T, dtype=np.int64)

    # prefill: junk everywhere, logical rows at the rank's own random slots
    p_row = case.row_bytes(case.prefill)
    p_tables: dict[tuple[int, int], np.ndarray] = {}
    p_regions: dict[tuple[int, int, int, int], np.ndarray] = {}
    for pp, (lo, hi) in enumerate(case.prefill.splits):
        for tp in range(case.prefill.tp):
            table, pool = page_table(rng, T, case.prefill.page_size)
            p_tables[(tp, pp)] = table
            slots = ref_slots(table, case.prefill.page_size, all_tokens)
            heads = ref_heads(case.heads, case.prefill.tp, tp)
            for layer in range(lo, hi):
                for k in range(len(kinds)):
                    region = rng.integers(0, 256, size=pool * case.prefill.page_size * p_row, dtype=np.uint8)
                    region.reshape(-1, p_row)[slots] = rows(case, logical, k, layer, heads)
                    p_regions[(tp, pp, layer, k)] = region

    # decode: canary everywhere
    d_row = case.row_bytes(case.decode)
    d_tables: dict[tuple[int, int], np.ndarray] = {}
    d_regions: dict[tuple[int, int, int, int], np.ndarray] = {}
    d_writes: dict[tuple[int, int, int, int], np.ndarray] = {}
    for pp, (lo, hi) in enumerate(case.decode.splits):
        for tp in range(case.decode.tp):
            table, pool = page_table(rng, T, case.decode.page_size)
            d_tables[(tp, pp)] = table
            for layer in range(lo, hi):
                for k in range(len(kinds)):
                    size = pool * case.decode.page_size * d_row
                    d_regions[(tp, pp, layer, k)] = canary(size, salt(tp, pp, layer, k))
                    d_writes[(tp, pp, layer, k)] = np.zeros(size, dtype=np.int64)

    # the plan's destinations are the reference decode layout
    assert len(plan.destinations) == case.decode.tp * case.decode.pp
    for dest in plan.destinations:
        assert dest.heads == ref_heads(case.heads, case.decode.tp, dest.tp_rank)
        assert dest.layers == case.decode.splits[dest.pp_rank]
        for w in dest.writers:  # a writer only sends what its source rank holds
            src_heads, src_layers = ref_heads(case.heads, case.prefill.tp, w.tp_rank), case.prefill.splits[w.pp_rank]
            assert src_heads[0] <= w.heads[0] < w.heads[1] <= src_heads[1], (w, src_heads)
            assert src_layers[0] <= w.layers[0] < w.layers[1] <= src_layers[1], (w, src_layers)

    # transfer, chunk by chunk, in a shuffled order
    edges = [0, *case.cuts, T]
    ps_p, ps_d = case.prefill.page_size, case.decode.page_size
    work = [(c, dest, w) for c in range(len(edges) - 1) for dest in plan.destinations for w in dest.writers]
    random.Random(case.seed).shuffle(work)
    for c, dest, w in work:
        start, end = edges[c], edges[c + 1]
        full_src = p_tables[w.src]
        src_pages = full_src[start // ps_p:(end - 1) // ps_p + 1]
        dst_pages = d_tables[dest.rank]
        segs = request_segments(w, src_pages, ps_p, start, dst_pages, ps_d, start, end)
        chunk = np.arange(start, end, dtype=np.int64)
        src_size = p_regions[(*w.src, w.layers[0], 0)].size
        dst_size = d_regions[(*dest.rank, w.layers[0], 0)].size
        check_segments(segs, w, end - start, src_size, dst_size)
        assert len(segs) == expected_segment_count(
            w, ref_slots(full_src, ps_p, chunk), ref_slots(dst_pages, ps_d, chunk))
        src_idx = flat_index(segs.src, segs.lengths)
        dst_idx = flat_index(segs.dst, segs.lengths)
        for layer in range(*w.layers):
            for k in range(len(kinds)):
                dst_key = (*dest.rank, layer, k)
                d_regions[dst_key][dst_idx] = p_regions[(*w.src, layer, k)][src_idx]
                d_writes[dst_key] += np.bincount(dst_idx, minlength=d_writes[dst_key].size)

    # gather back and compare with the decode split of the same logical cache
    for pp, (lo, hi) in enumerate(case.decode.splits):
        for tp in range(case.decode.tp):
            table = d_tables[(tp, pp)]
            slots = ref_slots(table, ps_d, all_tokens)
            heads = ref_heads(case.heads, case.decode.tp, tp)
            for layer in range(lo, hi):
                for k in range(len(kinds)):
                    key = (tp, pp, layer, k)
                    got = d_regions[key]
                    want_rows = rows(case, logical, k, layer, heads)
                    assert np.array_equal(got.reshape(-1, d_row)[slots], want_rows), \
                        f"decode rank tp={tp} pp={pp} layer {layer} {kinds[k]}: wrong bytes"
                    want = canary(got.size, salt(*key))
                    want.reshape(-1, d_row)[slots] = want_rows
                    untouched = np.ones(got.size // (ps_d * d_row), dtype=bool)
                    untouched[table] = False
                    pages = got.reshape(-1, ps_d * d_row)
                    assert np.array_equal(pages[untouched], want.reshape(-1, ps_d * d_row)[untouched]), \
                        f"decode rank tp={tp} pp={pp} layer {layer}: a non-destination page changed"
                    assert np.array_equal(got, want), \
                        f"decode rank tp={tp} pp={pp} layer {layer}: stray bytes inside a destination page"
                    written = np.zeros(got.size, dtype=np.int64)
                    written.reshape(-1, d_row)[slots] = 1
                    assert np.array_equal(d_writes[key], written), \
                        f"decode rank tp={tp} pp={pp} layer {layer}: a byte written twice or never"


@SETTINGS
@given(cases())
def test_oracle(case: Case) -> None:
    """Every TP/PP/page-size/dtype combination lands byte for byte, chunked or not."""
    run_oracle(case)


@SETTINGS
@given(cases(dtypes=("int4", "float4_e2m1fn_x2")))
def test_oracle_packed_4bit(case: Case) -> None:
    """Packed 4-bit caches: heads may be half a byte, so slicing must be exact or refused."""
    run_oracle(case)


@settings(max_examples=100, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), pp=st.integers(1, 3), ps_p=st.sampled_from(PAGE_SIZES),
       ps_d=st.sampled_from(PAGE_SIZES), tokens=st.integers(1, 70), first_src=st.integers(0, 50),
       first_dst=st.integers(0, 50), chunk=st.data())
def test_consecutive_pages_make_one_segment(tp: int, pp: int, ps_p: int, ps_d: int, tokens: int,
                                            first_src: int, first_dst: int, chunk: st.DataObject) -> None:
    """Whole rows with consecutive page tables on both sides coalesce into a single segment."""
    spec_p = InstanceSpec("mha", 3, 4, "bfloat16", ps_p, tp_size=tp, pp_size=pp, total_kv_heads=4)
    spec_d = InstanceSpec("mha", 3, 4, "bfloat16", ps_d, tp_size=tp, total_kv_heads=4)
    plan = make_plan(spec_p, spec_d)
    start = chunk.draw(st.integers(0, tokens - 1))
    end = chunk.draw(st.integers(start + 1, tokens))
    src_pages = np.arange(first_src, first_src + (end - 1) // ps_p - start // ps_p + 1, dtype=np.int64)
    dst_pages = np.arange(first_dst, first_dst + -(-tokens // ps_d), dtype=np.int64)
    for dest in plan.destinations:
        for w in dest.writers:
            assert w.whole_rows
            segs = request_segments(w, src_pages, ps_p, start, dst_pages, ps_d, start, end)
            assert len(segs) == 1
            assert int(segs.src[0]) == (first_src * ps_p + start % ps_p) * w.src_row_bytes
            assert int(segs.dst[0]) == (first_dst * ps_d + start) * w.dst_row_bytes
            assert int(segs.lengths[0]) == (end - start) * w.src_row_bytes


def test_equal_page_sizes_consecutive_tables_one_segment() -> None:
    """The common case spelled out: 16-token pages, 40 tokens, both tables consecutive."""
    spec = InstanceSpec("mha", 2, 128, "bfloat16", 16, tp_size=2, total_kv_heads=8)
    plan: Plan = make_plan(spec, spec)
    (w,) = plan.destination(1, 0).writers
    segs = request_segments(w, np.array([5, 6, 7]), 16, 0, np.array([9, 10, 11]), 16, 0, 40)
    assert len(segs) == 1
    assert (int(segs.src[0]), int(segs.dst[0]), int(segs.lengths[0])) == \
        (5 * 16 * spec.row_bytes, 9 * 16 * spec.row_bytes, 40 * spec.row_bytes)
    # a break in either table splits the run there, and only there
    segs = request_segments(w, np.array([5, 6, 8]), 16, 0, np.array([9, 10, 11]), 16, 0, 40)
    assert len(segs) == 2 and list(segs.lengths) == [32 * spec.row_bytes, 8 * spec.row_bytes]

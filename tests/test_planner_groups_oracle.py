"""The planner oracle for cache groups, as hypothesis properties.

State groups: a random per-request tensor ``[layers, *shape]`` is split over prefill TP
ranks by an *independent* reference (numpy slicing along ``split_dim``, replicated when TP
exceeds that dimension, whole when it is None), stored at a random state slot per rank,
moved with ``make_plan``'s group sub-plan and ``request_segments``, and compared with the
decode ranks' reference split of the same tensor; the rest of every decode region must keep
its canary and every byte must be written exactly once.

Sliding-window groups: a random KV cache, chunked, moved with the daemon's own window
arithmetic (``group_origin``, ``source_range``); the decode side must hold exactly the last
``window`` tokens (the reference: ``[max(0, n - window), n)``) and the canary elsewhere.

Both run over PP stages too: each side draws its own PP size and, at times, the group's own
uneven ``layer_splits``; every rank holds only its stage's layers of the group (the reference
split: :func:`ref_stages`), so a writer that names a layer its source or destination does
not hold fails the test, and every byte of every stage must be written exactly once.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvxferd.errors import GeometryError
from kvxferd.model.geometry import InstanceSpec, RankGeometry
from kvxferd.model.group_requests import group_origin, source_range
from kvxferd.model.groups import Group
from kvxferd.model.plan import Plan
from kvxferd.model.plan_wire import plan_from_wire, plan_to_wire
from kvxferd.model.planner import make_plan
from kvxferd.model.segments import paired_segments, request_segments, unit_slots
from test_planner_oracle import canary, flat_index, ref_heads, ref_slots

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ESIZE = {"float32": 4, "bfloat16": 2, "int8": 1}


def with_group(tp: int, group: dict, pp: int = 1) -> InstanceSpec:
    # an MLA main cache accepts every TP size, so the group alone decides what is valid
    return InstanceSpec("mla", 4, 4, "bfloat16", 4, tp_size=tp, pp_size=pp, groups=(Group.from_dict(group),))


def ref_stages(layers: int, pp: int, splits: list[list[int]] | None = None) -> list[tuple[int, int]]:
    """The group's layers each PP stage holds: the splits given, else an even split (the first
    ``layers % pp`` stages one more)."""
    if splits:
        return [(a, b) for a, b in splits]
    base, extra = divmod(layers, pp)
    out, at = [], 0
    for rank in range(pp):
        count = base + (rank < extra)
        out.append((at, at + count))
        at += count
    return out


def draw_stages(draw: st.DrawFn, layers: int) -> tuple[int, list[list[int]] | None]:
    """A PP size no larger than the layers, and at times the group's own uneven splits."""
    pp = draw(st.integers(1, min(3, layers)))
    if pp == 1 or not draw(st.booleans()):
        return pp, None
    cuts = sorted(draw(st.lists(st.integers(1, layers - 1), min_size=pp - 1, max_size=pp - 1, unique=True)))
    edges = [0, *cuts, layers]
    return pp, [[edges[i], edges[i + 1]] for i in range(pp)]


def ref_local(logical: np.ndarray, split: int | None, tp: int, rank: int, parts: list[int] | None = None) -> np.ndarray:
    """``[layers, *local shape, esize]``: what TP rank ``rank`` holds of the state (with parts:
    its slice of each part, part after part)."""
    if split is None:
        return logical
    if parts:
        pieces, before = [], 0
        for size in parts:
            a, b = ref_heads(size, tp, rank)
            pieces.append(np.take(logical, np.arange(before + a, before + b), axis=split + 1))
            before += size
        return np.concatenate(pieces, axis=split + 1)
    c = logical.shape[split + 1]
    a, b = ref_heads(c, tp, rank)
    return np.take(logical, np.arange(a, b), axis=split + 1)


def _carried(pspec: InstanceSpec, dspec: InstanceSpec) -> Plan:
    """The plan as the decode daemon holds it: sent by the source, rebuilt and checked; equal to the planner's."""
    plan = make_plan(pspec, dspec)
    carried = plan_from_wire(plan_to_wire(plan), pspec, dspec, plan.mode)
    assert carried == plan
    return carried


@st.composite
def state_cases(draw: st.DrawFn) -> dict:
    ndim = draw(st.integers(1, 3))
    shape = draw(st.lists(st.sampled_from([1, 2, 3, 4, 6, 8, 12]), min_size=ndim, max_size=ndim))
    split = draw(st.integers(-1, ndim - 1))
    split = None if split < 0 else split  # None: every rank holds the state whole
    parts = None
    if split is not None and draw(st.booleans()):  # a concatenation of parts, each split by TP
        ptp, dtp = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4]))
        unit = max(ptp, dtp)
        parts = [unit * draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 3)))]
        shape[split] = sum(parts)
    else:
        c = shape[split] if split is not None else 1
        valid = [tp for tp in range(1, 9) if c % tp == 0 or tp % c == 0]
        ptp = draw(st.sampled_from(valid))
        others = [tp for tp in valid if tp != ptp]  # mostly a TP mismatch: what slices the state
        dtp = draw(st.sampled_from(others)) if others and draw(st.integers(0, 3)) else ptp
    layers = draw(st.integers(1, 4))
    (ppp, psplits), (dpp, dsplits) = draw_stages(draw, layers), draw_stages(draw, layers)
    return dict(shape=shape, split=split, dtype=draw(st.sampled_from(sorted(ESIZE))), layers=layers,
                ptp=ptp, dtp=dtp, parts=parts, seed=draw(st.integers(0, 2**32 - 1)),
                ppp=ppp, psplits=psplits, dpp=dpp, dsplits=dsplits)


@SETTINGS
@given(state_cases())
def test_state_group_heterogeneous_tp_is_byte_exact(case: dict) -> None:
    group = {"name": "st", "kind": "state", "num_layers": case["layers"], "shape": case["shape"],
             "split_dim": case["split"], "dtype": case["dtype"], "split_parts": case["parts"]}
    pspec = with_group(case["ptp"], {**group, "layer_splits": case["psplits"]}, case["ppp"])
    dspec = with_group(case["dtp"], {**group, "layer_splits": case["dsplits"]}, case["dpp"])
    gplan = _carried(pspec, dspec).group("st").plan
    event(f"sliced={gplan.sliced} parts={bool(case['parts'])} pp={case['ppp']}->{case['dpp']}")
    rng = np.random.default_rng(case["seed"])
    esize, split, layers = ESIZE[case["dtype"]], case["split"], case["layers"]
    logical = rng.integers(0, 256, size=(layers, *case["shape"], esize), dtype=np.uint8)
    pool = 5

    def rank_bytes(tp: int, rank: int) -> np.ndarray:  # [layers, slot bytes]
        return ref_local(logical, split, tp, rank, case["parts"]).reshape(layers, -1)

    # every rank (tp, pp) holds the state of its stage's layers only: {layer: region}
    src: dict[tuple[int, int], tuple[int, dict[int, np.ndarray]]] = {}
    for pp, (lo, hi) in enumerate(ref_stages(layers, case["ppp"], case["psplits"])):
        for r in range(case["ptp"]):
            local = rank_bytes(case["ptp"], r)
            slot = int(rng.integers(0, pool))
            region = rng.integers(0, 256, size=(layers, pool, local.shape[1]), dtype=np.uint8)
            region[:, slot] = local
            src[(r, pp)] = (slot, {layer: region[layer].reshape(-1) for layer in range(lo, hi)})
    dst: dict[tuple[int, int], tuple[int, dict[int, np.ndarray], dict[int, np.ndarray]]] = {}
    for pp, (lo, hi) in enumerate(ref_stages(layers, case["dpp"], case["dsplits"])):
        for r in range(case["dtp"]):
            size = pool * rank_bytes(case["dtp"], r).shape[1]
            dst[(r, pp)] = (int(rng.integers(0, pool)), {layer: canary(size, r * 7 + layer) for layer in range(lo, hi)},
                            {layer: np.zeros(size, dtype=np.int64) for layer in range(lo, hi)})
    rows = dspec.group_spec("st").page_size
    for dest in gplan.destinations:
        d_slot, d_region, writes = dst[dest.rank]
        for w in dest.writers:
            s_slot, s_region = src[w.src]
            segs = request_segments(w, np.array([s_slot]), rows, 0, np.array([d_slot]), rows, 0, rows)
            s_idx, d_idx = flat_index(segs.src, segs.lengths), flat_index(segs.dst, segs.lengths)
            for layer in range(*w.layers):  # a layer either side does not hold: KeyError
                d_region[layer][d_idx] = s_region[layer][s_idx]
                writes[layer] += np.bincount(d_idx, minlength=writes[layer].size)
    for (r, pp), (slot, region, writes) in dst.items():
        want_local = rank_bytes(case["dtp"], r)
        per_slot = want_local.shape[1]
        for layer, flat in region.items():
            got = flat.reshape(pool, per_slot)
            assert np.array_equal(got[slot], want_local[layer]), f"decode rank {r, pp} layer {layer}: wrong state"
            others = [s for s in range(pool) if s != slot]
            want = canary(flat.size, r * 7 + layer).reshape(pool, -1)
            assert np.array_equal(got[others], want[others]), f"decode rank {r, pp}: another slot changed"
            assert (writes[layer].reshape(pool, -1)[slot] == 1).all(), "a state byte written twice or never"


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.sampled_from([2, 3, 5, 6]), min_size=1, max_size=3), data=st.data())
def test_state_split_that_tp_cannot_make_is_refused_naming_the_group(shape: list[int], data: st.DataObject) -> None:
    split = data.draw(st.integers(0, len(shape) - 1))
    c = shape[split]
    bad = [tp for tp in range(2, 9) if c % tp and tp % c]
    if not bad:
        return
    tp = data.draw(st.sampled_from(bad))
    with pytest.raises(GeometryError) as err:
        with_group(tp, {"name": "st", "kind": "state", "num_layers": 1, "shape": shape, "split_dim": split,
                        "dtype": "float32"})
    assert err.value.field == "groups.st.split_dim" and str(c) in str(err.value) and f"tp_size {tp}" in str(err.value)


@st.composite
def window_cases(draw: st.DrawFn) -> dict:
    heads = draw(st.sampled_from([1, 2, 4]))
    valid = [tp for tp in (1, 2, 4, 8) if heads % tp == 0 or tp % heads == 0]
    tokens = draw(st.integers(1, 90))
    cuts = sorted(draw(st.lists(st.integers(1, tokens - 1), unique=True, max_size=4))) if tokens > 1 else []
    layers = draw(st.integers(1, 4))
    (ppp, psplits), (dpp, dsplits) = draw_stages(draw, layers), draw_stages(draw, layers)
    return dict(heads=heads, ptp=draw(st.sampled_from(valid)), dtp=draw(st.sampled_from(valid)),
                ps_p=draw(st.sampled_from([1, 2, 4, 16])), ps_d=draw(st.sampled_from([1, 3, 4, 16])),
                window=draw(st.integers(1, 100)), tokens=tokens, cuts=cuts, layers=layers,
                prefix=draw(st.integers(0, tokens - 1)) if draw(st.booleans()) else 0,
                seed=draw(st.integers(0, 2**32 - 1)), ppp=ppp, psplits=psplits, dpp=dpp, dsplits=dsplits)


@SETTINGS
@given(window_cases())
def test_window_group_moves_exactly_the_last_window_tokens(case: dict) -> None:
    def spec(tp: int, ps: int, pp: int, splits: list[list[int]] | None) -> InstanceSpec:
        return InstanceSpec("mha", 4, 4, "bfloat16", 4, tp_size=tp, pp_size=pp, total_kv_heads=case["heads"],
                            groups=(Group("swa", "window", case["layers"], head_dim=4, total_kv_heads=case["heads"],
                                          page_size=ps, window=case["window"],
                                          layer_splits=tuple(map(tuple, splits)) if splits else None),))
    pspec = spec(case["ptp"], case["ps_p"], case["ppp"], case["psplits"])
    dspec = spec(case["dtp"], case["ps_d"], case["dpp"], case["dsplits"])
    gplan = _carried(pspec, dspec).group("swa").plan
    rng = np.random.default_rng(case["seed"])
    n, layers, ps_p, ps_d = case["tokens"], case["layers"], case["ps_p"], case["ps_d"]
    head_bytes = 4 * 2
    logical = rng.integers(0, 256, size=(layers, 2, n, case["heads"], head_bytes), dtype=np.uint8)
    # the reference: the last `window` tokens, less what the decode side holds already (a prefix hit)
    lo = max(0, n - case["window"], case["prefix"])
    event(f"window covers {'all' if lo == 0 else 'a suffix'}{' after a prefix' if case['prefix'] else ''}")
    tokens = np.arange(n)

    def store(tp: int, ps: int, rank: int, stage: tuple[int, int], fill) -> tuple[np.ndarray, dict]:
        """A rank's window-group table and regions: its stage's layers only."""
        need = -(-n // ps)
        pool = need + 2
        table = rng.permutation(pool)[:need].astype(np.int64)
        a, b = ref_heads(case["heads"], tp, rank)
        row = (b - a) * head_bytes
        regions = {}
        for layer in range(*stage):
            for k in range(2):
                region = fill(pool * ps * row, layer * 2 + k).reshape(-1, row)
                regions[(layer, k)] = region
        return table, regions

    src = {(r, pp): store(case["ptp"], ps_p, r, stage, lambda size, s: rng.integers(0, 256, size=size, dtype=np.uint8))
           for pp, stage in enumerate(ref_stages(layers, case["ppp"], case["psplits"])) for r in range(case["ptp"])}
    for (r, _pp), (table, regions) in src.items():
        a, b = ref_heads(case["heads"], case["ptp"], r)
        for (layer, k), region in regions.items():
            region[ref_slots(table, ps_p, tokens)] = logical[layer, k, :, a:b].reshape(n, -1)
    dst = {(r, pp): store(case["dtp"], ps_d, r, stage, lambda size, s, r=r: canary(size, r * 11 + s))
           for pp, stage in enumerate(ref_stages(layers, case["dpp"], case["dsplits"])) for r in range(case["dtp"])}
    written = {r: {key: np.zeros(region.size, dtype=np.int64) for key, region in regions.items()}
               for r, (_, regions) in dst.items()}
    edges = [0, *case["cuts"], n]
    origin = group_origin(pspec, "swa", case["prefix"], n)
    assert group_origin(dspec, "swa", case["prefix"], n) == origin == lo
    for dest in gplan.destinations:
        d_table, d_regions = dst[dest.rank]
        d_part = RankGeometry(dspec, dest.tp_rank, dest.pp_rank, 1,
                              group_pages={"swa": d_table.size + 2}).group("swa")
        assert d_part.layers == ref_stages(layers, case["dpp"], case["dsplits"])[dest.pp_rank]
        for w in dest.writers:
            s_table, s_regions = src[w.src]
            geometry = RankGeometry(pspec, w.tp_rank, w.pp_rank, 1, group_pages={"swa": s_table.size + 2})
            for c in range(len(edges) - 1):
                cs, ce = edges[c], edges[c + 1]
                chunk_table = s_table[cs // ps_p:(ce - 1) // ps_p + 1]
                part = source_range(geometry, "swa", cs, ce, c == len(edges) - 2, origin, chunk_table)
                if part is None:
                    assert ce <= lo
                    continue
                start, end, src_slots = part
                assert (start, end) == (max(cs, lo), ce)
                segs = paired_segments(src_slots, unit_slots(d_part.spec, d_table, start, end, 0), w)
                s_idx, d_idx = flat_index(segs.src, segs.lengths), flat_index(segs.dst, segs.lengths)
                for layer in range(*w.layers):  # a layer either side does not hold: KeyError
                    for k in range(2):
                        d_flat = d_regions[(layer, k)].reshape(-1)
                        d_flat[d_idx] = s_regions[(layer, k)].reshape(-1)[s_idx]
                        written[dest.rank][(layer, k)] += np.bincount(d_idx, minlength=d_flat.size)
    for (r, _pp), (table, regions) in dst.items():
        a, b = ref_heads(case["heads"], case["dtp"], r)
        for (layer, k), region in regions.items():
            want = canary(region.size, r * 11 + layer * 2 + k).reshape(region.shape)
            want[ref_slots(table, ps_d, tokens[lo:])] = logical[layer, k, lo:, a:b].reshape(n - lo, -1)
            assert np.array_equal(region, want), f"decode rank {r} layer {layer}: not exactly the window"
            once = np.zeros(region.shape, dtype=np.int64)
            once[ref_slots(table, ps_d, tokens[lo:])] = 1
            assert np.array_equal(written[(r, _pp)][(layer, k)].reshape(region.shape), once), \
                "a byte written twice or never"

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
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvxferd.errors import GeometryError
from kvxferd.geometry import InstanceSpec, RankGeometry
from kvxferd.group_requests import group_origin, source_range
from kvxferd.groups import Group
from kvxferd.planner import make_plan
from kvxferd.segments import paired_segments, request_segments, unit_slots
from test_planner_oracle import canary, flat_index, ref_heads, ref_slots

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ESIZE = {"float32": 4, "bfloat16": 2, "int8": 1}


def with_group(tp: int, group: dict) -> InstanceSpec:
    # an MLA main cache accepts every TP size, so the group alone decides what is valid
    return InstanceSpec("mla", 1, 4, "bfloat16", 4, tp_size=tp, groups=(Group.from_dict(group),))


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
    return dict(shape=shape, split=split, dtype=draw(st.sampled_from(sorted(ESIZE))), layers=draw(st.integers(1, 3)),
                ptp=ptp, dtp=dtp, parts=parts, seed=draw(st.integers(0, 2**32 - 1)))


@SETTINGS
@given(state_cases())
def test_state_group_heterogeneous_tp_is_byte_exact(case: dict) -> None:
    group = {"name": "st", "kind": "state", "num_layers": case["layers"], "shape": case["shape"],
             "split_dim": case["split"], "dtype": case["dtype"], "split_parts": case["parts"]}
    pspec, dspec = with_group(case["ptp"], group), with_group(case["dtp"], group)
    gplan = make_plan(pspec, dspec).group("st").plan
    event(f"sliced={gplan.sliced} parts={bool(case['parts'])}")
    rng = np.random.default_rng(case["seed"])
    esize, split, layers = ESIZE[case["dtype"]], case["split"], case["layers"]
    logical = rng.integers(0, 256, size=(layers, *case["shape"], esize), dtype=np.uint8)
    pool = 5

    def rank_bytes(tp: int, rank: int) -> np.ndarray:  # [layers, slot bytes]
        return ref_local(logical, split, tp, rank, case["parts"]).reshape(layers, -1)

    src: dict[int, tuple[int, np.ndarray]] = {}
    for r in range(case["ptp"]):
        local = rank_bytes(case["ptp"], r)
        slot = int(rng.integers(0, pool))
        region = rng.integers(0, 256, size=(layers, pool, local.shape[1]), dtype=np.uint8)
        region[:, slot] = local
        src[r] = (slot, region.reshape(layers, -1))
    dst: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}
    for r in range(case["dtp"]):
        size = pool * rank_bytes(case["dtp"], r).shape[1]
        dst[r] = (int(rng.integers(0, pool)), np.stack([canary(size, r * 7 + layer) for layer in range(layers)]),
                  np.zeros((layers, size), dtype=np.int64))
    rows = dspec.group_spec("st").page_size
    for dest in gplan.destinations:
        d_slot, d_region, writes = dst[dest.tp_rank]
        for w in dest.writers:
            s_slot, s_region = src[w.tp_rank]
            segs = request_segments(w, np.array([s_slot]), rows, 0, np.array([d_slot]), rows, 0, rows)
            s_idx, d_idx = flat_index(segs.src, segs.lengths), flat_index(segs.dst, segs.lengths)
            for layer in range(*w.layers):
                d_region[layer][d_idx] = s_region[layer][s_idx]
                writes[layer] += np.bincount(d_idx, minlength=writes.shape[1])
    for r, (slot, region, writes) in dst.items():
        want_local = rank_bytes(case["dtp"], r)
        per_slot = want_local.shape[1]
        got = region.reshape(layers, pool, per_slot)
        assert np.array_equal(got[:, slot], want_local), f"decode rank {r}: wrong state bytes"
        others = [s for s in range(pool) if s != slot]
        want = np.stack([canary(region.shape[1], r * 7 + layer) for layer in range(layers)]).reshape(layers, pool, -1)
        assert np.array_equal(got[:, others], want[:, others]), f"decode rank {r}: another slot changed"
        assert (writes.reshape(layers, pool, -1)[:, slot] == 1).all(), "a state byte written twice or never"


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
    return dict(heads=heads, ptp=draw(st.sampled_from(valid)), dtp=draw(st.sampled_from(valid)),
                ps_p=draw(st.sampled_from([1, 2, 4, 16])), ps_d=draw(st.sampled_from([1, 3, 4, 16])),
                window=draw(st.integers(1, 100)), tokens=tokens, cuts=cuts, layers=draw(st.integers(1, 3)),
                prefix=draw(st.integers(0, tokens - 1)) if draw(st.booleans()) else 0,
                seed=draw(st.integers(0, 2**32 - 1)))


@SETTINGS
@given(window_cases())
def test_window_group_moves_exactly_the_last_window_tokens(case: dict) -> None:
    def spec(tp: int, ps: int) -> InstanceSpec:
        return InstanceSpec("mha", 1, 4, "bfloat16", 4, tp_size=tp, total_kv_heads=case["heads"],
                            groups=(Group("swa", "window", case["layers"], head_dim=4, total_kv_heads=case["heads"],
                                          page_size=ps, window=case["window"]),))
    pspec, dspec = spec(case["ptp"], case["ps_p"]), spec(case["dtp"], case["ps_d"])
    gplan = make_plan(pspec, dspec).group("swa").plan
    rng = np.random.default_rng(case["seed"])
    n, layers, ps_p, ps_d = case["tokens"], case["layers"], case["ps_p"], case["ps_d"]
    head_bytes = 4 * 2
    logical = rng.integers(0, 256, size=(layers, 2, n, case["heads"], head_bytes), dtype=np.uint8)
    # the reference: the last `window` tokens, less what the decode side holds already (a prefix hit)
    lo = max(0, n - case["window"], case["prefix"])
    event(f"window covers {'all' if lo == 0 else 'a suffix'}{' after a prefix' if case['prefix'] else ''}")
    tokens = np.arange(n)

    def store(tp: int, ps: int, rank: int, fill) -> tuple[np.ndarray, dict]:
        need = -(-n // ps)
        pool = need + 2
        table = rng.permutation(pool)[:need].astype(np.int64)
        a, b = ref_heads(case["heads"], tp, rank)
        row = (b - a) * head_bytes
        regions = {}
        for layer in range(layers):
            for k in range(2):
                region = fill(pool * ps * row, layer * 2 + k).reshape(-1, row)
                regions[(layer, k)] = region
        return table, regions

    src = {r: store(case["ptp"], ps_p, r, lambda size, s: rng.integers(0, 256, size=size, dtype=np.uint8))
           for r in range(case["ptp"])}
    for r, (table, regions) in src.items():
        a, b = ref_heads(case["heads"], case["ptp"], r)
        for (layer, k), region in regions.items():
            region[ref_slots(table, ps_p, tokens)] = logical[layer, k, :, a:b].reshape(n, -1)
    dst = {r: store(case["dtp"], ps_d, r, lambda size, s, r=r: canary(size, r * 11 + s)) for r in range(case["dtp"])}
    written = {r: {key: np.zeros(region.size, dtype=np.int64) for key, region in regions.items()}
               for r, (_, regions) in dst.items()}
    edges = [0, *case["cuts"], n]
    origin = group_origin(pspec, "swa", case["prefix"], n)
    assert group_origin(dspec, "swa", case["prefix"], n) == origin == lo
    for dest in gplan.destinations:
        d_table, d_regions = dst[dest.tp_rank]
        d_part = RankGeometry(dspec, dest.tp_rank, 0, 1, group_pages={"swa": d_table.size + 2}).group("swa")
        for w in dest.writers:
            s_table, s_regions = src[w.tp_rank]
            geometry = RankGeometry(pspec, w.tp_rank, 0, 1, group_pages={"swa": s_table.size + 2})
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
                for layer in range(*w.layers):
                    for k in range(2):
                        d_flat = d_regions[(layer, k)].reshape(-1)
                        d_flat[d_idx] = s_regions[(layer, k)].reshape(-1)[s_idx]
                        written[dest.tp_rank][(layer, k)] += np.bincount(d_idx, minlength=d_flat.size)
    for r, (table, regions) in dst.items():
        a, b = ref_heads(case["heads"], case["dtp"], r)
        for (layer, k), region in regions.items():
            want = canary(region.size, r * 11 + layer * 2 + k).reshape(region.shape)
            want[ref_slots(table, ps_d, tokens[lo:])] = logical[layer, k, lo:, a:b].reshape(n - lo, -1)
            assert np.array_equal(region, want), f"decode rank {r} layer {layer}: not exactly the window"
            once = np.zeros(region.shape, dtype=np.int64)
            once[ref_slots(table, ps_d, tokens[lo:])] = 1
            assert np.array_equal(written[r][(layer, k)].reshape(region.shape), once), "a byte written twice or never"

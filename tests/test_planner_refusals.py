"""Planner refusals and structural plan properties.

Every refusal is read by an operator in a log line, so it must name the field, both
sides' values (in the text and on the exception) and what to change. Every plan must give
each destination (head, layer) cell exactly one writer, with the fewest writers possible,
because the decode side waits for exactly that many.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest

from kvxferd.errors import PlanRefusal
from kvxferd.model.geometry import InstanceSpec
from kvxferd.model.pairing import STAGED_SLICE_BYTES, check_compatible
from kvxferd.model.plan import Plan
from kvxferd.model.planner import make_plan


def mha(**overrides: Any) -> InstanceSpec:
    """A valid MHA spec (8 KV heads, 4 layers) with some fields replaced."""
    base: dict[str, Any] = dict(attention="mha", num_layers=4, head_dim=128, dtype="bfloat16",
                                page_size=16, total_kv_heads=8)
    base.update(overrides)
    return InstanceSpec(**base)


def mla(**overrides: Any) -> InstanceSpec:
    """A valid MLA spec (one 576-wide latent, 4 layers) with some fields replaced."""
    base: dict[str, Any] = dict(attention="mla", num_layers=4, head_dim=576, dtype="bfloat16",
                                page_size=1)
    base.update(overrides)
    return InstanceSpec(**base)


def refusal(prefill: InstanceSpec, decode: InstanceSpec, field: str, prefill_value: Any,
            decode_value: Any, shown: tuple[str, str] | None = None, **kwargs: Any) -> PlanRefusal:
    """Assert make_plan refuses on ``field`` and names both values and a fix.

    ``shown`` overrides how each side's value appears in the message (default: repr).
    """
    with pytest.raises(PlanRefusal) as info:
        make_plan(prefill, decode, **kwargs)
    err = info.value
    assert err.field == field, (err.field, str(err))
    assert err.prefill_value == prefill_value
    assert err.decode_value == decode_value
    assert err.fix, f"no fix in {err!r}"
    assert err.fix in str(err)
    texts = shown or (repr(prefill_value), repr(decode_value))
    for text in texts:
        assert text in err.message, f"{text!r} not named in {err.message!r}"
    wire = err.to_wire()
    assert wire["code"] == "incompatible" and wire["field"] == field
    assert wire["message"] == str(err)
    return err


def same_refusal_from_check_compatible(prefill: InstanceSpec, decode: InstanceSpec, field: str,
                                       **kwargs: Any) -> None:
    """check_compatible is the handshake's check; it must refuse the same way."""
    with pytest.raises(PlanRefusal) as info:
        check_compatible(prefill, decode, **kwargs)
    assert info.value.field == field


# -- field mismatches ------------------------------------------------------------------


def test_refuses_attention_mismatch() -> None:
    err = refusal(mha(), mla(), "attention", "mha", "mla")
    assert "attention" in err.message
    same_refusal_from_check_compatible(mha(), mla(), "attention")
    refusal(mla(), mha(), "attention", "mla", "mha")


def test_refuses_model_mismatch() -> None:
    refusal(mha(model="llama-3.1-8b"), mha(model="qwen2-7b"), "model", "llama-3.1-8b", "qwen2-7b")
    same_refusal_from_check_compatible(mha(model="a"), mha(model="b"), "model")


def test_model_unknown_on_one_side_is_not_refused() -> None:
    """A model name is only compared when both sides state one."""
    make_plan(mha(model="llama-3.1-8b"), mha())
    make_plan(mha(), mha(model="llama-3.1-8b"))


def test_refuses_num_layers_mismatch() -> None:
    refusal(mha(num_layers=32), mha(num_layers=28), "num_layers", 32, 28)


def test_refuses_total_kv_heads_mismatch() -> None:
    refusal(mha(total_kv_heads=8), mha(total_kv_heads=4), "total_kv_heads", 8, 4)
    # resolved from heads_per_rank * tp_size on one side
    refusal(mha(total_kv_heads=None, heads_per_rank=2, tp_size=2), mha(total_kv_heads=8, tp_size=2),
            "total_kv_heads", 4, 8)


def test_refuses_head_dim_mismatch() -> None:
    refusal(mha(head_dim=128), mha(head_dim=64), "head_dim", 128, 64)
    refusal(mla(head_dim=576), mla(head_dim=512), "head_dim", 576, 512)


def test_refuses_dtype_mismatch() -> None:
    err = refusal(mha(dtype="bfloat16"), mha(dtype="float8_e4m3fn"), "dtype", "bfloat16", "float8_e4m3fn")
    assert "convert" in err.fix
    refusal(mha(dtype="float16"), mha(dtype="bfloat16"), "dtype", "float16", "bfloat16")


def test_page_size_mismatch_is_refused_only_on_request() -> None:
    prefill, decode = mha(page_size=16), mha(page_size=1)
    plan = make_plan(prefill, decode)
    assert plan.prefill.page_size == 16 and plan.decode.page_size == 1
    refusal(prefill, decode, "page_size", 16, 1, require_same_page_size=True)
    same_refusal_from_check_compatible(prefill, decode, "page_size", require_same_page_size=True)
    check_compatible(prefill, decode)
    make_plan(mha(page_size=4), mha(page_size=4), require_same_page_size=True)


@pytest.mark.parametrize("p_splits, d_splits", [
    (((0, 4),), ((0, 2), (3, 4))),            # decode leaves layer 2 out
    (((1, 4),), ((0, 4),)),                   # prefill leaves layer 0 out
    (((0, 2), (2, 3)), ((0, 1), (1, 4))),     # prefill leaves layer 3 out
    (((0, 1), (2, 4)), ((0, 2), (2, 4))),     # gap on one side only
])
def test_refuses_layer_coverage_mismatch(p_splits: Any, d_splits: Any) -> None:
    prefill = mha(pp_size=len(p_splits), layer_splits=p_splits)
    decode = mha(pp_size=len(d_splits), layer_splits=d_splits)
    p_value = [list(s) for s in p_splits]
    d_value = [list(s) for s in d_splits]
    err = refusal(prefill, decode, "layer_splits", p_value, d_value, shown=(str(p_value), str(d_value)))
    assert "Destination KV descriptors do not match prefill pp configuration" in err.message
    same_refusal_from_check_compatible(prefill, decode, "layer_splits")


def test_equal_coverage_with_gaps_is_accepted() -> None:
    """Different PP cuts over the same (gappy) coverage pair fine."""
    prefill = mha(num_layers=6, pp_size=2, layer_splits=((0, 2), (3, 6)))
    decode = mha(num_layers=6, pp_size=3, layer_splits=((0, 1), (1, 2), (3, 6)))
    check_structure(make_plan(prefill, decode))


@pytest.mark.parametrize("dtype", ["int4", "float4_e2m1fn_x2"])
@pytest.mark.parametrize("tp_p, tp_d", [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_refuses_zero_head_slice(dtype: str, tp_p: int, tp_d: int) -> None:
    """One head of head_dim 1 in 4 bits is half a byte: slicing by head cannot be addressed."""
    prefill = mha(dtype=dtype, head_dim=1, tp_size=tp_p)
    decode = mha(dtype=dtype, head_dim=1, tp_size=tp_d)
    err = refusal(prefill, decode, "head_dim", tp_p, tp_d,
                  shown=(f"prefill tp_size {tp_p}", f"decode tp_size {tp_d}"))
    assert "Head slice size evaluates to zero" in err.message


@pytest.mark.parametrize("dtype", ["int4", "float4_e2m1fn_x2"])
@pytest.mark.parametrize("head_dim, tp_p, tp_d", [(3, 1, 2), (3, 2, 1), (5, 1, 4), (3, 4, 1)])
def test_refuses_non_integral_head_slice(dtype: str, head_dim: int, tp_p: int, tp_d: int) -> None:
    """An odd head_dim in 4 bits makes one head a fractional number of bytes."""
    prefill = mha(dtype=dtype, head_dim=head_dim, tp_size=tp_p)
    decode = mha(dtype=dtype, head_dim=head_dim, tp_size=tp_d)
    err = refusal(prefill, decode, "head_dim", tp_p, tp_d,
                  shown=(f"prefill tp_size {tp_p}", f"decode tp_size {tp_d}"))
    assert "Head slice size evaluates to" in err.message
    assert "non-integral" in err.message


@pytest.mark.parametrize("dtype", ["int4", "float4_e2m1fn_x2"])
def test_packed_dtypes_without_head_slicing_are_accepted(dtype: str) -> None:
    """Whole rows move as whole bytes even when one head is half a byte."""
    for tp in (1, 2, 4):
        plan = make_plan(mha(dtype=dtype, head_dim=1, tp_size=tp, pp_size=1),
                         mha(dtype=dtype, head_dim=1, tp_size=tp, pp_size=2, page_size=3))
        assert not plan.sliced
        check_structure(plan)
    # slicing is fine when one head is whole bytes
    plan = make_plan(mha(dtype=dtype, head_dim=2, tp_size=1), mha(dtype=dtype, head_dim=2, tp_size=8))
    assert plan.sliced
    check_structure(plan)
    plan = make_plan(mla(dtype=dtype, head_dim=2, tp_size=1), mla(dtype=dtype, head_dim=2, tp_size=4))
    assert not plan.sliced


@pytest.mark.parametrize("prefill_tensors, decode_tensors, named", [
    (False, True, ("prefill",)),
    (True, False, ("decode",)),
    (False, False, ("prefill", "decode")),
])
@pytest.mark.parametrize("tp_d", [2, 8])
def test_refuses_staged_without_tensors(prefill_tensors: bool, decode_tensors: bool,
                                        named: tuple[str, ...], tp_d: int) -> None:
    """Staging needs the mapped KV tensors of both sides, sliced or not."""
    err = refusal(mha(tp_size=8), mha(tp_size=tp_d), "kv_buffer_tensors", prefill_tensors,
                  decode_tensors, shown=named, mode="staged", prefill_tensors=prefill_tensors,
                  decode_tensors=decode_tensors)
    assert "kv_buffer_tensors is None" in err.message
    assert "mode=direct" in err.fix


def test_auto_without_tensors_falls_back_to_direct() -> None:
    """auto never refuses for missing tensors: it simply does not stage."""
    for flags in ((False, True), (True, False), (False, False)):
        plan = make_plan(mha(tp_size=8), mha(tp_size=2), prefill_tensors=flags[0],
                         decode_tensors=flags[1])
        assert plan.sliced and plan.mode == "direct"


def test_refuses_unknown_mode() -> None:
    err = refusal(mha(), mha(), "mode", "fast", "fast", mode="fast")
    assert "staged" in err.fix


def test_first_mismatch_wins_in_a_stable_order() -> None:
    """Both daemons must report the same refusal for the same pair."""
    prefill = mha(num_layers=4, head_dim=64, dtype="float16")
    decode = mha(num_layers=8, head_dim=128, dtype="bfloat16")
    with pytest.raises(PlanRefusal) as one:
        make_plan(prefill, decode)
    with pytest.raises(PlanRefusal) as two:
        make_plan(prefill, decode)
    assert one.value.field == two.value.field == "num_layers"
    assert str(one.value) == str(two.value)


# -- structure -------------------------------------------------------------------------


def check_structure(plan: Plan) -> None:
    """Each destination cell has exactly one writer, from a rank that holds it; minimal."""
    p, d = plan.prefill, plan.decode
    assert len(plan.destinations) == d.tp_size * d.pp_size
    per_head_bits = p.head_dim * p.bits
    for dest in plan.destinations:
        assert plan.destination(dest.tp_rank, dest.pp_rank) is dest
        assert dest.heads == d.head_range(dest.tp_rank)
        assert dest.layers == d.layer_range(dest.pp_rank)
        cells: Counter[tuple[int, int]] = Counter()
        for w in dest.writers:
            src_heads, src_layers = p.head_range(w.tp_rank), p.layer_range(w.pp_rank)
            assert src_heads[0] <= w.heads[0] < w.heads[1] <= src_heads[1], (w, src_heads)
            assert dest.heads[0] <= w.heads[0] < w.heads[1] <= dest.heads[1], (w, dest)
            assert src_layers[0] <= w.layers[0] < w.layers[1] <= src_layers[1], (w, src_layers)
            assert dest.layers[0] <= w.layers[0] < w.layers[1] <= dest.layers[1], (w, dest)
            assert w.src_head_offset == w.heads[0] - src_heads[0]
            assert w.dst_head_offset == w.heads[0] - dest.heads[0]
            assert w.slice_bytes * 8 == (w.heads[1] - w.heads[0]) * per_head_bits
            assert (w.src_row_bytes, w.dst_row_bytes) == (p.row_bytes, d.row_bytes)
            assert w.whole_rows == (w.heads == src_heads == dest.heads)
            for head in range(*w.heads):
                for layer in range(*w.layers):
                    cells[(head, layer)] += 1
        wanted = {(h, l) for h in range(*dest.heads) for l in range(*dest.layers)}
        assert set(cells) == wanted, f"destination {dest.rank} cells not covered exactly"
        assert all(n == 1 for n in cells.values()), f"destination {dest.rank} has doubled cells"
        groups = {p.head_range(r) for r in range(p.tp_size)}
        head_groups = sum(1 for g in groups if g[0] < dest.heads[1] and dest.heads[0] < g[1])
        pp_ranks = sum(1 for r in range(p.pp_size)
                       if p.layer_range(r)[0] < dest.layers[1] and dest.layers[0] < p.layer_range(r)[1])
        assert len(dest.writers) == head_groups * pp_ranks, f"destination {dest.rank} not minimal"
        assert len({w.src for w in dest.writers}) == len(dest.writers)
    for tp in range(p.tp_size):
        for pp in range(p.pp_size):
            for dest, w in plan.targets_of(tp, pp):
                assert w.src == (tp, pp) and w in dest.writers


TP_CASES = [
    # total_kv_heads, prefill tp, decode tp
    (4, 8, 2), (4, 2, 8), (4, 1, 16), (4, 16, 1), (4, 8, 8), (4, 16, 8), (4, 4, 4),
    (3, 3, 1), (3, 1, 3), (3, 6, 3), (3, 3, 6), (3, 6, 1),
    (6, 3, 2), (6, 2, 3), (6, 6, 4 * 3), (6, 2, 6), (6, 12, 2),
    (8, 1, 1), (8, 8, 1), (8, 2, 4), (2, 8, 4), (1, 4, 2), (1, 1, 8),
]


@pytest.mark.parametrize("heads, tp_p, tp_d", TP_CASES)
@pytest.mark.parametrize("pp_p, pp_d", [(1, 1), (2, 3), (3, 1)])
def test_plan_structure_mha(heads: int, tp_p: int, tp_d: int, pp_p: int, pp_d: int) -> None:
    prefill = mha(total_kv_heads=heads, tp_size=tp_p, pp_size=pp_p, num_layers=7)
    decode = mha(total_kv_heads=heads, tp_size=tp_d, pp_size=pp_d, num_layers=7, page_size=3)
    plan = make_plan(prefill, decode)
    check_structure(plan)
    assert plan.sliced == (prefill.local_heads != decode.local_heads)


def test_plan_structure_exhaustive() -> None:
    """Every valid TP pair up to 16 ranks for several head counts, a few PP layouts."""
    layouts = [(1, 1, None, None), (2, 3, None, None), (3, 2, ((0, 1), (1, 2), (2, 7)), None),
               (2, 2, ((0, 5), (5, 7)), ((0, 2), (2, 7)))]
    count = 0
    for heads in (1, 2, 3, 4, 6, 8, 12):
        valid = [tp for tp in range(1, 17) if heads % tp == 0 or tp % heads == 0]
        for tp_p, tp_d in itertools.product(valid, valid):
            for pp_p, pp_d, s_p, s_d in layouts:
                prefill = mha(total_kv_heads=heads, tp_size=tp_p, pp_size=pp_p, num_layers=7,
                              layer_splits=s_p, head_dim=4)
                decode = mha(total_kv_heads=heads, tp_size=tp_d, pp_size=pp_d, num_layers=7,
                             layer_splits=s_d, head_dim=4)
                check_structure(make_plan(prefill, decode))
                count += 1
    assert count > 1000


@pytest.mark.parametrize("heads, tp_p, tp_d, writers", [
    (4, 8, 2, [2, 2]), (4, 2, 8, [1] * 8), (4, 1, 16, [1] * 16), (4, 16, 1, [4]), (8, 2, 1, [2]),
    (8, 1, 2, [1, 1]), (6, 3, 2, [2, 2]), (6, 2, 3, [1, 2, 1]), (3, 1, 3, [1, 1, 1]), (3, 3, 1, [3]),
])
def test_tp_writer_counts(heads: int, tp_p: int, tp_d: int, writers: list[int]) -> None:
    """With one PP rank, writers per destination = prefill head groups overlapping it."""
    plan = make_plan(mha(total_kv_heads=heads, tp_size=tp_p), mha(total_kv_heads=heads, tp_size=tp_d))
    assert [len(d.writers) for d in plan.destinations] == writers


def test_replicated_sources_are_spread_over_replicas() -> None:
    """TP 8 -> 8 with 4 heads: each head has 2 replicas on both sides; no prefill rank idles."""
    plan = make_plan(mha(total_kv_heads=4, tp_size=8), mha(total_kv_heads=4, tp_size=8))
    loads = Counter(w.src for d in plan.destinations for w in d.writers)
    assert loads == {(tp, 0): 1 for tp in range(8)}
    plan = make_plan(mha(total_kv_heads=4, tp_size=16), mha(total_kv_heads=4, tp_size=16))
    assert max(Counter(w.src for d in plan.destinations for w in d.writers).values()) == 1


def test_plan_is_deterministic() -> None:
    """Both daemons compute the plan independently and must agree."""
    prefill = mha(total_kv_heads=4, tp_size=8, pp_size=2, num_layers=5)
    decode = mha(total_kv_heads=4, tp_size=2, pp_size=3, num_layers=5, page_size=1)
    assert make_plan(prefill, decode) == make_plan(prefill, decode)
    assert make_plan(prefill, decode).to_dict() == make_plan(prefill, decode).to_dict()


@pytest.mark.parametrize("tp_p, tp_d", [(1, 1), (1, 8), (8, 1), (4, 2), (3, 5)])
@pytest.mark.parametrize("p_splits, d_splits, writers", [
    (None, None, None),
    (((0, 2), (2, 4)), ((0, 1), (1, 3), (3, 4)), [1, 2, 1]),
    (((0, 1), (1, 2), (2, 4)), ((0, 4),), [3]),
    (((0, 3), (3, 4)), ((0, 3), (3, 4)), [1, 1]),
])
def test_plan_structure_mla(tp_p: int, tp_d: int, p_splits: Any, d_splits: Any,
                            writers: list[int] | None) -> None:
    """MLA: writers per destination = overlapping prefill PP ranks; whole latents only."""
    pp_p = len(p_splits) if p_splits else 1
    pp_d = len(d_splits) if d_splits else 1
    prefill = mla(tp_size=tp_p, pp_size=pp_p, layer_splits=p_splits)
    decode = mla(tp_size=tp_d, pp_size=pp_d, layer_splits=d_splits, page_size=16)
    plan = make_plan(prefill, decode)
    check_structure(plan)
    assert not plan.sliced and plan.mode == "direct"
    for dest in plan.destinations:
        overlapping = [r for r in range(pp_p) if prefill.layer_range(r)[0] < dest.layers[1]
                       and dest.layers[0] < prefill.layer_range(r)[1]]
        assert len(dest.writers) == len(overlapping)
        assert sorted(w.pp_rank for w in dest.writers) == overlapping
        assert len({w.tp_rank for w in dest.writers}) == 1
        for w in dest.writers:
            assert w.whole_rows and w.heads == (0, 1)
            assert w.src_head_offset == w.dst_head_offset == 0
            assert w.slice_bytes == 576 * 2
        if writers is not None:
            assert len(dest.writers) == writers[dest.pp_rank]


# -- mode -------------------------------------------------------------------------------


def test_auto_stages_small_head_slices() -> None:
    plan = make_plan(mha(tp_size=8), mha(tp_size=2))
    assert plan.sliced and plan.mode == "staged"
    plan = make_plan(mha(tp_size=1), mha(tp_size=8))
    assert plan.sliced and plan.mode == "staged"


def test_auto_is_direct_without_slicing() -> None:
    for prefill, decode in [
        (mha(tp_size=2), mha(tp_size=2, page_size=1)),
        (mha(tp_size=2, pp_size=2), mha(tp_size=2, pp_size=4)),
        (mla(tp_size=8), mla(tp_size=1)),
        (mha(total_kv_heads=4, tp_size=8), mha(total_kv_heads=4, tp_size=4)),  # 1 head each side
    ]:
        plan = make_plan(prefill, decode)
        assert not plan.sliced and plan.mode == "direct"


def test_auto_threshold_on_slice_bytes() -> None:
    """Slices of at most STAGED_SLICE_BYTES are staged; larger ones go direct."""
    at = STAGED_SLICE_BYTES // 2  # bfloat16 head_dim so that one head is exactly the threshold
    plan = make_plan(mha(total_kv_heads=2, head_dim=at, tp_size=1), mha(total_kv_heads=2, head_dim=at, tp_size=2))
    assert {w.slice_bytes for d in plan.destinations for w in d.writers} == {STAGED_SLICE_BYTES}
    assert plan.mode == "staged"
    big = at * 2
    plan = make_plan(mha(total_kv_heads=2, head_dim=big, tp_size=1), mha(total_kv_heads=2, head_dim=big, tp_size=2))
    assert plan.sliced and plan.mode == "direct"


def test_explicit_modes_are_kept() -> None:
    assert make_plan(mha(tp_size=8), mha(tp_size=2), mode="direct").mode == "direct"
    assert make_plan(mha(tp_size=2), mha(tp_size=2), mode="staged").mode == "staged"
    assert make_plan(mha(tp_size=2), mha(tp_size=2), mode="direct").mode == "direct"

"""Cache groups in instance geometry: validation at registration, compatibility at the handshake."""

from __future__ import annotations

import pytest

from kvxferd.errors import GeometryError, PlanRefusal
from kvxferd.model.geometry import InstanceSpec, RankGeometry
from kvxferd.model.planner import make_plan
from kvxferd.sdk.kv_cache import allocate_cpu

BASE = {"attention": "mha", "num_layers": 4, "head_dim": 8, "dtype": "bfloat16", "page_size": 4,
        "total_kv_heads": 4}
SWA = {"name": "swa", "kind": "window", "num_layers": 4, "head_dim": 8, "total_kv_heads": 4, "window": 16}
CONV = {"name": "conv", "kind": "state", "num_layers": 3, "shape": [16, 3], "split_dim": 0, "dtype": "float32"}
DRAFT = {"name": "draft", "kind": "draft", "num_layers": 1, "head_dim": 16, "total_kv_heads": 2}


def spec(tp: int = 1, groups: list | None = None, **kw) -> InstanceSpec:
    chosen = groups if groups is not None else [SWA, CONV]
    return InstanceSpec.from_dict({**BASE, "tp_size": tp, **kw, "groups": chosen})


def test_a_uniform_geometry_is_what_it_always_was_on_the_wire():
    plain = InstanceSpec.from_dict({**BASE, "tp_size": 2})
    assert "groups" not in plain.to_dict() and plain.groups == ()
    geometry = RankGeometry(plain, 1, 0, 8)
    assert "group_pages" not in geometry.to_dict()
    assert geometry.region_names() == [(layer, kind) for layer in range(4) for kind in ("k", "v")]


def test_groups_round_trip_and_name_their_regions():
    s = spec(2, [SWA, CONV, DRAFT])
    again = InstanceSpec.from_dict(s.to_dict())
    assert again.to_dict() == s.to_dict() and again.groups == s.groups
    g = RankGeometry(s, 1, 0, 10, group_pages={"conv": 5})
    assert RankGeometry.from_dict(g.to_dict()).to_dict() == g.to_dict()
    names = g.region_names()
    assert (3, "swa.v") in names and (2, "conv.state") in names and (0, "draft.k") in names
    assert (3, "conv.state") not in names  # the group has its own 3 layers
    conv = g.group("conv")
    # [16, 3] float32 split on dim 0 over TP 2: 8 channels of 3 floats per rank, one row per slot
    assert (conv.num_pages, conv.spec.page_size, conv.spec.local_heads, conv.spec.row_bytes) == (5, 1, 8, 96)
    assert g.region_nbytes("conv.state") == 5 * 96
    assert g.region_nbytes("draft.k") == 10 * 4 * 2 * 16 // 2 * 2  # pages x page_size x heads/rank x 16 x 2 bytes


def test_allocation_gives_each_group_its_own_shape():
    g = RankGeometry(spec(2, [SWA, {**CONV, "shape": [2, 16, 3], "split_dim": 1}]), 0, 0, 6, group_pages={"conv": 3})
    cache = allocate_cpu(g)
    try:
        assert tuple(cache.tensors[(0, "k")].shape) == (6, 4, 2, 8)
        assert tuple(cache.tensors[(0, "swa.k")].shape) == (6, 4, 2, 8)
        # split on dim 1: the 2 rows before it are the slot's "tokens", 8 of 16 channels per rank
        assert tuple(cache.tensors[(2, "conv.state")].shape) == (3, 2, 8, 3)
        assert cache.tensors[(2, "conv.state")].dtype.itemsize == 4
        assert all(d["nbytes"] == g.region_nbytes(d["kind"]) for d in cache.descriptors())
    finally:
        cache.close()


@pytest.mark.parametrize("group, field, words", [
    ({**CONV, "shape": [6, 3]}, "groups.conv.split_dim", ["6 entries", "tp_size 4"]),
    ({**CONV, "split_dim": 2}, "groups.conv.split_dim", ["split_dim 2", "[16, 3]"]),
    ({**SWA, "window": None}, "groups.swa.window", ["without a window"]),
    ({**SWA, "window": 0}, "groups.swa.window", ["window", "got 0"]),
    ({**SWA, "head_dim": None}, "groups.swa.head_dim", ["no head_dim"]),
    ({**DRAFT, "total_kv_heads": 3}, "groups.draft.tp_size", ["total_kv_heads 3", "tp_size 4"]),
    ({**DRAFT, "window": 8}, "groups.draft.window", ["unknown field", "window"]),
    ({**CONV, "dtype": None}, "groups.conv.dtype", ["no dtype"]),
    ({**CONV, "split_parts": [4, 4, 6]}, "groups.conv.split_parts", ["4, 4, 6", "(16)"]),
    ({**CONV, "split_parts": [4, 6, 6]}, "groups.conv.split_parts", ["part 6", "tp_size 4"]),
    ({**CONV, "split_dim": None, "split_parts": [16]}, "groups.conv.split_parts", ["split_dim"]),
    ({**CONV, "bogus": 1}, "groups.conv.bogus", ["unknown field"]),
    ({**SWA, "kind": "other"}, "groups.swa.kind", ["'other'"]),
    ({**SWA, "name": "Bad Name"}, "groups.name", ["'Bad Name'"]),
])
def test_registration_refuses_a_bad_group_naming_it_and_the_field(group, field, words):
    with pytest.raises(GeometryError) as err:
        spec(4, [group], total_kv_heads=4)
    assert err.value.field == field, err.value
    assert all(w in str(err.value) for w in words), str(err.value)
    assert err.value.fix


def test_groups_split_over_pp_stages_like_the_kv():
    """Each stage holds its own layers of every group: an even split, or the group's layer_splits."""
    s = spec(1, [SWA, {**CONV, "layer_splits": [[0, 1], [1, 3]]}], pp_size=2, num_layers=4)
    again = InstanceSpec.from_dict(s.to_dict())
    assert again.groups == s.groups and s.to_dict()["groups"][1]["layer_splits"] == [[0, 1], [1, 3]]
    assert s.group_spec("swa").splits == ((0, 2), (2, 4)) and s.group_spec("conv").splits == ((0, 1), (1, 3))
    first, second = (RankGeometry(s, 0, pp, 10) for pp in range(2))
    assert first.group("conv").layers == (0, 1) and second.group("conv").layers == (1, 3)
    assert (0, "conv.state") in first.region_names() and (0, "conv.state") not in second.region_names()
    assert {(2, "swa.k"), (3, "swa.v"), (1, "conv.state"), (2, "conv.state")} <= set(second.region_names())
    assert (1, "swa.k") not in second.region_names()
    # the split is one instance's fact: PP2 with its own group splits pairs with PP1
    plan = make_plan(s, spec(1, [SWA, CONV]))
    writers = plan.group("conv").plan.destination(0, 0).writers
    assert [(w.pp_rank, w.layers) for w in writers] == [(0, (0, 1)), (1, (1, 3))]


def test_pp_that_a_group_cannot_span_is_refused_naming_group_field_and_values():
    with pytest.raises(GeometryError) as err:
        spec(1, [SWA, DRAFT], pp_size=2)
    assert err.value.field == "groups.draft.num_layers", err.value
    assert all(w in str(err.value) for w in ("'draft'", "num_layers 1", "pp_size 2")) and "pp_size of at most 1" in \
        err.value.fix
    with pytest.raises(GeometryError) as err:
        spec(1, [{**SWA, "layer_splits": [[0, 2], [1, 4]]}], pp_size=2)  # stages overlapping
    assert err.value.field == "groups.swa.layer_splits", err.value
    # splits that leave layer 3 of the group on no stage pair with nothing that holds it: the handshake says so
    partial = spec(1, [{**SWA, "layer_splits": [[0, 1], [1, 3]]}], pp_size=2)
    with pytest.raises(PlanRefusal) as refusal:
        make_plan(partial, spec(1, [SWA]))
    assert refusal.value.field == "groups.swa.layer_splits", refusal.value
    assert "[[0, 1], [1, 3]]" in str(refusal.value) and "[[0, 4]]" in str(refusal.value) and refusal.value.fix
    with pytest.raises(GeometryError) as err:
        spec(1, [{**SWA, "layer_splits": [[0, 4]]}], pp_size=2)
    assert err.value.field == "groups.swa.layer_splits" and "one [start, end) per PP rank (2)" in str(err.value)


def test_group_names_are_unique():
    with pytest.raises(GeometryError) as err:
        spec(1, [SWA, SWA])
    assert err.value.field == "groups.swa.name"


def test_group_pages_name_only_groups_of_the_instance():
    with pytest.raises(GeometryError) as err:
        RankGeometry(spec(1), 0, 0, 4, group_pages={"nope": 2})
    assert err.value.field == "group_pages" and "nope" in str(err.value)


def test_the_main_spec_may_not_be_a_state():
    with pytest.raises(GeometryError) as err:
        InstanceSpec.from_dict({**BASE, "attention": "state"})
    assert err.value.field == "attention"


@pytest.mark.parametrize("decode_groups, field, prefill_value, decode_value", [
    ([SWA], "groups.conv", ["swa", "conv"], ["swa"]),
    ([SWA, CONV, DRAFT], "groups.draft", ["swa", "conv"], ["swa", "conv", "draft"]),
    ([{**SWA, "window": 32}, CONV], "groups.swa.window", 16, 32),
    ([{**SWA, "head_dim": 16}, CONV], "groups.swa.head_dim", 8, 16),
    ([{**SWA, "kind": "draft", "window": None}, CONV], "groups.swa.kind", "window", "draft"),
    ([SWA, {**CONV, "shape": [16, 4]}], "groups.conv.shape", [16, 3], [16, 4]),
    ([SWA, {**CONV, "split_dim": 1}], "groups.conv.split_dim", 0, 1),
    ([SWA, {**CONV, "dtype": "bfloat16"}], "groups.conv.dtype", "float32", "bfloat16"),
    ([SWA, {**CONV, "num_layers": 4}], "groups.conv.num_layers", 3, 4),
])
def test_handshake_refuses_mismatched_groups_with_both_values(decode_groups, field, prefill_value, decode_value):
    with pytest.raises(PlanRefusal) as err:
        make_plan(spec(2), spec(1, decode_groups))
    assert err.value.field == field, err.value
    assert err.value.prefill_value == prefill_value and err.value.decode_value == decode_value
    assert err.value.fix and field.split(".")[1] in str(err.value)


def test_a_group_slice_that_is_not_whole_bytes_is_refused_naming_the_group():
    four_bit = {**CONV, "shape": [4, 1], "dtype": "int4"}  # one channel of one 4-bit value per head
    with pytest.raises(PlanRefusal) as err:
        make_plan(spec(2, [four_bit]), spec(1, [four_bit]))
    assert err.value.field == "groups.conv.shape" and "Head slice" in str(err.value) and "'conv'" in str(err.value)


def test_state_group_tp_mismatch_plans_head_slices():
    plan = make_plan(spec(2), spec(1))
    conv = plan.group("conv")
    writers = plan.writers_of(0, 0)
    assert [w.group for w in writers] == ["", "", "swa", "swa", "conv", "conv"]
    conv_writers = conv.plan.destination(0, 0).writers
    assert [(w.tp_rank, w.heads, w.slice_bytes) for w in conv_writers] == [(0, (0, 8), 96), (1, (8, 16), 96)]
    assert conv.bytes_per_unit() == 3 * 16 * 3 * 4  # layers x shape x float32, once per request
    assert plan.group("swa").bytes_per_unit() == 4 * 2 * 4 * 8 * 2
    assert plan.group_kind("") == "full" and plan.group_kind("conv") == "state"


def test_state_parts_are_split_by_tp_one_by_one():
    """A split dimension that concatenates parts (Qwen3-Next's conv q|k|v): TP 2 -> 1 writes
    each part's half at the part's place in the decode row."""
    conv = {**CONV, "shape": [16, 3], "split_parts": [4, 4, 8]}
    plan = make_plan(spec(2, [conv]), spec(1, [conv]))
    writers = plan.group("conv").plan.destination(0, 0).writers
    # (source rank, part, channels, channel offset in the source row, ... in the decode row)
    assert [(w.tp_rank, w.part, w.heads, w.src_head_offset, w.dst_head_offset) for w in writers] == [
        (0, 0, (0, 2), 0, 0), (1, 0, (2, 4), 0, 2),
        (0, 1, (4, 6), 2, 4), (1, 1, (6, 8), 2, 6),
        (0, 2, (8, 12), 4, 8), (1, 2, (12, 16), 4, 12)]
    assert {w.slice_bytes for w in writers} >= {2 * 12} and all(w.src_row_bytes == 8 * 12 for w in writers)
    assert len({w.key for w in writers}) == len(writers)

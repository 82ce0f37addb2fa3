"""Unit tests for InstanceSpec / RankGeometry.

Geometry is validated at construction so that the planner and the daemon never see a
cache that cannot be laid out; every refusal must name the field, the offending value
and a fix, because an operator reads it in a log line.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvxferd.errors import GeometryError, KvxferError
from kvxferd.model.geometry import DTYPE_BITS, InstanceSpec, RankGeometry, even_layer_splits


def spec(**overrides: Any) -> InstanceSpec:
    """A valid MHA spec (8 KV heads, 4 layers) with some fields replaced."""
    base: dict[str, Any] = dict(attention="mha", num_layers=4, head_dim=8, dtype="bfloat16",
                                page_size=4, total_kv_heads=8)
    base.update(overrides)
    return InstanceSpec(**base)


def refused(make: Any, field: str, *values: Any) -> GeometryError:
    """Assert ``make()`` raises GeometryError on ``field``, naming ``values`` and a fix."""
    with pytest.raises(GeometryError) as info:
        make()
    err = info.value
    assert err.field == field, (err.field, str(err))
    assert err.fix, f"no fix in {err!r}"
    text = str(err)
    assert err.fix in text
    for value in values:
        assert str(value) in err.message, f"{value!r} not named in {err.message!r}"
    assert isinstance(err, ValueError) and isinstance(err, KvxferError)
    assert err.to_wire() == {"code": "geometry", "field": field, "message": text}
    return err


# -- heads ---------------------------------------------------------------------------


@pytest.mark.parametrize("total, tp, expected", [
    (8, 1, [(0, 8)]),
    (8, 2, [(0, 4), (4, 8)]),
    (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
    (8, 8, [(h, h + 1) for h in range(8)]),
    (6, 3, [(0, 2), (2, 4), (4, 6)]),
    (3, 3, [(0, 1), (1, 2), (2, 3)]),
    (1, 1, [(0, 1)]),
])
def test_head_ranges_without_replication(total: int, tp: int, expected: list[tuple[int, int]]) -> None:
    """Heads are split evenly, in rank order, with no replication."""
    s = spec(total_kv_heads=total, tp_size=tp)
    assert [s.head_range(r) for r in range(tp)] == expected
    assert s.local_heads == total // tp
    assert s.replication == 1
    assert s.kv_heads == total


@pytest.mark.parametrize("total, tp, expected", [
    (4, 8, [0, 0, 1, 1, 2, 2, 3, 3]),
    (2, 8, [0, 0, 0, 0, 1, 1, 1, 1]),
    (1, 4, [0, 0, 0, 0]),
    (4, 16, [r // 4 for r in range(16)]),
    (3, 6, [0, 0, 1, 1, 2, 2]),
])
def test_head_ranges_with_replication(total: int, tp: int, expected: list[int]) -> None:
    """tp > heads: each rank holds one head, rank r holds head r // (tp / heads)."""
    s = spec(total_kv_heads=total, tp_size=tp)
    assert s.local_heads == 1
    assert s.replication == tp // total
    assert [s.head_range(r) for r in range(tp)] == [(h, h + 1) for h in expected]
    assert s.row_bytes == s.head_dim * 2  # bfloat16, one head


def test_mla_is_one_latent_held_by_every_rank() -> None:
    """MLA: one latent 'head' that every TP rank holds in full; kinds = ('latent',)."""
    for tp in (1, 2, 3, 8):
        s = InstanceSpec("mla", 4, 576, "bfloat16", 1, tp_size=tp)
        assert s.kv_heads == 1
        assert [s.head_range(r) for r in range(tp)] == [(0, 1)] * tp
        assert s.region_kinds == ("latent",)
        assert s.row_bytes == 576 * 2
    assert InstanceSpec("mla", 4, 576, "bfloat16", 1, total_kv_heads=1).kv_heads == 1


@pytest.mark.parametrize("hpr, tp", [(1, 1), (2, 4), (4, 2), (1, 8), (3, 2)])
def test_total_kv_heads_resolved_from_heads_per_rank(hpr: int, tp: int) -> None:
    """Without total_kv_heads, the model total is heads_per_rank * tp_size."""
    s = InstanceSpec("mha", 2, 8, "float16", 4, tp_size=tp, heads_per_rank=hpr)
    assert s.kv_heads == hpr * tp
    assert s.local_heads == hpr
    assert s.to_dict()["total_kv_heads"] == hpr * tp
    assert "heads_per_rank" not in s.to_dict()


def test_heads_per_rank_consistent_with_total_is_accepted() -> None:
    """Both given and consistent, including the replicated case (1 head per rank)."""
    assert spec(total_kv_heads=8, tp_size=2, heads_per_rank=4).local_heads == 4
    assert spec(total_kv_heads=4, tp_size=8, heads_per_rank=1).replication == 2


def test_bytes() -> None:
    """row_bytes = local heads x head_dim x bits / 8; page_bytes = page_size x row_bytes."""
    s = spec(total_kv_heads=8, tp_size=2, head_dim=128, dtype="float32", page_size=16)
    assert s.row_bytes == 4 * 128 * 4
    assert s.page_bytes == 16 * s.row_bytes
    assert s.region_kinds == ("k", "v")
    packed = spec(total_kv_heads=8, tp_size=8, head_dim=2, dtype="int4")
    assert packed.row_bytes == 1
    odd_heads = spec(total_kv_heads=6, tp_size=3, head_dim=1, dtype="float4_e2m1fn_x2")
    assert odd_heads.row_bytes == 1


# -- layers --------------------------------------------------------------------------


@pytest.mark.parametrize("layers, pp, expected", [
    (4, 1, [(0, 4)]),
    (4, 2, [(0, 2), (2, 4)]),
    (5, 2, [(0, 3), (3, 5)]),
    (7, 3, [(0, 3), (3, 5), (5, 7)]),
    (8, 3, [(0, 3), (3, 6), (6, 8)]),
    (3, 3, [(0, 1), (1, 2), (2, 3)]),
    (61, 4, [(0, 16), (16, 31), (31, 46), (46, 61)]),
])
def test_even_layer_splits(layers: int, pp: int, expected: list[tuple[int, int]]) -> None:
    """The first num_layers % pp ranks get one extra layer."""
    assert list(even_layer_splits(layers, pp)) == expected
    s = spec(num_layers=layers, pp_size=pp)
    assert [s.layer_range(r) for r in range(pp)] == expected


def test_explicit_layer_splits() -> None:
    """Explicit splits are kept as given, including gaps and uneven sizes."""
    s = spec(num_layers=10, pp_size=3, layer_splits=((0, 1), (1, 7), (7, 10)))
    assert [s.layer_range(r) for r in range(3)] == [(0, 1), (1, 7), (7, 10)]
    gappy = spec(num_layers=6, pp_size=2, layer_splits=[[1, 3], [4, 6]])
    assert gappy.splits == ((1, 3), (4, 6))


# -- refusals ------------------------------------------------------------------------


def test_cannot_resolve_total_kv_heads() -> None:
    err = refused(lambda: InstanceSpec("mha", 4, 8, "bfloat16", 4, tp_size=2), "total_kv_heads")
    assert "Cannot resolve total_kv_heads" in err.message
    assert "total_kv_heads" in err.fix


def test_refuses_unknown_attention() -> None:
    err = refused(lambda: spec(attention="gqa"), "attention", "'gqa'")
    assert "mha" in err.fix and "mla" in err.fix


@pytest.mark.parametrize("name", ["num_layers", "head_dim", "page_size", "tp_size", "pp_size"])
@pytest.mark.parametrize("bad", [0, -3])
def test_refuses_too_small_ints(name: str, bad: int) -> None:
    refused(lambda: spec(**{name: bad}), name, bad, ">= 1")


@pytest.mark.parametrize("name", ["num_layers", "head_dim", "page_size", "tp_size", "pp_size"])
@pytest.mark.parametrize("bad", ["4", 4.0, True, None])
def test_refuses_non_ints(name: str, bad: Any) -> None:
    refused(lambda: spec(**{name: bad}), name, repr(bad))


def test_refuses_unknown_dtype() -> None:
    err = refused(lambda: spec(dtype="float64"), "dtype", "'float64'")
    for name in DTYPE_BITS:
        assert name in err.fix


def test_refuses_unknown_layout() -> None:
    refused(lambda: spec(layout="HND"), "layout", "'HND'")


@pytest.mark.parametrize("dtype", ["int4", "float4_e2m1fn_x2"])
def test_refuses_rows_that_are_not_whole_bytes(dtype: str) -> None:
    """Packed 4-bit rows of an odd number of nibbles cannot be addressed."""
    err = refused(lambda: spec(dtype=dtype, head_dim=1, total_kv_heads=8, tp_size=8), "head_dim",
                  "4 bits", "head_dim 1")
    assert "even head_dim" in err.fix
    refused(lambda: spec(dtype=dtype, head_dim=3, total_kv_heads=3, tp_size=1), "head_dim",
            "36 bits", "3 heads")


@pytest.mark.parametrize("total", [2, 8])
def test_refuses_mla_with_several_heads(total: int) -> None:
    refused(lambda: InstanceSpec("mla", 4, 576, "bfloat16", 1, total_kv_heads=total),
            "total_kv_heads", total)


@pytest.mark.parametrize("bad", [0, -2])
def test_refuses_bad_total_kv_heads(bad: int) -> None:
    refused(lambda: spec(total_kv_heads=bad), "total_kv_heads", bad)


def test_refuses_non_int_total_kv_heads() -> None:
    refused(lambda: spec(total_kv_heads="8"), "total_kv_heads", "'8'")


@pytest.mark.parametrize("bad", [0, -1, "2"])
def test_refuses_bad_heads_per_rank(bad: Any) -> None:
    refused(lambda: spec(total_kv_heads=None, heads_per_rank=bad), "heads_per_rank",
            bad if isinstance(bad, int) else repr(bad))


@pytest.mark.parametrize("total, tp", [(8, 3), (6, 4), (4, 3)])
def test_refuses_tp_not_dividing_heads(total: int, tp: int) -> None:
    err = refused(lambda: spec(total_kv_heads=total, tp_size=tp), "tp_size", total, tp)
    assert "divides" in err.fix


@pytest.mark.parametrize("total, tp", [(4, 6), (8, 12), (3, 4)])
def test_refuses_tp_not_multiple_of_heads(total: int, tp: int) -> None:
    err = refused(lambda: spec(total_kv_heads=total, tp_size=tp), "tp_size", total, tp)
    assert "multiple" in err.fix


@pytest.mark.parametrize("total, tp, hpr, expected", [(8, 2, 2, 4), (4, 8, 2, 1), (8, 1, 4, 8)])
def test_refuses_inconsistent_heads_per_rank(total: int, tp: int, hpr: int, expected: int) -> None:
    err = refused(lambda: spec(total_kv_heads=total, tp_size=tp, heads_per_rank=hpr), "heads_per_rank",
                  f"heads_per_rank {hpr}", f"total_kv_heads {total}", f"tp_size {tp}")
    assert str(expected) in err.fix


def test_refuses_fewer_layers_than_pp() -> None:
    refused(lambda: spec(num_layers=2, pp_size=3), "pp_size", 2, 3)


@pytest.mark.parametrize("splits", [((0, 4),), ((0, 1), (1, 2), (2, 4)), "0-2,2-4", 5])
def test_refuses_layer_splits_of_wrong_count(splits: Any) -> None:
    refused(lambda: spec(pp_size=2, layer_splits=splits), "layer_splits", repr(splits), "(2)")


@pytest.mark.parametrize("item", [(0,), (0, 1, 2), (0, "2"), (0.0, 2), (False, 2), 3])
def test_refuses_malformed_layer_split(item: Any) -> None:
    refused(lambda: spec(pp_size=2, layer_splits=(item, (2, 4))), "layer_splits", repr(item), "[0]")


@pytest.mark.parametrize("splits, rank, shown", [
    (((0, 2), (2, 2)), 1, "[2, 2)"),     # empty
    (((0, 3), (2, 4)), 1, "[2, 4)"),     # overlap
    (((2, 4), (0, 2)), 1, "[0, 2)"),     # out of order
    (((0, 2), (2, 5)), 1, "[2, 5)"),     # beyond num_layers
    (((-1, 2), (2, 4)), 0, "[-1, 2)"),   # negative
    (((3, 1), (3, 4)), 0, "[3, 1)"),     # reversed
])
def test_refuses_bad_layer_ranges(splits: Any, rank: int, shown: str) -> None:
    err = refused(lambda: spec(num_layers=4, pp_size=2, layer_splits=splits), "layer_splits",
                  f"layer_splits[{rank}]", shown, "[0, 4)")
    assert "ascending" in err.fix


def test_refuses_out_of_range_ranks() -> None:
    s = spec(total_kv_heads=8, tp_size=2, pp_size=2)
    refused(lambda: s.head_range(2), "tp_rank", 2, "[0, 2)")
    refused(lambda: s.head_range(-1), "tp_rank", -1)
    refused(lambda: s.layer_range(2), "pp_rank", 2, "[0, 2)")
    refused(lambda: RankGeometry(s, tp_rank=2), "tp_rank", 2)
    refused(lambda: RankGeometry(s, pp_rank=5), "pp_rank", 5)
    refused(lambda: RankGeometry(s, tp_rank=-1), "tp_rank", -1)
    refused(lambda: RankGeometry(s, num_pages=0), "num_pages", 0)
    refused(lambda: RankGeometry(s, num_pages="3"), "num_pages", "'3'")


# -- RankGeometry ----------------------------------------------------------------------


def test_rank_geometry_properties() -> None:
    s = spec(total_kv_heads=8, tp_size=4, pp_size=2, num_layers=5, page_size=16)
    r = RankGeometry(s, tp_rank=3, pp_rank=1, num_pages=10)
    assert r.heads == (6, 8)
    assert r.layers == (3, 5)
    assert r.region_bytes == 10 * s.page_bytes
    assert r.region_names() == [(3, "k"), (3, "v"), (4, "k"), (4, "v")]
    mla = RankGeometry(InstanceSpec("mla", 3, 64, "bfloat16", 1, tp_size=2, pp_size=2), 1, 0, 2)
    assert mla.region_names() == [(0, "latent"), (1, "latent")]


# -- (de)serialisation -----------------------------------------------------------------


ROUND_TRIP_SPECS = [
    dict(attention="mha", num_layers=32, head_dim=128, dtype="bfloat16", page_size=16, tp_size=2,
         total_kv_heads=8, model="llama"),
    dict(attention="mha", num_layers=7, head_dim=64, dtype="float8_e4m3fn", page_size=1, tp_size=8,
         pp_size=3, total_kv_heads=4),
    dict(attention="mha", num_layers=6, head_dim=2, dtype="int4", page_size=3, tp_size=2,
         heads_per_rank=2, pp_size=2, layer_splits=((1, 3), (4, 6))),
    dict(attention="mla", num_layers=61, head_dim=576, dtype="bfloat16", page_size=64, tp_size=4,
         pp_size=4),
]


@pytest.mark.parametrize("kwargs", ROUND_TRIP_SPECS)
def test_spec_round_trip(kwargs: dict[str, Any]) -> None:
    """to_dict is canonical (resolved heads, explicit splits), and from_dict inverts it."""
    s = InstanceSpec(**kwargs)
    data = s.to_dict()
    assert data["total_kv_heads"] == s.kv_heads
    assert data["layer_splits"] == [list(x) for x in s.splits]
    back = InstanceSpec.from_dict(data)
    assert back.to_dict() == data
    for name in ("kv_heads", "splits", "local_heads", "replication", "row_bytes", "page_bytes",
                 "region_kinds", "attention", "dtype", "model", "tp_size", "pp_size"):
        assert getattr(back, name) == getattr(s, name), name
    # the canonical form is a fixed point, field for field
    assert InstanceSpec.from_dict(back.to_dict()) == back


def test_spec_round_trip_is_exact_for_canonical_specs() -> None:
    s = spec(tp_size=2, pp_size=2, layer_splits=((0, 1), (1, 4)))
    assert InstanceSpec.from_dict(s.to_dict()) == s


def test_rank_round_trip() -> None:
    s = spec(total_kv_heads=8, tp_size=4, pp_size=2)
    r = RankGeometry(s, tp_rank=2, pp_rank=1, num_pages=7)
    data = r.to_dict()
    assert (data["tp_rank"], data["pp_rank"], data["num_pages"]) == (2, 1, 7)
    back = RankGeometry.from_dict(data)
    assert back.to_dict() == data
    assert (back.heads, back.layers, back.region_bytes) == (r.heads, r.layers, r.region_bytes)
    # rank fields are tolerated when reading an InstanceSpec
    assert InstanceSpec.from_dict(data).to_dict() == s.to_dict()


def test_from_dict_rejects_unknown_fields() -> None:
    data = spec().to_dict()
    err = refused(lambda: InstanceSpec.from_dict({**data, "zeta": 1, "kv_lora_rank": 512}),
                  "kv_lora_rank", "kv_lora_rank", "zeta")
    assert "head_dim" in err.fix
    refused(lambda: RankGeometry.from_dict({**data, "tp_rnak": 1}), "tp_rnak", "tp_rnak")


def test_from_dict_rejects_missing_and_mistyped_fields() -> None:
    data = spec().to_dict()
    for name in ("attention", "num_layers", "head_dim", "dtype", "page_size"):
        partial = {k: v for k, v in data.items() if k != name}
        refused(lambda: InstanceSpec.from_dict(partial), name, name)
    refused(lambda: InstanceSpec.from_dict([("attention", "mha")]), "geometry", "list")
    refused(lambda: InstanceSpec.from_dict({**data, "model": 7}), "model", 7)
    for name in ("attention", "dtype", "layout"):
        refused(lambda: InstanceSpec.from_dict({**data, name: ["x"]}), name, "['x']")
    refused(lambda: InstanceSpec.from_dict({**data, "pp_size": 2, "layer_splits": [[0, 4], [4, 5]]}),
            "layer_splits", "layer_splits[1] = [4, 5)")

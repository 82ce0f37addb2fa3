"""KV cache groups in the instance's own layout (vLLM's packed pages and K|V token rows).

An engine's KV groups live in the same memory as its full-attention KV (vLLM overlays its
KV cache groups on one allocation), so a ``window`` or ``draft`` group is moved in the
instance's layout: region kind ``<group>.kv`` for the one-region layouts, and in a packed
layout (whole pages) a window starts at the page holding its first token.
"""

from __future__ import annotations

import pytest

from kvxferd.errors import ProtocolError
from kvxferd.model.geometry import InstanceSpec, RankGeometry
from kvxferd.model.group_plan import group_plans
from kvxferd.model.group_requests import group_origin
from kvxferd.sdk.kv_cache import allocate_cpu
from kvxferd.wire.protocol import region_kind

SWA = {"name": "swa", "kind": "window", "num_layers": 2, "head_dim": 32, "total_kv_heads": 2, "window": 39}


def spec(layout: str, tp: int = 1) -> InstanceSpec:
    return InstanceSpec.from_dict({"attention": "mha", "num_layers": 2, "head_dim": 32, "dtype": "float32",
                                   "page_size": 32, "total_kv_heads": 2, "tp_size": tp, "layout": layout,
                                   "groups": [SWA]})


@pytest.mark.parametrize("layout", ["packed_page", "NHD_kv", "HND_kv", "NHD"])
def test_a_kv_group_takes_the_instances_layout_and_region_kinds(layout):
    s = spec(layout)
    group = s.group_spec("swa")
    assert group.layout == layout and group.region_kinds == s.region_kinds
    geometry = RankGeometry(s, 0, 0, 6, group_pages={"swa": 4})
    kinds = {kind for _, kind in geometry.region_names()}
    assert kinds == set(s.region_kinds) | {f"swa.{k}" for k in s.region_kinds}
    cache = allocate_cpu(geometry)
    try:
        assert cache.tensors[(1, f"swa.{s.region_kinds[0]}")].numel() * 4 == geometry.group("swa").region_bytes
    finally:
        cache.close()


def test_a_packed_window_starts_at_the_page_of_its_first_token_a_token_row_window_at_the_token():
    packed, rows = spec("packed_page"), spec("NHD_kv")
    assert group_origin(packed, "swa", 0, 150) == 96          # 150 - 39 = 111, in page [96, 128)
    assert group_origin(rows, "swa", 0, 150) == 111
    assert group_origin(packed, "swa", 0, 30) == group_origin(rows, "swa", 0, 30) == 0
    assert group_origin(packed, "swa", 128, 150) == 128        # never before the expect's start
    assert group_origin(packed, "swa", 0, None) == 0           # length unknown: the whole request


def test_packed_window_groups_plan_like_the_instance_tp2_to_tp1():
    (plan,) = group_plans(spec("packed_page", 2), spec("packed_page", 1), "auto", False, False)
    assert (plan.name, plan.kind, plan.window) == ("swa", "window", 39)
    (dest,) = plan.plan.destinations
    assert sorted(w.heads for w in dest.writers) == [(0, 1), (1, 2)]
    assert all(w.group == "swa" for w in dest.writers)
    # per token: 2 layers x 2 heads x (K + V of 32 float32); a window of 39 tokens touches at most 3 pages
    summary = plan.to_dict()
    assert summary["bytes_per_token"] == 2 * 2 * 2 * 32 * 4
    assert summary["max_bytes_per_request"] == 3 * 32 * summary["bytes_per_token"]
    (rows,) = group_plans(spec("NHD_kv", 2), spec("NHD_kv", 1), "auto", False, False)
    assert rows.to_dict()["bytes_per_token"] == summary["bytes_per_token"]
    assert rows.to_dict()["max_bytes_per_request"] == 39 * summary["bytes_per_token"]


def test_the_protocol_takes_a_groups_kv_region_and_nothing_else_new():
    assert region_kind("kind", "swa0.kv") == "swa0.kv"
    for bad in ("swa0.kx", "swa0.", ".kv"):
        with pytest.raises(ProtocolError):
            region_kind("kind", bad)

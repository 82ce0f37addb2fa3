"""The one rule for how a chunk leaves (direct or staged) and why, over every input."""

from __future__ import annotations

import itertools

import pytest

from kvxferd.model.geometry import InstanceSpec
from kvxferd.model.planner import make_plan
from kvxferd.transport import chunk_modes as cm


@pytest.mark.parametrize("plan_mode, pinned, device_memory, short_runs, private",
                         list(itertools.product(("direct", "staged"), *[(False, True)] * 4)))
def test_pick(plan_mode, pinned, device_memory, short_runs, private):
    mode, why = cm.pick(plan_mode, pinned, device_memory, short_runs, private)
    assert why in cm.WHYS
    if plan_mode == "staged":  # a staged plan never moves a chunk in place
        assert (mode, why) == ("staged", "plan")
    elif private:  # a decode daemon that keeps its engines' memory private: into its ring, asked or not
        assert (mode, why) == ("staged", "private_destination")
    elif device_memory:  # GPU pages go through the daemon's own slot, asked or not
        assert (mode, why) == ("staged", "device_memory")
    elif pinned:  # direct asked outright: kept for host memory, however short the runs
        assert (mode, why) == ("direct", "plan")
    else:  # auto planned direct: short runs go through a slot, the rest in place
        assert (mode, why) == (("staged", "short_runs") if short_runs else ("direct", "plan"))


def _spec(tp: int, head_dim: int) -> InstanceSpec:
    return InstanceSpec(attention="mha", num_layers=2, total_kv_heads=8, head_dim=head_dim, dtype="bfloat16",
                        page_size=16, tp_size=tp)


@pytest.mark.parametrize("head_dim, p_tp, d_tp, asked, warned", [
    (128, 2, 1, "direct", 4 * 128 * 2),  # 1 KiB slices: direct moves each as a run of its own
    (128, 2, 1, "auto", 0),              # auto stages them: nothing to warn about
    (128, 1, 1, "direct", 0),            # whole rows: no slices
    (1024, 2, 1, "direct", 0),           # 8 KiB slices are long enough to move in place
])
def test_short_slices_warn_only_where_direct_keeps_short_runs(head_dim, p_tp, d_tp, asked, warned):
    plan = make_plan(_spec(p_tp, head_dim), _spec(d_tp, head_dim), mode="direct")
    assert cm.short_slices(plan, asked) == warned

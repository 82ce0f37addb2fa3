"""The one rule for how a chunk leaves (direct or staged) and why, over every input."""

from __future__ import annotations

import itertools

import pytest

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

"""Which way a chunk crosses NIXL in blocks (:func:`kvxferd.transport.nixl.blocks.choose`): pure rules."""

from __future__ import annotations

import numpy as np
import pytest

from kvxferd.transport.nixl.blocks import LAND, PLACE, READ, choose

LONG = np.arange(64)  # one run of 64 rows: long enough to use in place at 1 KiB a row
SHUFFLED = np.array([5, 1, 9, 3, 7, 11, 13, 15])  # runs of one row


def _choose(**kw):
    args = dict(src_whole=True, dst_whole=True, src_slots=LONG, dst_slots=LONG, slice_bytes=1024,
                can_land=True, can_gather=True, in_place_bytes=16 * 1024)
    return choose(**{**args, **kw})


def test_whole_rows_in_long_runs_are_read_in_place_and_short_ones_copied():
    assert _choose() == READ
    assert _choose(src_slots=SHUFFLED) == PLACE  # the destination's long runs are written in place
    assert _choose(src_slots=SHUFFLED, dst_slots=SHUFFLED) == LAND
    assert _choose(src_slots=SHUFFLED, dst_slots=SHUFFLED, can_land=False) is None  # direct


@pytest.mark.parametrize("can_land", [True, False])
@pytest.mark.parametrize("dst", ["long", "short"])
def test_a_source_that_may_not_be_read_in_place_is_always_gathered(can_land, dst):
    """GPU memory opened by CUDA IPC: UCX sends from it as host memory, so no route reads it in
    place, and with no landing ring the gathered block is written into the decode rows."""
    dst_slots = LONG if dst == "long" else SHUFFLED
    route = _choose(src_in_place=False, dst_slots=dst_slots, can_land=can_land)
    assert route in (LAND, PLACE)
    if dst == "long":
        assert route == PLACE  # one copy, on this side
    else:
        assert route == (LAND if can_land else PLACE)
    assert _choose(src_in_place=False, can_gather=False) is None  # no slot of its own: only direct is left


@pytest.mark.parametrize("src_in_place", [True, False])
@pytest.mark.parametrize("dst", ["long", "short"])
def test_a_destination_that_may_not_be_written_in_place_lands_when_the_peer_gave_a_ring(src_in_place, dst):
    """The decode side's GPU memory opened by CUDA IPC: written in place it moves by software, so
    every chunk goes through the landing ring when there is one, read in place on a host source
    with long runs, gathered otherwise; with no ring it is written in place, the only way left."""
    dst_slots = LONG if dst == "long" else SHUFFLED
    route = _choose(src_in_place=src_in_place, src_slots=SHUFFLED, dst_slots=dst_slots, dst_in_place=False)
    assert route == LAND
    assert _choose(src_in_place=src_in_place, dst_slots=dst_slots, dst_in_place=False) == (READ if src_in_place else LAND)
    assert _choose(src_in_place=src_in_place, src_slots=SHUFFLED, dst_slots=dst_slots, dst_in_place=False,
                   can_land=False) == PLACE
    assert _choose(src_in_place=src_in_place, src_slots=SHUFFLED, dst_slots=dst_slots, dst_in_place=False,
                   can_land=False, dst_whole=False) is None

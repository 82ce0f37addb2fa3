"""Which way a chunk crosses NIXL in blocks (:func:`kvxferd.transport.nixl.blocks.choose`): pure rules."""

from __future__ import annotations

import numpy as np
import pytest

from hypothesis import given, settings, strategies as st

from kvxferd.transport.nixl.blocks import LAND, PLACE, READ, choose, cut_rows

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


def _byte_map(local: np.ndarray, remote: np.ndarray) -> list[tuple[int, int]]:
    """The oracle: every (source byte, destination byte) pair the rows move, in stream order."""
    return [(int(s) + i, int(d) + i) for (s, n, *_), (d, *_) in zip(local.tolist(), remote.tolist())
            for i in range(int(n))]


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=12), block=st.integers(-1, 64))
def test_a_cut_write_moves_exactly_the_uncut_bytes_in_blocks_of_at_most_block(lengths, block):
    """``qos.bulk_block_bytes``: a bulk chunk's direct WRITE cut into several moves the same bytes
    to the same places, in the same order, no WRITE larger than the block, none empty."""
    starts_src = np.cumsum([0] + [n + 100 for n in lengths[:-1]])  # rows apart, as regions are
    local = np.array([[1000 + s, n, 0] for s, n in zip(starts_src, lengths)], dtype=np.uint64)
    remote = np.array([[9000 + 3 * s, n, 1] for s, n in zip(starts_src, lengths)], dtype=np.uint64)
    writes = cut_rows(local, remote, block)
    total = sum(lengths)
    assert [p for loc, rem in writes for p in _byte_map(loc, rem)] == _byte_map(local, remote)
    if block <= 0 or total <= block:
        assert len(writes) == 1 and writes[0][0] is local  # uncut: the rows as they were
        return
    sizes = [int(loc[:, 1].sum()) for loc, _ in writes]
    assert all(0 < n <= block for n in sizes)
    assert sizes[:-1] == [block] * (len(sizes) - 1)  # every WRITE but the last is a full block
    for loc, rem in writes:
        assert (loc[:, 1] == rem[:, 1]).all() and (loc[:, 2] == 0).all() and (rem[:, 2] == 1).all()

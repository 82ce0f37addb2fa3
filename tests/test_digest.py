"""Chunk digests: both ends of a chunk hash the same bytes however each side lays them out.

The oracle is a plain per-token loop that copies a writer's slice from source rows to
destination rows of another width and offset. The digest of the source's slots must equal
the digest of the destination's slots after that copy, and the xxhash package's digest of the
slices joined by a plain loop, on every path (in C where the native library hashes; in Python,
runs hashed in place, runs gathered first, the scratch buffer cut several times); a changed
byte inside a copied slice must change it, and a byte outside every slice must not.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxferd.datapath import digest, runcopy
from kvxferd.datapath.digest import region_digests


@pytest.fixture(params=["native", "python"])
def hashing(request, monkeypatch):
    """Region digests in C (where this build hashes there) or with the xxhash package."""
    if request.param == "python":
        monkeypatch.setattr(runcopy, "_loaded", [None])
    elif runcopy.native() is None or not runcopy.native().hashes:
        pytest.skip("this build does not hash in C (no xxhash header when it was compiled)")
    return request.param


def _copy_oracle(src: np.ndarray, dst: np.ndarray, src_slots, dst_slots, src_row: int, dst_row: int,
                 src_head: int, dst_head: int, n: int) -> None:
    for s, d in zip(src_slots, dst_slots):
        dst[d * dst_row + dst_head:d * dst_row + dst_head + n] = src[s * src_row + src_head:s * src_row + src_head + n]


@st.composite
def _layouts(draw):
    slice_bytes = draw(st.sampled_from([2, 64, 1024, 4096, 32768]))
    src_extra = draw(st.sampled_from([0, slice_bytes, 3 * slice_bytes]))  # head slices of wider rows
    dst_extra = draw(st.sampled_from([0, slice_bytes]))
    src_head = draw(st.integers(0, src_extra // slice_bytes)) * slice_bytes if src_extra else 0
    dst_head = draw(st.integers(0, dst_extra // slice_bytes)) * slice_bytes if dst_extra else 0
    n_tokens = draw(st.integers(1, 24))
    src_slots_n, dst_slots_n = n_tokens + draw(st.integers(0, 8)), n_tokens + draw(st.integers(0, 8))
    rand = draw(st.randoms(use_true_random=False))
    consecutive = draw(st.booleans())  # consecutive slots: one long run; else scattered
    src_slots = (np.arange(n_tokens) + rand.randrange(src_slots_n - n_tokens + 1) if consecutive
                 else np.array(rand.sample(range(src_slots_n), n_tokens)))
    dst_slots = np.array(rand.sample(range(dst_slots_n), n_tokens))
    return (slice_bytes, slice_bytes + src_extra, slice_bytes + dst_extra, src_head, dst_head,
            src_slots.astype(np.int64), dst_slots.astype(np.int64), src_slots_n, dst_slots_n, draw(st.integers(1, 3)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(layout=_layouts(), small_scratch=st.booleans(), seed=st.integers(0, 2**31))
def test_source_and_destination_digests_agree_and_see_one_changed_byte(hashing, layout, small_scratch, seed):
    (n, src_row, dst_row, src_head, dst_head, src_slots, dst_slots, src_count, dst_count, regions) = layout
    rng = np.random.default_rng(seed)
    srcs = [rng.integers(0, 256, src_count * src_row, dtype=np.uint8) for _ in range(regions)]
    dsts = [rng.integers(0, 256, dst_count * dst_row, dtype=np.uint8) for _ in range(regions)]
    for s, d in zip(srcs, dsts):
        _copy_oracle(s, d, src_slots, dst_slots, src_row, dst_row, src_head, dst_head, n)
    saved = digest.SCRATCH_BYTES
    if small_scratch:  # several gathers per region, and a slice larger than the scratch
        digest.SCRATCH_BYTES = 3 * n if n < 4096 else 1024
        digest._local.__dict__.pop("buf", None)
    try:
        want = region_digests([torch.from_numpy(s) for s in srcs], src_slots, src_row, src_head, n)
        got = region_digests([torch.from_numpy(d) for d in dsts], dst_slots, dst_row, dst_head, n)
        assert got == want
        assert want == [xxhash.xxh3_64(b"".join(s[t * src_row + src_head:t * src_row + src_head + n].tobytes()
                                               for t in src_slots.tolist())).intdigest() for s in srcs]
        k = int(rng.integers(regions))
        # a byte outside every slice of the chunk: the digest does not cover it
        covered = np.zeros(dst_count * dst_row, dtype=bool)
        for d in dst_slots:
            covered[d * dst_row + dst_head:d * dst_row + dst_head + n] = True
        outside = np.flatnonzero(~covered)
        if outside.size:
            dsts[k][outside[int(rng.integers(outside.size))]] ^= 0xFF
            assert region_digests([torch.from_numpy(d) for d in dsts], dst_slots, dst_row, dst_head, n) == want
        # one byte inside a slice: that region's digest, and only that one, changes
        d = int(dst_slots[int(rng.integers(dst_slots.size))])
        dsts[k][d * dst_row + dst_head + int(rng.integers(n))] ^= 0x01
        changed = region_digests([torch.from_numpy(d) for d in dsts], dst_slots, dst_row, dst_head, n)
        assert [i for i, (a, b) in enumerate(zip(changed, want)) if a != b] == [k]
    finally:
        digest.SCRATCH_BYTES = saved
        digest._local.__dict__.pop("buf", None)


def test_the_order_of_slots_is_part_of_the_digest(hashing):
    """Two tokens' slices swapped on the destination is a different KV cache: caught."""
    data = torch.arange(64, dtype=torch.uint8)
    a = region_digests([data], np.array([0, 1, 2, 3]), 16, 0, 16)
    b = region_digests([data], np.array([1, 0, 2, 3]), 16, 0, 16)
    assert a != b


def test_an_empty_chunk_has_the_digest_of_no_bytes(hashing):
    data = torch.zeros(64, dtype=torch.uint8)
    empty = np.zeros(0, dtype=np.int64)
    assert region_digests([data], empty, 16, 0, 16) == region_digests([data[:0]], empty, 16, 0, 16)


@settings(max_examples=60, deadline=None)
@given(layout=_layouts(), per_slot=st.integers(1, 9))
def test_running_digests_fed_block_by_block_or_in_place_are_the_region_digests(layout, per_slot):
    """What a sender hashes as it goes (each packed block as a staging slot holds it, or each
    block's slices where its pages hold them) is the digest of the slices joined by a plain
    loop: the receiver's check cannot tell how the source hashed."""
    from kvxferd.datapath.staging import block_count, block_pieces

    n, src_row, _dst_row, src_head, _dst_head, src_slots, _dst, src_n, _dst_n, regions = layout
    rng = np.random.default_rng(n + src_row + regions)
    flats = [torch.from_numpy(rng.integers(0, 256, src_n * src_row, dtype=np.uint8)) for _ in range(regions)]
    joined = [xxhash.xxh3_64_intdigest(b"".join(f.numpy()[s * src_row + src_head:s * src_row + src_head + n].tobytes()
                                                for s in src_slots)) for f in flats]
    packed, in_place = digest.RunningDigests(regions), digest.RunningDigests(regions)
    for k in range(block_count(regions, src_slots.size, per_slot)):
        pieces = block_pieces(k, regions, src_slots.size, per_slot, n)
        slot = torch.zeros(per_slot * n, dtype=torch.uint8)
        for p in pieces:  # gathered by a plain loop, as a staging slot would hold it
            for j, s in enumerate(src_slots[p.lo:p.hi]):
                at = p.offset + j * n
                slot[at:at + n] = flats[p.region][s * src_row + src_head:s * src_row + src_head + n]
        packed.add_block(pieces, slot, n)
        for p in pieces:
            in_place.add_slots(p.region, memoryview(flats[p.region].numpy()), src_slots[p.lo:p.hi], src_row,
                               src_head, n)
    assert packed.digests() == joined == in_place.digests()

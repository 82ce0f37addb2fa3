"""The native run copy and the torch path give the same bytes as a per-run reference, and the
native hashing the digests of the xxhash package.

The library is compiled here from ``kvxferd/datapath/runcopy.c`` with the system C compiler, so the
test exercises the source in the tree (not a stale build). Every case runs three ways: the
native library (with and without streaming stores), the torch fallback, and a plain
Python loop over byte slices that shares no code with either.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxferd.datapath import copier, runcopy
from kvxferd.errors import TransferError
from kvxferd.model.plan import Writer
from kvxferd.model import segments
from kvxferd.model.segments import head_offset_bytes

CC = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler (cc, gcc, clang) to build kvxferd/datapath/runcopy.c")


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> runcopy.RunCopy:
    path = runcopy.build(tmp_path_factory.mktemp("runcopy") / "runcopy.so", cc=CC)
    return runcopy.RunCopy(path)


# the same setting for every generated input (the fixture is not reset between them, and need not be)
@pytest.fixture(params=["native", "native-streaming", "torch"])
def path(request: pytest.FixtureRequest, lib: runcopy.RunCopy, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(runcopy, "_loaded", [None if request.param == "torch" else lib])
    # streaming stores from the first byte, or never
    monkeypatch.setattr(runcopy, "STREAM_BYTES", 0 if request.param == "native-streaming" else 1 << 62)
    return request.param


def random_bytes(rng: np.random.Generator, n: int) -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))


@st.composite
def row_cases(draw: st.DrawFn) -> dict:
    heads = draw(st.integers(1, 3))
    per_head = draw(st.sampled_from((1, 3, 8, 64, 136, 512)))  # odd sizes: unaligned runs and leads
    src_heads, dst_heads = heads + draw(st.integers(0, 2)), heads + draw(st.integers(0, 2))
    n = draw(st.integers(0, 40))
    return dict(slice_bytes=heads * per_head, src_row=src_heads * per_head, dst_row=dst_heads * per_head,
                heads=heads, per_head=per_head,
                src_head=draw(st.integers(0, src_heads - heads)) * per_head,
                dst_head=draw(st.integers(0, dst_heads - heads)) * per_head,
                n=n, regions=draw(st.integers(1, 3)), seed=draw(st.integers(0, 2**32 - 1)),
                whole=draw(st.booleans()))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=row_cases())
def test_copy_regions_matches_reference(path: str, case: dict) -> None:
    rng = np.random.default_rng(case["seed"])
    n, whole = case["n"], case["whole"]
    src_row, dst_row = (case["slice_bytes"],) * 2 if whole else (case["src_row"], case["dst_row"])
    src_head, dst_head = (0, 0) if whole else (case["src_head"], case["dst_head"])
    # pages of 3 slots in random order: neighbours inside a page coalesce into longer runs
    pages = -(-n // 3) + 2
    slots_src = (rng.permutation(pages)[:, None] * 3 + np.arange(3)).ravel()[:n].astype(np.int64)
    slots_dst = (rng.permutation(pages)[:, None] * 3 + np.arange(3)).ravel()[:n].astype(np.int64)
    w = Writer(0, 0, (0, case["heads"]), (0, 1), src_head // case["per_head"], dst_head // case["per_head"],
               case["slice_bytes"], src_row, dst_row)
    assert (head_offset_bytes(w, "src"), head_offset_bytes(w, "dst")) == (src_head, dst_head)
    srcs = [random_bytes(rng, pages * 3 * src_row) for _ in range(case["regions"])]
    dsts = [random_bytes(rng, pages * 3 * dst_row) for _ in range(case["regions"])]
    want = [d.numpy().copy() for d in dsts]
    for s, ref in zip(srcs, want):
        sb = s.numpy()
        for a, b in zip(slots_src.tolist(), slots_dst.tolist()):
            ref[b * dst_row + dst_head:b * dst_row + dst_head + case["slice_bytes"]] = \
                sb[a * src_row + src_head:a * src_row + src_head + case["slice_bytes"]]
    moved = copier.copy_regions(srcs, dsts, slots_src, slots_dst, w, src_head, dst_head)
    for d, ref in zip(dsts, want):
        assert np.array_equal(d.numpy(), ref)
    assert (moved == 0) == (n == 0)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=row_cases())
def test_gather_then_scatter_matches_reference(path: str, case: dict) -> None:
    rng = np.random.default_rng(case["seed"])
    # a staged piece always holds a token (the torch path cannot view an empty slot as words)
    n, sb, row, head = max(1, case["n"]), case["slice_bytes"], case["src_row"], case["src_head"]
    if case["whole"]:
        row, head = sb, 0  # whole rows: the native copy moves each run of consecutive slots at once
    # pages of 3 slots in random order, one of them cut short: runs of 1 to 3 consecutive slots
    pages = -(-n // 3) + 2
    slots = (rng.permutation(pages)[:, None] * 3 + np.arange(3)).ravel()
    slots = np.delete(slots, rng.integers(0, slots.size))[:n].astype(np.int64)
    region = random_bytes(rng, pages * 3 * row)
    out = torch.zeros(n * sb + 7, dtype=torch.uint8)
    copier.gather(region, slots, row, head, sb, out[:n * sb])
    flat = region.numpy()
    want = b"".join(flat[s * row + head:s * row + head + sb].tobytes() for s in slots.tolist())
    assert out.numpy()[:n * sb].tobytes() == want and not out.numpy()[n * sb:].any()

    target = random_bytes(rng, pages * 3 * row)
    ref = target.numpy().copy()
    data = random_bytes(rng, n * sb)
    for i, s in enumerate(slots.tolist()):
        ref[s * row + head:s * row + head + sb] = data.numpy()[i * sb:(i + 1) * sb]
    copier.scatter(target, slots, row, head, sb, data)
    assert np.array_equal(target.numpy(), ref)


@pytest.mark.parametrize("broadcast", [True, False])
def test_copy_runs_matches_reference(lib: runcopy.RunCopy, monkeypatch: pytest.MonkeyPatch, broadcast: bool) -> None:
    rng = np.random.default_rng(5)
    for stream in (0, 1 << 62):
        monkeypatch.setattr(runcopy, "STREAM_BYTES", stream)
        size = 1 << 16
        # disjoint destination runs of assorted lengths (1 byte to several KiB), random sources
        lengths = np.full(20, 777, dtype=np.int64) if broadcast else rng.integers(1, 3000, 20)
        dst_off = (np.cumsum(lengths) - lengths + rng.integers(0, 64, 20).cumsum()).astype(np.int64)
        src_off = rng.integers(0, size - 3000, 20).astype(np.int64)
        lens = np.broadcast_to(np.int64(777), (20,)) if broadcast else lengths
        srcs = [random_bytes(rng, size) for _ in range(2)]
        dsts = [random_bytes(rng, size) for _ in range(2)]
        want = [d.numpy().copy() for d in dsts]
        for s, ref in zip(srcs, want):
            for a, b, k in zip(src_off.tolist(), dst_off.tolist(), lengths.tolist()):
                ref[b:b + k] = s.numpy()[a:a + k]
        lib.copy_runs(srcs, dsts, src_off, dst_off, lens)
        for d, ref in zip(dsts, want):
            assert np.array_equal(d.numpy(), ref)


needs_hash = pytest.mark.skipif(not Path("/usr/include/xxhash.h").exists(),
                                reason="no xxhash header (libxxhash-dev): the build hashes with the xxhash package")


@needs_hash
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 3000)), max_size=30),
       regions=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_native_hashing_gives_the_xxhash_packages_digests(lib: runcopy.RunCopy, pieces, regions, seed) -> None:
    import xxhash
    rng = np.random.default_rng(seed)
    flats = [random_bytes(rng, 8000) for _ in range(regions)]
    offsets = np.array([o for o, _ in pieces], dtype=np.int64)
    lengths = np.array([n for _, n in pieces], dtype=np.int64)
    assert lib.hashes
    want = [xxhash.xxh3_64(b"".join(f.numpy()[o:o + n].tobytes() for o, n in pieces)).intdigest() for f in flats]
    assert lib.hash_pieces(flats, offsets, lengths) == want


@needs_hash
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=row_cases(), block=st.sampled_from((1, 100, 4096, 1 << 20)), flip=st.booleans(), data=st.data())
def test_a_copy_that_hashes_moves_the_bytes_and_digests_the_checked_slots_of_both_sides(
        lib: runcopy.RunCopy, monkeypatch: pytest.MonkeyPatch, case: dict, block: int, flip: bool, data) -> None:
    """Bytes against the per-slot reference copy; each side's digests against the xxhash package
    over the checked slots' slices, in slot order; ``flip`` changes the destination's digest of
    the first region, and only there, by inverting the first checked byte it landed."""
    import xxhash
    monkeypatch.setattr(runcopy, "_loaded", [lib])
    rng = np.random.default_rng(case["seed"])
    n, whole, sb = case["n"], case["whole"], case["slice_bytes"]
    src_row, dst_row = (sb,) * 2 if whole else (case["src_row"], case["dst_row"])
    src_head, dst_head = (0, 0) if whole else (case["src_head"], case["dst_head"])
    pages = -(-n // 3) + 2
    slots_src = (rng.permutation(pages)[:, None] * 3 + np.arange(3)).ravel()[:n].astype(np.int64)
    slots_dst = (rng.permutation(pages)[:, None] * 3 + np.arange(3)).ravel()[:n].astype(np.int64)
    checked = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    w = Writer(0, 0, (0, case["heads"]), (0, 1), src_head // case["per_head"], dst_head // case["per_head"],
               sb, src_row, dst_row)
    srcs = [random_bytes(rng, pages * 3 * src_row) for _ in range(case["regions"])]
    dsts = [random_bytes(rng, pages * 3 * dst_row) for _ in range(case["regions"])]
    want = [d.numpy().copy() for d in dsts]
    for s, ref in zip(srcs, want):
        for a, b in zip(slots_src.tolist(), slots_dst.tolist()):
            at = a * src_row + src_head
            ref[b * dst_row + dst_head:b * dst_row + dst_head + sb] = s.numpy()[at:at + sb]
    if flip and checked.any():  # the first checked slot's first byte, as landed in region 0
        at = int(slots_dst[np.flatnonzero(checked)[0]]) * dst_row + dst_head
        want[0][at] ^= 0xFF

    def digest_of(flat: np.ndarray, slots: np.ndarray, row: int, head: int) -> int:
        return xxhash.xxh3_64(b"".join(flat[s * row + head:s * row + head + sb].tobytes()
                                       for s in slots[checked].tolist())).intdigest()

    got = copier.copy_hashed(srcs, dsts, slots_src, slots_dst, w, src_head, dst_head, checked, block,
                             flip=flip and bool(checked.any()))
    assert got is not None
    src_digests, dst_digests, _ = got
    for d, ref in zip(dsts, want):
        assert np.array_equal(d.numpy(), ref)
    assert src_digests == [digest_of(s.numpy(), slots_src, src_row, src_head) for s in srcs]
    assert dst_digests == [digest_of(d, slots_dst, dst_row, dst_head) for d in want]
    changed = [i for i, (a, b) in enumerate(zip(src_digests, dst_digests)) if a != b]
    assert changed == ([0] if flip and checked.any() else [])
    pieces = segments.hashed_pieces(slots_src, slots_dst, w, src_head, dst_head, checked, block)
    assert all(k <= max(block, sb) for k in pieces[2][pieces[3]])  # each hashed piece fits the block


def test_out_of_bounds_is_refused_and_nothing_written(lib: runcopy.RunCopy) -> None:
    region = torch.zeros(1024, dtype=torch.uint8)
    data = torch.ones(256, dtype=torch.uint8)
    with pytest.raises(TransferError) as err:
        lib.scatter_rows(region, np.array([0, 8]), 128, 0, 128, data)  # slot 8 ends at byte 1152
    assert err.value.field == "slots" and "1024-byte region" in str(err.value)
    with pytest.raises(TransferError):
        lib.scatter_rows(region, np.array([-1, 2]), 128, 0, 128, data)
    with pytest.raises(TransferError):
        lib.gather_rows(region, np.array([0, 1, 2]), 128, 0, 128, data)  # 3 slices, room for 2
    with pytest.raises(TransferError):
        lib.copy_runs([region], [region.clone()], np.array([1000]), np.array([0]), np.array([100]))
    with pytest.raises(TransferError):
        lib.copy_rows([region], [torch.zeros(512, dtype=torch.uint8)], np.array([1]), 128, 0,
                      np.array([4]), 128, 0, 128)
    if lib.hashes:
        with pytest.raises(TransferError):
            lib.hash_pieces([region], np.array([1000]), np.array([100]))
        with pytest.raises(TransferError):
            lib.copy_hash([region], [torch.zeros(512, dtype=torch.uint8)], np.array([0]), np.array([500]),
                          np.array([100]), np.array([1]))
    assert not region.any()


def test_build_writes_a_loadable_library(tmp_path: Path) -> None:
    built = runcopy.build(tmp_path / "lib.so", cc=CC)
    assert built.exists() and not list(tmp_path.glob(".*.tmp"))
    region = torch.arange(64, dtype=torch.uint8)
    out = torch.zeros(8, dtype=torch.uint8)
    runcopy.RunCopy(built).gather_rows(region, np.array([3, 1]), 16, 4, 4, out)
    assert out.tolist() == [52, 53, 54, 55, 20, 21, 22, 23]

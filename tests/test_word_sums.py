"""The device digest (word sums) against an independent oracle of its definition.

The oracle (``tests/digest_oracles.py``) is written from the definition in
:mod:`kvxferd.datapath.word_sums`' docstring with Python integers only. Both of the module's kernels (numpy on a host, torch as on a GPU) run here
on CPU tensors; the CUDA run of the torch kernel is the GPU check's (kvxferd.tools.gpu_check).
"""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from digest_oracles import KEYS, wsum as oracle
from kvxferd.datapath import digest, word_sums
from kvxferd.datapath.word_sums import BLOCK_BYTES, BLOCK_WORDS

def _bytes(rng: random.Random, n: int) -> bytes:
    return rng.randbytes(n)


def test_the_key_table_is_the_definitions():
    assert word_sums.keys_table().tolist() == KEYS
    assert all(k % 2 == 1 and 0 < k < 2 ** 31 for k in KEYS)


@pytest.mark.parametrize("kernel", [word_sums.block_sums, word_sums.device_sums])
def test_both_kernels_sum_whole_blocks_as_the_definition_does(kernel):
    rng = random.Random(1)
    data = _bytes(rng, 3 * BLOCK_BYTES)
    words = struct.unpack(f"<{len(data) // 2}H", data)
    want = [sum(k * w for k, w in zip(KEYS, words[b:b + BLOCK_WORDS])) for b in range(0, len(words), BLOCK_WORDS)]
    got = kernel(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert got.dtype == torch.int64 and got.tolist() == want
    # the largest sums a block can have (every word 0xFFFF) are exact: int64 never wraps
    full = torch.full((BLOCK_BYTES,), 0xFF, dtype=torch.uint8)
    assert kernel(full).tolist() == [0xFFFF * sum(KEYS)]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 3 * BLOCK_BYTES + 7), cuts=st.lists(st.integers(0, 3 * BLOCK_BYTES), max_size=6),
       seed=st.integers(0, 2 ** 32))
def test_a_stream_fed_in_any_pieces_digests_as_the_oracle(n, cuts, seed):
    data = _bytes(random.Random(seed), n)
    state = word_sums.WordSums(torch.device("cpu"), piece_bytes=BLOCK_BYTES // 2)
    at = 0
    for cut in sorted(c for c in cuts if c <= n) + [n]:
        state.add(torch.frombuffer(bytearray(data[at:cut]) or bytearray(1), dtype=torch.uint8)[:cut - at])
        at = cut
    sums, nbytes = state.take()
    assert nbytes == n and word_sums.fold(sums.numpy(), nbytes) == oracle(data)
    # the same buffer then digests another stream from its start
    state.add(torch.frombuffer(bytearray(data[:7] or b"x"), dtype=torch.uint8))
    assert word_sums.fold(state.take()[0].numpy(), min(n, 7) or 1) == oracle(data[:7] or b"x")


@settings(max_examples=30, deadline=None)
@given(slots=st.integers(0, 40), row_words=st.integers(1, 3000), seed=st.integers(0, 2 ** 32), data=st.data())
def test_region_digests_cover_each_regions_slices_in_slot_order(slots, row_words, seed, data):
    rng = random.Random(seed)
    row = 2 * row_words
    head = data.draw(st.integers(0, row - 1))
    width = data.draw(st.integers(1, row - head))
    n_rows = max(slots, 1) + 3
    flats = [torch.frombuffer(bytearray(_bytes(rng, n_rows * row)), dtype=torch.uint8) for _ in range(2)]
    order = np.array(rng.sample(range(n_rows), slots), dtype=np.int64)
    piece = data.draw(st.sampled_from([1, 4096, BLOCK_BYTES, 4 * BLOCK_BYTES]))
    got = word_sums.region_digests(flats, order, row, head, width, piece_bytes=piece)
    want = [oracle(b"".join(bytes(f[s * row + head:s * row + head + width].numpy()) for s in order.tolist()))
            for f in flats]
    assert got == want
    assert digest.region_digests(flats, order, row, head, width, hash=word_sums.NAME) == got


def test_any_one_changed_word_or_a_swapped_block_changes_the_digest():
    rng = random.Random(3)
    data = bytearray(_bytes(rng, 2 * BLOCK_BYTES + 100))
    base = oracle(bytes(data))
    flat = torch.frombuffer(data, dtype=torch.uint8)
    whole = np.array([0], dtype=np.int64)
    assert word_sums.region_digests([flat], whole, len(data), 0, len(data)) == [base]
    for _ in range(50):
        at = rng.randrange(len(data))
        old = data[at]
        data[at] = (old + rng.randrange(1, 256)) % 256
        assert word_sums.region_digests([flat], whole, len(data), 0, len(data)) != [base], at
        data[at] = old
    swapped = data[BLOCK_BYTES:2 * BLOCK_BYTES] + data[:BLOCK_BYTES] + data[2 * BLOCK_BYTES:]
    assert swapped != data  # random blocks differ
    assert oracle(bytes(swapped)) != base
    # a zero byte appended (the pad of an odd stream) is told apart by the length
    assert oracle(bytes(data[:101])) != oracle(bytes(data[:101]) + b"\0")
    assert oracle(b"") != oracle(b"\0\0")

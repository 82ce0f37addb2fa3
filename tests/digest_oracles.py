"""Digests written from their definitions, apart from kvxferd's code: what tests compare against.

``wsum`` is the device digest as :mod:`kvxferd.datapath.word_sums`' docstring defines it, in
Python integers: its own SplitMix64 for the keys, a loop over little-endian 16-bit words, then
XXH3-64 (the ``xxhash`` package) over the sums and the stream's length.
"""

from __future__ import annotations

import struct

import xxhash

BLOCK_WORDS = 1 << 16
KEY_SEED = 0x6B76786665726421
M64 = (1 << 64) - 1


def _key(i: int) -> int:
    z = (KEY_SEED + i + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    z ^= z >> 31
    return (z >> 33) | 1


KEYS = [_key(i) for i in range(BLOCK_WORDS)]


def wsum(data: bytes) -> int:
    padded = data + b"\0" * (len(data) % 2)
    words = struct.unpack(f"<{len(padded) // 2}H", padded)
    sums = [sum(k * w for k, w in zip(KEYS, words[b:b + BLOCK_WORDS])) for b in range(0, len(words), BLOCK_WORDS)]
    packed = b"".join(s.to_bytes(8, "little", signed=True) for s in sums)
    return xxhash.xxh3_64_intdigest(packed + len(data).to_bytes(8, "little"))


def xxh3(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)

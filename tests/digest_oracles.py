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


# -- the data header's digest, as kvxferd.datapath.digest.header_digest's docstring defines it,
# encoded here by hand (the msgpack spec's smallest forms) rather than by the msgpack package

HEADER_TAG = "kvxferd-data-header-1"


def _mp(value) -> bytes:
    if value is None:
        return b"\xc0"
    if value is True or value is False:
        return b"\xc3" if value else b"\xc2"
    if isinstance(value, int):
        assert value >= 0, "header fields are non-negative"
        if value < 0x80:
            return bytes([value])
        for tag, size in ((0xCC, 1), (0xCD, 2), (0xCE, 4), (0xCF, 8)):
            if value < 1 << (8 * size):
                return bytes([tag]) + value.to_bytes(size, "big")
        raise AssertionError(value)
    if isinstance(value, str):
        raw = value.encode()
        if len(raw) < 32:
            return bytes([0xA0 | len(raw)]) + raw
        for tag, size in ((0xD9, 1), (0xDA, 2), (0xDB, 4)):
            if len(raw) < 1 << (8 * size):
                return bytes([tag]) + len(raw).to_bytes(size, "big") + raw
    if isinstance(value, (bytes, bytearray)):
        for tag, size in ((0xC4, 1), (0xC5, 2), (0xC6, 4)):
            if len(value) < 1 << (8 * size):
                return bytes([tag]) + len(value).to_bytes(size, "big") + bytes(value)
    if isinstance(value, (list, tuple)):
        head = bytes([0x90 | len(value)]) if len(value) < 16 else b"\xdc" + len(value).to_bytes(2, "big")
        return head + b"".join(_mp(v) for v in value)
    raise AssertionError(f"no encoding for {value!r}")


def header(h: dict) -> int:
    """XXH3-64 of [tag, request_id, decode_instance, dst tp, dst pp, src tp, src pp, group, part,
    start, end, last, nbytes, aux, trailer, hash, sample, picks], absent ones as "", 0, b"",
    false, "xxh3" and nil; every other field (token, ring, slot, block, pack, digests, the
    header digest itself) left out."""
    sample, picks = h.get("sample"), h.get("picks")
    fields = [HEADER_TAG, h["request_id"], h["decode_instance"], *h["dst"], *h["src"], h.get("group", ""),
              h.get("part", 0), h["start"], h["end"], h["last"], h["nbytes"], h.get("aux", b""),
              h.get("trailer", False), h.get("hash", "xxh3"), list(sample) if sample else None,
              list(picks) if picks else None]
    return xxhash.xxh3_64_intdigest(_mp(fields))

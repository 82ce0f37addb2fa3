"""The digest of pages that live on a GPU: keyed sums of 16-bit words, computed on the device.

XXH3 (:mod:`.digest`) is a byte-serial CPU hash: for pages on a GPU it costs a copy of every
checked byte to the host and a host core to hash it, which is exactly the traffic a one-sided
GPU-to-GPU WRITE avoids. This digest is built from operations a GPU does at memory speed
(integer multiply and sum), and the device hands the host one integer per 128 KiB.

Definition (both sides, any device, must agree to the bit):

- the stream is read as little-endian unsigned 16-bit words ``w``, a last odd byte padded with
  a zero byte;
- word ``j`` lies in block ``j // BLOCK_WORDS`` at position ``i = j % BLOCK_WORDS``;
- block ``b``'s sum is ``S_b = sum_i key(i) * w_(b*BLOCK_WORDS + i)``, exact: a key is below
  2^31, a product below 2^47, a block of 2^16 of them below 2^63, so int64 never wraps;
- the digest is XXH3-64 over the sums as little-endian int64, followed by the stream's length
  in bytes as a little-endian uint64 (so zero padding and an empty stream are unambiguous).

What it detects: a change of one word changes its block's sum by ``key * delta``, never zero
(keys are odd, so nonzero; both factors are below 2^32), so it is always caught; two changed
words cancel only where ``key_i * d_i == -key_j * d_j``, which for 31-bit keys and 16-bit deltas
needs the keys to share a factor above 2^15; more changes cancel with odds of about one in the
range of the sums (2^47 and up). Blocks are ordered by the XXH3 fold, so moved or swapped
pages are caught too. Like XXH3, it guards against faults, not against an adversary.

``key(i)`` is the top 31 bits of SplitMix64 at ``KEY_SEED + i``, made odd: a fixed formula, so
every build and every device derives the same table.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..model.segments import INDEX_DTYPE
from .copier import gather

#: the digest's name on the wire (a data header's ``hash``; XXH3, the default, has none)
NAME = "wsum"
#: 16-bit words one block's sum covers, and its bytes
BLOCK_WORDS = 1 << 16
BLOCK_BYTES = 2 * BLOCK_WORDS
KEY_SEED = 0x6B76786665726421
#: bytes of slices gathered on the device at a time (one region's), besides one block carried over
PIECE_BYTES = 8 * 1024 * 1024

_keys: dict[torch.device, torch.Tensor] = {}


def keys_table() -> np.ndarray:
    """``key(i)`` for every position of a block (uint64 arithmetic wraps, as SplitMix64's does)."""
    z = np.arange(BLOCK_WORDS, dtype=np.uint64) + np.uint64(KEY_SEED)
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(33)) | np.uint64(1)).astype(np.int64)


def _keys_on(device: torch.device) -> torch.Tensor:
    table = _keys.get(device)
    if table is None:  # one 512 KiB table per device, for the life of the process
        table = _keys[device] = torch.from_numpy(keys_table()).to(device)
    return table


def block_sums(data: torch.Tensor) -> torch.Tensor:
    """``S_b`` of each whole block of the uint8 buffer ``data`` (its length a multiple of
    :data:`BLOCK_BYTES`), on ``data``'s device, as int64."""
    if data.device.type == "cpu":
        return _host_sums(data)
    return device_sums(data)


def device_sums(data: torch.Tensor) -> torch.Tensor:
    """:func:`block_sums` in torch kernels: widen, multiply, sum (memory bound on a GPU)."""
    words = data.view(torch.int16).view(-1, BLOCK_WORDS).to(torch.int64) & 0xFFFF
    return (words * _keys_on(data.device)).sum(dim=1)


def _host_sums(data: torch.Tensor) -> torch.Tensor:
    """:func:`block_sums` on a CPU: numpy's einsum multiplies the 16-bit words by the int64 keys
    without widening them first (several times faster than the torch kernels there)."""
    words = data.numpy().view(np.uint16).reshape(-1, BLOCK_WORDS)
    return torch.from_numpy(np.einsum("ij,j->i", words, _host_keys()))


def _host_keys() -> np.ndarray:
    return _keys_on(torch.device("cpu")).numpy()


class WordSums:
    """A stream's digest fed piece by piece (any cut; pieces on one device): the bytes short of a
    whole block wait in a buffer until the next piece or the end. One buffer serves stream after
    stream (:meth:`take` starts the next), so a chunk of many regions holds one."""

    def __init__(self, device: torch.device, piece_bytes: int = PIECE_BYTES) -> None:
        self.buf = torch.empty(piece_bytes + BLOCK_BYTES, dtype=torch.uint8, device=device)
        self.carry = 0  # bytes at the front of ``buf`` not yet summed
        self.nbytes = 0
        self.sums: list[torch.Tensor] = []  # on the device, until the caller copies them to the host

    def room(self) -> torch.Tensor:
        """Where the next piece goes: after the carried bytes, up to the buffer's end (at least
        ``piece_bytes``)."""
        return self.buf[self.carry:]

    def added(self, n: int) -> None:
        """``n`` bytes were written at :meth:`room`'s start: sum the whole blocks, carry the rest."""
        self.nbytes += n
        end = self.carry + n
        whole = end // BLOCK_BYTES * BLOCK_BYTES
        if whole:
            self.sums.append(block_sums(self.buf[:whole]))
            rest = end - whole
            if rest:  # never overlaps: rest < one block <= whole
                self.buf[:rest].copy_(self.buf[whole:end])
            self.carry = rest
        else:
            self.carry = end

    def add(self, data: torch.Tensor) -> None:
        """Feed a uint8 tensor (any length) on this digest's device."""
        at = 0
        while at < data.numel():
            n = min(data.numel() - at, self.room().numel())
            self.room()[:n].copy_(data[at:at + n])
            self.added(n)
            at += n

    def take(self) -> tuple[torch.Tensor, int]:
        """The stream's sums (the last block zero padded; int64 on the device) and its length in
        bytes; the next byte fed starts a new stream."""
        if self.carry:
            self.buf[self.carry:BLOCK_BYTES].zero_()
            self.sums.append(block_sums(self.buf[:BLOCK_BYTES]))
        sums = torch.cat(self.sums) if self.sums else torch.zeros(0, dtype=torch.int64, device=self.buf.device)
        out = (sums, self.nbytes)
        self.carry, self.nbytes, self.sums = 0, 0, []
        return out


def fold(sums: np.ndarray, nbytes: int) -> int:
    """The digest from a stream's block sums (host side)."""
    import xxhash
    data = np.ascontiguousarray(sums, dtype="<i8").tobytes() + int(nbytes).to_bytes(8, "little")
    return xxhash.xxh3_64_intdigest(data)


def region_digests(flats: Sequence[torch.Tensor], slots: np.ndarray, row_bytes: int, head_offset: int,
                   slice_bytes: int, piece_bytes: int = PIECE_BYTES) -> list[int]:
    """The digest of each region's ``slice_bytes`` at ``head_offset`` of every slot, in slot
    order (:func:`kvxferd.datapath.digest.region_digests`' stream), summed where the region lies
    through one gather buffer per device; every region's sums come to the host in one copy."""
    slots = np.ascontiguousarray(slots, dtype=INDEX_DTYPE)
    per = max(1, piece_bytes // max(1, slice_bytes))
    piece = max(1, min(per * slice_bytes, slots.size * slice_bytes))  # no larger than the stream
    states: dict[torch.device, WordSums] = {}
    streams: list[tuple[torch.Tensor, int]] = []
    for flat in flats:
        state = states.get(flat.device)
        if state is None:
            state = states[flat.device] = WordSums(flat.device, piece)
        for i in range(0, slots.size, per):
            part = slots[i:i + per]
            n = part.size * slice_bytes
            gather(flat, part, row_bytes, head_offset, slice_bytes, state.room()[:n])
            state.added(n)
        streams.append(state.take())
    if not streams:
        return []
    devices = {sums.device for sums, _ in streams}
    if len(devices) == 1:
        on_host = torch.cat([sums for sums, _ in streams]).cpu().numpy()
    else:
        on_host = np.concatenate([sums.cpu().numpy() for sums, _ in streams])
    out, at = [], 0
    for sums, nbytes in streams:
        out.append(fold(on_host[at:at + sums.numel()], nbytes))
        at += sums.numel()
    return out

"""Digests of a chunk's bytes as they sit in memory, one per region (no I/O).

Both ends of a chunk hash the same byte stream: for each region of the writer, in wire
order, the writer's slice of every token slot in slot order. The source reads it from its
pages, the destination from its pages after the bytes landed, so the digest covers what the
engines will read, whatever moved the bytes (a socket, a NIXL WRITE, a staging slot, a local
copy) and whatever the two sides' page sizes and TP slicing: each side walks its own slots.

The hash is XXH3-64 (the ``xxhash`` package): 34 GB/s on one core of the host the benchmarks
ran on, where CRC32C (``google-crc32c``) ran 5.2 GB/s and zlib's CRC32 1.3 GB/s. It guards
against corruption and stale writes, not against an adversary (authentication does that).

A large chunk sent by tcp with every slot checked is hashed *as it moves* instead
(:class:`RunningDigests`): the source hashes each block of about :data:`FOLD_BYTES` just before
the socket reads it, the destination each block just after it landed in the engine's pages,
while the block is still in cache; the source's digests then follow the payload. Hashed in a
pass of its own, each side read a 512 MiB chunk from memory once more (about 50 ms here, at
10 GB/s); hashed block by block, it costs a fraction of that.

Long runs are hashed where they lie. Short runs (head slices, small pages) are first gathered
into a scratch buffer of at most :data:`SCRATCH_BYTES` per thread: a hash call per 1 KiB
slice would cost more than the slice. Device memory (a destination on a GPU whose source sent
XXH3) is gathered on its device and copied to the host a block at a time. A source on a GPU
sends the device's digest instead (:mod:`.word_sums`, summed where its pages lie), which its
regions name (:attr:`~.regions.MappedRegion.digest`) and its data headers carry as ``hash``.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator, Mapping, Sequence

import msgpack
import numpy as np
import torch

from ..model.segments import side_runs
from . import word_sums
from .copier import gather
from .runcopy import native

#: this digest's name on the wire (a data header without ``hash`` means it)
XXH3 = "xxh3"

#: runs at least this long on average are hashed in place, shorter ones gathered first
HASH_IN_PLACE = 16 * 1024
#: one thread's scratch buffer for gathered runs (each data thread, and the loop, holds one)
SCRATCH_BYTES = 4 * 1024 * 1024

#: a local copy that hashes as it goes hashes pieces of at most this many bytes, each right after
#: its copy, while the source and destination bytes are both in one core's cache
COPY_HASH_BYTES = 256 * 1024

#: bytes hashed and moved at a time when a chunk is hashed as it moves: small enough to stay in
#: one core's cache between the hash and the copy (2-4 MiB here); 256 KiB and 4 MiB blocks both
#: cost more than 1 MiB (one benchmark row, alternated)
FOLD_BYTES = 1 << 20

_local = threading.local()


def _hasher():  # the import is deferred: daemons that never check integrity need no xxhash
    import xxhash
    return xxhash.xxh3_64()


def _scratch() -> torch.Tensor:
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = torch.empty(SCRATCH_BYTES, dtype=torch.uint8)
    return buf


def region_digests(flats: Sequence[torch.Tensor], slots: np.ndarray, row_bytes: int, head_offset: int,
                   slice_bytes: int, hash: str = XXH3) -> list[int]:
    """The digest ``hash`` (XXH3-64, or :data:`.word_sums.NAME`) of each region's ``slice_bytes``
    at ``head_offset`` of every slot, in slot order."""
    if hash != XXH3:
        assert hash == word_sums.NAME, f"unknown digest {hash!r}: the data header's schema admits none other"
        return word_sums.region_digests(flats, slots, row_bytes, head_offset, slice_bytes)
    slots = np.ascontiguousarray(slots)
    runs = side_runs(slots, row_bytes, head_offset, slice_bytes)
    lib = native()
    if lib is not None and lib.hashes and all(f.device.type == "cpu" for f in flats):
        return lib.hash_pieces(flats, runs.offsets, runs.lengths)  # in C, GIL-free, however short the runs
    long_runs = len(runs) > 0 and runs.nbytes // len(runs) >= HASH_IN_PLACE
    out = []
    for flat in flats:
        h = _hasher()
        if flat.device.type == "cpu" and long_runs:
            view = memoryview(flat.numpy()).cast("B")
            for off, n in zip(runs.offsets.tolist(), runs.lengths.tolist()):
                h.update(view[off:off + n])
        else:
            _gathered(h, flat, slots, row_bytes, head_offset, slice_bytes)
        out.append(h.intdigest())
    return out


def _gathered(h, flat: torch.Tensor, slots: np.ndarray, row_bytes: int, head_offset: int, slice_bytes: int) -> None:
    """Feed ``h`` the slices of ``slots`` gathered a scratch buffer at a time."""
    scratch = _scratch()
    per = max(1, SCRATCH_BYTES // slice_bytes)
    if slice_bytes > SCRATCH_BYTES:  # one slice larger than the scratch: a buffer of its own
        scratch = torch.empty(slice_bytes, dtype=torch.uint8)
    for i in range(0, slots.size, per):
        part = slots[i:i + per]
        n = part.size * slice_bytes
        if flat.device.type == "cpu":
            gather(flat, part, row_bytes, head_offset, slice_bytes, scratch[:n])
        else:
            on_device = torch.empty(n, dtype=torch.uint8, device=flat.device)
            gather(flat, part, row_bytes, head_offset, slice_bytes, on_device)
            scratch[:n].copy_(on_device)
        h.update(memoryview(scratch[:n].numpy()))


class RunningDigests:
    """One XXH3-64 per region, fed a chunk's bytes in wire order as they pass: what
    :func:`region_digests` computes over every slot, without a pass of its own.

    ``flip_first``: fault injection for tests (``integrity.corrupt_landed_every``): the first
    byte fed is flipped where it lies before it is hashed, as a landed byte changed between the
    write and the check would be."""

    def __init__(self, n_regions: int, flip_first: bool = False) -> None:
        self._hashers = [_hasher() for _ in range(n_regions)]
        self._flip = flip_first

    def add(self, region: int, view: memoryview) -> None:
        if self._flip and len(view):
            view[0] ^= 0xFF
            self._flip = False
        self._hashers[region].update(view)

    def add_block(self, block: Sequence[Any], data: torch.Tensor, slice_bytes: int) -> None:
        """A packed block (:func:`~kvxferd.datapath.staging.pack`'s pieces) as a host staging slot
        holds it; blocks come in wire order."""
        view = memoryview(data.numpy())
        for piece in block:
            self.add(piece.region, view[piece.offset:piece.offset + (piece.hi - piece.lo) * slice_bytes])

    def add_slots(self, region: int, view: memoryview, slots: np.ndarray, row_bytes: int, head_offset: int,
                  slice_bytes: int) -> None:
        """The slices of ``slots`` as a region holds them, in slot order, hashed where they lie."""
        runs = side_runs(slots, row_bytes, head_offset, slice_bytes)
        for off, n in zip(runs.offsets.tolist(), runs.lengths.tolist()):
            self.add(region, view[off:off + n])

    def digests(self) -> list[int]:
        return [h.intdigest() for h in self._hashers]


#: the first item of the header digest's encoding: names the encoding, so that a later one (other
#: fields, another order) can never hash alike by accident
HEADER_TAG = "kvxferd-data-header-1"

#: the data header fields its digest covers, in the order they are encoded: every one the decode
#: daemon or its engine acts on (which request, rank, writer and cache group; the token range,
#: ``last``, the byte count and ``aux``; where the digests are and what they cover). Not covered:
#: ``token`` (compared byte for byte with the link's own before anything else: a changed one is
#: refused, and a secret has no place in a digest sent in clear), NIXL's per-block ``ring``,
#: ``slot``, ``block`` and ``pack`` (where a block sits, not what it is: a changed one lands bytes
#: where the page digests find them, or is refused), and the digests themselves
HEADER_FIELDS = ("request_id", "decode_instance", "dst", "src", "group", "part", "start", "end", "last",
                 "nbytes", "aux", "trailer", "hash", "sample", "picks")


def header_digest(header: Mapping[str, Any]) -> int:
    """XXH3-64 of a data header's :data:`HEADER_FIELDS` in a canonical encoding: the msgpack array
    of :data:`HEADER_TAG`, the request id, decode instance, ``dst`` and ``src`` (two integers each),
    group (``""`` when absent), part (0), start, end, last, nbytes, aux (``b""``), trailer (false),
    hash (``"xxh3"``), sample (``[period, offset]``, else nil) and picks (``[first, bits]``, else nil).

    Both sides take it over the header as they hold it (the source as it sends it, the destination
    as it read it), so any covered field changed in between, or a digest changed, fails the chunk
    ``integrity`` before anything acts on it. The header is a hundred bytes: one hash call, on
    every chunk that carries digests, whatever the pages' digest (XXH3 or word sums) and sample."""
    get = header.get
    dst, src, sample, picks = header["dst"], header["src"], get("sample"), get("picks")
    fields = [HEADER_TAG, header["request_id"], header["decode_instance"], int(dst[0]), int(dst[1]), int(src[0]),
              int(src[1]), get("group") or "", int(get("part") or 0), int(header["start"]), int(header["end"]),
              bool(header["last"]), int(header["nbytes"]), bytes(get("aux") or b""), bool(get("trailer")),
              get("hash") or XXH3, None if sample is None else [int(sample[0]), int(sample[1])],
              None if picks is None else [int(picks[0]), bytes(picks[1])]]
    packer = getattr(_local, "packer", None)
    if packer is None:  # one per thread (a packer keeps a buffer): packb would make one per call, at twice the cost
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    import xxhash  # deferred like the page digests': only a chunk with digests has a header digest
    return xxhash.xxh3_64_intdigest(packer.pack(fields))


def batches(views: Sequence[memoryview], offsets: Sequence[int], lengths: Sequence[int],
            block: int = FOLD_BYTES) -> Iterator[list[tuple[int, memoryview]]]:
    """Every region's runs (``views[i][offset:offset + length]``, region-major: the direct wire
    order) as lists of ``(region, view)`` of about ``block`` bytes each, a run longer than a
    block cut into blocks: what is hashed and moved together."""
    batch: list[tuple[int, memoryview]] = []
    size = 0
    for i, region in enumerate(views):
        for off, n in zip(offsets, lengths):
            for at in range(off, off + n, block):
                view = region[at:min(at + block, off + n)]
                batch.append((i, view))
                size += len(view)
                if size >= block:
                    yield batch
                    batch, size = [], 0
    if batch:
        yield batch

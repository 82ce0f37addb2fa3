"""How a sliced chunk crosses NIXL in blocks: which side is copied, and each block's descriptors.

A TP-mismatched writer's bytes are head slices on at least one side. Where a side holds the
writer's slices as whole rows (the source of ``tp2>1``, the destination of ``tp1>2``), its
runs are as long as its pages, and copying them through a staging slot buys nothing: NIXL
reads them in place, or writes into them in place. Only the sliced side goes through a
slot. Three routes, all cut into the same blocks (:func:`~kvxferd.datapath.staging.block_pieces`), so
the receiver derives every block's pieces from its header alone:

- ``land``: gather into a local staging slot, WRITE one descriptor into a landing slot of the
  peer, the peer scatters (both sides sliced; two copies);
- ``read``: WRITE the source's rows in place into a landing slot, the peer scatters (the
  source holds whole rows; one copy, on the decode side);
- ``place``: gather into a local staging slot, WRITE it in place into the decode pages (the
  destination holds whole rows; one copy, on the prefill side; no landing ring needed).

Pure numpy: which route, and the paired (address, length) rows of one block. The WRITEs
themselves live in :mod:`.transport`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import RequestError
from ...model.segments import side_runs
from ...datapath.staging import Piece

LAND = "land"
READ = "read"
PLACE = "place"


def mean_run(slots: np.ndarray, slice_bytes: int) -> float:
    """Mean length in bytes of the contiguous runs of whole rows over ``slots`` (one region)."""
    if slots.size == 0:
        return 0.0
    runs = 1 + int(np.count_nonzero(np.diff(slots) != 1))
    return slots.size * slice_bytes / runs


def choose(*, src_whole: bool, dst_whole: bool, src_slots: np.ndarray, dst_slots: np.ndarray | None,
           slice_bytes: int, can_land: bool, can_gather: bool, in_place_bytes: int,
           src_in_place: bool = True, dst_in_place: bool = True) -> str | None:
    """The route of a sliced chunk, or None when none applies (the slices then go direct).

    A side is used in place only where it holds whole rows in runs of at least
    ``in_place_bytes`` on average (``limits.nixl_in_place_bytes``): below that a descriptor per
    run costs more than a copy. Over UCX on TCP it does: 70B pages of 16 tokens (16 KiB runs)
    moved in place at 0.5-0.8x the speed of copying them through slots; over RDMA a descriptor
    costs far less, and a lower bound saves the copy.

    ``src_in_place=False``: the source may not be read in place at all (GPU memory an engine
    shared by CUDA IPC, which UCX takes for host memory on the sending side), so every route
    gathers it into a slot of this daemon's own; any destination run length then beats direct.
    ``dst_in_place=False``: the same for the destination (an engine's GPU memory on the decode
    daemon): written in place it moved at 0.05-0.25 GB/s on one H200 where the landing ring
    moved 10-30, so it lands whenever the peer gave a ring, and is written in place (``place``)
    only where nothing else can carry it.
    """
    if src_in_place and can_land and src_whole and mean_run(src_slots, slice_bytes) >= in_place_bytes:
        return READ
    if (dst_in_place and can_gather and dst_whole and dst_slots is not None
            and mean_run(dst_slots, slice_bytes) >= in_place_bytes):
        return PLACE
    if can_land and can_gather:
        return LAND
    if not (src_in_place and dst_in_place) and can_gather and dst_whole and dst_slots is not None:
        return PLACE
    return None


def cut_rows(local: np.ndarray, remote: np.ndarray, block: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """A direct WRITE's paired descriptor rows cut into WRITEs of at most ``block`` bytes each.

    ``local`` and ``remote`` are ``[n, k]`` rows (address, length, ...) of pairwise equal lengths,
    in wire order. The bytes are read as one stream and cut every ``block`` bytes, a row split where
    a cut falls inside it; every WRITE keeps the rows' order, so together they move exactly what
    the uncut rows did. ``block <= 0``, or rows of no more than ``block`` bytes in all: one WRITE.
    """
    lengths = local[:, 1].astype(np.int64)
    total = int(lengths.sum())
    if block <= 0 or total <= block:
        return [(local, remote)]
    keep = lengths > 0
    local, remote, lengths = local[keep], remote[keep], lengths[keep]
    starts = np.cumsum(lengths) - lengths  # each row's first byte in the stream
    points = np.union1d(starts, np.arange(block, total, block, dtype=np.int64))  # where each piece begins
    row = np.searchsorted(starts, points, side="right") - 1
    into = (points - starts[row]).astype(np.uint64)
    sizes = np.diff(np.append(points, total)).astype(np.uint64)
    pieces = []
    for rows in (local, remote):
        out = rows[row].copy()
        out[:, 0] += into
        out[:, 1] = sizes
        pieces.append(out)
    bounds = np.flatnonzero(np.diff(points // block)) + 1
    return list(zip(np.split(pieces[0], bounds), np.split(pieces[1], bounds)))


@dataclass(frozen=True)
class BlockDescs:
    """One block's WRITE: ``local`` and ``remote`` rows of (address, length), pairwise equal lengths."""

    local: np.ndarray  # [n, 2] uint64
    remote: np.ndarray


def in_place(pieces: list[Piece], slots: np.ndarray, row_bytes: int, slice_bytes: int,
             bases: np.ndarray, limit: int, packed_at: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole-row side's runs of one block, and where each sits in the packed block.

    Returns ``(rows in place, rows in the packed block)``, each ``[n, 2]`` (address, length):
    the packed side is one contiguous buffer at ``packed_at`` holding the pieces in order,
    exactly as a gather would have written it. Every run must end within ``limit`` bytes of
    its region (the smallest region the block touches).
    """
    addresses: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    packed: list[np.ndarray] = []
    for piece in pieces:
        runs = side_runs(slots[piece.lo:piece.hi], row_bytes, 0, slice_bytes)
        run_lengths = np.asarray(runs.lengths, dtype=np.uint64)
        end = int((runs.offsets + runs.lengths).max())
        if end > limit:
            raise RequestError(f"block reaches byte {end} of a {limit}-byte region", field="pages",
                               fix="send pages inside both ranks' registered regions")
        addresses.append(np.uint64(bases[piece.region]) + runs.offsets.astype(np.uint64))
        lengths.append(run_lengths)
        starts = np.empty_like(run_lengths)
        starts[0] = 0
        np.cumsum(run_lengths[:-1], out=starts[1:])
        packed.append(np.uint64(packed_at + piece.offset) + starts)
    length = np.concatenate(lengths)
    there = np.stack([np.concatenate(addresses), length], axis=1)
    here = np.stack([np.concatenate(packed), length], axis=1)
    return there, here


def read_block(pieces: list[Piece], src_slots: np.ndarray, row_bytes: int, slice_bytes: int,
               src_bases: np.ndarray, src_limit: int, landing_at: int) -> BlockDescs:
    """``read``: the source's rows in place, written packed into the landing slot at ``landing_at``."""
    there, here = in_place(pieces, src_slots, row_bytes, slice_bytes, src_bases, src_limit, landing_at)
    return BlockDescs(local=there, remote=here)


def place_block(pieces: list[Piece], dst_slots: np.ndarray, row_bytes: int, slice_bytes: int,
                dst_bases: np.ndarray, dst_limit: int, staged_at: int) -> BlockDescs:
    """``place``: the gathered block at ``staged_at``, written in place into the decode rows."""
    there, here = in_place(pieces, dst_slots, row_bytes, slice_bytes, dst_bases, dst_limit, staged_at)
    return BlockDescs(local=here, remote=there)

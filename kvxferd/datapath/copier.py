"""Vectorised byte movement between regions and staging buffers (no I/O).

CPU buffers go through the native run copy (:mod:`kvxferd.datapath.runcopy`) when it is built:
one GIL-free ``memcpy`` loop per call, no temporaries. Otherwise, and for GPU buffers,
torch index kernels: those on uint8 rows run several times slower than on the same bytes
viewed as a wide integer type, so every view here uses the widest word (8, 4, 2 or 1
bytes) that divides the row, the slice offset, the slice length and the buffer's address.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import torch

from ..model.plan import Writer
from ..model.segments import SMALL_SLOTS, hashed_pieces, paired_runs, paired_segments
from .runcopy import native

WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
FEW_RUNS = 16  # below this many runs, plain slice copies beat index kernels
LONG_RUN = 8192  # average run bytes from which per-run slice copies beat index copies


def word(*values: int) -> tuple[int, torch.dtype]:
    for size, dtype in WORDS:
        if all(v % size == 0 for v in values):
            return size, dtype
    return 1, torch.uint8


def rows(flat: torch.Tensor, row_bytes: int, head_offset: int, slice_bytes: int,
         size: int, dtype: torch.dtype) -> torch.Tensor:
    """``[slots, slice_words]`` view of one region's head slice."""
    table = flat.view(dtype).view(-1, row_bytes // size)
    start = head_offset // size
    return table[:, start:start + slice_bytes // size]


def _index(slots: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(slots)).to(device, non_blocking=True)


def gather(flat: torch.Tensor, slots: np.ndarray, row_bytes: int, head_offset: int,
           slice_bytes: int, out: torch.Tensor) -> None:
    """Copy the slice of every slot, in order, into the contiguous byte buffer ``out``."""
    lib = native()
    if lib is not None and flat.device.type == "cpu" and out.device.type == "cpu":
        lib.gather_rows(flat, slots, row_bytes, head_offset, slice_bytes, out)
        return
    size, dtype = word(row_bytes, head_offset, slice_bytes, flat.data_ptr(), out.data_ptr())
    src = rows(flat, row_bytes, head_offset, slice_bytes, size, dtype)
    dst = out.view(dtype).view(slots.size, slice_bytes // size)
    if out.device != flat.device:
        tmp = torch.index_select(src, 0, _index(slots, flat.device))
        dst.copy_(tmp)
        return
    torch.index_select(src, 0, _index(slots, flat.device), out=dst)


def scatter(flat: torch.Tensor, slots: np.ndarray, row_bytes: int, head_offset: int,
            slice_bytes: int, data: torch.Tensor) -> None:
    """Inverse of :func:`gather`: write consecutive slices of ``data`` into the slots."""
    lib = native()
    if lib is not None and flat.device.type == "cpu" and data.device.type == "cpu":
        lib.scatter_rows(flat, slots, row_bytes, head_offset, slice_bytes, data)
        return
    size, dtype = word(row_bytes, head_offset, slice_bytes, flat.data_ptr(), data.data_ptr())
    dst = rows(flat, row_bytes, head_offset, slice_bytes, size, dtype)
    # a blocking copy: ``data`` is a staging slot the caller reuses as soon as this returns
    src = data.view(dtype).view(slots.size, slice_bytes // size).to(flat.device)
    dst.index_copy_(0, _index(slots, flat.device), src)


def settle(tensors: Iterable[torch.Tensor]) -> None:
    """Wait for the device work queued on these tensors' GPUs.

    The engine that hears "done" reads its pages from another process, whose CUDA work is
    not ordered after this process's stream: every kernel writing them must have finished.
    """
    seen = set()
    for t in tensors:
        if t.device.type == "cuda" and t.device not in seen:
            seen.add(t.device)
            torch.cuda.current_stream(t.device).synchronize()


def copy_runs(src_flat: torch.Tensor, dst_flat: torch.Tensor, src_off: np.ndarray,
              dst_off: np.ndarray, lengths: np.ndarray) -> None:
    """Copy paired byte runs one by one (used when there are only a few)."""
    for s, d, n in zip(src_off.tolist(), dst_off.tolist(), lengths.tolist()):
        dst_flat[d:d + n].copy_(src_flat[s:s + n])


def copy_slots(src_flat: torch.Tensor, src_slots: np.ndarray, src_row: int, src_head: int,
               dst_flat: torch.Tensor, dst_slots: np.ndarray, dst_row: int, dst_head: int,
               slice_bytes: int) -> None:
    """Region-to-region copy of one head slice per token with two index kernels."""
    size, dtype = word(src_row, src_head, dst_row, dst_head, slice_bytes,
                       src_flat.data_ptr(), dst_flat.data_ptr())
    src = rows(src_flat, src_row, src_head, slice_bytes, size, dtype)
    dst = rows(dst_flat, dst_row, dst_head, slice_bytes, size, dtype)
    picked = torch.index_select(src, 0, _index(src_slots, src_flat.device))
    dst.index_copy_(0, _index(dst_slots, dst_flat.device), picked.to(dst_flat.device))


def copy_regions(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], src_slots: np.ndarray,
                 dst_slots: np.ndarray, writer: Writer, src_head: int, dst_head: int) -> int:
    """Region-to-region copy of a writer's slices for every (srcs[r], dsts[r]) pair; returns
    the number of runs moved. Whole rows move as coalesced runs, head slices per token."""
    lib = native()
    cpu = all(t.is_cpu for t in srcs) and all(t.is_cpu for t in dsts)
    if writer.whole_rows:
        if lib is not None and cpu and src_slots.size == dst_slots.size and src_slots.size <= SMALL_SLOTS:
            # a small chunk: its runs as Python ints straight into the native call (no numpy)
            runs = paired_runs(src_slots.tolist(), dst_slots.tolist(), writer.src_row_bytes,
                               writer.dst_row_bytes, writer.slice_bytes)
            lib.copy_run_lists(srcs, dsts, *runs)
            return len(runs[2]) * len(srcs)
        segs = paired_segments(src_slots, dst_slots, writer)
        if lib is not None and cpu:
            lib.copy_runs(srcs, dsts, segs.src, segs.dst, segs.lengths)
            return len(segs) * len(srcs)
    else:
        if lib is not None and cpu:
            lib.copy_rows(srcs, dsts, src_slots, writer.src_row_bytes, src_head, dst_slots,
                          writer.dst_row_bytes, dst_head, writer.slice_bytes)
            return int(src_slots.size) * len(srcs)
        segs = paired_segments(src_slots, dst_slots, writer)
    for src, dst in zip(srcs, dsts):
        # long runs (whole pages) on CPUs: plain slice copies, no temporaries; short ones, and
        # any number on a GPU (where each slice copy is a launch): two index kernels
        on_gpu = src.device.type == "cuda" or dst.device.type == "cuda"
        if len(segs) <= FEW_RUNS or (not on_gpu and segs.lengths.sum() >= LONG_RUN * len(segs)):
            copy_runs(src, dst, segs.src, segs.dst, segs.lengths)
        else:
            copy_slots(src, src_slots, writer.src_row_bytes, src_head, dst, dst_slots,
                       writer.dst_row_bytes, dst_head, writer.slice_bytes)
    return len(segs) * len(srcs)


def copy_hashed(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], src_slots: np.ndarray,
                dst_slots: np.ndarray, writer: Writer, src_head: int, dst_head: int, checked: np.ndarray,
                block: int, flip: bool = False) -> tuple[list[int], list[int], int] | None:
    """:func:`copy_regions` that hashes the ``checked`` slots of both sides as it copies them,
    piece by piece while each is in cache: each region's source and destination digests (those
    :func:`~kvxferd.datapath.digest.region_digests` takes over the same slots) and the runs moved,
    from one read of the bytes instead of three. None, having copied nothing: no native hashing
    here (the caller copies, then hashes each side)."""
    lib = native()
    if lib is None or not lib.hashes or not all(t.is_cpu for t in (*srcs, *dsts)):
        return None
    pieces = hashed_pieces(src_slots, dst_slots, writer, src_head, dst_head, checked, block)
    return (*lib.copy_hash(srcs, dsts, *pieces, flip=flip), len(pieces[0]) * len(srcs))

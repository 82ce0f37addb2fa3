"""Vectorised byte movement between regions and staging buffers (torch, no I/O).

Index copies on uint8 rows run several times slower than on the same bytes viewed as a
wide integer type, so every view here uses the widest word (8, 4, 2 or 1 bytes) that
divides the row, the slice offset, the slice length and the buffer's address.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
FEW_RUNS = 16  # below this many runs, plain slice copies beat index kernels


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

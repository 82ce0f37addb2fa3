"""The native batched run copy (``runcopy.c``), loaded with ctypes when it has been built.

Copying KV pages as many short runs is bound by per-run overhead in torch and numpy (a
Python-level slice copy per page, or index kernels through a temporary as large as the
chunk); a C loop of ``memcpy`` over a run list moves the same bytes at memcpy speed, with
no temporaries, and ctypes releases the GIL for the whole loop.

The library is optional. The package build compiles it where a C compiler exists (setup.py:
``kvxferd/_runcopy.<abi>.so``, loaded with ctypes, never imported), and ``python -m
kvxferd.datapath.runcopy`` compiles it by hand next to this module (``_runcopy.so``); when neither is
there, or ``KVXFERD_RUNCOPY=off``, :func:`native` returns None and :mod:`kvxferd.datapath.copier`
keeps its torch path. :func:`copy_path` says which one runs, for the start-up log, ``status``
and the metrics. The C code
trusts its offsets, so every wrapper here checks them against the buffers' sizes first
and raises :class:`~kvxferd.errors.TransferError` instead of writing out of bounds.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import TransferError
from ..model.segments import SMALL_SLOTS

log = logging.getLogger("kvxferd.runcopy")

SOURCE = Path(__file__).with_name("runcopy.c")
LIBRARY = Path(__file__).with_name("_runcopy.so")  # where ``python -m kvxferd.datapath.runcopy`` builds it
CFLAGS = ("-O2", "-shared", "-fPIC", "-std=c99")

_i64, _ptr, _u64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_uint64

#: bytes per call from which destinations are written with non-temporal stores: past the
#: caches they would be evicted unread anyway, and skipping the read-for-ownership of
#: every destination line saves a third of the memory traffic
STREAM_BYTES = 1 << 20


#: bytes per call up to which the copy keeps the GIL: a few microseconds of memcpy cost less
#: than handing the GIL over and waiting to take it back from a busy event-loop thread
#: (which can take up to the interpreter's switch interval, milliseconds, per call)
HOLD_GIL_BYTES = 1 << 16


def _streaming(run_bytes: int, regions: int) -> int:
    return int(run_bytes * regions >= STREAM_BYTES)


def build(dest: Path = LIBRARY, cc: str | None = None) -> Path:
    """Compile ``runcopy.c`` into ``dest`` with ``cc`` ($CC, else cc/gcc/clang on PATH)."""
    compiler = cc or os.environ.get("CC") or next(
        (c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if not compiler:
        raise FileNotFoundError("no C compiler found (cc, gcc or clang); install build-essential")
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        subprocess.run([compiler, *CFLAGS, "-o", str(tmp), str(SOURCE)], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, dest)  # atomic: a daemon starting meanwhile loads the old or the new, whole
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _pointer(t: torch.Tensor) -> int:
    return t.data_ptr()


def _int64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


def _bases(tensors: Sequence[torch.Tensor]) -> tuple[ctypes.Array, int]:
    """Base addresses, and the smallest size: every region must hold every offset.

    A ctypes array straight from the Python ints: a numpy array would cost a generator and
    an ``.ctypes`` object per call, more than the copy itself for a small chunk."""
    return ((_u64 * len(tensors))(*map(torch.Tensor.data_ptr, tensors)),
            min(map(torch.Tensor.numel, tensors), default=0))


def _check_rows(slots: np.ndarray, row: int, head: int, slice_bytes: int, size: int, side: str) -> None:
    if slots.size and (int(slots.min()) < 0 or int(slots.max()) * row + head + slice_bytes > size):
        raise TransferError(f"{side} slots {int(slots.min())}..{int(slots.max())} of {row}-byte rows "
                            f"(slice {head}+{slice_bytes}) fall outside a {size}-byte region",
                            field="slots", fix="send page indices inside the registered regions")


def _few(slots: np.ndarray) -> bool:
    """A slot array small enough that Python ints beat numpy's per-call cost (int64, 1-D)."""
    return slots.dtype == np.int64 and slots.ndim == 1 and slots.size <= SMALL_SLOTS


def _check_row_list(slots: list[int], row: int, head: int, slice_bytes: int, size: int, side: str) -> None:
    """:func:`_check_rows` for slots held as Python ints (the same refusal, the same message)."""
    if slots:
        low, high = min(slots), max(slots)
        if low < 0 or high * row + head + slice_bytes > size:
            raise TransferError(f"{side} slots {low}..{high} of {row}-byte rows (slice {head}+{slice_bytes}) "
                                f"fall outside a {size}-byte region", field="slots",
                                fix="send page indices inside the registered regions")


def _check_runs(offsets: np.ndarray, lengths: np.ndarray, size: int, side: str) -> None:
    if not offsets.size:
        return
    if lengths.strides[0] == 0:
        end = int(offsets.max()) + int(lengths[0])
    else:
        end = int((offsets + lengths).max())
    if int(offsets.min()) < 0 or end > size:
        raise TransferError(f"{side} runs reach byte {end}, outside a {size}-byte region", field="slots",
                            fix="send page indices inside the registered regions")


def _check_run_lists(offsets: list[int], lengths: list[int], size: int, side: str) -> None:
    """:func:`_check_runs` for runs held as Python ints (the same refusal, the same message)."""
    if not offsets:
        return
    end = max([o + n for o, n in zip(offsets, lengths)])
    if min(offsets) < 0 or end > size:
        raise TransferError(f"{side} runs reach byte {end}, outside a {size}-byte region", field="slots",
                            fix="send page indices inside the registered regions")


def _check_buffer(buffer: torch.Tensor, n: int, slice_bytes: int) -> None:
    if buffer.numel() < n * slice_bytes or not buffer.is_contiguous():
        raise TransferError(f"buffer of {buffer.numel()} bytes cannot hold {n} slices of {slice_bytes}",
                            field="staging", fix="size staging slots to whole blocks")


def _hashed(rc: int) -> None:
    if rc:
        raise MemoryError("no memory for a hash state")


class _Bound:
    """One C function of the library bound twice: through ``CDLL``, which releases the GIL for the
    call, and through ``PyDLL``, which keeps it (for copies up to :data:`HOLD_GIL_BYTES`)."""

    def __init__(self, free: ctypes.CDLL, held: ctypes.PyDLL, name: str, argtypes: list[Any]) -> None:
        self.free, self.held = getattr(free, name), getattr(held, name)
        for f in (self.free, self.held):
            f.argtypes, f.restype = argtypes, None

    def for_bytes(self, nbytes: int) -> Any:
        return self.held if nbytes <= HOLD_GIL_BYTES else self.free


def _run_pairs(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], n_src: int, n_dst: int,
               n_lengths: int) -> tuple[ctypes.Array, int, ctypes.Array, int]:
    """Both sides' bases and sizes, once the run counts and region counts agree."""
    if not (n_src == n_dst == n_lengths) or len(srcs) != len(dsts):
        raise TransferError(f"{n_src} source runs, {n_dst} destination runs, {n_lengths} "
                            f"lengths, {len(srcs)} and {len(dsts)} regions", field="segments")
    return (*_bases(srcs), *_bases(dsts))


class RunCopy:
    """The loaded library; every method checks bounds, then makes one call: GIL-free, except for a
    small chunk (up to :data:`HOLD_GIL_BYTES`), which is copied before the GIL could change hands."""

    def __init__(self, path: Path) -> None:
        free, held = ctypes.CDLL(str(path)), ctypes.PyDLL(str(path))
        self._copy_runs = _Bound(free, held, "kvx_copy_runs", [_i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64,
                                                              ctypes.c_int])
        self._copy_rows = _Bound(free, held, "kvx_copy_rows", [_i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _ptr, _i64,
                                                              _i64, _i64, ctypes.c_int])
        self._gather = _Bound(free, held, "kvx_gather_rows", [_ptr, _i64, _ptr, _i64, _i64, _i64, _ptr])
        self._scatter = _Bound(free, held, "kvx_scatter_rows", [_ptr, _i64, _ptr, _i64, _i64, _i64, _ptr,
                                                               ctypes.c_int])
        self.path = path
        #: XXH3-64 in C (integrity digests), where the build found the xxhash header and this CPU
        #: runs it; else None (digests.py hashes with the xxhash package)
        self._hash_pieces = self._copy_hash = None
        if hasattr(free, "kvx_hash_pieces"):
            self._hash_pieces = free.kvx_hash_pieces
            self._hash_pieces.argtypes, self._hash_pieces.restype = [_i64, _ptr, _i64, _ptr, _ptr, _ptr], ctypes.c_int
            self._copy_hash = free.kvx_copy_hash
            self._copy_hash.argtypes = [_i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, ctypes.c_int, ctypes.c_int,
                                        _ptr, _ptr]
            self._copy_hash.restype = ctypes.c_int
            if self._hash_pieces(0, None, 0, None, None, None) == -2:  # built for AVX2, run without it
                self._hash_pieces = self._copy_hash = None

    @property
    def hashes(self) -> bool:
        """This build hashes in C: digests GIL-free, and copies that hash as they go."""
        return self._hash_pieces is not None

    def hash_pieces(self, flats: Sequence[torch.Tensor], offsets: np.ndarray, lengths: np.ndarray) -> list[int]:
        """XXH3-64 of each region's pieces ``flat[offset:offset + length]``, in order (GIL-free)."""
        assert self._hash_pieces is not None, "hash_pieces needs a build with the xxhash header"
        offsets, lengths = _int64(offsets), _int64(lengths)
        bases, size = _bases(flats)
        _check_runs(offsets, lengths, size, "hashed")
        out = np.zeros(len(flats), dtype=np.uint64)
        _hashed(self._hash_pieces(len(flats), bases, offsets.size, offsets.ctypes.data, lengths.ctypes.data,
                                  out.ctypes.data))
        return [int(v) for v in out]

    def copy_hash(self, srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], src_off: np.ndarray,
                  dst_off: np.ndarray, lengths: np.ndarray, hashed: np.ndarray,
                  flip: bool = False) -> tuple[list[int], list[int]]:
        """:meth:`copy_runs` that hashes the pieces marked ``hashed`` on both sides as it copies
        them: each region's source and destination XXH3-64 over those pieces, in order.
        ``flip``: the first hashed destination byte is inverted before it is hashed (tests)."""
        assert self._copy_hash is not None, "copy_hash needs a build with the xxhash header"
        src_off, dst_off, lengths = _int64(src_off), _int64(dst_off), _int64(lengths)
        hashed = np.ascontiguousarray(hashed, dtype=np.uint8)
        src_bases, src_size, dst_bases, dst_size = _run_pairs(srcs, dsts, src_off.size, dst_off.size, lengths.size)
        if hashed.size != src_off.size:
            raise TransferError(f"{hashed.size} hash marks for {src_off.size} runs", field="segments")
        _check_runs(src_off, lengths, src_size, "source")
        _check_runs(dst_off, lengths, dst_size, "destination")
        src_out, dst_out = np.zeros(len(srcs), dtype=np.uint64), np.zeros(len(srcs), dtype=np.uint64)
        _hashed(self._copy_hash(len(srcs), src_bases, dst_bases, src_off.size, src_off.ctypes.data,
                                dst_off.ctypes.data, lengths.ctypes.data, hashed.ctypes.data,
                                _streaming(int(lengths.sum()), len(srcs)), int(flip), src_out.ctypes.data,
                                dst_out.ctypes.data))
        return [int(v) for v in src_out], [int(v) for v in dst_out]

    def copy_runs(self, srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], src_off: np.ndarray,
                  dst_off: np.ndarray, lengths: np.ndarray) -> None:
        """The same paired runs in every (srcs[r], dsts[r]) region pair."""
        src_off, dst_off = _int64(src_off), _int64(dst_off)
        if lengths.ndim == 1 and lengths.strides[0] == 0 and lengths.dtype == np.int64:
            stride = 0  # one length for every run (a broadcast view)
        else:
            lengths, stride = _int64(lengths), 1
        src_bases, src_size, dst_bases, dst_size = _run_pairs(srcs, dsts, src_off.size, dst_off.size, lengths.size)
        _check_runs(src_off, lengths, src_size, "source")
        _check_runs(dst_off, lengths, dst_size, "destination")
        if not src_off.size:
            return
        self._copy_runs.free(len(srcs), src_bases, dst_bases, src_off.size, src_off.ctypes.data,
                             dst_off.ctypes.data, lengths.ctypes.data, stride,
                             _streaming(int(lengths.sum()), len(srcs)))

    def copy_run_lists(self, srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], src_off: list[int],
                       dst_off: list[int], lengths: list[int]) -> None:
        """:meth:`copy_runs` for a few runs held as Python ints (a small chunk): bounds checked
        on the ints, then the same one call over every region pair, with no numpy (GIL-free
        unless the chunk is under :data:`HOLD_GIL_BYTES`)."""
        n = len(src_off)
        src_bases, src_size, dst_bases, dst_size = _run_pairs(srcs, dsts, n, len(dst_off), len(lengths))
        _check_run_lists(src_off, lengths, src_size, "source")
        _check_run_lists(dst_off, lengths, dst_size, "destination")
        if not n:
            return
        runs = _i64 * n
        total = sum(lengths)
        self._copy_runs.for_bytes(total * len(srcs))(len(srcs), src_bases, dst_bases, n, runs(*src_off),
                                                     runs(*dst_off), runs(*lengths), 1, _streaming(total, len(srcs)))

    def copy_rows(self, srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], src_slots: np.ndarray,
                  src_row: int, src_head: int, dst_slots: np.ndarray, dst_row: int, dst_head: int,
                  slice_bytes: int) -> None:
        """One head slice per token, for every (srcs[r], dsts[r]) region pair."""
        src_slots, dst_slots = _int64(src_slots), _int64(dst_slots)
        if src_slots.size != dst_slots.size or len(srcs) != len(dsts):
            raise TransferError(f"{src_slots.size} source and {dst_slots.size} destination slots, "
                                f"{len(srcs)} and {len(dsts)} regions", field="slots")
        src_bases, src_size = _bases(srcs)
        dst_bases, dst_size = _bases(dsts)
        if _few(src_slots) and _few(dst_slots):  # a small chunk: checked as ints, no numpy
            src_list, dst_list = src_slots.tolist(), dst_slots.tolist()
            _check_row_list(src_list, src_row, src_head, slice_bytes, src_size, "source")
            _check_row_list(dst_list, dst_row, dst_head, slice_bytes, dst_size, "destination")
            total = slice_bytes * len(src_list)
            slots = _i64 * len(src_list)
            copy = self._copy_rows.for_bytes(total * len(srcs))
            copy(len(srcs), src_bases, dst_bases, len(src_list), slots(*src_list), src_row, src_head,
                 slots(*dst_list), dst_row, dst_head, slice_bytes, _streaming(total, len(srcs)))
            return
        _check_rows(src_slots, src_row, src_head, slice_bytes, src_size, "source")
        _check_rows(dst_slots, dst_row, dst_head, slice_bytes, dst_size, "destination")
        self._copy_rows.free(len(srcs), src_bases, dst_bases, src_slots.size, src_slots.ctypes.data, src_row,
                             src_head, dst_slots.ctypes.data, dst_row, dst_head, slice_bytes,
                             _streaming(slice_bytes * src_slots.size, len(srcs)))

    def gather_rows(self, flat: torch.Tensor, slots: np.ndarray, row: int, head: int, slice_bytes: int,
                    out: torch.Tensor) -> None:
        if _few(slots):
            listed = slots.tolist()
            _check_row_list(listed, row, head, slice_bytes, flat.numel(), "source")
            _check_buffer(out, len(listed), slice_bytes)
            gather = self._gather.for_bytes(len(listed) * slice_bytes)
            gather(_pointer(flat), len(listed), (_i64 * len(listed))(*listed), row, head, slice_bytes,
                   _pointer(out))
            return
        slots = _int64(slots)
        _check_rows(slots, row, head, slice_bytes, flat.numel(), "source")
        _check_buffer(out, slots.size, slice_bytes)
        self._gather.free(_pointer(flat), slots.size, slots.ctypes.data, row, head, slice_bytes, _pointer(out))

    def scatter_rows(self, flat: torch.Tensor, slots: np.ndarray, row: int, head: int, slice_bytes: int,
                     data: torch.Tensor) -> None:
        if _few(slots):
            listed = slots.tolist()
            _check_row_list(listed, row, head, slice_bytes, flat.numel(), "destination")
            _check_buffer(data, len(listed), slice_bytes)
            total = len(listed) * slice_bytes
            scatter = self._scatter.for_bytes(total)
            scatter(_pointer(flat), len(listed), (_i64 * len(listed))(*listed), row, head, slice_bytes,
                    _pointer(data), _streaming(total, 1))
            return
        slots = _int64(slots)
        _check_rows(slots, row, head, slice_bytes, flat.numel(), "destination")
        _check_buffer(data, slots.size, slice_bytes)
        self._scatter.free(_pointer(flat), slots.size, slots.ctypes.data, row, head, slice_bytes, _pointer(data),
                           _streaming(slice_bytes * slots.size, 1))


_loaded: list[RunCopy | None] = []


def library() -> Path | None:
    """The built library beside this module, newest first: the package build's, or a hand-built one."""
    found = [p for p in (*(LIBRARY.with_name("_runcopy" + s) for s in importlib.machinery.EXTENSION_SUFFIXES),
                         LIBRARY) if p.exists()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


#: why the torch path runs (empty while the native library is loaded); set by :func:`native`
_why_not = [""]


def native() -> RunCopy | None:
    """The library beside this module, loaded once; None when not built or turned off."""
    if not _loaded:
        lib = None
        path = library()
        if os.environ.get("KVXFERD_RUNCOPY", "").lower() in ("off", "0", "no", "false"):
            _why_not[0] = "turned off by KVXFERD_RUNCOPY"
        elif path is None:
            _why_not[0] = ("not built: no C compiler when kvxferd was installed; install one (gcc) and "
                           "reinstall, or run 'python -m kvxferd.datapath.runcopy'")
        else:
            try:
                lib = RunCopy(path)
            except OSError as exc:
                _why_not[0] = f"{path} does not load: {exc}"
        _loaded.append(lib)
    return _loaded[0]


def copy_path() -> dict[str, str]:
    """Which copy path this process runs: ``native`` (and the library) or ``torch`` (and why); and
    where integrity digests are hashed: in C (``native``, local copies hashing as they go) or
    with the xxhash package (``python``)."""
    lib = native()
    if lib is not None:
        return {"path": "native", "library": str(lib.path), "hashing": "native" if lib.hashes else "python"}
    return {"path": "torch", "reason": _why_not[0], "hashing": "python"}


if __name__ == "__main__":
    try:
        print(f"built {build()}")
    except (FileNotFoundError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        print(f"warning: native run copy not built ({detail}); copies use the torch path", file=sys.stderr)
        sys.exit(1)

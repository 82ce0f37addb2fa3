"""Registering KV tensors an engine already owns.

kvxferd's own engines allocate their cache with :func:`kvxferd.sdk.kv_cache.allocate_cpu`, so
the file behind every region is known. A real engine (SGLang, vLLM) allocates its KV pool
itself and hands its attention layers the tensors. Two helpers bridge that:

- :func:`share_in_place` moves CPU tensors into one kvxferd shared-memory file (a sealed
  memfd by default, see :mod:`kvxferd.datapath.shmfile`) and rebinds the very tensor objects to it
  (``Tensor.set_``), so the layers that hold them compute into memory the daemon can map.
  Tensors that shared a storage keep sharing it.
- :func:`describe_tensors` turns existing tensors into the region descriptors ``register``
  takes: for CPU it finds the file and offset behind the data pointer in
  ``/proc/self/maps`` (the daemon maps files, not pointers) and names a memfd or unlinked
  file by this process's descriptor of it; for CUDA it sends the storage's IPC handle plus
  the tensor's offset inside it.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..datapath import shmfile
from ..datapath.cuda_ipc import cuda_ipc_handle
from ..errors import RegistrationError

_ALIGN = 4096  # each moved storage starts on a page of the file (keeps every dtype aligned)
SHARE_FIX = "place the pool in shared memory first: kvxferd.sdk.engine_memory.share_in_place(tensors, name=...)"


def _release(path: str | None, fd: int | None) -> None:
    if path is not None:
        shmfile.unlink(path)
    shmfile.close_fd(fd)


@dataclass
class SharedPool:
    """The shared memory an engine's tensors were moved into.

    By default a memfd (``path`` None, ``fd`` this process's descriptor of it): it has no
    name to leak, and the descriptor lets the engine register again after a daemon restart.
    :meth:`close` closes the descriptor (unlinks a named file; idempotent); the mapping
    itself lives as long as any tensor uses it, and the memory goes with the last mapping.
    Without close() the same happens once no tensor uses the mapping any more, or when the
    process exits. Register the tensors before closing (a daemon that already mapped the
    memory keeps its mapping).
    """

    path: str | None
    size: int
    _finalizer: Any = field(default=None, repr=False)
    fd: int | None = None
    name: str | None = None  # the memfd's or file's name, as /proc/<pid>/maps shows it

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs _release once; later calls are no-ops
        self.path = None
        self.fd = None

    def __enter__(self) -> "SharedPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def share_in_place(tensors: Sequence[torch.Tensor], *, name: str, shm_dir: str | None = None) -> SharedPool:
    """Move CPU tensors' storages into one kvxferd shared-memory file, rebinding them in place.

    Every storage is copied once (current contents kept) to its own page-aligned range of
    the file; every tensor is then pointed at the same byte offset of that range with its
    own size and stride. Views of one storage therefore still alias each other, and every
    holder of a given tensor object sees the shared memory. A holder of a *different*
    tensor object over the old storage (a base tensor the engine also keeps) does not:
    pass every tensor the engine uses.

    ``shm_dir`` puts a named file there instead of a memfd, for a daemon that cannot see
    this process's pid; such a file outlives a SIGKILLed engine.
    """
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise RegistrationError(f"tensors[{i}] is a {type(t).__name__}, not a torch.Tensor",
                                    field="tensors", fix="pass the engine's KV tensors")
        if t.device.type != "cpu":
            fix = ("register CUDA tensors as they are: describe_tensors() sends their CUDA IPC handle, no "
                   "move is needed" if t.device.type == "cuda" else "pass CPU tensors only")
            raise RegistrationError(
                f"tensors[{i}] is on device {t.device}; only CPU tensors move into shared memory",
                field="tensors", fix=fix)
    storages: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        s = t.untyped_storage()
        storages.setdefault(s.data_ptr(), s)
    spans = sorted((ptr, s.nbytes()) for ptr, s in storages.items())
    for (p0, n0), (p1, _n1) in zip(spans, spans[1:]):
        if p0 + n0 > p1:
            raise RegistrationError("two different storages overlap in memory; moving them apart would "
                                    "break their aliasing", field="tensors",
                                    fix="pass tensors that are views of whole storages")
    offsets: dict[int, int] = {}
    total = 0
    for ptr, nbytes in spans:
        offsets[ptr] = total
        total += _align(max(nbytes, 1))
    total = max(total, _ALIGN)
    shared_file = shmfile.create(name, total, shm_dir)
    path, fd = shared_file.path, shared_file.fd
    try:
        array = np.frombuffer(shared_file.mm, dtype=np.uint8)
        base = torch.from_numpy(array)  # the storage keeps ``array`` and so the mapping alive
        for ptr, s in storages.items():
            old = torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),))
            base[offsets[ptr]:offsets[ptr] + s.nbytes()].copy_(old)
        shared = base.untyped_storage()
        for t in tensors:
            size = t.element_size()
            byte_offset = offsets[t.untyped_storage().data_ptr()] + t.storage_offset() * size
            with torch.no_grad():
                t.set_(shared, byte_offset // size, t.size(), t.stride())
    except BaseException:
        _release(path, fd)
        raise
    # the name (or descriptor) goes when close() is called, when no tensor uses the mapping
    # any more, or at interpreter exit, whichever comes first
    return SharedPool(path, total, weakref.finalize(array, _release, path, fd), fd=fd, name=shared_file.name)


# -- describing existing tensors ----------------------------------------------------------

@dataclass(frozen=True)
class _Mapping:
    start: int
    end: int
    shared: bool
    offset: int  # file offset of ``start``
    path: str  # "" for anonymous memory
    inode: int = 0


def _read_maps() -> list[_Mapping]:
    """This process's mappings, adjacent pieces of one file merged (the kernel may split them)."""
    out: list[_Mapping] = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.rstrip("\n").split(maxsplit=5)
            if len(parts) < 5:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5] if len(parts) == 6 else ""
            m = _Mapping(lo, hi, parts[1][3] == "s", int(parts[2], 16), path, int(parts[4]))
            prev = out[-1] if out else None
            if (prev is not None and prev.end == m.start and prev.path == m.path and m.path.startswith("/")
                    and prev.inode == m.inode and prev.shared == m.shared
                    and prev.offset + (prev.end - prev.start) == m.offset):
                out[-1] = _Mapping(prev.start, m.end, m.shared, prev.offset, m.path, m.inode)
            else:
                out.append(m)
    return out


def _find(maps: list[_Mapping], ptr: int) -> _Mapping | None:
    for m in maps:
        if m.start <= ptr < m.end:
            return m
    return None


def _own_fd(m: _Mapping) -> int | None:
    """A descriptor this process holds of the (unnamed) file behind a mapping, if any.

    Matched by link text and inode, never by a remembered number: a closed descriptor's
    number may since name another file.
    """
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for name in fds:
        fd = int(name)
        try:
            if shmfile.fd_target(fd) == m.path and os.fstat(fd).st_ino == m.inode:
                return fd
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor among them)
    return None


def _describe_cpu(key: tuple[int, str], t: torch.Tensor, maps: list[_Mapping],
                  fds: dict[_Mapping, int | None]) -> dict[str, Any]:
    layer, kind = key
    nbytes = t.numel() * t.element_size()
    ptr = t.data_ptr()
    m = _find(maps, ptr)
    where = f"tensor (layer {layer}, kind {kind!r})"
    if m is None or not m.path.startswith("/") or not m.shared:
        what = "anonymous" if m is None or not m.path.startswith("/") else f"a private mapping of {m.path}"
        raise RegistrationError(
            f"{where} at 0x{ptr:x} lives in private memory ({what}); the daemon can only map a "
            "shared-memory file", field="tensors", fix=SHARE_FIX)
    if ptr + nbytes > m.end:
        raise RegistrationError(f"{where} of {nbytes} bytes runs past the end of its mapping of {m.path}",
                                field="tensors", fix=SHARE_FIX)
    where_file: dict[str, Any] = {"path": m.path}
    if m.path.endswith(shmfile.DELETED) or m.path.startswith(shmfile.MEMFD_LINK):
        if m not in fds:
            fds[m] = _own_fd(m)
        fd = fds[m]  # a memfd or unlinked file: the daemon opens it through our descriptor
        if fd is None:
            raise RegistrationError(f"{where} lives in {m.path} which has no name and no descriptor in this "
                                    "process, so the daemon cannot open it", field="tensors", fix=SHARE_FIX)
        where_file = {"fd": fd}
    return {"layer": layer, "kind": kind, "mem": "shm", **where_file, "offset": m.offset + ptr - m.start,
            "nbytes": nbytes}


def _describe_cuda(key: tuple[int, str], t: torch.Tensor) -> dict[str, Any]:  # pragma: no cover - needs a GPU
    # the handle opens the tensor's whole storage; its "storage_offset" already includes this
    # tensor's byte offset, so several tensors of one allocation each get their own region
    return {"layer": key[0], "kind": key[1], "mem": "cuda_ipc", "offset": 0,
            "nbytes": t.numel() * t.element_size(), "handle": cuda_ipc_handle(t)}


def describe_tensors(tensors: Mapping[tuple[int, str], torch.Tensor]) -> list[dict[str, Any]]:
    """Region descriptors for an engine's existing tensors, keyed by (global layer, kind).

    Each tensor's bytes must be contiguous (a region is one byte range). CPU tensors must
    live in a shared-memory file mapping (see :func:`share_in_place`); CUDA tensors are
    described by their storage's IPC handle.
    """
    maps: list[_Mapping] | None = None
    fds: dict[_Mapping, int | None] = {}
    out = []
    for key, t in tensors.items():
        layer, kind = key
        if not t.is_contiguous():
            raise RegistrationError(
                f"tensor (layer {layer}, kind {kind!r}) of shape {list(t.shape)} has strides "
                f"{list(t.stride())}, not contiguous; a region must be one byte range", field="tensors",
                fix="register the contiguous tensor the engine allocated (one per layer and kind), "
                    "not a permuted or sliced view")
        if t.device.type == "cuda":
            out.append(_describe_cuda(key, t))  # pragma: no cover - needs a GPU
            continue
        if t.device.type != "cpu":
            raise RegistrationError(f"tensor (layer {layer}, kind {kind!r}) is on device {t.device}",
                                    field="tensors", fix="register CPU (shared memory) or CUDA tensors")
        if maps is None:
            maps = _read_maps()
        out.append(_describe_cpu(key, t, maps, fds))
    return out

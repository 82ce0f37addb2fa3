"""An engine rank's KV cache in memory its daemon can map, allocated by kvxferd.

One shared-memory file per rank holds every region, by default an anonymous memfd
(:mod:`kvxferd.datapath.shmfile`: nothing in ``/dev/shm`` to outlive a killed engine); the engine
sees torch tensors over it, and ``register`` hands the daemon the file's descriptor. An
engine that allocates its cache itself registers it with :mod:`kvxferd.sdk.engine_memory`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..datapath import shmfile
from ..model.geometry import RankGeometry

ALIGN = 4096

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        TORCH_DTYPES[_name] = getattr(torch, _name)


def torch_dtype(name: str) -> torch.dtype:
    """The element type engines see; packed 4-bit types are handed out as raw bytes."""
    return TORCH_DTYPES.get(name, torch.uint8)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def region_shape(geometry: RankGeometry) -> tuple[int, ...]:
    """NHD ``[pages, page_size, heads, head_dim]``; NHD_kv ``[pages, page_size, heads, 2 * head_dim]``;
    packed_page and HND_kv vLLM's ``[pages, heads, page_size, 2 * head_dim]``."""
    spec = geometry.spec
    if spec.layout == "NHD_kv":
        if spec.dtype in TORCH_DTYPES:
            return (geometry.num_pages, spec.page_size, spec.local_heads, 2 * spec.head_dim)
        return (geometry.num_pages, spec.page_size, spec.row_bytes)
    if spec.packed:
        if spec.dtype in TORCH_DTYPES:
            return (geometry.num_pages, spec.local_heads, spec.page_size, 2 * spec.head_dim)
        return (geometry.num_pages, spec.local_heads, spec.head_slot_bits // 8)
    if spec.dtype in TORCH_DTYPES:
        return (geometry.num_pages, spec.page_size, spec.local_heads, spec.head_dim)
    return (geometry.num_pages, spec.page_size, spec.row_bytes)


@dataclass
class KVCache:
    """An engine rank's KV cache in daemon-mappable memory.

    ``tensors[(layer, kind)]`` is the NHD tensor of one region; ``descriptors()`` is what
    ``register`` sends, again after a daemon restart (the memfd's descriptor ``fd`` stays
    open for that). Call :meth:`close` (or use as a context manager) to let go of it: the
    descriptor is closed (a named file unlinked), the memory goes with the last mapping.
    """

    geometry: RankGeometry
    tensors: dict[tuple[int, str], torch.Tensor]
    path: str | None  # a named file (allocate_cpu(shm_dir=...)), None for a memfd or GPU memory
    _descriptors: list[dict[str, Any]]
    _mmap: Any = field(default=None, repr=False)
    fd: int | None = None  # the memfd, open while the cache is shared
    name: str | None = None  # the memfd's or file's name, as /proc/<pid>/maps shows it

    def descriptors(self) -> list[dict[str, Any]]:
        return [dict(d) for d in self._descriptors]

    def k(self, layer: int) -> torch.Tensor:
        return self.tensors[(layer, "k")]

    def v(self, layer: int) -> torch.Tensor:
        return self.tensors[(layer, "v")]

    def latent(self, layer: int) -> torch.Tensor:
        return self.tensors[(layer, "latent")]

    def close(self) -> None:
        self.tensors.clear()
        if self.path:
            shmfile.unlink(self.path)
            self.path = None
        shmfile.close_fd(self.fd)
        self.fd = None

    def __enter__(self) -> "KVCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def allocate_cpu(geometry: RankGeometry, *, name: str = "kv", shm_dir: str | None = None,
                 fill: int | None = 0) -> KVCache:
    """Allocate every region of a rank in one shared-memory file.

    By default a sealed memfd, registered by descriptor: it goes away with the engine and
    the daemon's mapping, however either ends. ``shm_dir`` makes a named file there instead,
    for a daemon that cannot see this process's pid (it outlives a SIGKILLed engine).
    """
    names = geometry.region_names()
    sizes = [geometry.region_nbytes(kind) for _, kind in names]
    offsets = np.concatenate(([0], np.cumsum([_align(n) for n in sizes]))).tolist()
    total = offsets[-1]
    shared = shmfile.create(name, total, shm_dir)
    mm, path = shared.mm, shared.path
    where: dict[str, Any] = {"path": path} if path is not None else {"fd": shared.fd}
    base = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
    if fill is not None:
        base.fill_(fill)
    tensors: dict[tuple[int, str], torch.Tensor] = {}
    descriptors = []
    for i, (layer, kind) in enumerate(names):
        offset, nbytes = offsets[i], sizes[i]
        part = geometry.group(kind.rpartition(".")[0])  # the region's group (itself for the default one)
        region = base[offset:offset + nbytes]
        tensors[(layer, kind)] = region.view(torch_dtype(part.spec.dtype)).view(region_shape(part))
        descriptors.append({"layer": layer, "kind": kind, "mem": "shm", **where,
                            "offset": offset, "nbytes": nbytes})
    return KVCache(geometry, tensors, path, descriptors, mm, fd=shared.fd, name=shared.name)

"""KV memory both an engine and the daemon can touch.

CPU: one shared-memory file per rank holds every region, by default an anonymous memfd
(:mod:`kvxferd.shmfile`: nothing in ``/dev/shm`` to outlive a killed engine); the engine
sees torch tensors over it, the daemon maps the same file, opened through the engine's
descriptor. GPU: the engine hands over a CUDA IPC handle per region and the daemon opens
it (same node, same device visibility).

The daemon only maps memfds of the registering engine and files inside its configured
shared-memory directories (named ones opened with ``O_NOFOLLOW``), and checks every
region's bounds against the file before it is used.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import torch

from . import shmfile
from .errors import RegistrationError
from .geometry import RankGeometry

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


# -- engine side -------------------------------------------------------------------------

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


def cuda_ipc_handle(tensor: torch.Tensor) -> dict[str, Any]:
    """The parts of ``storage._share_cuda_()`` another process needs to open the memory."""
    storage = tensor.untyped_storage()
    (device, handle, size, offset, ref_handle, ref_offset, event_handle,
     event_sync) = storage._share_cuda_()
    return {"device": int(device), "uuid": _device_uuid(int(device)), "handle": bytes(handle), "size": int(size),
            "storage_offset": int(offset) + tensor.storage_offset() * tensor.element_size(),
            # where the storage starts inside the IPC allocation (the caching allocator may have
            # placed it in a larger segment): the daemon opens the storage there, not at the base
            "block_offset": int(offset),
            "ref_handle": bytes(ref_handle), "ref_offset": int(ref_offset),
            "event_handle": bytes(event_handle) if event_handle else b"",
            "event_sync": bool(event_sync)}


def _device_uuid(index: int) -> str:
    """A GPU's UUID: the same in every process, whatever each one's CUDA_VISIBLE_DEVICES numbers it."""
    try:
        return str(torch.cuda.get_device_properties(index).uuid)
    except Exception:  # noqa: BLE001 - a torch without the property: the daemon falls back to the index
        return ""


def local_device(handle: dict[str, Any]) -> int:
    """This process's index of the GPU a CUDA IPC handle was made on.

    The engine numbers GPUs as its own CUDA_VISIBLE_DEVICES says, which need not match the
    daemon's (one daemon per node sees every GPU, each engine often only its own as 0): the
    UUID names the device the same way everywhere. A handle without one (an older client)
    keeps its index."""
    uuid = handle.get("uuid") or ""
    if not uuid:
        return int(handle["device"])
    for index in range(torch.cuda.device_count()):
        if _device_uuid(index) == uuid:
            return index
    raise RegistrationError(f"the engine's GPU {uuid} (its cuda:{handle['device']}) is not visible to the daemon "
                            f"({torch.cuda.device_count()} GPUs here)", field="regions.handle.uuid",
                            fix="run the daemon with every GPU its engines use visible (CUDA_VISIBLE_DEVICES)")


# -- daemon side -------------------------------------------------------------------------

@dataclass
class MappedRegion:
    """One region as the daemon sees it: a flat byte tensor on its device."""

    layer: int
    kind: str
    flat: torch.Tensor  # uint8, 1-D, exactly the region's bytes

    @property
    def nbytes(self) -> int:
        return int(self.flat.numel())

    @property
    def is_cpu(self) -> bool:
        return self.flat.device.type == "cpu"

    @property
    def view(self) -> memoryview:
        """Writable byte view of a CPU region, for zero-copy socket I/O."""
        mv = self.__dict__.get("_mv")
        if mv is None:
            mv = self.__dict__["_mv"] = memoryview(self.flat.numpy()).cast("B")
        return mv


class MemoryMapper:
    """Maps engine-described regions into the daemon, sharing one mapping per file.

    A region names its file by ``path`` (inside ``shm_dirs``) or by ``fd``, a descriptor
    open in the registering engine's process ``pid`` (see :mod:`kvxferd.shmfile`).
    Mappings are keyed by the file's identity (device, inode), so however a file is named
    it is mapped once, and the key cannot be reused while the mapping holds the file.
    """

    def __init__(self, shm_dirs: Iterable[str]) -> None:
        self.shm_dirs = [os.path.realpath(d) for d in shm_dirs]
        self._files: dict[tuple[int, int], tuple[mmap.mmap, torch.Tensor]] = {}

    def map_regions(self, geometry: RankGeometry, regions: list[dict[str, Any]],
                    pid: int | None = None) -> dict[tuple[int, str], MappedRegion]:
        expected = geometry.region_names()
        got = sorted((r["layer"], r["kind"]) for r in regions)
        if got != sorted(expected):
            missing = sorted(set(expected) - set(got))
            extra = sorted(set(got) - set(expected))
            dup = len(got) != len(set(got))
            raise RegistrationError(
                f"regions do not match the geometry's layers {list(geometry.layers)} and kinds "
                f"{list(geometry.spec.region_kinds)}: missing {missing[:4]}, unexpected {extra[:4]}"
                + (", duplicates present" if dup else ""),
                field="regions", fix="register exactly one region per local layer and kind")
        out: dict[tuple[int, str], MappedRegion] = {}
        opened: dict[tuple[str, Any], torch.Tensor] = {}  # each named file / descriptor opened once
        for r in regions:
            need = geometry.region_nbytes(r["kind"])
            part = geometry.group(r["kind"].rpartition(".")[0])
            if r["nbytes"] != need:
                raise RegistrationError(
                    f"region layer {r['layer']} kind {r['kind']} has {r['nbytes']} bytes, geometry needs "
                    f"{need} ({part.num_pages} pages of {part.spec.page_bytes} bytes"
                    + (f" every {part.page_stride} bytes" if part.page_stride else "") + ")",
                    field="regions.nbytes", fix="allocate regions from the same geometry you register")
            flat = self._map_one(r, pid, opened)
            out[(r["layer"], r["kind"])] = MappedRegion(r["layer"], r["kind"], flat)
        return out

    def _map_one(self, r: dict[str, Any], pid: int | None, opened: dict[tuple[str, Any], torch.Tensor]) -> torch.Tensor:
        if r["mem"] == "shm":
            return self._map_shm(r, pid, opened)
        return self._open_cuda(r)

    def _map_shm(self, r: dict[str, Any], pid: int | None, opened: dict[tuple[str, Any], torch.Tensor]) -> torch.Tensor:
        if r.get("fd") is not None and r.get("path"):
            raise RegistrationError(f"region names both descriptor {r['fd']} and path {r['path']}",
                                    field="regions.path", fix="send a memfd's descriptor (fd) or a file's path, not both")
        if r.get("fd") is not None:
            key: tuple[str, Any] = ("fd", r["fd"])
            label, field_name = f"descriptor {r['fd']} of engine process {pid}", "regions.fd"
        elif r.get("path"):
            key = ("path", r["path"])
            label, field_name = str(r["path"]), "regions.path"
        else:
            raise RegistrationError("shm region without a path or a descriptor", field="regions.path",
                                    fix="send the region's memfd descriptor (fd) or shared-memory file path")
        base = opened.get(key)
        if base is None:
            base = opened[key] = self._map_file(key, pid, label, field_name)
        offset = r.get("offset", 0)
        if offset + r["nbytes"] > base.numel():
            raise RegistrationError(
                f"region [{offset}, {offset + r['nbytes']}) exceeds {label} of {base.numel()} bytes",
                field="regions.offset", fix="describe regions inside the shared-memory file")
        return base[offset:offset + r["nbytes"]]

    def _map_file(self, key: tuple[str, Any], pid: int | None, label: str, field_name: str) -> torch.Tensor:
        if key[0] == "fd":
            fd = shmfile.open_engine_fd(pid, key[1], self.shm_dirs)
        else:
            fd = shmfile.open_path(key[1], self.shm_dirs)
        try:
            st = os.fstat(fd)
            entry = self._files.get((st.st_dev, st.st_ino))
            if entry is None:
                mm, st = shmfile.map_open(fd, label, field_name)
                entry = (mm, torch.from_numpy(np.frombuffer(mm, dtype=np.uint8)))
                self._files[(st.st_dev, st.st_ino)] = entry
        finally:
            os.close(fd)  # the mapping keeps the file; no descriptor stays open in the daemon
        return entry[1]

    def _open_cuda(self, r: dict[str, Any]) -> torch.Tensor:  # pragma: no cover - needs a GPU
        if not torch.cuda.is_available():
            raise RegistrationError("region is CUDA IPC but this daemon has no CUDA", field="regions.mem",
                                    fix="run the daemon with access to the engine's GPUs")
        h = r.get("handle")
        device = local_device(h)
        try:
            block = int(h.get("block_offset", 0))  # handles from older clients: the storage's own base
            storage = torch.UntypedStorage._new_shared_cuda(
                device, h["handle"], h["size"], block, h["ref_handle"], h["ref_offset"],
                h["event_handle"] or None, h["event_sync"])
            offset = int(h["storage_offset"]) - block + int(r.get("offset", 0))
        except Exception as exc:
            raise RegistrationError(f"cannot open CUDA IPC handle: {exc}", field="regions.handle",
                                    fix="send the handle from cuda_ipc_handle() of a live tensor") from None
        flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
        flat.set_(storage, 0, (storage.nbytes(),))
        if offset < 0 or offset + r["nbytes"] > flat.numel():
            raise RegistrationError("CUDA region exceeds its storage", field="regions.nbytes",
                                    fix="describe the region inside its tensor's storage")
        return flat[offset:offset + r["nbytes"]]

    def release_unused(self, in_use: Iterable[torch.Tensor]) -> None:
        """Forget file mappings no registered region uses any more."""
        used = {t.untyped_storage().data_ptr() for t in in_use if t.device.type == "cpu"}
        for real, (mm, base) in list(self._files.items()):
            if base.untyped_storage().data_ptr() not in used:
                del self._files[real]


# engine-owned tensors (kept in their own module; re-exported here for one import path)
from .engine_memory import SharedPool, describe_tensors, share_in_place  # noqa: E402,F401

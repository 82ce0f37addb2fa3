"""KV memory as the daemon maps it: the regions an engine registered, as flat byte tensors.

CPU: one shared-memory file per rank holds every region (:mod:`kvxferd.datapath.shmfile`), opened
through the engine's descriptor. GPU: the engine hands over a CUDA IPC handle per region
(:mod:`kvxferd.datapath.cuda_ipc`) and the daemon opens it (same node, same device visibility).

The daemon only maps memfds of the registering engine and files inside its configured
shared-memory directories (named ones opened with ``O_NOFOLLOW``), and checks every
region's bounds against the file before it is used.
"""

from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import torch

from ..errors import RegistrationError
from ..model.geometry import RankGeometry
from ..ops.logutil import q
from . import shmfile
from .cuda_ipc import allocation_range, local_device
from .digest import XXH3
from .word_sums import NAME as WORD_SUMS

log = logging.getLogger("kvxferd.regions")


@dataclass
class MappedRegion:
    """One region as the daemon sees it: a flat byte tensor on its device."""

    layer: int
    kind: str
    flat: torch.Tensor  # uint8, 1-D, exactly the region's bytes
    #: the digest its bytes are checked with (:mod:`.digest`): XXH3 where a host core reads them,
    #: word sums (:mod:`.word_sums`) where they live on a GPU, so they are summed where they lie
    digest: str = ""

    def __post_init__(self) -> None:
        if not self.digest:
            self.digest = XXH3 if self.flat.device.type == "cpu" else WORD_SUMS

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
    open in the registering engine's process ``pid`` (see :mod:`kvxferd.datapath.shmfile`).
    Mappings are keyed by the file's identity (device, inode), so however a file is named
    it is mapped once, and the key cannot be reused while the mapping holds the file.
    ``allow_named_files``: whether named files (which cannot be sealed against shrinking) may
    be mapped at all; the daemon passes ``engine.allow_named_files`` (off by default).
    """

    def __init__(self, shm_dirs: Iterable[str], device_digest_on_cpu: bool = False,
                 allow_named_files: bool = True) -> None:
        self.shm_dirs = [os.path.realpath(d) for d in shm_dirs]
        self.allow_named_files = allow_named_files
        #: test setting (``integrity.device_digest_on_cpu``): CPU regions are checked with the GPU's
        #: digest, so its whole path runs on a machine without one
        self.device_digest_on_cpu = device_digest_on_cpu
        if device_digest_on_cpu:
            log.warning("event=integrity_device_digest_on_cpu note=%s",
                        q("host pages are checked with the word sums meant for pages on a GPU: a test setting, "
                          "never for production"))
        self._files: dict[tuple[int, int], tuple[mmap.mmap, torch.Tensor]] = {}

    def map_regions(self, geometry: RankGeometry, regions: list[dict[str, Any]],
                    pid: int | None = None, owner: int | None = None) -> dict[tuple[int, str], MappedRegion]:
        """The regions of one registering rank: descriptors opened in process ``pid`` (the
        connection's peer), named files owned by uid ``owner`` (the peer's; None: unchecked)."""
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
            flat = self._map_one(r, pid, owner, opened)
            out[(r["layer"], r["kind"])] = MappedRegion(r["layer"], r["kind"], flat,
                                                        WORD_SUMS if self.device_digest_on_cpu else "")
        return out

    def _map_one(self, r: dict[str, Any], pid: int | None, owner: int | None,
                 opened: dict[tuple[str, Any], torch.Tensor]) -> torch.Tensor:
        if r["mem"] == "shm":
            return self._map_shm(r, pid, owner, opened)
        return self._open_cuda(r)

    def _map_shm(self, r: dict[str, Any], pid: int | None, owner: int | None,
                 opened: dict[tuple[str, Any], torch.Tensor]) -> torch.Tensor:
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
            base = opened[key] = self._map_file(key, pid, owner, label, field_name)
        offset = r.get("offset", 0)
        if offset + r["nbytes"] > base.numel():
            raise RegistrationError(
                f"region [{offset}, {offset + r['nbytes']}) exceeds {label} of {base.numel()} bytes",
                field="regions.offset", fix="describe regions inside the shared-memory file")
        return base[offset:offset + r["nbytes"]]

    def _map_file(self, key: tuple[str, Any], pid: int | None, owner: int | None, label: str,
                  field_name: str) -> torch.Tensor:
        if key[0] == "fd":
            fd = shmfile.open_engine_fd(pid, key[1], self.shm_dirs, named_ok=self.allow_named_files, owner=owner)
        else:
            fd = shmfile.open_path(key[1], self.shm_dirs, named_ok=self.allow_named_files, owner=owner)
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
        # the storage's size is the engine's word: the driver's own record of the allocation bounds it
        start = storage.data_ptr() + offset
        with torch.cuda.device(device):
            base, size = allocation_range(start)
        if start < base or start + r["nbytes"] > base + size:
            raise RegistrationError(
                f"CUDA region [{start - base}, {start - base + r['nbytes']}) of layer {r['layer']} kind {r['kind']} "
                f"exceeds its real allocation of {size} bytes (the handle declared {storage.nbytes()})",
                field="regions.nbytes", fix="send handles of the engine's own KV tensors, sized as allocated")
        return flat[offset:offset + r["nbytes"]]

    def release_unused(self, in_use: Iterable[torch.Tensor]) -> None:
        """Forget file mappings no registered region uses any more."""
        used = {t.untyped_storage().data_ptr() for t in in_use if t.device.type == "cpu"}
        for real, (mm, base) in list(self._files.items()):
            if base.untyped_storage().data_ptr() not in used:
                del self._files[real]

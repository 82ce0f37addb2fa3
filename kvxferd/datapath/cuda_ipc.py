"""CUDA IPC handles: what an engine sends for a region on its GPU, and which GPU of the
daemon's it names.

The engine's device index is its own numbering (CUDA_VISIBLE_DEVICES); the handle carries
the GPU's UUID too, which names the device the same way in every process.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from ..errors import RegistrationError


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


_DRIVER: list[Any] = []  # libcuda's cuMemGetAddressRange, once loaded


def _address_range_fn() -> Any:
    if not _DRIVER:
        fn = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        fn.restype = ctypes.c_int
        _DRIVER.append(fn)
    return _DRIVER[0]


def allocation_range(ptr: int) -> tuple[int, int]:  # pragma: no cover - needs a GPU
    """``(base, size)`` of the CUDA allocation that holds device pointer ``ptr``, as the driver knows
    it (``cuMemGetAddressRange``): the bound of a region opened from an IPC handle, whatever size
    the engine declared. The pointer's device must be current (``torch.cuda.device``)."""
    try:
        fn = _address_range_fn()
    except (OSError, AttributeError) as exc:
        raise RegistrationError(f"cannot load the CUDA driver's cuMemGetAddressRange to bound a CUDA IPC region: "
                                f"{exc}", field="regions.handle",
                                fix="run the daemon where libcuda.so.1 is on the loader's path") from None
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise RegistrationError(f"cuMemGetAddressRange failed (CUresult {rc}) for the CUDA IPC region at 0x{ptr:x}",
                                field="regions.handle", fix="send the handle from cuda_ipc_handle() of a live tensor")
    return int(base.value), int(size.value)

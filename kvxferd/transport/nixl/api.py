"""The NIXL library as kvxferd uses it: loading the Python API (whichever distribution is
installed), memory descriptors, and what the prefill side knows of a decode daemon's agent
(:class:`NixlPeer`: its regions' base addresses, landing credits). No agent is created here;
:class:`.transport.NixlTransport` owns the one agent of a daemon."""

from __future__ import annotations

import importlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from ...errors import TransferError
from ...model.geometry import InstanceSpec
from ...lifecycle.registry import Rank
from ...model.segments import unit_slots
from .staging import Credits

log = logging.getLogger("kvxferd.nixl")

#: distributions that ship the NIXL Python API, tried in this order
MODULES = ("nixl_cu12", "nixl_cu13", "nixl")
BACKEND = "UCX"
#: ``peer.nixl_engine_memory``: sources write only landing rings (the default), or engines' pages in place too
PRIVATE, EXPOSED = "private", "exposed"
_import_error: str | None = None
_api: Any = None


def load_api() -> Any:
    """The NIXL Python module, or raise ImportError saying why it is unusable."""
    global _api, _import_error
    if _api is not None:
        return _api
    if _import_error is not None:
        raise ImportError(_import_error)
    errors = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
            module.nixl_agent, module.nixl_agent_config, module.nixl_thread_sync_t  # noqa: B018
        except Exception as exc:  # noqa: BLE001 - a broken install raises more than ImportError
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        _quiet_python_logger()
        _api = module
        return module
    _import_error = "NIXL is not importable (" + "; ".join(errors) + ")"
    raise ImportError(_import_error)


#: UCX settings a daemon's agent needs, unless the operator's environment sets them. The memory
#: type cache classifies an address by UCX's hooks on the allocation calls of this process; a
#: daemon registers memory it never allocated (an engine's GPU memory opened by CUDA IPC), which
#: the cache then takes for host memory, and NIXL refuses the VRAM registration ("VRAM memory is
#: detected as host by UCX"). Without the cache UCX asks the CUDA driver each time.
UCX_DEFAULTS = {"UCX_MEMTYPE_CACHE": "n"}


def apply_ucx_defaults() -> dict[str, str]:
    """Put :data:`UCX_DEFAULTS` into the environment where unset, before an agent starts UCX;
    returns the ones set."""
    applied = {}
    for key, value in UCX_DEFAULTS.items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    return applied


def loaded() -> bool:
    """Whether this process has loaded the NIXL module (and with it UCX)."""
    return _api is not None


def available() -> tuple[bool, str]:
    """Whether the NIXL Python API imports here, and why not."""
    try:
        load_api()
    except ImportError as exc:
        return False, str(exc)
    return True, ""


def _quiet_python_logger() -> None:
    """NIXL's Python logger prints INFO lines to stdout; route it through ours, at WARNING."""
    nixl_log = logging.getLogger("nixl")
    for handler in list(nixl_log.handlers):
        nixl_log.removeHandler(handler)
    nixl_log.propagate = True
    nixl_log.setLevel(logging.WARNING)



def _mem(device: int) -> str:
    return "DRAM" if device < 0 else "VRAM"


def _descs(bases: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, device: int) -> np.ndarray:
    """``[regions x segments, 3]`` (address, length, device id) rows, regions outermost (wire order)."""
    n_regions, n_segs = bases.size, offsets.size
    out = np.empty((n_regions * n_segs, 3), dtype=np.uint64)
    out[:, 0] = (bases[:, None] + offsets.astype(np.uint64)[None, :]).ravel()
    out[:, 1] = np.tile(lengths.astype(np.uint64), n_regions)
    out[:, 2] = max(device, 0)
    return out


@dataclass
class _Registered:
    rank: Rank
    generation: int
    device: int  # -1: host memory
    reg_descs: Any  # nixlRegDList, for deregistration and partial metadata
    addresses: dict[tuple[int, str], int]
    metadata: bytes | None = None
    nbytes: int = 0  # bytes registered (each range once)


class NixlPeer:
    """A decode daemon's agent as one (prefill, decode) route of this daemon sees it.

    Holds the remote regions (base address, size, device, page stride) per decode rank,
    layer and kind; base arrays in wire order are built once per (destination rank, layer
    range). ``spec`` is the decode instance's spec: a chunk's destination slots come from it
    through :func:`~kvxferd.model.segments.unit_slots`, the same function the decode side's inbox
    uses for tcp and local, so every layout (token rows, packed pages, strided pages) is
    addressed alike on every transport. A decode instance with cache groups has regions of
    each group (kinds ``<group>.<kind>``) moved as the group's own spec.
    """

    def __init__(self, agent: str, spec: InstanceSpec) -> None:
        self.agent = agent
        self.spec = spec
        self.units: dict[str, InstanceSpec] = {"": spec, **{g.name: spec.group_spec(g.name) for g in spec.groups}}
        self.dead = ""  # set by the daemon when the peer stops answering heartbeats
        self.credits: Credits | None = None  # the peer's landing ring for staged blocks, if it gave one
        #: the peer keeps its engines' memory private (``nixl_private``): no region of it is described,
        #: and every chunk lands in its landing ring
        self.private = False
        self._regions: dict[tuple[int, int, int, str], tuple[int, int, int, int]] = {}
        self._bases: dict[tuple[Any, ...], tuple[np.ndarray, int, int]] = {}
        #: page stride of each decode rank's regions of a group, by (tp, pp, group); 0: dense
        self._strides: dict[tuple[int, int, str], int] = {}
        self._lock = threading.Lock()

    def update(self, entries: Iterable[list[Any]]) -> None:
        """Regions as the decode side describes them (:func:`kvxferd.wire.protocol.nixl_region`): a
        row without the eighth entry (page stride) is a dense rank's. A rank whose regions of
        one group disagree on the stride is refused here, before any WRITE."""
        rows = [(row[:7], int(row[7]) if len(row) > 7 else 0) for row in entries]
        with self._lock:
            strides: dict[tuple[int, int, str], int] = {}
            for (tp, pp, _layer, kind, _addr, _nbytes, _device), stride in rows:
                key = (tp, pp, kind.rpartition(".")[0])
                if strides.setdefault(key, stride) != stride:
                    raise TransferError(f"decode rank {[tp, pp]} described regions with page strides "
                                        f"{sorted({strides[key], stride})}", field="nixl_regions",
                                        fix="register every region of a rank with one page stride")
            for (tp, pp, layer, kind, addr, nbytes, device), stride in rows:
                self._regions[(tp, pp, layer, kind)] = (addr, nbytes, device, stride)
            self._strides.update(strides)
            self._bases.clear()

    @property
    def groups(self) -> list[str]:
        """The decode instance's cache groups, by name."""
        return [g for g in self.units if g]

    def dst_slots(self, dst: tuple[int, int], group: str, pages: np.ndarray, start: int, end: int) -> np.ndarray:
        """Destination slots of tokens ``[start, end)``: what the decode side's inbox computes for
        the same chunk (token rows or whole packed pages, dense or strided pages)."""
        spec = self.units[group]
        stride = self._strides.get((dst[0], dst[1], group), 0)  # one dict read: this runs per chunk
        return unit_slots(spec, pages, start, end, 0, stride // spec.row_bytes if stride else None)

    def num_pages(self, dst: tuple[int, int], group: str = "") -> int | None:
        """Pages (state slots) every region of a group of a decode rank holds, or None if the rank
        described none."""
        with self._lock:
            rows = [(n, s) for (tp, pp, _l, kind), (_a, n, _d, s) in self._regions.items()
                    if (tp, pp) == tuple(dst) and kind.rpartition(".")[0] == group]
        if not rows:
            return None
        page = self.units[group].page_bytes
        return min((n - page) // s + 1 if s else n // page for n, s in rows)

    def bases(self, dst: tuple[int, int], layers: tuple[int, int],
              kinds: tuple[str, ...]) -> tuple[np.ndarray, int, int]:
        """(base addresses in wire order, smallest region size, device) of a writer's destination."""
        key = (tuple(dst), tuple(layers), kinds)
        with self._lock:
            found = self._bases.get(key)
            if found is not None:
                return found
            rows = []
            for layer in range(*layers):
                for kind in kinds:
                    region = self._regions.get((dst[0], dst[1], layer, kind))
                    if region is None:
                        raise TransferError(f"decode rank {list(dst)} described no NIXL region for layer {layer} "
                                            f"kind {kind}", field="nixl_regions",
                                            fix="check the decode rank registered with a NIXL-enabled daemon")
                    rows.append(region)
            devices = {d for _a, _n, d, _s in rows}
            if len(devices) != 1:
                raise TransferError(f"decode rank {list(dst)} regions span devices {sorted(devices)}",
                                    field="nixl_regions", fix="register each rank's regions on one device")
            found = (np.array([a for a, _n, _d, _s in rows], dtype=np.uint64), min(n for _a, n, _d, _s in rows),
                     devices.pop())
            self._bases[key] = found
            return found

"""Other engines on the same loopback, as peers to compare against: a raw NIXL agent over
UCX/TCP and Mooncake's transfer engine over TCP. Each writes one contiguous buffer to
another process, and the target checks every byte; a row is skipped, with the reason,
where the engine is not installed.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import time
from typing import Any


def _nixl_api() -> Any:
    """``(nixl_agent, nixl_agent_config)`` from the ``nixl_cu12`` wheel, else a ``nixl`` build."""
    if _find("nixl_cu12") is not None:
        from nixl_cu12 import nixl_agent, nixl_agent_config  # type: ignore[import-not-found]
    else:
        from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found]
    return nixl_agent, nixl_agent_config


def _nixl_side(role: str, nbytes: int, repeats: int, conn: Any) -> None:
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        import torch
        nixl_agent, nixl_agent_config = _nixl_api()
        agent = nixl_agent(f"kvxferd-bench-{role}", nixl_agent_config(backends=["UCX"]))
        buf = torch.full((nbytes,), 3 if role == "initiator" else 0, dtype=torch.uint8)
        agent.register_memory([buf])
        descs = agent.get_xfer_descs([buf])
        if role == "target":
            conn.send((agent.get_agent_metadata(), agent.get_serialized_descs(descs)))
            conn.recv()  # initiator done
            conn.send(("ok", bool((buf == 3).all())))  # every byte the initiator wrote
            return
        meta, sdescs = conn.recv()
        peer = agent.add_remote_agent(meta)
        remote = agent.deserialize_descs(sdescs)
        times = []
        for r in range(repeats + 1):
            handle = agent.initialize_xfer("WRITE", descs, remote, peer, b"kvxferd-bench")
            t = time.perf_counter()
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                time.sleep(0.0001)  # leave the cores to UCX's progress threads (2-core machines)
                state = agent.check_xfer_state(handle)
            if state == "ERR":
                raise RuntimeError("NIXL transfer failed")
            if r:
                times.append(time.perf_counter() - t)
            agent.release_xfer_handle(handle)
        conn.send(("times", times))
    except Exception as exc:  # noqa: BLE001 - reported as a skipped row
        conn.send(("error", f"{type(exc).__name__}: {exc}"[:300]))


def _run_peer_pair(side: Any, label: str, nbytes: int, repeats: int) -> tuple[float | None, str | None]:
    """Start a peer engine's target then initiator process; GB/s of the best timed write."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    c, d = ctx.Pipe()
    target = ctx.Process(target=side, args=("target", nbytes, repeats, a), daemon=True)
    target.start()
    try:
        if not b.poll(120):
            return None, f"error: {label} target did not start"
        first = b.recv()
        if first and first[0] == "error":
            return None, f"error: {first[1]}"
        init = ctx.Process(target=side, args=("initiator", nbytes, repeats, c), daemon=True)
        init.start()
        d.send(first)
        if not d.poll(600):
            return None, f"error: {label} initiator timed out"
        kind, payload = d.recv()
        init.join(30)
        b.send("done")
        if kind != "times":
            return None, f"error: {payload}"
        ok = b.recv() if b.poll(30) else ("ok", False)
        if not ok[1]:
            return None, f"error: {label} moved wrong bytes"
        return nbytes / min(payload) / 1e9, None
    finally:
        target.join(5)
        if target.is_alive():
            target.kill()


def nixl_raw(nbytes: int, repeats: int) -> tuple[float | None, str | None]:
    if _find("nixl_cu12") is None and _find("nixl") is None:
        return None, "not installed"
    return _run_peer_pair(_nixl_side, "NIXL", nbytes, repeats)


def _mooncake_side(role: str, nbytes: int, repeats: int, conn: Any) -> None:
    try:
        import numpy as np
        from mooncake.engine import TransferEngine  # type: ignore[import-not-found]
        te = TransferEngine()
        if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("TransferEngine.initialize failed")
        buf = np.full(nbytes, 3 if role == "initiator" else 0, dtype=np.uint8)
        ptr = buf.ctypes.data
        if te.register_memory(ptr, nbytes) != 0:
            raise RuntimeError("register_memory failed")
        if role == "target":
            conn.send((f"127.0.0.1:{te.get_rpc_port()}", ptr))
            conn.recv()
            conn.send(("ok", bool((buf == 3).all())))
            return
        session, remote = conn.recv()
        times = []
        for r in range(repeats + 1):
            t = time.perf_counter()
            if te.transfer_sync_write(session, ptr, remote, nbytes) != 0:
                raise RuntimeError("transfer_sync_write failed")
            if r:
                times.append(time.perf_counter() - t)
        conn.send(("times", times))
    except Exception as exc:  # noqa: BLE001
        conn.send(("error", f"{type(exc).__name__}: {exc}"[:300]))


def mooncake_tcp(nbytes: int, repeats: int) -> tuple[float | None, str | None]:
    if _find("mooncake") is None or _find("mooncake.engine") is None:
        return None, "not installed"
    return _run_peer_pair(_mooncake_side, "Mooncake", nbytes, repeats)


def nixl_unavailable() -> str | None:
    """Why kvxferd cannot move bytes over NIXL here, or None when it can."""
    if all(_find(m) is None for m in ("nixl_cu12", "nixl_cu13", "nixl")):
        return "not installed"
    try:
        from ...ops.config import TRANSPORTS
    except ImportError:
        TRANSPORTS = ("tcp",)
    if "nixl" not in TRANSPORTS:
        return "this kvxferd build has no NIXL transport"
    return None


def _find(name: str) -> Any:
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None

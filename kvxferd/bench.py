"""``kvxferd bench``: throughput, latency and limits on loopback, every byte checked.

One invocation measures, on this machine:

- **limits**: a single-thread ``torch`` memcpy of the payload, a raw TCP stream between
  two processes (``sendall`` / ``recv_into``), and a one-copy through shared memory
  between two processes (``/dev/shm`` mapping -> private memory, and -> another mapping);
- **kvxferd** through real daemons (``python -m kvxferd serve``) and a real engine
  process (``python -m kvxferd.bench engine``): ``local`` (one daemon) and ``tcp`` (two
  daemons), ``direct`` and ``staged`` (``KVXFERD_PEER_MODE`` on the daemons), TP 1->1,
  2->1, 1->2, page-size mismatch, page size 1, MLA; one-page latency; small requests per
  second through a daemon pair;
- **peers** when installed: raw NIXL agent-to-agent over UCX/TCP and the Mooncake
  transfer engine over TCP (rows are skipped with a reason otherwise);
- **planner**: ``make_plan`` + ``request_segments`` for every writer of a 128k-token
  request on an 80-layer model.

The engine process allocates its ranks' caches in shared memory, registers them with
:class:`~kvxferd.client.EngineClient`, fills the prefill pages once from a seeded oracle
and then keeps a window of requests in flight, timing from the first ``send`` to the last
decode-side completion event. Before the timed run every destination page set is
written once (so the daemons' first-touch page faults are not timed); the page sets of
the checked requests are then reset to a canary, and after the run their bytes are
compared with the oracle, along with pages that were never destinations. A scenario
that moves a wrong byte is reported and makes the whole bench exit non-zero.

Targets are reported, never asserted.
"""

from __future__ import annotations

import importlib.util
import json
import math
import multiprocessing as mp
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

MiB = 1 << 20
GiB = 1 << 30
CANARY = 0xA5

#: model shapes (the KV cache only) modelled on public checkpoints
MODELS: dict[str, dict[str, Any]] = {
    # Llama-3-8B class: 32 layers, 8 KV heads (GQA), head_dim 128
    "8B": dict(attention="mha", num_layers=32, total_kv_heads=8, head_dim=128, dtype="bfloat16",
               model="gqa-8b"),
    # Llama-3-70B class: 80 layers, 8 KV heads
    "70B": dict(attention="mha", num_layers=80, total_kv_heads=8, head_dim=128, dtype="bfloat16",
                model="gqa-70b"),
    # DeepSeek-V3 class MLA: 61 layers, one 576-wide latent (512 + 64 rope) per token
    "MLA": dict(attention="mla", num_layers=61, head_dim=576, dtype="bfloat16", model="mla-61l"),
    # control-plane probe: as small as a page gets
    "tiny": dict(attention="mha", num_layers=2, total_kv_heads=1, head_dim=64, dtype="bfloat16",
                 model="tiny"),
}

TARGETS = {
    "tcp_vs_socket": 0.90,
    "local_vs_memcpy": 0.85,
    "tp_mismatch_vs_matched": 0.75,
    "one_page_p50_ms": 1.0,
    "small_requests_per_s": 5000.0,
    "plan_128k_ms": 10.0,
}


def token_bytes(model: str) -> int:
    m = MODELS[model]
    kinds = 1 if m["attention"] == "mla" else 2
    heads = 1 if m["attention"] == "mla" else m["total_kv_heads"]
    return m["num_layers"] * kinds * heads * m["head_dim"] * 2


def _size(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v >= 10 or v == int(v) else f"{v:.1f} {unit}"
    return f"{int(n)} B"


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


@dataclass(frozen=True)
class Workload:
    model: str
    tokens: int
    p_tp: int = 1
    d_tp: int = 1
    p_page: int = 16
    d_page: int = 16

    @property
    def label(self) -> str:
        parts = [self.model, _tokens(self.tokens)]
        if (self.p_tp, self.d_tp) != (1, 1) or self.model == "70B":
            parts.append(f"tp{self.p_tp}>{self.d_tp}")
        if self.p_page != self.d_page:
            parts.append(f"page{self.p_page}>{self.d_page}")
        elif self.p_page != 16:
            parts.append(f"page{self.p_page}")
        return " ".join(parts)

    @property
    def nbytes(self) -> int:
        """Bytes of one request's KV cache (what lands on the decode side, all ranks)."""
        return self.tokens * token_bytes(self.model)

    def specs(self) -> tuple[Any, Any]:
        from .geometry import InstanceSpec
        m = MODELS[self.model]
        return (InstanceSpec(tp_size=self.p_tp, page_size=self.p_page, **m),
                InstanceSpec(tp_size=self.d_tp, page_size=self.d_page, **m))


@dataclass
class Scenario:
    name: str
    kind: str  # throughput | latency | rate
    transport: str  # local | tcp
    mode: str  # direct | staged
    workload: Workload
    requests: int
    window: int
    verify: int = 2
    order: int = 0
    client: str = "sync"  # sync: EngineClient, one call at a time; async: AsyncEngineClient

    @property
    def gate(self) -> bool:
        return self.kind == "latency"


@dataclass
class Row:
    name: str
    group: str  # limit | kvxferd | latency | rate | peer | planner
    bytes: int | None = None
    gbps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    requests_per_s: float | None = None
    ms: float | None = None
    vs_limit: float | None = None
    limit: str | None = None
    vs_peer: float | None = None
    verified: bool | None = None
    skipped: str | None = None
    error: str | None = None
    transport: str | None = None
    mode: str | None = None
    moved_as: str | None = None
    workload: str | None = None
    requests: int | None = None
    seconds: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not d["extra"]:
            d.pop("extra")
        return d


def _say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


# -- the oracle ----------------------------------------------------------------------------

def _oracle(seed: int, layer: int, kind: int, n: int, width: int) -> Any:
    """``[n, width]`` uint8 of one layer and kind of the logical cache (all heads)."""
    import numpy as np
    import torch
    total = n * width
    words = np.random.default_rng([seed, layer, kind]).random(-(-total // 8))
    return torch.from_numpy(words.view(np.uint8)[:total]).view(n, width)


def _slots(pages: Any, page_size: int, n: int) -> Any:
    import numpy as np
    import torch
    t = np.arange(n)
    return torch.from_numpy(np.asarray(pages, dtype=np.int64)[t // page_size] * page_size + t % page_size)


def _head_bytes(spec: Any) -> int:
    return spec.head_dim * spec.bits // 8


def oracle_fill(cache: Any, geometry: Any, seed: int, pages: Any, n: int) -> None:
    """Write this rank's slice (its layers, its heads) of the logical cache into ``pages``."""
    import torch
    spec = geometry.spec
    hb = _head_bytes(spec)
    h0, h1 = geometry.heads
    rows = _slots(pages, spec.page_size, n)
    for layer in range(*geometry.layers):
        for k, kind in enumerate(spec.region_kinds):
            full = _oracle(seed, layer, k, n, spec.kv_heads * hb)
            table = cache.tensors[(layer, kind)].view(torch.uint8).reshape(-1, spec.row_bytes)
            table.index_copy_(0, rows, full[:, h0 * hb:h1 * hb].contiguous())


def oracle_check(cache: Any, geometry: Any, seed: int, pages: Any, n: int) -> int:
    """Bytes of this rank's ``pages`` that differ from its slice of the logical cache."""
    import torch
    spec = geometry.spec
    hb = _head_bytes(spec)
    h0, h1 = geometry.heads
    rows = _slots(pages, spec.page_size, n)
    bad = 0
    for layer in range(*geometry.layers):
        for k, kind in enumerate(spec.region_kinds):
            full = _oracle(seed, layer, k, n, spec.kv_heads * hb)
            table = cache.tensors[(layer, kind)].view(torch.uint8).reshape(-1, spec.row_bytes)
            got = table.index_select(0, rows)
            want = full[:, h0 * hb:h1 * hb]
            if not torch.equal(got, want):
                bad += int((got != want).sum())
    return bad


def _reset_pages(cache: Any, geometry: Any, pages: Any, value: int) -> None:
    import torch
    idx = torch.as_tensor(list(pages), dtype=torch.int64)
    for tensor in cache.tensors.values():
        tensor.view(torch.uint8).reshape(geometry.num_pages, -1).index_fill_(0, idx, value)


def _untouched(cache: Any, geometry: Any, pages: Any) -> int:
    import torch
    idx = torch.as_tensor(list(pages), dtype=torch.int64)
    bad = 0
    for tensor in cache.tensors.values():
        bad += int((tensor.view(torch.uint8).reshape(geometry.num_pages, -1).index_select(0, idx) != CANARY).sum())
    return bad


# -- the bench engine process ----------------------------------------------------------------

class _Rank:
    def __init__(self, role: str, geometry: Any, cache: Any) -> None:
        self.role, self.geometry, self.cache = role, geometry, cache
        self.client: Any = None
        self.rid = ""


class _Layout:
    """Page tables of one scenario: one prefill source set, rotating and checked decode sets."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        import numpy as np
        self.cfg = cfg
        self.wl = Workload(**cfg["workload"])
        self.pspec, self.dspec = self.wl.specs()
        self.n = self.wl.tokens
        self.window, self.total, self.n_verify = cfg["window"], cfg["requests"], cfg["verify"]
        self.seed = cfg["seed"]
        rng = np.random.default_rng(self.seed)
        p_need = -(-self.n // self.pspec.page_size)
        d_need = -(-self.n // self.dspec.page_size)
        self.p_pages = p_need + 4
        self.sets_n = self.window + self.n_verify
        self.d_pages = self.sets_n * d_need + 8
        self.src_pages = rng.permutation(self.p_pages)[:p_need].tolist()
        perm = rng.permutation(self.d_pages)
        self.sets = [perm[i * d_need:(i + 1) * d_need].tolist() for i in range(self.sets_n)]
        self.spare = perm[self.sets_n * d_need:].tolist()
        self.tag = cfg["tag"]
        self.pinst, self.dinst = f"{self.tag}-prefill", f"{self.tag}-decode"
        self.source_address = cfg.get("source_address")
        checked = {0, self.total - 1, *(self.total * (j + 1) // (self.n_verify + 1) for j in range(self.n_verify))}
        self.fixed = {i: self.window + j for j, i in enumerate(sorted(checked)[:self.n_verify])}

    def warmup_plan(self) -> list[tuple[str, int | None]]:
        return [(f"{self.tag}-warm-{k}", k) for k in range(self.sets_n)]

    def timed_plan(self) -> list[tuple[str, int | None]]:
        return [(f"{self.tag}-{i}", self.fixed.get(i)) for i in range(self.total)]

    def allocate(self) -> list[_Rank]:
        from .geometry import RankGeometry
        from .memory import allocate_cpu
        ranks = []
        for role, spec, num_pages in (("prefill", self.pspec, self.p_pages), ("decode", self.dspec, self.d_pages)):
            for tp in range(spec.tp_size):
                g = RankGeometry(spec, tp, 0, num_pages)
                cache = allocate_cpu(g, name=f"bench-{self.tag}-{role[0]}{tp}",
                                     fill=CANARY if role == "decode" else None)
                ranks.append(_Rank(role, g, cache))
        for r in ranks:
            if r.role == "prefill":
                oracle_fill(r.cache, r.geometry, self.seed, self.src_pages, self.n)
        return ranks

    def reset_checked(self, ranks: list[_Rank]) -> None:
        for k in range(self.window, self.sets_n):
            for r in ranks:
                if r.role == "decode":
                    _reset_pages(r.cache, r.geometry, self.sets[k], CANARY)

    def check(self, ranks: list[_Rank]) -> int:
        bad = 0
        for r in ranks:
            if r.role != "decode":
                continue
            for k in range(self.window, self.sets_n):
                bad += oracle_check(r.cache, r.geometry, self.seed, self.sets[k], self.n)
            bad += _untouched(r.cache, r.geometry, self.spare)
        return bad


def _summary(lay: _Layout, rounds: list[tuple[int, float]], lat: list[float]) -> dict[str, Any]:
    """Throughput of the best round (others on the machine only ever slow a round down) and overall."""
    per = lay.wl.nbytes
    rates = [n / sec for n, sec in rounds if sec > 0]
    total_n = sum(n for n, _ in rounds)
    total_s = sum(sec for _, sec in rounds)
    best = max(rates) if rates else None
    return {"requests": total_n, "seconds": total_s, "bytes": total_n * per,
            "gbps": best * per / 1e9 if best else None, "requests_per_s": best,
            "gbps_overall": total_n * per / total_s / 1e9 if total_s > 0 else None,
            "gbps_rounds": [round(r * per / 1e9, 3) for r in rates], "rps_rounds": [round(r, 1) for r in rates],
            "p50_ms": _pct(lat, 0.50) * 1e3 if lat else None, "p99_ms": _pct(lat, 0.99) * 1e3 if lat else None}


def _rounds(plan: list[Any], k: int) -> list[list[Any]]:
    k = max(1, min(k, len(plan)))
    return [plan[len(plan) * i // k:len(plan) * (i + 1) // k] for i in range(k)]


def _failure(ev: dict[str, Any]) -> dict[str, Any]:
    return {k: ev.get(k) for k in ("rank_id", "request_id", "state", "code", "reason")}


def engine_main(cfg: dict[str, Any]) -> dict[str, Any]:
    """Drive one scenario from inside an engine process; returns the result record."""
    import torch
    torch.set_num_threads(1)
    lay = _Layout(cfg)
    result: dict[str, Any] = {"verified": False, "bad_bytes": None, "failures": []}
    ranks: list[_Rank] = []
    t_setup = time.perf_counter()
    try:
        ranks = lay.allocate()
        if cfg.get("client") == "async":
            import asyncio
            asyncio.run(_engine_async(lay, ranks, result, t_setup))
        else:
            _engine_sync(lay, ranks, result, t_setup)
    except Exception as exc:  # noqa: BLE001 - reported to the orchestrator as a failed row
        result["error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        for r in ranks:
            r.cache.close()
    return result


def _finish(lay: _Layout, ranks: list[_Rank], result: dict[str, Any], missing_prefill: int) -> None:
    t_check = time.perf_counter()
    bad = lay.check(ranks)
    result["check_s"] = round(time.perf_counter() - t_check, 3)
    failures = result["failures"]
    result.update(bad_bytes=bad, checked_requests=lay.n_verify, missing_prefill_events=missing_prefill,
                  verified=bad == 0 and not failures and missing_prefill == 0)


def _engine_sync(lay: _Layout, ranks: list[_Rank], result: dict[str, Any], t_setup: float) -> None:
    """One :class:`EngineClient` per rank, calls one at a time, a window of requests in flight."""
    import zmq

    from . import protocol
    from .client import MAX_REPLY, DaemonError, EngineClient
    cfg = lay.cfg
    try:
        for r in ranks:
            r.client = EngineClient(cfg["prefill_socket" if r.role == "prefill" else "decode_socket"], timeout=60)
            r.rid = r.client.register(lay.pinst if r.role == "prefill" else lay.dinst, r.role, r.geometry,
                                      r.cache.descriptors())
        prefill = [r for r in ranks if r.role == "prefill"]
        decode = [r for r in ranks if r.role == "decode"]
        by_rid = {r.rid: r for r in ranks}
        poller = zmq.Poller()
        for r in ranks:
            poller.register(r.client.sock, zmq.POLLIN)
        result["setup_s"] = round(time.perf_counter() - t_setup, 3)
        failures: list[dict[str, Any]] = result["failures"]
        prefill_done: dict[str, int] = {}

        def events(timeout_ms: int) -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = []
            for r in ranks:
                while r.client.events:
                    out.append(r.client.events.pop(next(iter(r.client.events))))
            if out:
                return out
            ready = dict(poller.poll(timeout_ms))
            for r in ranks:
                if r.client.sock in ready:
                    while True:
                        try:
                            raw = r.client.sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        msg = protocol.decode(raw, MAX_REPLY)
                        if msg.get("op") == "event":
                            out.append(msg)
            return out

        def wait_known(req: str) -> None:
            # latency is timed from `send`: first let the prefill side learn the destination
            deadline = time.monotonic() + 30
            for r in prefill:
                while True:
                    try:
                        r.client.call("poll", rank_id=r.rid, request_id=req)
                        break
                    except DaemonError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.0002)

        def run(plan: list[tuple[str, int | None]], stall_s: float = 120.0) -> tuple[float, list[float]]:
            free = deque(range(lay.window))
            pending: dict[str, dict[str, Any]] = {}
            latencies: list[float] = []
            first = last = None
            i = done = 0
            last_progress = time.monotonic()
            while done < len(plan):
                while i < len(plan) and len(pending) < lay.window:
                    req, fixed = plan[i]
                    set_idx = fixed if fixed is not None else free.popleft()
                    for r in decode:
                        r.client.expect(r.rid, req, source_instance=lay.pinst, source_address=lay.source_address,
                                        pages=lay.sets[set_idx], num_tokens=lay.n)
                    if cfg["gate"]:
                        wait_known(req)
                    t_send = time.perf_counter()
                    for r in prefill:
                        r.client.send(r.rid, req, pages=lay.src_pages, start=0, end=lay.n, last=True, aux=b"tok")
                    first = first if first is not None else t_send
                    pending[req] = {"set": set_idx, "rotating": fixed is None, "t": t_send,
                                    "left": {r.rid for r in decode}}
                    i += 1
                for ev in events(200):
                    rank = by_rid.get(ev.get("rank_id"))
                    req = ev.get("request_id")
                    if rank is None:
                        continue
                    if ev.get("state") != "done":
                        failures.append(_failure(ev))
                    if rank.role == "prefill":
                        prefill_done[req] = prefill_done.get(req, 0) + 1
                        continue
                    info = pending.get(req)
                    if info is None:
                        continue
                    info["left"].discard(rank.rid)
                    if not info["left"]:
                        now = time.perf_counter()
                        latencies.append(now - info["t"])
                        last = now
                        if info["rotating"]:
                            free.append(info["set"])
                        del pending[req]
                        done += 1
                        last_progress = time.monotonic()
                if time.monotonic() - last_progress > stall_s:
                    raise TimeoutError(f"no request finished for {stall_s:.0f}s; {len(pending)} pending")
            return ((last or 0.0) - (first or 0.0)), latencies

        t_warm = time.perf_counter()
        run(lay.warmup_plan())
        lay.reset_checked(ranks)
        result["warmup_s"] = round(time.perf_counter() - t_warm, 3)
        if failures:
            raise RuntimeError("warm-up requests failed")
        plan = lay.timed_plan()
        rounds, lat = [], []
        for part in _rounds(plan, cfg.get("rounds", 1)):
            seconds, part_lat = run(part)
            rounds.append((len(part), seconds))
            lat += part_lat
        result.update(_summary(lay, rounds, lat))
        want = [req for req, _ in plan]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(prefill_done.get(q, 0) for q in want) < len(want) * len(prefill):
            for ev in events(200):
                if ev.get("state") != "done":
                    failures.append(_failure(ev))
                rank = by_rid.get(ev.get("rank_id"))
                if rank is not None and rank.role == "prefill":
                    prefill_done[ev["request_id"]] = prefill_done.get(ev["request_id"], 0) + 1
        _finish(lay, ranks, result, len(want) * len(prefill) - sum(prefill_done.get(q, 0) for q in want))
    finally:
        for r in ranks:
            if r.client is not None:
                try:
                    if r.rid:
                        r.client.unregister(r.rid)
                except Exception:  # noqa: BLE001 - the daemon may be gone
                    pass
                r.client.close()


async def _engine_async(lay: _Layout, ranks: list[_Rank], result: dict[str, Any], t_setup: float) -> None:
    """One :class:`AsyncEngineClient` per rank; every in-flight request has its calls in flight too."""
    import asyncio

    from .client import AsyncEngineClient
    cfg = lay.cfg
    try:
        for r in ranks:
            r.client = AsyncEngineClient(cfg["prefill_socket" if r.role == "prefill" else "decode_socket"],
                                         timeout=60)
            r.rid = await r.client.register(lay.pinst if r.role == "prefill" else lay.dinst, r.role, r.geometry,
                                            r.cache.descriptors())
        prefill = [r for r in ranks if r.role == "prefill"]
        decode = [r for r in ranks if r.role == "decode"]
        result["setup_s"] = round(time.perf_counter() - t_setup, 3)
        failures: list[dict[str, Any]] = result["failures"]

        async def run(plan: list[tuple[str, int | None]]) -> tuple[float, list[float]]:
            free = deque(range(lay.window))
            sem = asyncio.Semaphore(lay.window)
            latencies: list[float] = []
            marks: list[float] = []

            async def one(req: str, fixed: int | None) -> None:
                async with sem:
                    set_idx = fixed if fixed is not None else free.popleft()
                    try:
                        await asyncio.gather(*(r.client.expect(
                            r.rid, req, source_instance=lay.pinst, source_address=lay.source_address,
                            pages=lay.sets[set_idx], num_tokens=lay.n) for r in decode))
                        t_send = time.perf_counter()
                        marks.append(t_send)
                        await asyncio.gather(*(r.client.send(r.rid, req, pages=lay.src_pages, start=0, end=lay.n,
                                                             last=True, aux=b"tok") for r in prefill))
                        evs = await asyncio.gather(*(r.client.wait(r.rid, req, timeout=120) for r in decode))
                        now = time.perf_counter()
                        marks.append(now)
                        latencies.append(now - t_send)
                        failures.extend(_failure(ev) for ev in evs if ev.get("state") != "done")
                    except Exception as exc:  # noqa: BLE001
                        failures.append({"request_id": req, "error": f"{type(exc).__name__}: {exc}"[:200]})
                    finally:
                        if fixed is None:
                            free.append(set_idx)

            await asyncio.gather(*(one(req, fixed) for req, fixed in plan))
            return (max(marks) - min(marks)) if marks else 0.0, latencies

        t_warm = time.perf_counter()
        await run(lay.warmup_plan())
        lay.reset_checked(ranks)
        result["warmup_s"] = round(time.perf_counter() - t_warm, 3)
        if failures:
            raise RuntimeError("warm-up requests failed")
        plan = lay.timed_plan()
        rounds, lat = [], []
        for part in _rounds(plan, cfg.get("rounds", 1)):
            seconds, part_lat = await run(part)
            rounds.append((len(part), seconds))
            lat += part_lat
        result.update(_summary(lay, rounds, lat))
        # each prefill rank reports every request once its pages are free
        deadline = time.monotonic() + 60
        missing = 0
        for r in prefill:
            for req, _ in plan:
                try:
                    ev = await r.client.wait(r.rid, req, timeout=max(0.1, deadline - time.monotonic()))
                    if ev.get("state") != "done":
                        failures.append(_failure(ev))
                except Exception:  # noqa: BLE001
                    missing += 1
        _finish(lay, ranks, result, missing)
    finally:
        for r in ranks:
            if r.client is not None:
                try:
                    if r.rid:
                        await r.client.call("unregister", rank_id=r.rid)
                except Exception:  # noqa: BLE001
                    pass
                r.client.close()


# -- limits ----------------------------------------------------------------------------------

def memcpy_limit(nbytes: int, repeats: int) -> float:
    """Best GB/s of a single-thread torch copy between two private buffers."""
    import torch
    torch.set_num_threads(1)
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(2)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return nbytes / min(times) / 1e9


def _sock_sink(port_q: Any, nbytes: int, repeats: int) -> None:
    import numpy as np
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = np.ones(nbytes, dtype=np.uint8)
    view = memoryview(buf)
    for _ in range(repeats + 1):
        got = 0
        while got < nbytes:
            k = conn.recv_into(view[got:], nbytes - got)
            if k == 0:
                return
            got += k
        conn.sendall(b"k")
    conn.close()
    srv.close()


def socket_limit(nbytes: int, repeats: int) -> float:
    """Best GB/s of one ``sendall`` of the payload to another process (acked) on loopback."""
    import numpy as np
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_sock_sink, args=(q, nbytes, repeats), daemon=True)
    proc.start()
    try:
        port = q.get(timeout=60)
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = memoryview(np.full(nbytes, 7, dtype=np.uint8))
        times = []
        for r in range(repeats + 1):
            t = time.perf_counter()
            sock.sendall(payload)
            if sock.recv(1) != b"k":
                raise ConnectionError("socket sink closed early")
            if r:
                times.append(time.perf_counter() - t)
        sock.close()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return nbytes / min(times) / 1e9


def _shm_reader(path: str, path2: str, nbytes: int, repeats: int, out_q: Any) -> None:
    import mmap

    import numpy as np
    import torch
    torch.set_num_threads(1)

    def mapped(p: str) -> Any:
        fd = os.open(p, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return mm, torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))

    _mm1, src = mapped(path)
    _mm2, shared_dst = mapped(path2)
    private = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    res = {}
    for name, dst in (("private", private), ("shared", shared_dst)):
        dst.copy_(src)  # first touch of this process's page tables, untimed
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
        res[name] = nbytes / min(times) / 1e9
    out_q.put(res)


def shm_limit(nbytes: int, repeats: int) -> dict[str, float]:
    """One process writes a /dev/shm mapping; another copies it (to private and to shared memory)."""
    import mmap

    import numpy as np
    paths = []
    maps = []
    try:
        for _ in range(2):
            fd, path = tempfile.mkstemp(prefix="kvxferd-bench-", dir="/dev/shm")
            paths.append(path)
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            os.close(fd)
            np.frombuffer(mm, dtype=np.uint8)[:] = 0x5A  # the writer's side
            maps.append(mm)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        proc = ctx.Process(target=_shm_reader, args=(paths[0], paths[1], nbytes, repeats, q), daemon=True)
        proc.start()
        res = q.get(timeout=300)
        proc.join(30)
        return res
    finally:
        for p in paths:
            try:
                os.unlink(p)
            except OSError:
                pass


# -- peers (optional engines) ----------------------------------------------------------------

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
        from .config import TRANSPORTS
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


# -- planner -----------------------------------------------------------------------------------

def planner_bench(runs: int, p_tp: int, d_tp: int, tokens: int = 128 * 1024) -> dict[str, Any]:
    """Median ms of make_plan + request_segments for every writer of one request."""
    import numpy as np

    from .geometry import InstanceSpec
    from .planner import make_plan
    from .segments import request_segments
    m = MODELS["70B"]
    p = InstanceSpec(tp_size=p_tp, page_size=16, **m)
    d = InstanceSpec(tp_size=d_tp, page_size=16, **m)
    rng = np.random.default_rng(7)
    pages = tokens // 16
    src = rng.permutation(pages + 1024)[:pages].astype(np.int64)
    dst = rng.permutation(pages + 1024)[:pages].astype(np.int64)
    times = []
    segments = 0
    for _ in range(runs + 1):
        t = time.perf_counter()
        plan = make_plan(p, d)
        segments = 0
        for dest in plan.destinations:
            for w in dest.writers:
                segments += len(request_segments(w, src, 16, 0, dst, 16, 0, tokens))
        times.append(time.perf_counter() - t)
    times = times[1:]
    return {"ms": statistics.median(times) * 1e3, "best_ms": min(times) * 1e3, "segments": segments, "writers":
            sum(len(dd.writers) for dd in plan.destinations), "mode": plan.mode}


# -- orchestration -----------------------------------------------------------------------------

class DaemonPool:
    """Daemons for one (transport, mode) at a time, restarted when they held too much memory.

    A daemon keeps the mappings of ranks that unregistered, so they are recycled once the
    bytes registered through them pass ``recycle_bytes``.
    """

    def __init__(self, root: Path, recycle_bytes: int) -> None:
        from .sim import Cluster
        self.cluster = Cluster(root=root)
        self.recycle_bytes = recycle_bytes
        self.key: tuple[str, str] | None = None
        self.prefill: Any = None
        self.decode: Any = None
        self.held = 0
        self.count = 0

    def get(self, transport: str, mode: str, nbytes: int) -> tuple[Any, Any]:
        if self.key != (transport, mode) or self.held + nbytes > self.recycle_bytes:
            self.stop()
            env = {"KVXFERD_PEER_MODE": mode, "KVXFERD_DAEMON_LOG_LEVEL": "info",
                   "KVXFERD_PEER_HEARTBEAT_INTERVAL_S": "1.0", "KVXFERD_PEER_PEER_TIMEOUT_S": "10"}
            if transport == "nixl":  # the same UCX setup as the raw NIXL peer row
                env.update(KVXFERD_PEER_TRANSPORT="nixl", UCX_TLS="tcp", UCX_NET_DEVICES="lo", NIXL_LOG_LEVEL="WARN")
            self.count += 1
            _say(f"starting {'one daemon' if transport == 'local' else 'a daemon pair'} (mode={mode})")
            self.prefill = self.cluster.daemon(f"b{self.count}-prefill", env=env)
            self.decode = self.prefill if transport == "local" else self.cluster.daemon(f"b{self.count}-decode",
                                                                                            env=env)
            self.key = (transport, mode)
            self.held = 0
        self.held += nbytes
        return self.prefill, self.decode

    def logs(self) -> str:
        out = []
        for d in {id(x): x for x in (self.prefill, self.decode) if x is not None}.values():
            out.append(d.log()[-1500:])
        return "\n".join(out)

    def stop(self) -> None:
        for d in {id(x): x for x in (self.prefill, self.decode) if x is not None}.values():
            d.stop()
        self.prefill = self.decode = None
        self.key = None


def _chunk_counts(metrics_url: str) -> dict[str, float]:
    try:
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for m in re.finditer(r'^kvxferd_chunks_total\{([^}]*)\}\s+([0-9.e+]+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        key = f'{labels.get("transport", "?")}/{labels.get("mode", "?")}'
        out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) a live process has used."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def _machine_busy() -> float:
    """CPU seconds all cores have spent in user and system time since boot.

    Interrupt and softirq time is left out: loopback TCP is processed there and is charged
    to no process, so it would count our own traffic as somebody else's.
    """
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return (v[0] + v[1] + v[2] + v[7]) / _TICK  # user, nice, system, steal
    except (OSError, ValueError, IndexError):
        return 0.0


def _children_cpu() -> float:
    import resource
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _tag(sc: Scenario) -> str:
    """Names the scenario's instances and cache files; unique per bench process, so its files can be
    told from those of another bench running beside it."""
    return f"b{os.getpid()}s{sc.order}"


def _run_engine(cfg: dict[str, Any], timeout: float) -> tuple[int, str, str]:
    """Run one scenario's engine process. However this ends (timeout, a signal to the bench), the
    engine is stopped with SIGTERM first, so it unlinks its caches, and any cache file it could
    not unlink (killed) is removed here."""
    proc = subprocess.Popen([sys.executable, "-m", "kvxferd.bench", "engine", json.dumps(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stdout, stderr
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for path in Path("/dev/shm").glob(f"kvxferd-bench-{cfg['tag']}-*"):
            path.unlink(missing_ok=True)


def run_scenario(sc: Scenario, pool: DaemonPool, seed: int, timeout: float, quiet_wait: float = 0.0,
                 rounds: int = 3) -> Row:
    wl = sc.workload
    pspec, dspec = wl.specs()
    sets = sc.window + sc.verify
    registered = (sc.workload.nbytes * (sets + 1))
    pd, dd = pool.get(sc.transport, sc.mode, registered)
    before = _chunk_counts(pd.metrics_url)
    waited = wait_quiet(quiet_wait) if quiet_wait > 0 else 0.0
    adjacent = None
    if sc.kind == "throughput" and sc.transport in ("local", "tcp"):
        # the limit measured right before the scenario, so that both see the same machine
        reps = max(5, min(64, -(-GiB // wl.nbytes)))
        adjacent = memcpy_limit(wl.nbytes, reps) if sc.transport == "local" else socket_limit(wl.nbytes, reps)
    cfg = {"workload": asdict(wl), "window": sc.window, "requests": sc.requests, "verify": sc.verify,
           "gate": sc.gate, "seed": seed, "tag": _tag(sc), "client": sc.client, "rounds": rounds,
           "prefill_socket": pd.socket_path, "decode_socket": dd.socket_path,
           "source_address": None if sc.transport == "local" else pd.address}
    row = Row(sc.name, {"throughput": "kvxferd", "latency": "latency", "rate": "rate"}[sc.kind],
              bytes=wl.nbytes, transport=sc.transport, mode=sc.mode, workload=wl.label, requests=sc.requests,
              extra={"client": sc.client} if sc.kind == "rate" else {})
    t = time.perf_counter()
    daemons = {"prefill": pd, "decode": dd} if dd is not pd else {"daemon": pd}
    cpu0 = {k: _proc_cpu(d.proc.pid) for k, d in daemons.items()}
    busy0, child0, own0 = _machine_busy(), _children_cpu(), time.process_time()
    try:
        returncode, stdout, stderr = _run_engine(cfg, timeout)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        res = json.loads(lines[-1]) if lines else {"error": f"engine exited {returncode}: {stderr.strip()[-400:]}"}
    except subprocess.TimeoutExpired:
        res = {"error": f"engine timed out after {timeout:.0f}s"}
    wall = time.perf_counter() - t
    daemon_cpu = {k: round(_proc_cpu(d.proc.pid) - cpu0[k], 3) for k, d in daemons.items()}
    engine_cpu = _children_cpu() - child0
    busy = _machine_busy() - busy0
    ours = sum(daemon_cpu.values()) + engine_cpu + (time.process_time() - own0)
    row.extra["daemon_cpu_s"] = daemon_cpu
    if adjacent is not None:
        row.extra["adjacent_limit_gbps"] = round(adjacent, 3)
    if waited:
        row.extra["waited_for_quiet_s"] = waited
    row.extra["engine_cpu_s"] = round(engine_cpu, 3)
    # CPU time other processes on this machine took while the scenario ran: noise to read with the row
    row.extra["others_cpu_pct"] = round(max(0.0, busy - ours) / (wall * (os.cpu_count() or 1)) * 100, 1)
    moved_requests = sc.requests + sc.window + sc.verify
    row.extra["daemon_cpu_ms_per_request"] = round(sum(daemon_cpu.values()) / moved_requests * 1e3, 3)
    if sc.kind == "throughput":
        row.extra["daemon_cpu_s_per_gb"] = round(sum(daemon_cpu.values()) / (moved_requests * wl.nbytes / 1e9), 3)
    after = _chunk_counts(pd.metrics_url)
    moved = [k for k in sorted(after) if after[k] - before.get(k, 0.0) > 0]
    row.moved_as = "+".join(k.split("/", 1)[1] for k in moved) if moved else None
    row.extra["moved"] = "+".join(moved) if moved else None
    if sc.transport == "nixl" and moved and not all(k.startswith("nixl/") for k in moved):
        row.error = ((row.error or "") + f" configured for nixl but chunks moved as {row.extra['moved']}").strip()
    row.verified = bool(res.get("verified"))
    if res.get("error") or res.get("failures"):
        row.error = (res.get("error") or "") + (f" failures: {res['failures'][:3]}" if res.get("failures") else "")
        row.error = row.error.strip()[:600]
        logs = pool.logs().strip()
        if logs:
            row.extra["daemon_log_tail"] = logs[-1200:]
        pool.stop()  # do not reuse daemons that saw a failure
    if res.get("bad_bytes"):
        row.extra["bad_bytes"] = res["bad_bytes"]
        row.verified = False
        row.error = ((row.error or "") + f" {res['bad_bytes']} destination bytes differ from the oracle").strip()
    row.seconds = res.get("seconds")
    row.extra.update({k: res[k] for k in ("setup_s", "warmup_s", "check_s", "checked_requests", "gbps_overall",
                                          "gbps_rounds", "rps_rounds") if k in res})
    if sc.kind == "throughput":
        row.gbps = res.get("gbps")
    if sc.kind == "rate":
        row.requests_per_s = res.get("requests_per_s")
    row.p50_ms = res.get("p50_ms")
    row.p99_ms = res.get("p99_ms")
    status = "ok" if row.verified else "FAILED"
    value = (f"{row.gbps:.2f} GB/s" if row.gbps else f"{row.requests_per_s:,.0f} req/s" if row.requests_per_s
             else f"p50 {row.p50_ms:.3f} ms" if row.p50_ms else "-")
    _say(f"  {sc.name}: {value}  bytes {status}  ({time.perf_counter() - t:.1f}s)"
         + (f"  error: {row.error[:200]}" if row.error else ""))
    return row


def build_scenarios(quick: bool) -> list[Scenario]:
    out: list[Scenario] = []

    def add(kind: str, transport: str, mode: str, wl: Workload, requests: int | None = None,
            window: int | None = None, verify: int = 2, client: str = "sync") -> None:
        if requests is None:
            budget = (384 * MiB) if quick else (6 * GiB)
            requests = max(4 if quick else 6, min(64, -(-budget // wl.nbytes)))
        if window is None:
            window = 2 if wl.nbytes >= GiB else 3 if wl.nbytes >= 384 * MiB else 4
        if kind == "throughput":
            name = f"{transport} {mode} {wl.label}"
        elif kind == "latency":
            name = f"latency 1 page {transport} {wl.model}"
        else:
            name = f"small requests {transport} {wl.model} {client} client"
        out.append(Scenario(name, kind, transport, mode, wl, requests, window, verify, len(out), client))

    modes = ("direct", "staged")
    if quick:
        gqa = Workload("8B", 256)
        for t, m in (("local", "direct"), ("local", "staged"), ("tcp", "direct"), ("tcp", "staged")):
            add("throughput", t, m, gqa)
        add("throughput", "tcp", "direct", Workload("8B", 256, p_page=1, d_page=1))
        add("throughput", "tcp", "direct", Workload("8B", 256, d_page=32))
        for p_tp, d_tp in ((1, 1), (2, 1), (1, 2)):
            add("throughput", "tcp", "direct", Workload("70B", 128, p_tp, d_tp))
        add("throughput", "tcp", "direct", Workload("MLA", 256))
        for t in ("local", "tcp"):
            for model in ("8B", "tiny"):
                add("latency", t, "direct", Workload(model, 16), requests=40, window=1, verify=1)
        for client in ("sync", "async"):
            add("rate", "tcp", "direct", Workload("tiny", 16), requests=400, window=64, client=client)
        return out
    for tokens in (1024, 4096, 16384):
        wl = Workload("8B", tokens)
        add("throughput", "local", "direct", wl)
        if tokens == 4096:
            add("throughput", "local", "staged", wl)
        for m in modes:
            add("throughput", "tcp", m, wl)
    for wl in (Workload("8B", 1024, p_page=1, d_page=1), Workload("8B", 4096, d_page=32),
               Workload("8B", 1024, d_page=1), Workload("MLA", 4096)):
        add("throughput", "local", "direct", wl)
        for m in modes:
            add("throughput", "tcp", m, wl)
    for p_tp, d_tp in ((1, 1), (2, 1), (1, 2)):
        wl = Workload("70B", 2048, p_tp, d_tp)
        for t in ("local", "tcp"):
            for m in modes:
                add("throughput", t, m, wl)
    # kvxferd's NIXL transport (UCX over TCP), next to the raw NIXL agent row
    add("throughput", "nixl", "direct", Workload("8B", 4096))
    for p_tp, d_tp in ((2, 1), (1, 2)):  # sliced plans: one descriptor per head slice vs staged blocks
        for m in modes:
            add("throughput", "nixl", m, Workload("70B", 2048, p_tp, d_tp))
    for t in ("local", "tcp"):
        for model in ("8B", "tiny"):
            add("latency", t, "direct", Workload(model, 16), requests=400, window=1, verify=1)
    for t in ("local", "tcp"):
        for client in ("sync", "async"):
            add("rate", t, "direct", Workload("tiny", 16), requests=4000, window=64, client=client)
    return out


def wait_quiet(max_wait: float, threshold_pct: float = 25.0) -> float:
    """Wait (at most ``max_wait`` s) until other processes leave the CPUs mostly idle.

    Between measurements nothing of ours runs, so the busy share of a one-second sample is
    somebody else's. Returns the seconds waited.
    """
    t0 = time.monotonic()
    while True:
        busy0, t = _machine_busy(), time.perf_counter()
        time.sleep(1.0)
        pct = (_machine_busy() - busy0) / ((time.perf_counter() - t) * (os.cpu_count() or 1)) * 100
        waited = time.monotonic() - t0
        if pct <= threshold_pct or waited >= max_wait:
            return round(waited, 1)


class _Noise:
    """Share of the machine's CPU that processes other than ours used during a measurement."""

    def __enter__(self) -> "_Noise":
        self.t, self.busy, self.child, self.own = (time.perf_counter(), _machine_busy(), _children_cpu(),
                                                   time.process_time())
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self.t
        ours = (_children_cpu() - self.child) + (time.process_time() - self.own)
        self.pct = round(max(0.0, _machine_busy() - self.busy - ours) / (wall * (os.cpu_count() or 1)) * 100, 1)


def _limit_rows(sizes: list[int], quick: bool) -> list[Row]:
    rows = []
    for nbytes in sizes:
        repeats = max(5, min(64, -(-GiB // nbytes))) if quick else max(5, min(20, -(-8 * GiB // nbytes)))
        if not quick:
            wait_quiet(10.0)
        _say(f"limits at {_size(nbytes)} (best of {repeats})")
        with _Noise() as noise:
            gbps = memcpy_limit(nbytes, repeats)
        rows.append(Row(f"limit memcpy 1 thread {_size(nbytes)}", "limit", bytes=nbytes, gbps=gbps,
                        extra={"limit": "memcpy", "others_cpu_pct": noise.pct}))
        with _Noise() as noise:
            gbps = socket_limit(nbytes, repeats)
        rows.append(Row(f"limit tcp socket 2 procs {_size(nbytes)}", "limit", bytes=nbytes, gbps=gbps,
                        extra={"limit": "socket", "others_cpu_pct": noise.pct}))
        with _Noise() as noise:
            shm = shm_limit(nbytes, repeats)
        rows.append(Row(f"limit shm->private copy 2 procs {_size(nbytes)}", "limit", bytes=nbytes,
                        gbps=shm["private"], extra={"limit": "shm_private", "others_cpu_pct": noise.pct}))
        rows.append(Row(f"limit shm->shm copy 2 procs {_size(nbytes)}", "limit", bytes=nbytes,
                        gbps=shm["shared"], extra={"limit": "shm_shared", "others_cpu_pct": noise.pct}))
        for r in rows[-4:]:
            _say(f"  {r.name}: {r.gbps:.2f} GB/s")
    return rows


def _peer_rows(sizes: list[int], quick: bool) -> list[Row]:
    rows = []
    for nbytes in sizes:
        repeats = 3 if quick else 5
        for name, fn in (("peer nixl ucx-tcp", nixl_raw), ("peer mooncake tcp", mooncake_tcp)):
            _say(f"{name} {_size(nbytes)}")
            with _Noise() as noise:
                try:
                    gbps, why = fn(nbytes, repeats)
                except Exception as exc:  # noqa: BLE001
                    gbps, why = None, f"error: {type(exc).__name__}: {exc}"[:300]
            rows.append(Row(f"{name} {_size(nbytes)}", "peer", bytes=nbytes, gbps=gbps, skipped=why,
                            extra={"peer": name.split()[1], **({"others_cpu_pct": noise.pct} if gbps else {})}))
            if gbps:
                _say(f"  {rows[-1].name}: {gbps:.2f} GB/s")
    return rows


def _find_row(rows: list[Row], pred: Callable[[Row], bool]) -> Row | None:
    for r in rows:
        if pred(r):
            return r
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def compute(rows: list[Row], headline: Workload, tp_workloads: list[Workload]) -> dict[str, Any]:
    limits = {(r.extra.get("limit"), r.bytes): r.gbps for r in rows if r.group == "limit"}
    peers = [r for r in rows if r.group == "peer" and r.gbps]

    def peer_at(name: str, nbytes: int | None) -> float | None:
        r = _find_row(rows, lambda x: x.group == "peer" and x.extra.get("peer") == name and x.bytes == nbytes)
        return r.gbps if r else None

    for r in rows:
        if r.group != "kvxferd" or not r.gbps or not r.verified:
            continue
        if r.transport == "nixl":
            lim = peer_at("nixl", r.bytes)
            kind = "raw nixl"
        else:
            kind = "memcpy" if r.transport == "local" else "socket"
            lim = r.extra.get("adjacent_limit_gbps") or limits.get((kind, r.bytes))
        r.limit = kind
        r.vs_limit = _ratio(r.gbps, lim)
        same = [p.gbps for p in peers if p.bytes == r.bytes] or [p.gbps for p in peers]
        r.vs_peer = _ratio(r.gbps, max(same)) if same else None

    def best(transport: str, wl: Workload, mode: str | None = None) -> float | None:
        vals = [r.gbps for r in rows if r.group == "kvxferd" and r.verified and r.gbps and r.transport == transport
                and r.workload == wl.label and (mode is None or r.mode == mode)]
        return max(vals) if vals else None

    hb = headline.nbytes
    tcp_row = _find_row(rows, lambda r: r.group == "kvxferd" and r.verified and r.transport == "tcp"
                        and r.mode == "direct" and r.workload == headline.label and bool(r.gbps))
    local_row = _find_row(rows, lambda r: r.group == "kvxferd" and r.verified and r.transport == "local"
                          and r.mode == "direct" and r.workload == headline.label and bool(r.gbps))
    tcp_head = tcp_row.gbps if tcp_row else None
    local_head = local_row.gbps if local_row else None
    nixl_head = best("nixl", headline)

    def tp_ratio(transport: str) -> float | None:
        matched = [w for w in tp_workloads if w.p_tp == w.d_tp]
        mism = [w for w in tp_workloads if w.p_tp != w.d_tp]
        m = best(transport, matched[0]) if matched else None
        worst = [best(transport, w) for w in mism]
        if not m or not worst or any(v is None for v in worst):
            return None
        return _ratio(min(v for v in worst if v is not None), m)

    nixl = peer_at("nixl", hb)
    mooncake = peer_at("mooncake", hb)
    ratios = {
        # against the limit measured right before the scenario (same machine state)
        "tcp_vs_socket": tcp_row.vs_limit if tcp_row else None,
        "local_vs_memcpy": local_row.vs_limit if local_row else None,
        "local_vs_shm_copy": _ratio(local_head, limits.get(("shm_shared", hb))),
        "tp_mismatch_vs_matched": tp_ratio("tcp"),
        "tp_mismatch_vs_matched_local": tp_ratio("local"),
        "nixl_vs_raw_nixl": _ratio(nixl_head, nixl),
        "vs_nixl_ucx_tcp": _ratio(tcp_head, nixl),
        "vs_mooncake_tcp": _ratio(tcp_head, mooncake),
    }
    return ratios


def targets_report(rows: list[Row], ratios: dict[str, Any]) -> list[dict[str, Any]]:
    out = []

    def add(name: str, value: float | None, target: float, higher: bool, unit: str = "") -> None:
        met = None if value is None else (value >= target if higher else value <= target)
        out.append({"target": name, "value": value, "goal": f"{'>=' if higher else '<='} {target:g}{unit}",
                    "met": met})

    add("tcp_vs_socket", ratios["tcp_vs_socket"], TARGETS["tcp_vs_socket"], True, "x")
    add("local_vs_memcpy", ratios["local_vs_memcpy"], TARGETS["local_vs_memcpy"], True, "x")
    add("tp_mismatch_vs_matched", ratios["tp_mismatch_vs_matched"], TARGETS["tp_mismatch_vs_matched"], True, "x")
    for r in rows:
        if r.group == "latency" and r.p50_ms is not None:
            model = (r.workload or "").split()[0]
            add(f"one_page_p50_ms ({r.transport}, {model})", round(r.p50_ms, 3), TARGETS["one_page_p50_ms"], False,
                " ms")
    for r in rows:
        if r.group == "rate" and r.requests_per_s is not None and r.transport == "tcp":
            add(f"small_requests_per_s (tcp pair, {r.extra.get('client', 'sync')} client)", round(r.requests_per_s),
                TARGETS["small_requests_per_s"], True)
    for r in rows:
        if r.group == "planner" and r.ms is not None and r.extra.get("headline"):
            add("plan_128k_ms", round(r.ms, 3), TARGETS["plan_128k_ms"], False, " ms")
    return out


def render_table(rows: list[Row]) -> str:
    head = ("scenario", "bytes/req", "GB/s", "x limit", "x peer", "p50 ms", "p99 ms", "other", "others' CPU",
            "bytes ok")
    lines = [head]

    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for r in rows:
        other = ""
        if r.requests_per_s is not None:
            other = f"{r.requests_per_s:,.0f} req/s"
        elif r.ms is not None:
            other = f"{r.ms:.2f} ms"
        if r.moved_as and r.group == "kvxferd" and r.moved_as != r.mode:
            other = (other + " " if other else "") + f"moved {r.moved_as}"
        if r.extra.get("first_attempt_error"):
            other = (other + " " if other else "") + "retried"
        check = ("skipped: " + r.skipped) if r.skipped else (
            "-" if r.verified is None else "yes" if r.verified else "FAILED")
        lim = f"{r.vs_limit:.2f} {r.limit}" if r.vs_limit is not None else "-"
        noise = r.extra.get("others_cpu_pct")
        lines.append((r.name, _size(r.bytes) if r.bytes else "-", f(r.gbps, ".2f"), lim, f(r.vs_peer, ".2f"),
                      f(r.p50_ms, ".3f"), f(r.p99_ms, ".3f"), other, "-" if noise is None else f"{noise:.0f}%",
                      check))
    widths = [max(len(str(x[c])) for x in lines) for c in range(len(head))]
    out = []
    for i, ln in enumerate(lines):
        out.append("  ".join(str(c).ljust(widths[j]) if j in (0, 7, 9) else str(c).rjust(widths[j])
                             for j, c in enumerate(ln)).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def plot(rows: list[Row], path: str) -> None:
    import matplotlib  # checked before the run
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    bars = [r for r in rows if r.gbps]
    colors = {"limit": "#999999", "kvxferd": "#1f77b4", "peer": "#ff7f0e"}
    fig, ax = plt.subplots(figsize=(10, max(4, 0.28 * len(bars))))
    ax.barh([r.name for r in bars], [r.gbps for r in bars], color=[colors.get(r.group, "#2ca02c") for r in bars])
    ax.invert_yaxis()
    ax.set_xlabel("GB/s")
    ax.set_title("kvxferd bench (loopback)")
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        mem = None
    import torch
    return {"cores": os.cpu_count(), "cpu": cpu, "memory_bytes": mem, "python": platform.python_version(),
            "torch": torch.__version__, "kernel": platform.release()}


def run_all(quick: bool, only: str | None = None, seed: int = 1) -> dict[str, Any]:
    t_all = time.perf_counter()
    scenarios = build_scenarios(quick)
    if only:
        rx = re.compile(only)
        scenarios = [s for s in scenarios if rx.search(s.name)]
    headline = Workload("8B", 256 if quick else 4096)
    tp_workloads = sorted({s.workload for s in scenarios if s.workload.model == "70B"},
                          key=lambda w: (w.p_tp != w.d_tp, w.p_tp, w.d_tp))
    sizes = sorted({s.workload.nbytes for s in scenarios if s.kind == "throughput"})
    _say(f"{'quick' if quick else 'full'} run: {len(scenarios)} kvxferd scenarios, limits at "
         f"{', '.join(_size(s) for s in sizes)}, {os.cpu_count()} cores")
    rows: list[Row] = []
    rows += _limit_rows(sizes, quick)
    peer_sizes = [headline.nbytes] if headline.nbytes in sizes or not sizes else [sizes[0]]
    rows += _peer_rows(peer_sizes, quick)
    root = Path(tempfile.mkdtemp(prefix="kvxferd-bench-"))
    pool = DaemonPool(root, recycle_bytes=(2 * GiB) if quick else (8 * GiB))
    results: dict[int, Row] = {}
    no_nixl = nixl_unavailable()
    for sc in scenarios:
        if sc.transport == "nixl" and no_nixl:
            results[sc.order] = Row(sc.name, "kvxferd", bytes=sc.workload.nbytes, transport="nixl", mode=sc.mode,
                                    workload=sc.workload.label, skipped=no_nixl)
    if quick:
        rows.append(Row("kvxferd nixl (full run only)", "kvxferd", transport="nixl", mode="direct",
                        skipped=no_nixl or "full run only"))
    try:
        # group by daemon configuration so daemons are reused, report in scenario order
        for sc in sorted(scenarios, key=lambda s: (s.transport, s.mode, s.order)):
            if sc.order in results:
                continue
            _say(f"run {sc.name}: {sc.requests} x {_size(sc.workload.nbytes)}, window {sc.window}")
            row = run_scenario(sc, pool, seed, timeout=300 if quick else 900, quiet_wait=0.0 if quick else 10.0)
            if row.error and not row.extra.get("bad_bytes"):
                # a scenario that failed without moving a wrong byte (a timeout on a busy machine, a
                # daemon that did not answer) runs once more on fresh daemons; both are reported
                _say(f"  retrying {sc.name} once on fresh daemons")
                pool.stop()
                first = row
                row = run_scenario(sc, pool, seed, timeout=300 if quick else 900, quiet_wait=10.0)
                row.extra["first_attempt_error"] = first.error
                if first.extra.get("daemon_log_tail"):
                    row.extra["first_attempt_daemon_log"] = first.extra["daemon_log_tail"]
            results[sc.order] = row
    finally:
        pool.stop()
        shutil.rmtree(root, ignore_errors=True)
    rows += [results[s.order] for s in scenarios]
    runs = 3 if quick else 9
    _say("planner: 128k tokens, 80 layers")
    if not quick:
        wait_quiet(10.0)
    for p_tp, d_tp, headline_row in ((4, 2, True), (1, 1, False)):
        with _Noise() as noise:
            res = planner_bench(runs, p_tp, d_tp)
        rows.append(Row(f"planner 128k tokens 80 layers tp{p_tp}>{d_tp} page16", "planner", ms=res["ms"],
                        extra={"segments": res["segments"], "writers": res["writers"], "headline": headline_row,
                               "mode": res["mode"], "best_ms": round(res["best_ms"], 3), "runs": runs,
                               "others_cpu_pct": noise.pct}))
        _say(f"  {rows[-1].name}: median {res['ms']:.2f} ms, best {res['best_ms']:.2f} ms "
             f"({res['segments']} segments)")
    ratios = compute(rows, headline, tp_workloads)
    targets = targets_report(rows, ratios)
    verified = all(r.verified for r in rows if r.group in ("kvxferd", "latency", "rate") and not r.skipped)
    return {"quick": quick, "machine": machine(), "seconds": round(time.perf_counter() - t_all, 1),
            "verified": verified, "rows": [r.to_dict() for r in rows], "ratios": ratios, "targets": targets,
            "_rows": rows}


def main(args: Any) -> int:
    plot_path = getattr(args, "plot", None)
    if plot_path and _find("matplotlib") is None:
        print("kvxferd bench: --plot needs matplotlib, which is not installed (pip install matplotlib)",
              file=sys.stderr)
        return 2
    from .signals import cleanup_on_signals
    with cleanup_on_signals():  # SIGTERM/SIGINT/SIGHUP: stop the daemons and engines, remove their files
        report = run_all(bool(getattr(args, "quick", False)), getattr(args, "only", None),
                         int(getattr(args, "seed", 1) or 1))
    rows: list[Row] = report.pop("_rows")
    if plot_path:
        plot(rows, plot_path)
        _say(f"wrote {plot_path}")
    if getattr(args, "json", False):
        print(json.dumps(report, default=str))
    else:
        m = report["machine"]
        print(f"kvxferd bench ({'quick' if report['quick'] else 'full'}) on {m['cores']} cores, {m['cpu']}, "
              f"{report['seconds']:.0f}s")
        print()
        print(render_table(rows))
        print()
        print("ratios: " + "  ".join(f"{k}={'-' if v is None else v}" for k, v in report["ratios"].items()))
        print("targets:")
        for t in report["targets"]:
            met = "n/a" if t["met"] is None else "met" if t["met"] else "MISSED"
            print(f"  {t['target']:<44} {'-' if t['value'] is None else t['value']!s:>10}  goal {t['goal']:<10} {met}")
        print(f"\nbytes verified: {'yes' if report['verified'] else 'NO - some scenario moved wrong bytes or failed'}")
    return 0 if report["verified"] else 1


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "engine":
        from .signals import cleanup_on_signals
        with cleanup_on_signals():  # SIGTERM from the bench: engine_main's finally unlinks the caches
            out = engine_main(json.loads(sys.argv[2]))
        print(json.dumps(out, default=str), flush=True)
        sys.exit(0 if out.get("verified") else 1)
    print("usage: python -m kvxferd.bench engine CONFIG_JSON  (run the bench with `kvxferd bench`)",
          file=sys.stderr)
    sys.exit(2)

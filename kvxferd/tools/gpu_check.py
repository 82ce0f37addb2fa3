"""``make gpu-check``: KV caches on a GPU, moved by real daemons, every byte checked.

The test suite runs on CPUs: CUDA memory and CUDA IPC (``describe_tensors`` sending a CUDA
tensor's IPC handle, ``MemoryMapper._open_cuda`` opening it in the daemon, the copier's GPU
paths, NIXL writing VRAM) are exercised by nothing else. This is the one prepared run that
does, in a few minutes of one GPU:

- two engine processes (``python -m kvxferd.tools.gpu_check engine``, one for the prefill
  ranks, one for the decode ranks, apart from every daemon) allocate KV on ``cuda:0`` in the
  layouts engines really use: SGLang's NHD pool (per layer K and V of
  ``[pages * page_size, heads, head_dim]``, read by the SGLang adapter's own
  ``pool_facts``/``build_geometry``) and vLLM's per-layer views ``LBNHC`` and ``LBHNC`` of one
  allocation (read by the vLLM adapter's ``decide``/``rank_geometry``/``layer_span``), and
  register them with ``kvxferd serve`` daemons by CUDA IPC;
- every layout moves matched (TP1->TP1) and TP-mismatched (TP2->TP1, TP1->TP2) requests over
  ``local`` (both instances at one daemon), ``tcp`` and ``nixl`` (two daemons each);
- every destination byte is checked against the byte oracle (:mod:`kvxferd.tools.oracle`,
  which knows nothing of plans or transports) on a host copy of the GPU memory, pages no
  request used must still hold the canary, and the bytes must have moved over the transport
  the case names (the prefill daemon's metrics say which);
- each case's GB/s (first send to last done, as the engines see it) is set against a
  device-to-device copy of the same byte count measured in the same run.

One line per case, one summary line; exit 1 on any wrong byte, failed request, fallback to
another transport or case left undone by the deadline. Without CUDA it says so and exits 0.
``--device cpu`` runs the very same cases on CPU tensors in shared memory (the dry run that
proves the script before GPU time is spent on it). Every process, socket and shared-memory
file it started or made is gone when it exits, however it exits (a failed run keeps its run
dir of daemon and engine logs, and says where).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from ..model.geometry import RankGeometry
from . import jsonlines, launch, procstats
from .oracle import CANARY, check_rank, fill_rank, untouched

PROG = "gpu-check"

#: the engine layouts checked, and the kvxferd layout each must be registered as
LAYOUTS: dict[str, str] = {"sglang-NHD": "NHD", "vllm-LBNHC": "NHD_kv", "vllm-LBHNC": "HND_kv"}
TRANSPORTS = ("local", "tcp", "nixl")
TP_PAIRS = ((1, 1), (2, 1), (1, 2))
#: UCX transports for NIXL between the daemons: GPU memory by CUDA IPC (same node) or cuda_copy,
#: tcp for the control and host memory; the CPU dry run has no CUDA transport to offer
UCX_TLS = {"cuda": "cuda_ipc,cuda_copy,tcp", "cpu": "tcp"}
MIN_CASE_S = 10.0  # a case is not started with less time than this left before the deadline


# -- what is checked (pure) ---------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One engine layout moved between a prefill and a decode instance over one transport."""

    layout: str      # a key of LAYOUTS
    prefill_tp: int
    decode_tp: int
    transport: str   # local, tcp or nixl

    @property
    def name(self) -> str:
        return f"{self.layout} tp{self.prefill_tp}->tp{self.decode_tp} {self.transport}"


def case_list(layouts: Iterable[str] = LAYOUTS, transports: Iterable[str] = TRANSPORTS,
              tp_pairs: Iterable[tuple[int, int]] = TP_PAIRS) -> list[Case]:
    """Every (transport, layout, TP pair), transport outermost so the daemons of one transport
    see their cases together."""
    return [Case(layout, p, d, t) for t in transports for layout in layouts for p, d in tp_pairs]


@dataclass(frozen=True)
class Sizes:
    """The model and pool every case uses: small enough for minutes, large enough for real copies."""

    layers: int = 8
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    page_size: int = 16
    num_pages: int = 768
    tokens: tuple[int, ...] = (1000, 2048, 3001, 4096)  # one request of each length per case

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()

    @property
    def token_bytes(self) -> int:
        """K and V of one token over every layer and head: what a decode instance receives per token."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.element_size

    def pages(self, n: int) -> int:
        return -(-n // self.page_size)

    def request_bytes(self, layout: str, n: int) -> int:
        """Bytes a request of ``n`` tokens lands in the decode instance: whole pages for the
        head-major layout (its last page moves whole, tail included), token rows otherwise."""
        tokens = self.pages(n) * self.page_size if LAYOUTS[layout] == "HND_kv" else n
        return tokens * self.token_bytes

    def check(self, tp_pairs: Iterable[tuple[int, int]] = TP_PAIRS) -> None:
        """Refuse sizes the cases cannot use, before any process starts."""
        need = sum(self.pages(n) for n in self.tokens)
        if need > self.num_pages - 1:  # page 0 is SGLang's padding page, never handed out
            raise ValueError(f"--tokens need {need} pages per instance, --pages gives {self.num_pages - 1} "
                             "(page 0 is padding)")
        for tp in {t for pair in tp_pairs for t in pair}:
            if tp < 1 or self.kv_heads % tp:
                raise ValueError(f"--kv-heads {self.kv_heads} does not split over TP {tp}")


@dataclass(frozen=True)
class Request:
    """One request of a case: its id, length, pages on each side and chunks."""

    request_id: str
    n: int
    src_pages: list[int]
    dst_pages: list[int]
    chunks: list[list[int]]


def plan_requests(case_index: int, sizes: Sizes, seed: int) -> list[Request]:
    """The case's requests on shuffled, disjoint pages of each side (never page 0), each of more
    than one page sent in two chunks cut on a page boundary (the head-major layout moves whole
    pages, so a chunk must not cut one)."""
    rng = random.Random(seed * 1000 + case_index)
    need = [sizes.pages(n) for n in sizes.tokens]
    src = rng.sample(range(1, sizes.num_pages), sum(need))
    dst = rng.sample(range(1, sizes.num_pages), sum(need))
    out, at = [], 0
    for i, (n, p) in enumerate(zip(sizes.tokens, need)):
        cut = p // 2 * sizes.page_size
        chunks = [[0, cut], [cut, n]] if 0 < cut < n else [[0, n]]
        out.append(Request(f"gc{case_index}-r{i}", n, src[at:at + p], dst[at:at + p], chunks))
        at += p
    return out


def never_used(requests: Sequence[Request], num_pages: int) -> list[int]:
    """Decode pages no request of the case wrote: they must still hold the canary."""
    used = {p for r in requests for p in r.dst_pages}
    return [p for p in range(num_pages) if p not in used]


def transport_problem(case: Case, moved: dict[str, float], expected: int) -> str | None:
    """Why the bytes did not move as the case asked, else None: none over its transport, some over
    another (NIXL falling back to tcp must not pass for NIXL), or another count than the requests
    hold (a chunk sent twice, or part of one never)."""
    mine = moved.get(case.transport, 0.0)
    others = {k: v for k, v in moved.items() if k != case.transport and v}
    if mine <= 0:
        return f"no byte moved over {case.transport} (sent by transport: {moved or 'nothing'})"
    if others:
        return f"bytes moved over {sorted(others)} besides {case.transport} ({moved})"
    if int(mine) != expected:
        return f"{int(mine)} bytes sent over {case.transport}, the requests hold {expected}"
    return None


def moved_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Bytes sent per transport between two readings of a daemon's cumulative counter."""
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0)}


@dataclass
class CaseResult:
    """What one case did; ``ok`` only when every request is done and byte-exact where it should be."""

    case: Case
    requests: int = 0
    done: int = 0            # requests done on every decode and prefill rank
    wrong_bytes: int = 0     # destination bytes differing from the oracle
    stray_bytes: int = 0     # bytes off the canary in decode pages no request used
    nbytes: int = 0          # bytes landed in the decode instance
    seconds: float = 0.0     # first send to last done
    fill_s: float = 0.0      # the oracle's time filling the sources (not in seconds)
    check_s: float = 0.0     # the oracle's time checking the destinations
    moved: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (not self.failures and self.requests > 0 and self.done == self.requests
                and self.wrong_bytes == 0 and self.stray_bytes == 0)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def request_verdict(decode_events: Sequence[dict[str, Any]], prefill_events: Sequence[dict[str, Any]],
                    wrong: dict[str, int]) -> tuple[int, int, list[str]]:
    """(requests done on every rank of both sides, wrong bytes, failures) of a case's requests.

    A request counts as done only if every decode and every prefill rank says ``done``; a
    wrong byte is a failure even in a request the daemons called done.
    """
    failures = []
    state: dict[str, bool] = {}
    for ev in [*decode_events, *prefill_events]:
        rid = ev.get("request_id", "?")
        good = ev.get("state") == "done"
        state[rid] = state.get(rid, True) and good
        if not good:
            failures.append(f"{rid} on {ev.get('name', '?')}: {ev.get('state')} {ev.get('code') or ''} "
                            f"{ev.get('reason') or ''}".strip())
    bad = 0
    for rid, n in wrong.items():
        bad += int(n)
        if n:
            failures.append(f"{rid}: {n} wrong bytes")
    return sum(1 for rid, good in state.items() if good and not wrong.get(rid)), bad, failures


def arrived(decode_events: Sequence[dict[str, Any]]) -> set[str]:
    """Requests every decode rank called done: the ones whose bytes there are to check."""
    done: dict[str, bool] = {}
    for ev in decode_events:
        rid = ev.get("request_id", "?")
        done[rid] = done.get(rid, True) and ev.get("state") == "done"
    return {rid for rid, good in done.items() if good}


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def format_case(r: CaseResult, d2d_gbps: float | None) -> str:
    """One line per case: verdict, size, time, GB/s against the device copy, and why it failed."""
    ratio = f" ({r.gbps / d2d_gbps:.1%} of d2d)" if d2d_gbps and r.gbps else ""
    line = (f"  {'ok  ' if r.ok else 'FAIL'} {r.case.name:<30} {r.done}/{r.requests} done  {_mib(r.nbytes):>10}  "
            f"{r.seconds:7.3f} s  {r.gbps:7.2f} GB/s{ratio}  wrong {r.wrong_bytes}  stray {r.stray_bytes}")
    if r.failures:
        line += "\n" + "\n".join(f"       - {f}" for f in r.failures[:5])
    return line


def summarize(results: Sequence[CaseResult], d2d_gbps: float | None, device: str, seconds: float) -> tuple[str, int]:
    """The final line and the exit status: 0 only if there were cases and every one passed."""
    good = [r for r in results if r.ok]
    rates = [r.gbps for r in good if r.gbps]
    span = f"transfers {min(rates):.2f}-{max(rates):.2f} GB/s" if rates else "no transfer measured"
    d2d = f"d2d copy {d2d_gbps:.1f} GB/s" if d2d_gbps else "d2d copy not measured"
    wrong = sum(r.wrong_bytes for r in results)
    stray = sum(r.stray_bytes for r in results)
    line = (f"{PROG}: {len(good)}/{len(results)} cases byte-exact on {device}; {span}; {d2d}; "
            f"{wrong} wrong bytes, {stray} stray bytes; {seconds:.1f} s")
    failed = [r.case.name for r in results if not r.ok]
    if failed:
        line += "; FAILED: " + ", ".join(failed[:6]) + (f" and {len(failed) - 6} more" if len(failed) > 6 else "")
    return line, 0 if results and not failed else 1


def skip_reason() -> str | None:
    """Why CUDA cannot be used from this interpreter, or None if it can."""
    if torch.version.cuda is None:
        return (f"CUDA is not available: {sys.executable} has torch {torch.__version__}, a CPU build "
                "(point GPU_PYTHON at a python with CUDA torch)")
    if not torch.cuda.is_available():
        return f"CUDA is not available: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
    return None


# -- the engine process ---------------------------------------------------------------------

def _canary(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` whose every byte is the oracle's canary."""
    elem = torch.empty(0, dtype=dtype).element_size()
    raw = torch.full((*shape[:-1], shape[-1] * elem), CANARY, dtype=torch.uint8, device=device)
    return raw.view(dtype)


def sglang_pool(sizes: Sizes, tp_size: int, tp_rank: int,
                device: str) -> tuple[RankGeometry, dict[tuple[int, str], torch.Tensor], list[torch.Tensor]]:
    """SGLang's MHA token pool (per layer ``k_buffer``/``v_buffer`` of ``[rows, heads, head_dim]``,
    page 0 padding), read by the SGLang adapter's own functions: (geometry, regions, tensors)."""
    from ..adapters.sglang.layout import RankFacts, build_geometry
    from ..adapters.sglang.pool import pool_facts, pool_region_tensors
    dtype = getattr(torch, sizes.dtype)
    shape = (sizes.num_pages * sizes.page_size, sizes.kv_heads // tp_size, sizes.head_dim)
    k = [_canary(shape, dtype, device) for _ in range(sizes.layers)]
    v = [_canary(shape, dtype, device) for _ in range(sizes.layers)]
    pool = SimpleNamespace(k_buffer=k, v_buffer=v, page_size=sizes.page_size, start_layer=0)
    facts = pool_facts(pool)
    geometry = build_geometry(facts, RankFacts(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
                                               layer_splits=((0, sizes.layers),),
                                               model_total_kv_heads=sizes.kv_heads))
    return geometry, pool_region_tensors(pool, facts), k + v


def vllm_strides(layout: str, heads: int, block: int, content: int) -> tuple[int, int, int, int]:
    """Element strides of vLLM 0.32's per-layer view ``[B, H, N, C]`` for a layout with its
    layers outermost (``compute_layout_strides``): token rows (``LBNHC``) or head-major blocks
    (``LBHNC``)."""
    if layout == "LBNHC":
        return (block * heads * content, content, heads * content, 1)
    if layout == "LBHNC":
        return (heads * block * content, block * content, content, 1)
    raise ValueError(f"layout {layout} is not one this check builds")


def vllm_cache(layout: str, sizes: Sizes, tp_size: int, tp_rank: int,
               device: str) -> tuple[RankGeometry, dict[tuple[int, str], torch.Tensor], list[torch.Tensor]]:
    """vLLM's KV allocation (one buffer, per-layer strided views, K and V interleaved per head
    and token as ``create_kv_cache_views`` makes them), read by the vLLM adapter's own functions
    exactly as its connector's ``register`` does: (geometry, regions, tensors)."""
    from ..adapters.vllm.layout import decide, rank_geometry, same_for_all
    dtype = getattr(torch, sizes.dtype)
    heads, block, content = sizes.kv_heads // tp_size, sizes.page_size, 2 * sizes.head_dim
    page = heads * block * content
    raw = _canary((sizes.layers * sizes.num_pages * page,), dtype, device)
    stride = vllm_strides(layout, heads, block, content)
    views = [torch.as_strided(raw, (sizes.num_pages, heads, block, content), stride, layer * sizes.num_pages * page)
             for layer in range(sizes.layers)]
    lay = same_for_all({i: decide(tuple(v.shape), tuple(v.stride()), v.element_size(), block_size=block, mla=False,
                                  on_cpu=False, backend="gpu-check") for i, v in enumerate(views)})
    geometry = rank_geometry(lay, sizes.dtype, num_layers=sizes.layers, total_kv_heads=sizes.kv_heads,
                             tp_size=tp_size, pp_size=1, layer_splits=None, tp_rank=tp_rank, pp_rank=0)
    # the spans are taken later, once the tensors are where they stay (CPU: in shared memory)
    return geometry, {(i, lay.kind): v for i, v in enumerate(views)}, [raw, *views]


def allocate(layout: str, sizes: Sizes, tp_size: int, tp_rank: int, device: str, name: str) -> dict[str, Any]:
    """A rank's KV in ``layout`` on ``device``, its region descriptors, and what keeps it alive.

    On CPU the engine's tensors move into a shared-memory file first (``share_in_place``, what
    both adapters do on CPU); on CUDA they stay where they are and ``describe_tensors`` sends
    their IPC handles.
    """
    from ..sdk.engine_memory import describe_tensors, share_in_place
    if layout == "sglang-NHD":
        geometry, regions, tensors = sglang_pool(sizes, tp_size, tp_rank, device)
    else:
        geometry, regions, tensors = vllm_cache(layout.split("-", 1)[1], sizes, tp_size, tp_rank, device)
    want = LAYOUTS[layout]
    if geometry.spec.layout != want:
        raise RuntimeError(f"{layout} was registered as {geometry.spec.layout}, expected {want}")
    pool = share_in_place(tensors, name=f"gpu-check-{name}") if device == "cpu" else None
    if layout != "sglang-NHD":  # vLLM: each layer's byte span, as its connector registers it
        from ..adapters.vllm.layout import layer_span
        regions = {key: layer_span(v, geometry.region_nbytes("kv")) for key, v in regions.items()}
    flat = {key: t.view(torch.uint8).reshape(-1) for key, t in regions.items()}
    return {"geometry": geometry, "regions": flat, "descriptors": describe_tensors(regions),
            "tensors": tensors, "pool": pool}


def host_copy(regions: dict[tuple[int, str], torch.Tensor]) -> SimpleNamespace:
    """A host copy of a rank's regions, shaped as the oracle reads a cache (``.tensors``).

    The oracle computes on the CPU; the same copy is taken on either device, so the dry run
    exercises this very path.
    """
    return SimpleNamespace(tensors={k: t.to("cpu", copy=True) for k, t in regions.items()})


def write_back(regions: dict[tuple[int, str], torch.Tensor], host: SimpleNamespace) -> None:
    """The host copy's bytes into the rank's regions, finished before this returns."""
    for key, t in regions.items():
        t.copy_(host.tensors[key])
    synchronize(next(iter(regions.values())).device)


def synchronize(device: torch.device) -> None:
    """Every kernel this process queued on the device has finished: the daemon, another process,
    reads the memory next (what an engine does before it calls send)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fill_requests(geometry: RankGeometry, regions: dict[tuple[int, str], torch.Tensor],
                  requests: Sequence[dict[str, Any]]) -> None:
    """The oracle's bytes of every request into its source pages (the model's prefill)."""
    host = host_copy(regions)
    for r in requests:
        fill_rank(host, geometry, r["request_id"], r["pages"], r["n"])
    write_back(regions, host)


def check_requests(geometry: RankGeometry, regions: dict[tuple[int, str], torch.Tensor],
                   requests: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Wrong bytes per request in this rank's destination pages, against the oracle."""
    host = host_copy(regions)
    return {r["request_id"]: check_rank(host, geometry, r["request_id"], r["pages"], r["n"]) for r in requests}


def stray_bytes(geometry: RankGeometry, regions: dict[tuple[int, str], torch.Tensor], pages: Sequence[int]) -> int:
    """Bytes off the canary in pages no request wrote."""
    return untouched(host_copy(regions), geometry, list(pages)) if pages else 0


@dataclass
class EngineRank:
    """One registered rank in the engine process: its client, memory and what keeps it alive."""

    name: str
    client: Any
    rank_id: str
    geometry: RankGeometry
    regions: dict[tuple[int, str], torch.Tensor]
    keep: dict[str, Any]

    def close(self) -> None:
        """Unregister (the daemon lets go of the memory), then free it."""
        try:
            self.client.unregister(self.rank_id)
        except Exception:  # noqa: BLE001 - the daemon may be gone; the memory goes anyway
            pass
        finally:
            self.client.close()
            pool = self.keep.get("pool")
            if pool is not None:
                pool.close()
            self.regions.clear()
            self.keep.clear()


class Engine:
    """The engine process's state: its device and ranks; one method per command."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.ranks: dict[str, EngineRank] = {}

    def _ranks(self, cmd: dict[str, Any]) -> list[EngineRank]:
        return [self.ranks[n] for n in cmd["names"]]

    def open(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from ..sdk.client import EngineClient
        made = allocate(cmd["layout"], Sizes(**{**cmd["sizes"], "tokens": tuple(cmd["sizes"]["tokens"])}),
                        cmd["tp_size"], cmd["tp_rank"], self.device, cmd["name"])
        client = EngineClient(cmd["socket"], timeout=cmd.get("timeout", 30))
        try:
            rank_id = client.register(cmd["instance"], cmd["role"], made["geometry"], made["descriptors"])
        except BaseException:
            client.close()
            if made["pool"] is not None:
                made["pool"].close()
            raise
        self.ranks[cmd["name"]] = EngineRank(cmd["name"], client, rank_id, made["geometry"], made["regions"],
                                             {"tensors": made["tensors"], "pool": made["pool"]})
        return {"rank_id": rank_id, "layout": made["geometry"].spec.layout,
                "mem": sorted({d["mem"] for d in made["descriptors"]})}

    def fill(self, cmd: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        for r in self._ranks(cmd):
            fill_requests(r.geometry, r.regions, cmd["requests"])
        return {"fill_s": time.perf_counter() - t0}

    def expect(self, cmd: dict[str, Any]) -> dict[str, Any]:
        for r in self._ranks(cmd):
            for q in cmd["requests"]:
                r.client.expect(r.rank_id, q["request_id"], source_instance=cmd["source_instance"],
                                source_address=cmd.get("source_address"), pages=q["pages"], num_tokens=q["n"])
        return {}

    def send(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Every chunk of every request from every rank; ``t0`` is when the first send left."""
        ps = self._ranks(cmd)[0].geometry.spec.page_size
        t0 = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
        for q in cmd["requests"]:
            for start, end in q["chunks"]:
                for r in self._ranks(cmd):
                    r.client.send(r.rank_id, q["request_id"], pages=q["pages"][start // ps:-(-end // ps)],
                                  start=start, end=end, last=end == q["n"])
        return {"t0": t0}

    def wait(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The final event of every named request on every rank, each stamped when it arrived."""
        import zmq
        ranks = self._ranks(cmd)
        pending = {(r.name, rid) for r in ranks for rid in cmd["request_ids"]}
        events = []
        poller = zmq.Poller()
        for r in ranks:
            poller.register(r.client.sock, zmq.POLLIN)
        deadline = time.monotonic() + cmd["timeout"]
        while pending and time.monotonic() < deadline:
            for r in ranks:
                while (ev := r.client.wait_any(0)) is not None:
                    key = (r.name, ev.get("request_id"))
                    if key in pending:
                        pending.discard(key)
                        events.append({"name": r.name, "request_id": ev["request_id"], "state": ev.get("state"),
                                       "code": ev.get("code"), "reason": ev.get("reason"), "t": time.monotonic()})
            if pending:
                poller.poll(max(1, int(min(0.05, deadline - time.monotonic()) * 1000)))
        events += [{"name": n, "request_id": rid, "state": "no event", "reason": f"none within {cmd['timeout']} s"}
                   for n, rid in sorted(pending)]
        return {"events": events}

    def check(self, cmd: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        wrong: dict[str, int] = {q["request_id"]: 0 for q in cmd["requests"]}
        for r in self._ranks(cmd):
            for rid, n in check_requests(r.geometry, r.regions, cmd["requests"]).items():
                wrong[rid] += n
        return {"wrong": wrong, "check_s": time.perf_counter() - t0}

    def untouched(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return {"stray": sum(stray_bytes(r.geometry, r.regions, cmd["pages"]) for r in self._ranks(cmd))}

    def corrupt(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Flip one byte of a destination page (``--corrupt-one-byte``: proves a wrong byte fails the run)."""
        r = self._ranks(cmd)[0]
        flat = next(iter(r.regions.values()))
        at = cmd["page"] * (flat.numel() // r.geometry.num_pages)
        flat[at:at + 1].bitwise_not_()
        synchronize(flat.device)
        return {}

    def close(self, cmd: dict[str, Any]) -> dict[str, Any]:
        for name in cmd["names"]:
            rank = self.ranks.pop(name, None)
            if rank is not None:
                rank.close()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
        return {}

    def d2d(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Device-to-device copy of ``nbytes`` on this engine's device: the ceiling to compare with."""
        src = torch.full((cmd["nbytes"],), 7, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        dst.copy_(src)  # warm-up
        synchronize(src.device)
        t0 = time.perf_counter()
        copies = 0
        while copies < cmd["repeat"] or time.perf_counter() - t0 < 0.2:  # long enough to time
            dst.copy_(src)
            copies += 1
            if copies >= cmd["repeat"]:
                synchronize(src.device)
        seconds = (time.perf_counter() - t0) / copies
        del src, dst
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
        return {"gbps": cmd["nbytes"] / seconds / 1e9, "seconds": seconds}

    def wsum(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The device digest (word sums) of ``nbytes`` random bytes, gathered from scattered slots,
        taken on this engine's device and on a host copy: both must agree to the bit. GB/s is the
        device kernel's over whole blocks."""
        from ..datapath import word_sums
        gen = torch.Generator().manual_seed(cmd["seed"])
        host = torch.randint(0, 256, (cmd["nbytes"],), dtype=torch.uint8, generator=gen)
        flat = host.to(self.device)
        row = 4096 + 6  # rows whose slices start off a block and a word boundary
        slots = torch.randperm(cmd["nbytes"] // row, generator=gen).numpy()
        args = (slots, row, 6, 4095)
        on_device = word_sums.region_digests([flat], *args)
        on_host = word_sums.region_digests([host], *args)
        whole = flat[:cmd["nbytes"] // word_sums.BLOCK_BYTES * word_sums.BLOCK_BYTES]
        word_sums.device_sums(whole)  # warm-up (the key table, the kernels)
        synchronize(flat.device)
        t0 = time.perf_counter()
        sums = word_sums.device_sums(whole)
        synchronize(flat.device)
        seconds = time.perf_counter() - t0
        same_sums = bool(torch.equal(sums.cpu(), word_sums.block_sums(whole.cpu())))
        del flat, whole, sums
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
        return {"equal": on_device == on_host and same_sums, "gbps": cmd["nbytes"] / seconds / 1e9}

    def close_all(self) -> None:
        self.close({"names": list(self.ranks)})


def engine_main(argv: list[str]) -> int:
    """Answer JSON-line commands on stdin, one reply line each (``ok`` or ``error``), until stdin ends."""
    ap = argparse.ArgumentParser(prog=f"{PROG} engine")
    ap.add_argument("--device", required=True)
    args = ap.parse_args(argv)
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    engine = Engine(args.device)
    handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
        "open": engine.open, "fill": engine.fill, "expect": engine.expect, "send": engine.send,
        "wait": engine.wait, "check": engine.check, "untouched": engine.untouched, "corrupt": engine.corrupt,
        "close": engine.close, "d2d": engine.d2d, "wsum": engine.wsum}

    def reply(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    from ..ops.signals import cleanup_on_signals
    with cleanup_on_signals():  # SIGTERM (the tool died): unregister and free on the way out
        try:
            on_gpu = args.device.startswith("cuda")
            reply({"ok": True, "cmd": "ready", "pid": os.getpid(), "torch": torch.__version__,
                   "cuda": torch.version.cuda, "device_name": torch.cuda.get_device_name(args.device) if on_gpu
                   else "CPU shared memory, dry run"})
            for line in sys.stdin:
                if not line.strip():
                    continue
                cmd = json.loads(line)
                try:
                    reply({"ok": True, "cmd": cmd["cmd"], **handlers[cmd["cmd"]](cmd)})
                except Exception as exc:  # noqa: BLE001 - reported to the orchestrator, which fails the case
                    reply({"ok": False, "cmd": cmd["cmd"], "error": f"{type(exc).__name__}: {exc}",
                           "code": getattr(exc, "code", "")})
        finally:
            engine.close_all()
    return 0


# -- the orchestrator -----------------------------------------------------------------------

class CheckError(RuntimeError):
    """A step of a case did not complete: the case fails with this message."""


class EngineLost(CheckError):
    """An engine process did not answer in time or exited: nothing more can be asked of it."""


class DeadlineExceeded(BaseException):
    """The run's deadline passed (raised by SIGALRM in the main thread): finish with what was done."""


class EngineProc(jsonlines.JsonProc):
    """An engine process spoken to in JSON lines: one reply per command, in order.

    ``post`` sends without waiting, so the decode engine can be waiting for its requests while
    the prefill engine sends; ``reply`` takes the oldest outstanding answer.
    """

    def __init__(self, role: str, device: str, log_path: Path) -> None:
        super().__init__(["-m", "kvxferd.tools.gpu_check", "engine", "--device", device], log_path)
        self.role = role
        self.outstanding: list[str] = ["ready"]

    def post(self, cmd: str, **fields: Any) -> None:
        self.outstanding.append(cmd)
        try:
            jsonlines.send_command(self.proc, {"cmd": cmd, **fields})
        except OSError as exc:
            raise EngineLost(f"{self.role} engine is gone ({exc}): {self.log_tail()}") from None

    def reply(self, timeout: float) -> dict[str, Any]:
        cmd = self.outstanding[0]
        try:
            ev = self.events.get(timeout=max(0.1, timeout))
        except queue.Empty:
            raise EngineLost(f"{self.role} engine did not answer {cmd!r} within {timeout:.0f} s") from None
        self.outstanding.pop(0)
        if ev.get("event") == "exit":
            self.outstanding.clear()
            raise EngineLost(f"{self.role} engine exited during {cmd!r}: {self.log_tail()}")
        if not ev.get("ok"):
            raise CheckError(f"{self.role} engine {cmd}: {ev.get('error')}")
        return ev

    def call(self, wait_s: float, cmd: str, /, **fields: Any) -> dict[str, Any]:  # type: ignore[override]
        """``cmd`` with ``fields``, its answer within ``wait_s`` seconds."""
        self.drain(wait_s)
        self.post(cmd, **fields)
        return self.reply(wait_s)

    def drain(self, timeout: float) -> None:
        """Take the answers a failed step left outstanding, so the next reply is the next command's."""
        while self.outstanding:
            try:
                self.reply(timeout)
            except EngineLost:
                raise
            except CheckError:
                pass  # that step's failure was reported when it happened


@dataclass
class Run:
    """What one run shares between its cases: settings, daemons, engines, the clock."""

    args: argparse.Namespace
    sizes: Sizes
    device: str
    daemons: dict[str, Any]
    prefill: EngineProc
    decode: EngineProc
    deadline: float

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def timeout(self) -> float:
        """A step's time: the per-request timeout, never past the deadline."""
        return max(1.0, min(self.args.request_timeout, self.left()))

    def pair(self, transport: str) -> tuple[Any, Any]:
        if transport == "local":
            return self.daemons["local"], self.daemons["local"]
        return self.daemons[f"{transport}-prefill"], self.daemons[f"{transport}-decode"]


def sent_by_transport(daemon: Any) -> dict[str, float]:
    """The prefill daemon's cumulative KV bytes sent, per transport (its Prometheus counter)."""
    return procstats.by_label(procstats.scrape(daemon.metrics_url, missing_ok=True), "kvxferd_sent_bytes_total",
                              "transport")


def checked_by_digest(daemon: Any) -> dict[str, float]:
    """The decode daemon's cumulative chunks checked against their digests, per digest."""
    return procstats.by_label(procstats.scrape(daemon.metrics_url, missing_ok=True),
                              "kvxferd_integrity_checked_chunks_total", "digest")


def run_case(run: Run, index: int, case: Case) -> CaseResult:
    """Fresh prefill and decode instances move the case's requests; every byte checked; the ranks
    unregistered and freed whatever happened."""
    result = CaseResult(case)
    pd, dd = run.pair(case.transport)
    requests = plan_requests(index, run.sizes, run.args.seed)
    result.requests = len(requests)
    result.nbytes = sum(run.sizes.request_bytes(case.layout, r.n) for r in requests)
    p_names = [f"c{index}-p{t}" for t in range(case.prefill_tp)]
    d_names = [f"c{index}-d{t}" for t in range(case.decode_tp)]
    p_inst, d_inst = f"gc{index}-prefill", f"gc{index}-decode"
    try:
        _open(run, run.prefill, pd, p_inst, "prefill", p_names, case)
        _open(run, run.decode, dd, d_inst, "decode", d_names, case)
        src = [{"request_id": r.request_id, "n": r.n, "pages": r.src_pages, "chunks": r.chunks} for r in requests]
        dst = [{"request_id": r.request_id, "n": r.n, "pages": r.dst_pages} for r in requests]
        result.fill_s = run.prefill.call(run.timeout(), "fill", names=p_names, requests=src)["fill_s"]
        run.decode.call(run.timeout(), "expect", names=d_names, requests=dst, source_instance=p_inst,
                        source_address=None if pd is dd else pd.address)
        before, checked_before = sent_by_transport(pd), checked_by_digest(dd)
        ids = [r.request_id for r in requests]
        run.decode.post("wait", names=d_names, request_ids=ids, timeout=run.timeout())
        t0 = run.prefill.call(run.timeout(), "send", names=p_names, requests=src)["t0"]
        d_events = run.decode.reply(run.timeout() + 5)["events"]
        p_events = run.prefill.call(run.timeout() + 5, "wait", names=p_names, request_ids=ids,
                                    timeout=run.timeout())["events"]
        done_at = [e["t"] for e in d_events if e.get("t")]
        result.seconds = max(done_at) - t0 if done_at else 0.0
        landed = arrived(d_events)
        if run.args.corrupt_one_byte and index == 0:
            run.decode.call(run.timeout(), "corrupt", names=d_names[:1], page=requests[0].dst_pages[0])
        # a request that failed has no bytes to check: its failure is counted, not its empty pages
        checked = run.decode.call(run.timeout(), "check", names=d_names,
                                  requests=[q for q in dst if q["request_id"] in landed])
        result.check_s = checked["check_s"]
        result.done, result.wrong_bytes, result.failures = request_verdict(d_events, p_events, checked["wrong"])
        result.stray_bytes = run.decode.call(run.timeout(), "untouched", names=d_names,
                                             pages=never_used(requests, run.sizes.num_pages))["stray"]
        if result.stray_bytes:
            result.failures.append(f"{result.stray_bytes} bytes changed in decode pages no request used")
        result.moved = moved_delta(before, sent_by_transport(pd))
        problem = transport_problem(case, result.moved, result.nbytes)
        if problem:
            result.failures.append(problem)
        if run.args.integrity != "off":  # GPU pages are checked with word sums, host pages with XXH3
            digest = "wsum" if run.device.startswith("cuda") else "xxh3"
            if not moved_delta(checked_before, checked_by_digest(dd)).get(digest):
                result.failures.append(f"integrity {run.args.integrity}: no chunk was checked with {digest}")
    except CheckError as exc:
        result.failures.append(str(exc))
    finally:
        for engine, names in ((run.prefill, p_names), (run.decode, d_names)):
            try:
                engine.call(run.timeout() + 5, "close", names=names)
            except CheckError as exc:
                result.failures.append(f"closing the ranks: {exc}")
    return result


def _open(run: Run, engine: EngineProc, daemon: Any, instance: str, role: str, names: list[str], case: Case) -> None:
    """Register every rank of one instance at its daemon (CUDA IPC on a GPU, shared memory on CPU)."""
    tp = case.prefill_tp if role == "prefill" else case.decode_tp
    for rank, name in enumerate(names):
        opened = engine.call(run.timeout(), "open", name=name, socket=daemon.socket_path, instance=instance,
                             role=role, layout=case.layout, tp_size=tp, tp_rank=rank, sizes=asdict(run.sizes),
                             timeout=run.timeout())
        want = "cuda_ipc" if run.device.startswith("cuda") else "shm"
        if opened["mem"] != [want]:
            raise CheckError(f"{name} registered {opened['mem']} memory, expected {want}")


def start_daemons(cluster: Any, transports: Sequence[str], device: str, args: argparse.Namespace) -> dict[str, Any]:
    """The daemons the transports need, on loopback with free ports, started side by side (each
    imports torch). NIXL's daemons offer NIXL first; that the bytes did go over it is checked
    per case."""
    wanted: list[tuple[str, dict[str, str]]] = []
    if "local" in transports:
        wanted.append(("local", {}))
    if "tcp" in transports:
        wanted += [("tcp-prefill", {}), ("tcp-decode", {})]
    if "nixl" in transports:
        tls = args.ucx_tls or UCX_TLS["cpu" if device == "cpu" else "cuda"]
        env = {"KVXFERD_PEER_TRANSPORT": "nixl", "UCX_TLS": tls,
               "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
        if args.no_landing_ring:  # blocks from GPU memory then take the place route (written in place)
            env["KVXFERD_LIMITS_NIXL_LANDING_SLOTS"] = "0"
        wanted += [("nixl-prefill", env), ("nixl-decode", env)]
    daemons = {name: cluster.daemon(name, start=False) for name, _ in wanted}
    errors: list[BaseException] = []

    def start(name: str, env: dict[str, str]) -> None:
        try:
            daemons[name].start({"KVXFERD_PEER_MODE": args.mode, "KVXFERD_INTEGRITY_MODE": args.integrity, **env})
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=w) for w in wanted]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise CheckError(f"a daemon did not start: {errors[0]}")
    return daemons


def _shm_files() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def remove_leftover_shm(before: set[str], pids: Iterable[int]) -> list[str]:
    """Files that appeared in /dev/shm during the run and belong to a process of this run (torch's
    CUDA IPC reference counters are ``torch_<pid>_...``; kvxferd's named caches ``kvxferd-gpu-check-...``):
    removed, and returned to be reported. Anything else new there is another program's."""
    ours = {str(p) for p in pids}
    gone = []
    for name in sorted(_shm_files() - before):
        torch_file = re.match(r"torch_(\d+)_", name)
        if (torch_file and torch_file.group(1) in ours) or name.startswith("kvxferd-gpu-check-"):
            try:
                os.unlink(os.path.join("/dev/shm", name))
                gone.append(name)
            except OSError:
                pass
    return gone


@contextmanager
def deadline_alarm(seconds: float) -> Iterator[None]:
    """Raise :class:`DeadlineExceeded` in the main thread once ``seconds`` have passed inside the
    block: a step stuck past every timeout still ends the run on time (and cleans up)."""
    def alarm(_signum: int, _frame: Any) -> None:
        raise DeadlineExceeded()

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, max(1.0, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def measure_d2d(run: Run, cases: Sequence[Case], out: Callable[[str], None]) -> float:
    """GB/s of a device-to-device copy of the largest case's byte count (at most 1 GiB), taken in
    the decode engine: what the transfers are set against."""
    nbytes = min(1 << 30, max(sum(run.sizes.request_bytes(c.layout, n) for n in run.sizes.tokens) for c in cases))
    gbps = run.decode.call(run.timeout(), "d2d", nbytes=nbytes, repeat=5)["gbps"]
    out(f"  d2d  torch copy of {_mib(nbytes)} on {run.device}: {gbps:.1f} GB/s")
    return float(gbps)


def check_word_sums(run: Run, out: Callable[[str], None]) -> None:
    """The device digest taken on the device must equal the host's over the same bytes, or every
    integrity check of GPU pages would fail (or, worse, agree with a wrong source)."""
    nbytes = 64 << 20
    got = run.decode.call(run.timeout(), "wsum", nbytes=nbytes, seed=run.args.seed)
    out(f"  wsum word sums of {_mib(nbytes)} on {run.device}: {got['gbps']:.1f} GB/s, "
        f"{'equal to' if got['equal'] else 'DIFFERENT from'} the host's")
    if not got["equal"]:
        raise CheckError(f"the word sums taken on {run.device} differ from the host's over the same bytes")


def run_cases(run: Run, cases: Sequence[Case], results: list[CaseResult], d2d: float | None,
              out: Callable[[str], None]) -> None:
    """Every case in turn, a line each; those the deadline leaves no time for are not started."""
    for i, case in enumerate(cases):
        if run.left() < MIN_CASE_S:
            results.append(CaseResult(case, failures=[f"not run: the {run.args.deadline:.0f} s deadline"]))
        else:
            results.append(run_case(run, i, case))
        out(format_case(results[-1], d2d))


def clean_up(cluster: Any, engines: Sequence[EngineProc], shm_before: set[str], keep_logs: bool,
             out: Callable[[str], None]) -> list[int]:
    """Stop the engines (they unregister and free their KV), then the daemons (their sockets go);
    remove the run dir unless its logs are kept, and any shared-memory file the run left. Returns
    the pids of every process it had started."""
    pids = [*(e.proc.pid for e in engines), *(d.proc.pid for d in cluster.daemons.values() if d.proc)]
    for e in engines:
        e.close()
    cluster.close(keep_root=keep_logs)
    if cluster.root.exists():
        for sock in cluster.root.glob("*.sock"):  # a daemon killed after its stop timeout leaves it
            sock.unlink(missing_ok=True)
        out(f"{PROG}: daemon and engine logs kept in {cluster.root}")
    leftover = remove_leftover_shm(shm_before, [os.getpid(), *pids])
    if leftover:
        out(f"{PROG}: removed shared-memory files the run left: {leftover}")
    return pids


def run_check(args: argparse.Namespace, out: Callable[[str], None]) -> int:
    """Start the daemons and engines, run every case until done or the deadline, clean up."""
    from .sim import Cluster
    sizes = sizes_of(args)
    sizes.check(args.tp)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    cases = case_list(args.layouts, args.transports, args.tp)
    started = time.monotonic()
    out(f"{PROG}: {len(cases)} cases on {device}; {sizes.layers} layers x {sizes.kv_heads} KV heads x "
        f"{sizes.head_dim} {sizes.dtype}, page {sizes.page_size}, {sizes.num_pages} pages, requests of "
        f"{list(sizes.tokens)} tokens; deadline {args.deadline:.0f} s")
    if "nixl" in args.transports:
        from ..transport.nixl.api import available
        ok, why = available()
        if not ok:
            out(f"{PROG}: NIXL is not available here ({why}); its cases will fail (--transports local,tcp leaves "
                "them out)")
    shm_before = _shm_files()
    cluster = Cluster()
    engines: list[EngineProc] = []
    results: list[CaseResult] = []
    d2d: float | None = None
    stopped: str | None = None
    signalled: SystemExit | None = None
    pids: list[int] = []
    if device == "cpu" and not args.no_fork_server:
        launch.fork_from_preloaded()  # CPU-bound hosts: children fork from one interpreter that imported torch
    try:
        try:
            with deadline_alarm(args.deadline):
                for role in ("prefill", "decode"):  # first: their imports overlap the daemons' start
                    engines.append(EngineProc(role, device, cluster.root / f"engine-{role}.log"))
                daemons = start_daemons(cluster, args.transports, device, args)
                ready = [e.reply(120) for e in engines]  # each imported torch and took its device
                out(f"  {device}: {ready[0]['device_name']} (torch {ready[0]['torch']}, CUDA {ready[0]['cuda']})")
                run = Run(args, sizes, device, daemons, engines[0], engines[1], started + args.deadline)
                d2d = measure_d2d(run, cases, out)
                check_word_sums(run, out)
                run_cases(run, cases, results, d2d, out)
        except DeadlineExceeded:
            stopped = f"the {args.deadline:.0f} s deadline passed"
        except SystemExit as exc:  # SIGTERM, SIGINT or SIGHUP (kvxferd.ops.signals): clean up, then exit so
            stopped, signalled = f"stopped by a signal (exit {exc.code})", exc
        except CheckError as exc:
            stopped = str(exc)
        except Exception as exc:  # noqa: BLE001 - a bug here must still stop everything and say so
            import traceback
            traceback.print_exc()
            stopped = f"{type(exc).__name__}: {exc}"
        for case in cases[len(results):]:
            results.append(CaseResult(case, failures=[f"not run: {stopped or 'stopped'}"]))
            out(format_case(results[-1], d2d))
    finally:
        from ..ops.signals import deferred
        with deferred():  # a SIGTERM now ends the run once everything it started is stopped
            keep_logs = stopped is not None or not all(r.ok for r in results)
            pids = clean_up(cluster, engines, shm_before, keep_logs, out)
            launch.stop_forking()
    if stopped:
        out(f"{PROG}: stopped early: {stopped}")
    line, status = summarize(results, d2d, device, time.monotonic() - started)
    if args.json:
        write_json(Path(args.json), results, d2d_gbps=d2d, device=device, status=status, stopped_early=stopped,
                   run_dir=str(cluster.root), pids=pids)
    out(line)
    if signalled is not None:
        raise signalled
    return 1 if stopped else status


def sizes_of(args: argparse.Namespace) -> Sizes:
    return Sizes(layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                 page_size=args.page_size, num_pages=args.pages, tokens=tuple(args.tokens))


def write_json(path: Path, results: Sequence[CaseResult], **run: Any) -> None:
    """Every case's figures, and the run's (device, d2d, status, its run dir and child pids)."""
    cases = [{**asdict(r.case), "name": r.case.name, "ok": r.ok, "done": r.done, "requests": r.requests,
              "wrong_bytes": r.wrong_bytes, "stray_bytes": r.stray_bytes, "bytes": r.nbytes, "seconds": r.seconds,
              "gbps": r.gbps, "fill_s": r.fill_s, "check_s": r.check_s, "moved": r.moved, "failures": r.failures}
             for r in results]
    path.write_text(json.dumps({**run, "cases": cases}, indent=1))


def _tp_pair(text: str) -> tuple[int, int]:
    p, d = text.split(":")
    return int(p), int(d)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cuda (cuda:0; skipped with exit 0 when CUDA is unavailable) or cpu: the same cases on "
                         "shared-memory CPU tensors, a dry run of this script")
    ap.add_argument("--deadline", type=float, default=420.0, help="seconds for the whole run (default 420)")
    ap.add_argument("--request-timeout", type=float, default=60.0, help="seconds for one step of a case (default 60)")
    ap.add_argument("--layouts", type=lambda s: s.split(","), default=list(LAYOUTS),
                    help=f"comma-separated, of {','.join(LAYOUTS)}")
    ap.add_argument("--transports", type=lambda s: s.split(","), default=list(TRANSPORTS),
                    help=f"comma-separated, of {','.join(TRANSPORTS)}")
    ap.add_argument("--tp", type=lambda s: [_tp_pair(x) for x in s.split(",")], default=list(TP_PAIRS),
                    help="prefill:decode TP pairs, comma-separated (default 1:1,2:1,1:2)")
    ap.add_argument("--layers", type=int, default=Sizes.layers)
    ap.add_argument("--kv-heads", type=int, default=Sizes.kv_heads)
    ap.add_argument("--head-dim", type=int, default=Sizes.head_dim)
    ap.add_argument("--dtype", default=Sizes.dtype, choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--page-size", type=int, default=Sizes.page_size)
    ap.add_argument("--pages", type=int, default=Sizes.num_pages, help="pages per rank (page 0 is padding)")
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=list(Sizes.tokens),
                    help="request lengths of each case, comma-separated")
    ap.add_argument("--mode", default="auto", choices=["auto", "direct", "staged"],
                    help="peer.mode of the daemons (local copies are always direct)")
    ap.add_argument("--ucx-tls", default=None, help=f"UCX_TLS of the NIXL daemons (default {UCX_TLS['cuda']} on "
                                                    f"cuda, {UCX_TLS['cpu']} on cpu)")
    ap.add_argument("--no-fork-server", action="store_true",
                    help="--device cpu: start every child with its own interpreter (by default they fork from one "
                         "that imported torch once, as the test suite's do; on cuda they always start on their own)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write every case's figures to this file")
    ap.add_argument("--no-landing-ring", action="store_true",
                    help="NIXL daemons offer no landing ring: chunks gathered from GPU memory are written in place "
                         "into the decode pages (the place route), sliced decode rows go direct")
    ap.add_argument("--integrity", default="off", choices=["off", "sampled", "full"],
                    help="integrity.mode of the daemons; not off: each case must have chunks checked, with the "
                         "device digest (word sums) on cuda, XXH3 on cpu")
    ap.add_argument("--corrupt-one-byte", action="store_true",
                    help="flip one destination byte of the first case before its check (the run must fail)")
    args = ap.parse_args(list(argv))
    bad = [x for x in args.layouts if x not in LAYOUTS] + [x for x in args.transports if x not in TRANSPORTS]
    if bad:
        ap.error(f"unknown layout or transport: {bad}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["engine"]:
        return engine_main(argv[1:])
    args = parse_args(argv)

    def out(line: str) -> None:
        print(line, flush=True)

    if args.device == "cuda":
        why = skip_reason()
        if why:
            out(f"{PROG}: skipped: {why}. GPU memory and CUDA IPC were not exercised; "
                "`--device cpu` runs the same cases on CPU shared memory")
            return 0
    try:
        sizes_of(args).check(args.tp)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    from ..ops.signals import cleanup_on_signals
    with cleanup_on_signals():  # SIGTERM/SIGINT/SIGHUP: stop the daemons and engines first
        return run_check(args, out)


if __name__ == "__main__":
    sys.exit(main())

"""The bench engine with one :class:`AsyncEngineClient` per rank: every in-flight request has
its calls in flight too."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

from .engine_layout import Layout, Rank, failure, finish, split_rounds, summary


async def _one(lay: Layout, ranks: list[Rank], req: str, set_idx: int, marks: list[float],
               latencies: list[float], failures: list[dict[str, Any]]) -> None:
    """One request: expect on every decode rank, send on every prefill rank, wait for done."""
    prefill = [r for r in ranks if r.role == "prefill"]
    decode = [r for r in ranks if r.role == "decode"]
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
        failures.extend(failure(ev) for ev in evs if ev.get("state") != "done")
    except Exception as exc:  # noqa: BLE001
        failures.append({"request_id": req, "error": f"{type(exc).__name__}: {exc}"[:200]})


async def _run(lay: Layout, ranks: list[Rank], plan: list[tuple[str, int | None]],
               failures: list[dict[str, Any]]) -> tuple[float, list[float]]:
    """Every request of ``plan``, ``window`` at a time; (first send to last done, latencies)."""
    free = deque(range(lay.window))
    sem = asyncio.Semaphore(lay.window)
    latencies: list[float] = []
    marks: list[float] = []

    async def slot(req: str, fixed: int | None) -> None:
        async with sem:
            set_idx = fixed if fixed is not None else free.popleft()
            try:
                await _one(lay, ranks, req, set_idx, marks, latencies, failures)
            finally:
                if fixed is None:
                    free.append(set_idx)

    await asyncio.gather(*(slot(req, fixed) for req, fixed in plan))
    return (max(marks) - min(marks)) if marks else 0.0, latencies


async def _missing_prefill(ranks: list[Rank], plan: list[tuple[str, int | None]],
                           failures: list[dict[str, Any]], wait_s: float = 60.0) -> int:
    """Each prefill rank reports every request once its pages are free; the reports not seen."""
    deadline = time.monotonic() + wait_s
    missing = 0
    for r in ranks:
        if r.role != "prefill":
            continue
        for req, _ in plan:
            try:
                ev = await r.client.wait(r.rid, req, timeout=max(0.1, deadline - time.monotonic()))
                if ev.get("state") != "done":
                    failures.append(failure(ev))
            except Exception:  # noqa: BLE001
                missing += 1
    return missing


async def drive_async(lay: Layout, ranks: list[Rank], result: dict[str, Any], t_setup: float) -> None:
    from ...sdk.client import AsyncEngineClient
    failures: list[dict[str, Any]] = result["failures"]
    try:
        for r in ranks:
            r.client = AsyncEngineClient(lay.socket_of(r), timeout=60)
            r.rid = await r.client.register(lay.instance_of(r), r.role, r.geometry, r.cache.descriptors())
        result["setup_s"] = round(time.perf_counter() - t_setup, 3)
        t_warm = time.perf_counter()
        await _run(lay, ranks, lay.warmup_plan(), failures)
        lay.reset_checked(ranks)
        result["warmup_s"] = round(time.perf_counter() - t_warm, 3)
        if failures:
            raise RuntimeError("warm-up requests failed")
        plan = lay.timed_plan()
        rounds, lat = [], []
        for part in split_rounds(plan, lay.cfg.get("rounds", 1)):
            seconds, part_lat = await _run(lay, ranks, part, failures)
            rounds.append((len(part), seconds))
            lat += part_lat
        result.update(summary(lay, rounds, lat))
        finish(lay, ranks, result, await _missing_prefill(ranks, plan, failures))
    finally:
        for r in ranks:
            if r.client is not None:
                try:
                    if r.rid:
                        await r.client.call("unregister", rank_id=r.rid)
                except Exception:  # noqa: BLE001
                    pass
                r.client.close()

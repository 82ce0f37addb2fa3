"""Load, CI-sized: well over a thousand requests through two daemons and five engine ranks.

Prefill TP 2 (page size 4) on daemon A; on daemon B decode TP 2 with page size 8 (whole
rows, page-size mismatch, direct) and decode TP 1 (head slices, staged through bounce
buffers). Tiny geometry. Requests of mixed sizes, chunking and ordering, many in flight at
once, every one verified byte-exact on every decode rank.
Afterwards both daemons hold no request entries, their staging memory has not grown, their
RSS (``/proc/PID/status`` VmRSS) stayed bounded and their open file descriptors are within a
small constant of where they started.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from e2e_util import Node, module_cluster, spec
from kvxferd.sdk.client import EngineClient
from test_fuzz_engine import wait_idle

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import reliability_report as rr  # noqa: E402

REQUESTS = 2000
WARMUP = 60
CONCURRENCY = 48
NUM_PAGES = 1024
PAGE_P = 4
MAX_TOKENS = 48
RSS_GROWTH_LIMIT_KB = 48 * 1024
FD_SLACK = 8
CONFIG = ("[timeouts]\nbootstrap_s = 30.0\nwaiting_for_input_s = 30.0\ntransfer_s = 30.0\ndrain_grace_s = 1.0\n")


class Pages:
    """A free list of page indices for one side."""

    def __init__(self, n: int, rng: random.Random) -> None:
        self.free = list(range(n))
        rng.shuffle(self.free)

    def take(self, k: int) -> list[int]:
        out, self.free = self.free[:k], self.free[k:]
        assert len(out) == k, "page pool exhausted"
        return out

    def give(self, pages: list[int]) -> None:
        self.free.extend(pages)


def chunking(rng: random.Random, n: int) -> list[list[int]] | None:
    if n < 2 or rng.random() < 0.4:
        return None  # one chunk
    cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(1, 3))))
    bounds = [0, *cuts, n]
    return [[bounds[i], bounds[i + 1]] for i in range(len(bounds) - 1)]


def measure(d) -> dict[str, Any]:
    samples = rr.scrape(d.metrics_url)
    with EngineClient(d.socket_path, timeout=10) as client:
        left = client.status()["requests"]
    return {"rss_kb": rr.rss_kb(d.proc.pid), "fds": rr.open_fds(d.proc.pid),
            "staging": samples.get("kvxferd_staging_bytes_in_use", 0.0), "requests": left}


@pytest.fixture(scope="module")
def cluster(request):
    yield from module_cluster(request, Node("load-a", CONFIG), Node("load-b", CONFIG))


def run_requests(prefill, decodes, rng: random.Random, count: int, prefix: str, source_address: str,
                 stats: dict[str, Any]) -> None:
    src_pool = Pages(NUM_PAGES, rng)
    dst_pools = [Pages(NUM_PAGES, rng) for _ in decodes]
    workers = prefill + [w for group in decodes for w in group]
    inflight: dict[str, dict[str, Any]] = {}
    issued = done = 0
    deadline = time.monotonic() + 120
    while done < count:
        while issued < count and len(inflight) < CONCURRENCY:
            rid = f"{prefix}-{issued}"
            n = rng.randint(1, MAX_TOKENS)
            target = 0 if rng.random() < 0.65 else 1
            decode, dst_pool = decodes[target], dst_pools[target]
            src = src_pool.take(-(-n // PAGE_P))
            dst = dst_pool.take(-(-n // decode[0].geometry.spec.page_size))
            chunks = chunking(rng, n)
            order = rng.random() < 0.7  # mostly expect first, sometimes the chunks come first
            first, second = (decode, prefill) if order else (prefill, decode)
            for group in (first, second):
                for w in group:
                    if w.role == "decode":
                        w.command(cmd="expect", request_id=rid, pages=dst, n=n, source_instance=prefill[0].instance,
                                  source_address=source_address)
                    else:
                        w.command(cmd="send", request_id=rid, pages=src, n=n, chunks=chunks)
            inflight[rid] = {"src": src, "dst": dst, "pool": dst_pool, "events": [],
                             "expected": len(prefill) + len(decode)}
            stats["by_target"][target] += 1
            stats["tokens"].append(n)
            stats["chunked"] += chunks is not None
            issued += 1
        progressed = False
        for w in workers:
            while not w.events.empty():
                ev = w.events.get_nowait()
                progressed = True
                assert ev.get("event") != "exit", "a worker exited"
                rid = ev.get("request_id")
                assert ev.get("event") == "finished", ev
                entry = inflight[rid]
                entry["events"].append((w.role, ev))
                if len(entry["events"]) == entry["expected"]:
                    for role, e in entry["events"]:
                        assert e["state"] == "done", e
                        if role == "decode":
                            assert e["mismatched_bytes"] == 0, e
                    src_pool.give(entry["src"])
                    entry["pool"].give(entry["dst"])
                    del inflight[rid]
                    done += 1
                    stats["verified"] += 1
        if not progressed:
            assert time.monotonic() < deadline, f"{len(inflight)} requests stuck: {sorted(inflight)[:5]}"
            time.sleep(0.002)


def test_two_thousand_requests_across_two_daemons_stay_bounded(cluster):
    a, b = cluster.daemons["load-a"], cluster.daemons["load-b"]
    prefill, decode, staged = cluster.instances((a, "load-p", "prefill", spec(tp_size=2), NUM_PAGES),
                                              (b, "load-d", "decode", spec(tp_size=2, page_size=8), NUM_PAGES),
                                              (b, "load-s", "decode", spec(), NUM_PAGES))
    decodes = [decode, staged]
    rng = random.Random(1234)
    stats: dict[str, Any] = {"tokens": [], "chunked": 0, "verified": 0, "by_target": [0, 0]}
    run_requests(prefill, decodes, rng, WARMUP, "warm", a.address, stats)
    for d in (a, b):
        with EngineClient(d.socket_path, timeout=10) as client:
            assert wait_idle(client, 10) == {}
    time.sleep(0.5)
    before = {d.name: measure(d) for d in (a, b)}
    started = time.monotonic()
    run_requests(prefill, decodes, rng, REQUESTS, "load", a.address, stats)
    seconds = time.monotonic() - started
    for d in (a, b):
        with EngineClient(d.socket_path, timeout=10) as client:
            assert wait_idle(client, 10) == {}
    time.sleep(0.5)
    after = {d.name: measure(d) for d in (a, b)}
    leaks = []
    daemons = {}
    for name in before:
        x, y = before[name], after[name]
        daemons[name] = {"rss_kb_before": x["rss_kb"], "rss_kb_after": y["rss_kb"], "fds_before": x["fds"],
                         "fds_after": y["fds"], "requests_left": y["requests"],
                         "staging_bytes_before": int(x["staging"]), "staging_bytes_after": int(y["staging"])}
        if y["requests"]:
            leaks.append(f"{name}: request entries left {y['requests']}")
        if y["fds"] > x["fds"] + FD_SLACK:
            leaks.append(f"{name}: open descriptors {x['fds']} -> {y['fds']}")
        if y["staging"] > x["staging"]:
            leaks.append(f"{name}: staging bytes {x['staging']:.0f} -> {y['staging']:.0f}")
        if y["rss_kb"] - x["rss_kb"] > RSS_GROWTH_LIMIT_KB:
            leaks.append(f"{name}: RSS {x['rss_kb']} KiB -> {y['rss_kb']} KiB")
    rr.record("load", "two daemons, five engine ranks", {
        "requests": REQUESTS + WARMUP, "verified": stats["verified"], "concurrency": CONCURRENCY,
        "layout": f"prefill TP2 (page 4) on daemon A; decode TP2 (page 8, direct, {stats['by_target'][0]} "
                  f"requests) and decode TP1 (staged head slices, {stats['by_target'][1]} requests) on daemon B",
        "tokens_min": min(stats["tokens"]), "tokens_max": max(stats["tokens"]), "chunked": stats["chunked"],
        "seconds": seconds, "requests_per_s": REQUESTS / seconds, "daemons": daemons, "leaks": leaks})
    assert stats["verified"] == REQUESTS + WARMUP
    assert not leaks, leaks

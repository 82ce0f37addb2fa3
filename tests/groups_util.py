"""Shared pieces of the cache-group end-to-end tests: model shapes, a runner that moves requests
with every group and has each decode rank check every group against the oracle, canary checks."""

from __future__ import annotations

import random
import urllib.request
from typing import Any

from e2e_util import Cluster, close, finished, spec
from kvxferd.model.geometry import InstanceSpec
from kvxferd.tools.sim import Worker

NUM_PAGES = 48
request_ids = iter(range(1 << 30))

CONV = {"name": "conv", "kind": "state", "num_layers": 6, "shape": [32, 3], "split_dim": 0, "split_parts": [8, 8, 16],
        "dtype": "bfloat16"}  # q|k|v channels, each split by TP
SSM = {"name": "ssm", "kind": "state", "num_layers": 6, "shape": [4, 8, 16], "split_dim": 0, "dtype": "float32"}
SWA = {"name": "swa", "kind": "window", "num_layers": 3, "head_dim": 16, "total_kv_heads": 2, "window": 128}
DRAFT = {"name": "draft", "kind": "draft", "num_layers": 1, "head_dim": 32, "total_kv_heads": 2, "page_size": 8}


def qwen_next(tp: int, pp: int = 1) -> InstanceSpec:
    return spec(num_layers=2, total_kv_heads=2, tp_size=tp, pp_size=pp, groups=(as_group(CONV), as_group(SSM)))


def gpt_oss(tp: int, window: int = 128, pp: int = 1) -> InstanceSpec:
    return spec(num_layers=3, total_kv_heads=2, page_size=16, tp_size=tp, pp_size=pp,
                groups=(as_group({**SWA, "window": window}),))


def with_draft(tp: int) -> InstanceSpec:
    return spec(total_kv_heads=2, tp_size=tp, groups=(as_group(DRAFT),))


def as_group(d: dict[str, Any]):
    from kvxferd.model.groups import Group
    return Group.from_dict(d)


def _tables(rng: random.Random, s: InstanceSpec, n: int,
            used: dict[str, set[int]]) -> tuple[list[int], dict[str, list[int]]]:
    """Fresh main pages and group tables (pages from token 0, or one state slot) not used before."""
    def take(name: str, count: int) -> list[int]:
        free = [p for p in range(NUM_PAGES) if p not in used.setdefault(name, set())]
        picked = rng.sample(free, count)
        used[name].update(picked)
        return picked
    main = take("", -(-n // s.page_size))
    groups = {}
    for g in s.groups:
        groups[g.name] = take(g.name, 1) if g.kind == "state" else take(g.name, -(-n // s.group_spec(g.name).page_size))
    return main, groups


def metric(daemon, name: str, **labels: str) -> float:
    """Sum of a counter's samples on one daemon whose labels include ``labels``."""
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{"):
            head, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


def group_bytes(daemon) -> dict[str, float]:
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvxferd_group_sent_bytes_total{"):
            out[line.split('group="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def run_groups(cluster: Cluster, pspec: InstanceSpec, dspec: InstanceSpec, *, n_tokens: int, transport: str,
               chunks: list[list[int]] | None = None, requests: int = 2, seed: int = 0,
               prefill_node: str = "prefill-node", decode_node: str = "decode-node") -> tuple[list[Worker], list[dict]]:
    """Fresh instances move ``requests`` requests with every group; each decode rank verifies every
    group byte-exact (its share of each). Returns the decode workers (still open) and the
    [main pages, group tables] of every request, for the caller's further checks."""
    rng = random.Random(seed)
    n = next(request_ids)
    pd = cluster.daemons[prefill_node]
    dd = pd if transport == "local" else cluster.daemons[decode_node]
    prefill, decode = cluster.instances((pd, f"gp{n}", "prefill", pspec, NUM_PAGES),
                                        (dd, f"gd{n}", "decode", dspec, NUM_PAGES))
    src_used: dict[str, set[int]] = {}
    dst_used: dict[str, set[int]] = {}
    moved = []
    try:
        for i in range(requests):
            rid = f"g{n}-{i}"
            src, src_groups = _tables(rng, pspec, n_tokens, src_used)
            dst, dst_groups = _tables(rng, dspec, n_tokens, dst_used)
            src_used.clear()  # the prefill side may reuse its pages once a request is done
            for w in decode:
                w.command(cmd="expect", request_id=rid, pages=dst, n=n_tokens, groups=dst_groups,
                          source_instance=prefill[0].instance,
                          source_address=None if transport == "local" else pd.address)
            for w in prefill:
                w.command(cmd="send", request_id=rid, pages=src, n=n_tokens, chunks=chunks, groups=src_groups)
            for w in decode:
                ev = finished(w, rid)
                assert ev["event"] == "finished" and ev["state"] == "done", ev
                assert ev["mismatched_bytes"] == 0, ev
                assert ev["group_mismatched_bytes"] == {g.name: 0 for g in dspec.groups}, ev
            for w in prefill:
                ev = finished(w, rid)
                assert ev["event"] == "finished" and ev["state"] == "done", ev
            moved.append([dst, dst_groups])
    finally:
        close(prefill)
    return decode, moved


def untouched(worker: Worker, **cmd: Any) -> int:
    worker.command(cmd="untouched", **cmd)
    while True:
        ev = worker.next_event(60)
        if ev.get("event") == "untouched":
            return int(ev["bad_bytes"])


def never_used(decode: list[Worker], moved: list[list[Any]], dspec: InstanceSpec) -> None:
    """Pages and slots of every group that no request named still hold the canary."""
    for w in decode:
        assert untouched(w, pages=[p for p in range(NUM_PAGES) if all(p not in m[0] for m in moved)]) == 0
        for g in dspec.groups:
            never = [p for p in range(NUM_PAGES) if all(p not in m[1][g.name] for m in moved)]
            assert untouched(w, pages=never, group=g.name) == 0, g.name

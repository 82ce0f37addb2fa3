"""Cache groups end to end: real daemons and engine processes, every byte against the oracle.

- a Qwen3-Next-shaped hybrid (linear-attention conv and SSM state groups beside full
  attention), TP 2 -> 1 and 1 -> 2: the state splits along its channels like KV heads;
- a gpt-oss-shaped model (window-128 layers beside full layers) with a prompt longer than
  the window, chunked: only the window's tokens move, the window group's pages before it and
  the rows before the window on its first page keep the canary, and the daemon's per-group
  byte count is the window's;
- a target model with a draft-model KV group (its own heads, head_dim and page size);
- mismatched groups refused at the handshake with the group, the field and both values.
"""

from __future__ import annotations

import random
import urllib.request
from typing import Any

import pytest

from e2e_util import Cluster, close, finished, module_cluster, spec
from kvxferd.geometry import InstanceSpec
from kvxferd.tools.sim import Worker

NUM_PAGES = 48
_ids = iter(range(1 << 30))

CONV = {"name": "conv", "kind": "state", "num_layers": 6, "shape": [32, 3], "split_dim": 0, "split_parts": [8, 8, 16],
        "dtype": "bfloat16"}  # q|k|v channels, each split by TP
SSM = {"name": "ssm", "kind": "state", "num_layers": 6, "shape": [4, 8, 16], "split_dim": 0, "dtype": "float32"}
SWA = {"name": "swa", "kind": "window", "num_layers": 3, "head_dim": 16, "total_kv_heads": 2, "window": 128}
DRAFT = {"name": "draft", "kind": "draft", "num_layers": 1, "head_dim": 32, "total_kv_heads": 2, "page_size": 8}


def qwen_next(tp: int) -> InstanceSpec:
    return spec(num_layers=2, total_kv_heads=2, tp_size=tp, groups=(_g(CONV), _g(SSM)))


def gpt_oss(tp: int, window: int = 128) -> InstanceSpec:
    return spec(num_layers=3, total_kv_heads=2, page_size=16, tp_size=tp, groups=(_g({**SWA, "window": window}),))


def with_draft(tp: int) -> InstanceSpec:
    return spec(total_kv_heads=2, tp_size=tp, groups=(_g(DRAFT),))


def _g(d: dict[str, Any]):
    from kvxferd.groups import Group
    return Group.from_dict(d)


@pytest.fixture(scope="module")
def cluster(request):
    yield from module_cluster(request, "prefill-node", "decode-node")


def _tables(rng: random.Random, s: InstanceSpec, n: int, used: dict[str, set[int]]) -> tuple[list[int], dict[str, list[int]]]:
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


def _group_bytes(daemon) -> dict[str, float]:
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvxferd_group_sent_bytes_total{"):
            out[line.split('group="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def run_groups(cluster: Cluster, pspec: InstanceSpec, dspec: InstanceSpec, *, n_tokens: int, transport: str,
               chunks: list[list[int]] | None = None, requests: int = 2, seed: int = 0) -> tuple[list[Worker], list[dict]]:
    """Fresh instances move ``requests`` requests with every group; each decode rank verifies every
    group byte-exact (its share of each). Returns the decode workers (still open) and the
    [main pages, group tables] of every request, for the caller's further checks."""
    rng = random.Random(seed)
    n = next(_ids)
    pd = cluster.daemons["prefill-node"]
    dd = pd if transport == "local" else cluster.daemons["decode-node"]
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


def _untouched(worker: Worker, **cmd: Any) -> int:
    worker.command(cmd="untouched", **cmd)
    while True:
        ev = worker.next_event(60)
        if ev.get("event") == "untouched":
            return int(ev["bad_bytes"])


def _never_used(decode: list[Worker], moved: list[list[Any]], dspec: InstanceSpec) -> None:
    """Pages and slots of every group that no request named still hold the canary."""
    for w in decode:
        assert _untouched(w, pages=[p for p in range(NUM_PAGES) if all(p not in m[0] for m in moved)]) == 0
        for g in dspec.groups:
            never = [p for p in range(NUM_PAGES) if all(p not in m[1][g.name] for m in moved)]
            assert _untouched(w, pages=never, group=g.name) == 0, g.name


@pytest.mark.parametrize("transport", ["tcp", "local"])
@pytest.mark.parametrize("tp", [(2, 1), (1, 2)], ids=["tp2to1", "tp1to2"])
def test_hybrid_state_groups_heterogeneous_tp(cluster, transport, tp):
    pspec, dspec = qwen_next(tp[0]), qwen_next(tp[1])
    decode, moved = run_groups(cluster, pspec, dspec, n_tokens=37, transport=transport,
                               chunks=[[0, 16], [16, 37]])
    try:
        _never_used(decode, moved, dspec)
    finally:
        close(decode)


@pytest.mark.parametrize("transport", ["tcp", "local"])
@pytest.mark.parametrize("tp", [(1, 1), (2, 1)], ids=["tp1to1", "tp2to1"])
def test_sliding_window_moves_only_the_window(cluster, transport, tp):
    pspec, dspec = gpt_oss(tp[0]), gpt_oss(tp[1])
    n, window, ps = 300, 128, 16
    source = cluster.daemons["prefill-node"]
    before = _group_bytes(source)
    decode, moved = run_groups(cluster, pspec, dspec, n_tokens=n, transport=transport, requests=1,
                               chunks=[[0, 96], [96, 208], [208, 300]])
    try:
        after = _group_bytes(source)
        row = 3 * 2 * 2 * 16 * 2  # layers x (k, v) x heads x head_dim x bf16 bytes: one token of the group
        assert after["window"] - before.get("window", 0) == window * row
        assert after["full"] - before.get("full", 0) == n * row
        first = n - window  # token 172, inside page 10 of the window group
        for w in decode:
            table = moved[0][1]["swa"]
            # the pages wholly before the window were named but never written ...
            assert _untouched(w, pages=table[:first // ps], group="swa") == 0
            # ... nor the rows before the window on its first page
            assert _untouched(w, pages=[], group="swa", rows=[table, first // ps * ps, first]) == 0
        _never_used(decode, moved, dspec)
    finally:
        close(decode)


@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_draft_model_kv_group(cluster, transport):
    decode, moved = run_groups(cluster, with_draft(2), with_draft(1), n_tokens=29, transport=transport,
                               chunks=[[0, 8], [8, 29]])
    try:
        _never_used(decode, moved, with_draft(1))
    finally:
        close(decode)


@pytest.mark.parametrize("pspec, dspec, field, words", [
    (gpt_oss(1), gpt_oss(1, window=64), "groups.swa.window", ["128", "64"]),
    (qwen_next(1), spec(num_layers=2, total_kv_heads=2, groups=(_g(CONV),)), "groups.ssm", ["ssm", "prefill"]),
    (qwen_next(1), spec(num_layers=2, total_kv_heads=2, groups=(_g({**CONV, "shape": [32, 4]}), _g(SSM))),
     "groups.conv.shape", ["[32, 3]", "[32, 4]"]),
], ids=["window", "missing", "shape"])
def test_mismatched_groups_are_refused_naming_group_and_field(cluster, pspec, dspec, field, words):
    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    n = next(_ids)
    prefill, decode = cluster.instances((pd, f"rp{n}", "prefill", pspec, NUM_PAGES),
                                        (dd, f"rd{n}", "decode", dspec, NUM_PAGES))
    try:
        groups = {g.name: [1] if g.kind == "state" else list(range(20)) for g in dspec.groups}
        decode[0].command(cmd="expect", request_id=f"ref-{n}", pages=list(range(80)) [:20], n=70, groups=groups,
                          source_instance=prefill[0].instance, source_address=pd.address)
        ev = finished(decode[0], f"ref-{n}")
        assert ev["state"] == "failed" and ev["code"] == "incompatible", ev
        assert field in ev["reason"] and all(w in ev["reason"] for w in words), ev["reason"]
    finally:
        close(prefill + decode)


def test_requests_must_name_every_group(cluster):
    dd = cluster.daemons["decode-node"]
    decode = cluster.instance(dd, f"nd{next(_ids)}", "decode", qwen_next(1), NUM_PAGES)
    try:
        decode[0].command(cmd="expect", request_id="ng-1", pages=[1, 2], n=5, groups={"conv": [3]},
                          source_instance="x", source_address=cluster.daemons["prefill-node"].address)
        ev = finished(decode[0], "ng-1")
        assert ev["event"] == "error" and ev["field"] == "groups.ssm" and "ssm" in ev["error"], ev
        decode[0].command(cmd="expect", request_id="ng-2", pages=[1, 2], n=5, groups={"conv": [3, 4], "ssm": [1]},
                          source_instance="x", source_address=cluster.daemons["prefill-node"].address)
        ev = finished(decode[0], "ng-2")
        assert ev["event"] == "error" and ev["field"] == "groups.conv" and "one state slot" in ev["error"], ev
    finally:
        close(decode)

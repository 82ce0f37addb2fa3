"""Cache groups end to end: real daemons and engine processes, every byte against the oracle.

- a Qwen3-Next-shaped hybrid (linear-attention conv and SSM state groups beside full
  attention), TP 2 -> 1 and 1 -> 2: the state splits along its channels like KV heads;
- a gpt-oss-shaped model (window-128 layers beside full layers) with a prompt longer than
  the window, chunked: only the window's tokens move, the window group's pages before it and
  the rows before the window on its first page keep the canary, and the daemon's per-group
  byte count is the window's;
- both across PP stages (PP 2 -> 1 and 1 -> 2, the window model with a TP change too): each
  stage holds its own layers of every group;
- a target model with a draft-model KV group (its own heads, head_dim and page size);
- mismatched groups refused at the handshake with the group, the field and both values.
"""

from __future__ import annotations

import pytest

from e2e_util import Node, close, cluster_run, finished, module_cluster, spec, start_nodes
from kvxferd.model.geometry import InstanceSpec
from groups_util import (CONV, NUM_PAGES, SSM, as_group, gpt_oss, group_bytes, metric, never_used, qwen_next,
                         request_ids, run_groups, untouched, with_draft)


@pytest.fixture(scope="module")
def cluster(request):
    yield from module_cluster(request, "prefill-node", "decode-node")


@pytest.mark.parametrize("transport", ["tcp", "local"])
@pytest.mark.parametrize("tp", [(2, 1), (1, 2)], ids=["tp2to1", "tp1to2"])
def test_hybrid_state_groups_heterogeneous_tp(cluster, transport, tp):
    pspec, dspec = qwen_next(tp[0]), qwen_next(tp[1])
    decode, moved = run_groups(cluster, pspec, dspec, n_tokens=37, transport=transport,
                               chunks=[[0, 16], [16, 37]])
    try:
        never_used(decode, moved, dspec)
    finally:
        close(decode)


@pytest.mark.parametrize("transport", ["tcp", "local"])
@pytest.mark.parametrize("tp", [(1, 1), (2, 1)], ids=["tp1to1", "tp2to1"])
def test_sliding_window_moves_only_the_window(cluster, transport, tp):
    pspec, dspec = gpt_oss(tp[0]), gpt_oss(tp[1])
    n, window, ps = 300, 128, 16
    source = cluster.daemons["prefill-node"]
    before = group_bytes(source)
    decode, moved = run_groups(cluster, pspec, dspec, n_tokens=n, transport=transport, requests=1,
                               chunks=[[0, 96], [96, 208], [208, 300]])
    try:
        after = group_bytes(source)
        row = 3 * 2 * 2 * 16 * 2  # layers x (k, v) x heads x head_dim x bf16 bytes: one token of the group
        assert after["window"] - before.get("window", 0) == window * row
        assert after["full"] - before.get("full", 0) == n * row
        first = n - window  # token 172, inside page 10 of the window group
        for w in decode:
            table = moved[0][1]["swa"]
            # the pages wholly before the window were named but never written ...
            assert untouched(w, pages=table[:first // ps], group="swa") == 0
            # ... nor the rows before the window on its first page
            assert untouched(w, pages=[], group="swa", rows=[table, first // ps * ps, first]) == 0
        never_used(decode, moved, dspec)
    finally:
        close(decode)


def uneven(tp: int, pp: int = 2) -> InstanceSpec:
    """The hybrid with its conv layers split unevenly over two stages (1 and 5)."""
    return spec(num_layers=2, total_kv_heads=2, tp_size=tp, pp_size=pp,
                groups=(as_group({**CONV, "layer_splits": [[0, 1], [1, 6]]}), as_group(SSM)))


@pytest.mark.parametrize("make, pp", [(qwen_next, (2, 1)), (qwen_next, (1, 2)), (uneven, (2, 2))],
                         ids=["pp2to1", "pp1to2", "pp2-uneven-to-pp2-even"])
def test_hybrid_state_groups_across_pp_stages(cluster, make, pp):
    """Each stage holds its own layers of the full attention and of each state group (6 conv and
    6 SSM layers: 3 per stage, or the group's own split); the writers of a stage's layers are
    that stage's ranks."""
    pspec, dspec = make(1, pp=pp[0]), qwen_next(1, pp=pp[1])
    decode, moved = run_groups(cluster, pspec, dspec, n_tokens=37, transport="tcp", chunks=[[0, 16], [16, 37]])
    try:
        never_used(decode, moved, dspec)
    finally:
        close(decode)


@pytest.mark.parametrize("pp, tp", [((2, 1), (1, 2)), ((1, 2), (2, 1))], ids=["pp2tp1-to-pp1tp2", "pp1tp2-to-pp2tp1"])
def test_sliding_window_across_pp_stages_moves_only_the_window(cluster, pp, tp):
    n, window, ps = 300, 128, 16
    pspec, dspec = gpt_oss(tp[0], pp=pp[0]), gpt_oss(tp[1], pp=pp[1])
    decode, moved = run_groups(cluster, pspec, dspec, n_tokens=n, transport="tcp", requests=1,
                               chunks=[[0, 96], [96, 208], [208, 300]])
    try:
        first = n - window
        table = moved[0][1]["swa"]
        for w in decode:
            assert untouched(w, pages=table[:first // ps], group="swa") == 0
            assert untouched(w, pages=[], group="swa", rows=[table, first // ps * ps, first]) == 0
        never_used(decode, moved, dspec)
    finally:
        close(decode)


@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_draft_model_kv_group(cluster, transport):
    decode, moved = run_groups(cluster, with_draft(2), with_draft(1), n_tokens=29, transport=transport,
                               chunks=[[0, 8], [8, 29]])
    try:
        never_used(decode, moved, with_draft(1))
    finally:
        close(decode)


@pytest.mark.parametrize("pspec, dspec, field, words", [
    (gpt_oss(1), gpt_oss(1, window=64), "groups.swa.window", ["128", "64"]),
    (qwen_next(1), spec(num_layers=2, total_kv_heads=2, groups=(as_group(CONV),)), "groups.ssm", ["ssm", "prefill"]),
    (qwen_next(1), spec(num_layers=2, total_kv_heads=2, groups=(as_group({**CONV, "shape": [32, 4]}), as_group(SSM))),
     "groups.conv.shape", ["[32, 3]", "[32, 4]"]),
], ids=["window", "missing", "shape"])
def test_mismatched_groups_are_refused_naming_group_and_field(cluster, pspec, dspec, field, words):
    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    n = next(request_ids)
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
    decode = cluster.instance(dd, f"nd{next(request_ids)}", "decode", qwen_next(1), NUM_PAGES)
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


def test_the_last_chunk_must_name_every_state_slot(cluster):
    pd = cluster.daemons["prefill-node"]
    prefill = cluster.instance(pd, f"np{next(request_ids)}", "prefill", qwen_next(1), NUM_PAGES)
    try:
        # a KV group's pages and no state slots: refused before anything is held
        prefill[0].command(cmd="send", request_id="ns-1", pages=[1, 2], n=5, groups={"conv": [3]})
        ev = finished(prefill[0], "ns-1")
        assert ev["event"] == "error" and ev["field"] == "groups.ssm" and "last chunk" in ev["error"], ev
    finally:
        close(prefill)


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_groups_in_either_mode_through_tcp(request, mode):
    """Head slices of every group moved direct (runs straight from the socket) or staged."""
    with cluster_run(request) as c:
        env = {"KVXFERD_PEER_MODE": mode}
        pd, _ = start_nodes(c, Node("prefill-node", env=env), Node("decode-node", env=env))
        decode, moved = run_groups(c, qwen_next(2), qwen_next(1), n_tokens=37, transport="tcp", requests=1,
                                   chunks=[[0, 16], [16, 37]])
        try:
            never_used(decode, moved, qwen_next(1))
        finally:
            close(decode)
        other = "staged" if mode == "direct" else "direct"  # the plan's mode, whatever small runs did
        assert metric(pd, "kvxferd_transfers_total", side="prefill", outcome="done", mode=mode) == 2
        assert metric(pd, "kvxferd_transfers_total", side="prefill", mode=other) == 0

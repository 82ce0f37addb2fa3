"""Cache groups over NIXL: every group written one-sided, direct and staged, byte-exact.

Two pairs of daemons offer NIXL only over tcp's data port too (``peer.transport = "nixl"``
with tcp as a fallback); one pair moves in ``direct`` mode (WRITEs addressed by each
group's own destination table: its pages from token 0, or the request's state slot), one
in ``staged`` mode with 4 KiB slots and one landing slot (every group's chunk cut into
blocks that land in the ring and are scattered with the decode side's own tables). Each
case checks every group of every decode rank against the oracle, the canary of every page
no request named, and by metrics that exactly the request's bytes arrived over NIXL and
none over tcp:

- a Qwen3-Next-shaped hybrid (conv state with q|k|v parts, SSM state, full attention),
  TP 2 -> 1 and 1 -> 2;
- a gpt-oss-shaped model (window-128 layers beside full layers) with a 300-token prompt:
  only the window's tokens are written, the window group's pages before it and the rows
  before the window on its first page keep the canary;
- a draft-model KV group (its own heads, head_dim and page size), TP 2 -> 1;
- the hybrid and the window model across PP stages (PP 2 -> 1 and 1 -> 2).
"""

from __future__ import annotations

import math

import pytest

from e2e_util import Node, close, cluster_run, start_nodes
from groups_util import gpt_oss, never_used, qwen_next, run_groups, untouched, with_draft
from kvxferd.model.geometry import DTYPE_BITS, InstanceSpec
from nixl_util import NIXL_ENV, NIXL_MISSING, metric

SLOT = 4096
ENV = {
    # no landing ring: every chunk is a direct WRITE of its runs (with one, small head slices are staged)
    "direct": {**NIXL_ENV, "KVXFERD_PEER_MODE": "direct", "KVXFERD_LIMITS_NIXL_LANDING_SLOTS": "0"},
    "staged": {**NIXL_ENV, "KVXFERD_PEER_MODE": "staged", "KVXFERD_LIMITS_STAGING_SLOT_BYTES": str(SLOT),
               "KVXFERD_LIMITS_NIXL_BLOCK_BYTES": str(SLOT),
               "KVXFERD_LIMITS_STAGING_BYTES": str(4 * SLOT), "KVXFERD_LIMITS_NIXL_LANDING_SLOTS": "1"},
}


@pytest.fixture(scope="module")
def cluster(request):
    if NIXL_MISSING:
        pytest.skip(f"NIXL unusable here: {NIXL_MISSING}")
    with cluster_run(request) as c:
        start_nodes(c, *(Node(f"{side}-{mode}", env=env) for mode, env in ENV.items()
                         for side in ("prefill", "decode")))
        yield c


def request_bytes(s: InstanceSpec, n_tokens: int) -> int:
    """Every byte one request holds over all decode ranks of ``s`` (heads counted once), from the
    model's shape alone: full attention and draft KV for every token, a window group for the
    window's tokens, a state group's whole tensor per layer."""
    def kv(num_layers: int, heads: int, head_dim: int, dtype: str, tokens: int) -> int:
        return tokens * num_layers * 2 * heads * head_dim * DTYPE_BITS[dtype] // 8
    total = kv(s.num_layers, s.total_kv_heads, s.head_dim, s.dtype, n_tokens)
    for g in s.groups:
        if g.kind == "state":
            total += g.num_layers * math.prod(g.shape) * DTYPE_BITS[g.dtype] // 8
        else:
            tokens = min(n_tokens, g.window) if g.kind == "window" else n_tokens
            total += kv(g.num_layers, g.total_kv_heads, g.head_dim, g.dtype or s.dtype, tokens)
    return total


def move(cluster, mode: str, pspec: InstanceSpec, dspec: InstanceSpec, n_tokens: int, chunks, check=None) -> None:
    """Run requests between the mode's pair; the bytes must come over NIXL in that mode only."""
    pd, dd = cluster.daemons[f"prefill-{mode}"], cluster.daemons[f"decode-{mode}"]
    other = "staged" if mode == "direct" else "direct"
    before = {"nixl": metric(dd, "kvxferd_received_bytes_total", transport="nixl"),
              "tcp": metric(dd, "kvxferd_received_bytes_total", transport="tcp"),
              "sent": metric(pd, "kvxferd_sent_bytes_total", transport="nixl", mode=mode),
              "other": metric(pd, "kvxferd_sent_bytes_total", mode=other)}
    decode, moved = run_groups(cluster, pspec, dspec, n_tokens=n_tokens, transport="nixl", requests=2,
                               chunks=chunks, prefill_node=f"prefill-{mode}", decode_node=f"decode-{mode}")
    try:
        never_used(decode, moved, dspec)
        if check is not None:
            check(decode, moved)
    finally:
        close(decode)
    expected = 2 * request_bytes(dspec, n_tokens)
    assert metric(dd, "kvxferd_received_bytes_total", transport="nixl") - before["nixl"] == expected
    assert metric(pd, "kvxferd_sent_bytes_total", transport="nixl", mode=mode) - before["sent"] == expected
    assert metric(dd, "kvxferd_received_bytes_total", transport="tcp") == before["tcp"]
    assert metric(pd, "kvxferd_sent_bytes_total", mode=other) == before["other"]
    assert "event=nixl_skipped" not in pd.log()


MODES = ["direct", "staged"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tp", [(2, 1), (1, 2)], ids=["tp2to1", "tp1to2"])
def test_hybrid_state_and_full_attention_over_nixl(cluster, mode, tp):
    move(cluster, mode, qwen_next(tp[0]), qwen_next(tp[1]), 37, [[0, 16], [16, 37]])


@pytest.mark.parametrize("mode", MODES)
def test_sliding_window_over_nixl_writes_only_the_window(cluster, mode):
    n, window, ps = 300, 128, 16
    first = n - window  # token 172, inside page 10 of the window group

    def only_window(decode, moved):
        for w in decode:
            for _dst, tables in moved:
                table = tables["swa"]
                # the pages wholly before the window were named but never written ...
                assert untouched(w, pages=table[:first // ps], group="swa") == 0
                # ... nor the rows before the window on its first page
                assert untouched(w, pages=[], group="swa", rows=[table, first // ps * ps, first]) == 0

    move(cluster, mode, gpt_oss(1), gpt_oss(2), n, [[0, 96], [96, 208], [208, 300]], only_window)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pp", [(2, 1), (1, 2)], ids=["pp2to1", "pp1to2"])
def test_groups_across_pp_stages_over_nixl(cluster, mode, pp):
    """A hybrid and a window model whose stages each hold their own layers of every group."""
    move(cluster, mode, qwen_next(1, pp=pp[0]), qwen_next(1, pp=pp[1]), 37, [[0, 16], [16, 37]])
    move(cluster, mode, gpt_oss(1, pp=pp[0]), gpt_oss(2, pp=pp[1]), 300, [[0, 150], [150, 300]])


@pytest.mark.parametrize("mode", MODES)
def test_draft_group_over_nixl(cluster, mode):
    move(cluster, mode, with_draft(2), with_draft(1), 29, [[0, 8], [8, 29]])


def test_a_nixl_expect_must_carry_every_groups_table_inside_its_regions():
    """The prefill side checks each group's destination table against the regions the decode rank
    described for that group (a state group's regions hold its slots), before any WRITE."""
    from kvxferd.errors import ProtocolError, RequestError
    from kvxferd.transport.nixl.api import NixlPeer
    from kvxferd.transport.nixl.support import NixlSupport

    dspec = qwen_next(1)
    support = NixlSupport("unit", ["nixl", "tcp"], inbox=None, timeout_s=1, max_header_bytes=1 << 20, max_pages=8)
    peer = NixlPeer("agent-d", dspec)
    conv, ssm = dspec.group_spec("conv"), dspec.group_spec("ssm")
    # both states split along their first dimension: a slot is one row (of 32 x 3 and 4 x 8 x 16 entries)
    assert peer.units["conv"].page_size == 1 and peer.units["ssm"].page_size == 1 and peer.units[""].page_size == 4
    assert (conv.page_bytes, ssm.page_bytes) == (32 * 3 * 2, 4 * 8 * 16 * 4)
    peer.update([[0, 0, 0, "k", 1 << 20, 16 * dspec.page_bytes, -1], [0, 0, 0, "v", 2 << 20, 16 * dspec.page_bytes, -1],
                 [0, 0, 0, "conv.state", 3 << 20, 5 * conv.page_bytes, -1],
                 [0, 0, 0, "ssm.state", 4 << 20, 6 * ssm.page_bytes, -1]])
    assert peer.num_pages((0, 0)) == 16 and peer.num_pages((0, 0), "conv") == 5 and peer.num_pages((0, 0), "ssm") == 6
    got = support.expect_groups(peer, (0, 0), {"dst_groups": {"conv": [4], "ssm": [5]}})
    assert {k: v.tolist() for k, v in got.items()} == {"conv": [4], "ssm": [5]}
    cases = [({"dst_groups": {"conv": [5], "ssm": [0]}}, RequestError, "dst_groups.conv"),  # past its 5 slots
             ({"dst_groups": {"conv": [0]}}, ProtocolError, "dst_groups.ssm"),
             ({}, ProtocolError, "dst_groups.conv"),
             ({"dst_groups": {"conv": [0], "ssm": [0], "swa": [1]}}, ProtocolError, "dst_groups.swa"),
             ({"dst_groups": {"conv": [0], "ssm": list(range(9))}}, RequestError, "dst_groups.ssm")]
    for msg, kind, field in cases:
        with pytest.raises(kind) as err:
            support.expect_groups(peer, (0, 0), msg)
        assert err.value.field == field, msg
    with pytest.raises(RequestError) as err:  # a rank that described no region of the group
        support.expect_groups(NixlPeer("agent-d", dspec), (0, 0), {"dst_groups": {"conv": [0]}})
    assert err.value.field == "nixl_regions" and "conv" in str(err.value)

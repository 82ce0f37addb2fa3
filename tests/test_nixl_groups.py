"""Cache groups between two daemons that offer NIXL: the pair moves over tcp, byte-exact.

NIXL's one-sided WRITEs are built from one destination page table per rank; a cache group's
chunks have page tables (and state slots) of their own, which that path is not wired to.
Negotiation therefore skips NIXL for an instance with cache groups and says so in the log,
and every byte of every group still lands (over tcp), checked against the oracle.
"""

from __future__ import annotations

import pytest

from e2e_util import Node, close, cluster_run, start_nodes
from groups_util import gpt_oss, never_used, qwen_next, run_groups
from nixl_util import NIXL_ENV, NIXL_MISSING, metric


@pytest.fixture(scope="module")
def cluster(request):
    if NIXL_MISSING:
        pytest.skip(f"NIXL unusable here: {NIXL_MISSING}")
    with cluster_run(request) as c:
        start_nodes(c, Node("prefill-nixl", env=NIXL_ENV), Node("decode-nixl", env=NIXL_ENV))
        yield c


@pytest.mark.parametrize("make, tp", [(qwen_next, (2, 1)), (gpt_oss, (1, 2))], ids=["hybrid-tp2to1", "window-tp1to2"])
def test_groups_move_over_tcp_when_nixl_is_offered(cluster, make, tp):
    pd, dd = cluster.daemons["prefill-nixl"], cluster.daemons["decode-nixl"]
    nixl0 = metric(dd, "kvxferd_received_bytes_total", transport="nixl")
    tcp0 = metric(dd, "kvxferd_received_bytes_total", transport="tcp")
    dspec = make(tp[1])
    decode, moved = run_groups(cluster, make(tp[0]), dspec, n_tokens=150, transport="tcp", requests=1,
                               chunks=[[0, 64], [64, 150]], prefill_node="prefill-nixl", decode_node="decode-nixl")
    try:
        never_used(decode, moved, dspec)
    finally:
        close(decode)
    assert metric(dd, "kvxferd_received_bytes_total", transport="tcp") > tcp0
    assert metric(dd, "kvxferd_received_bytes_total", transport="nixl") == nixl0
    assert "event=nixl_skipped" in pd.log() and "cache groups is moved by tcp only" in pd.log()

"""NIXL over a long-lived pair of daemons while instances come and go.

Each instance registers its ranks, moves a few requests byte-exact over direct NIXL WRITEs
and unregisters (its engines exit); the next instance has another geometry, so its regions
have other sizes and may be mapped at virtual addresses the previous ones used. Every case
must pass on these daemons exactly as it would on fresh ones.

Reported against real deployments: after several such instances, direct WRITEs failed with
``NIXL_ERR_NOT_FOUND``. The cause was stale remote descriptors hiding newer regions mapped at
reused addresses (see ``kvxferd/transport/nixl/remote.py``); ``tests/test_nixl_remote.py``
reproduces it deterministically. This sequence of geometries passes with or without that
overlap, depending on where the decode daemon maps each engine's memory, and stays as the
end-to-end regression case for the report.
"""

from __future__ import annotations

import pytest

from e2e_util import Node, module_cluster, spec
from nixl_util import NIXL_ENV, NIXL_MISSING, SLOW_TIMEOUTS, metric, run_case

CASES = [  # (prefill spec, decode spec, tokens): Llama-8B-like TP1, PP2 -> PP1 with page 4 -> 16, MLA TP2 -> TP4
    (spec(num_layers=4, total_kv_heads=8, head_dim=32, page_size=8), spec(num_layers=4, total_kv_heads=8,
                                                                          head_dim=32, page_size=8), 37),
    (spec(pp_size=2, page_size=4), spec(page_size=16), 45),
    (spec(attention="mla", head_dim=64, tp_size=2), spec(attention="mla", head_dim=64, tp_size=4), 29),
]


@pytest.fixture(scope="module")
def cluster(request):
    if NIXL_MISSING:
        pytest.skip(f"NIXL unusable here: {NIXL_MISSING}")
    # no landing ring: every chunk is a direct WRITE of its runs (with one, small head slices are staged)
    env = {**NIXL_ENV, "KVXFERD_PEER_MODE": "direct", "KVXFERD_LIMITS_NIXL_LANDING_SLOTS": "0"}
    yield from module_cluster(request, Node("prefill-nixl", SLOW_TIMEOUTS, env), Node("decode-nixl", SLOW_TIMEOUTS, env))


@pytest.mark.parametrize("step", range(len(CASES) + 1))  # every geometry, then the first again
def test_instances_come_and_go_on_long_lived_daemons(cluster, step):
    pspec, dspec, n = CASES[step % len(CASES)]
    pd = cluster.daemons["prefill-nixl"]
    before = metric(pd, "kvxferd_sent_bytes_total", transport="nixl", mode="direct")
    run_case(cluster, pspec, dspec, n_tokens=n, chunks=[[0, 8], [8, n]], requests=2)
    # the bytes went as direct NIXL WRITEs, not over a tcp fallback
    assert metric(pd, "kvxferd_sent_bytes_total", transport="nixl", mode="direct") > before

"""End-to-end, byte-exact transfers through running daemons and engine processes.

Every case runs real daemon processes, real engine processes with shared-memory KV
caches, ZeroMQ over ipc:// and tcp://, and the tcp data transport (or the local one).
The decode ranks check their pages against their own slice of the request's logical
cache, so a wrong plan, offset or transport shows up as mismatched bytes.
"""

from __future__ import annotations

from functools import partial

import pytest

from e2e_util import Node, cluster_run, module_cluster, spec, start_nodes
from e2e_util import run_case as _run_case

# every request checks the aux bytes that travel with its last chunk (the first one has some)
run_case = partial(_run_case, aux=b"tok")


@pytest.fixture(scope="module")
def cluster(request):
    yield from module_cluster(request, "prefill-node", "decode-node")


@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_tp1_to_tp1(cluster, transport):
    run_case(cluster, spec(), spec(), transport=transport, n_tokens=37)


@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_send_before_expect(cluster, transport):
    run_case(cluster, spec(tp_size=2), spec(), transport=transport, n_tokens=21, order="send_first")


@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_tp2_to_tp1_chunked(cluster, transport):
    run_case(cluster, spec(tp_size=2), spec(), transport=transport, n_tokens=50, chunks=[[0, 16], [16, 40], [40, 50]])


@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_tp1_to_tp2(cluster, transport):
    run_case(cluster, spec(), spec(tp_size=2), transport=transport, n_tokens=33)


def test_tp4_replicated_to_tp1(cluster):
    # 2 KV heads on 4 prefill ranks: every head lives on two ranks, one of them writes it
    run_case(cluster, spec(tp_size=4, total_kv_heads=2), spec(total_kv_heads=2), transport="tcp", n_tokens=19)


def test_tp1_to_tp4_replicated(cluster):
    run_case(cluster, spec(total_kv_heads=2), spec(tp_size=4, total_kv_heads=2), transport="tcp", n_tokens=19)


@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_pp_mismatch(cluster, transport):
    pspec = spec(num_layers=5, pp_size=2, layer_splits=((0, 1), (1, 5)))
    dspec = spec(num_layers=5, tp_size=2, pp_size=2)  # even split: [0,3) [3,5)
    run_case(cluster, pspec, dspec, transport=transport, n_tokens=25)


@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_mla(cluster, transport):
    pspec = spec(attention="mla", head_dim=36, tp_size=2)
    dspec = spec(attention="mla", head_dim=36, pp_size=2)
    run_case(cluster, pspec, dspec, transport=transport, n_tokens=30)


@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_page_size_mismatch(cluster, transport):
    run_case(cluster, spec(page_size=3), spec(page_size=8, tp_size=2), transport=transport, n_tokens=41,
             chunks=[[0, 9], [9, 41]])


def test_chunk_not_page_aligned(cluster):
    run_case(cluster, spec(page_size=4), spec(page_size=4), transport="tcp", n_tokens=30, chunks=[[0, 7], [7, 30]])


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_modes_through_tcp(mode):
    with cluster_run() as c:
        env = {"KVXFERD_PEER_MODE": mode}
        start_nodes(c, Node("prefill-node", env=env), Node("decode-node", env=env))
        run_case(c, spec(tp_size=2, page_size=1), spec(page_size=2), transport="tcp", n_tokens=40)

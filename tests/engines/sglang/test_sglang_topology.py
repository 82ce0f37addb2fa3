"""Where an SGLang rank sits (DP rank, rendezvous, bootstrap host): the pure rules of
``kvxferd.adapters.sglang.topology``, each against the value an operator would name."""

from __future__ import annotations

import pytest

from kvxferd.adapters.sglang import topology
from kvxferd.errors import RegistrationError


@pytest.mark.parametrize("attn,system,want", [
    ((0, 1), (0, 1), None),  # no DP: a plain instance
    ((1, 4), (0, 1), (1, 4)),  # attention DP: SGLang's attn_dp_rank
    ((0, 1), (2, 3), (2, 3)),  # system DP (--dp-size without DP attention): the replica's rank
    ((0, 1), (None, 2), (0, 2)),  # SGLang leaves system_dp_rank None on its first replica
], ids=["none", "attention", "system", "system-none-rank"])
def test_dp_group_follows_sglang_bootstrap_numbering(attn, system, want):
    assert topology.dp_group(attn[0], attn[1], system[0], system[1]) == want


def test_dp_group_refuses_both_kinds_and_a_rank_out_of_range():
    with pytest.raises(RegistrationError) as both:
        topology.dp_group(1, 2, 1, 2)
    assert both.value.field == "attn_dp_size" and "dp_size is 2" in str(both.value)
    with pytest.raises(RegistrationError) as out:
        topology.dp_group(4, 4, None, 1)
    assert out.value.field == "attn_dp_rank" and "4 is not below its size 4" in str(out.value)


def test_rendezvous_named_by_the_operator_wins():
    got = topology.rendezvous("10.0.0.1:5557", nnodes=2, node_rank=1, dist_init_addr="10.0.0.9:20000",
                              own_address="10.0.0.2:5557")
    assert got == "10.0.0.1:5557"
    with pytest.raises(RegistrationError) as bad:
        topology.rendezvous("10.0.0.1", nnodes=1, node_rank=0, dist_init_addr=None, own_address="h:1")
    assert bad.value.field == "KVXFERD_SGLANG_RENDEZVOUS"


def test_rendezvous_follows_sglang_multi_node_settings():
    one_node = dict(nnodes=1, node_rank=0, dist_init_addr="10.0.0.9:20000", own_address="10.0.0.9:5557")
    assert topology.rendezvous(None, **one_node) is None
    # node 0 names its own daemon's advertised address: the string the daemon knows itself by
    assert topology.rendezvous(None, nnodes=2, node_rank=0, dist_init_addr="node0:20000",
                               own_address="10.0.0.9:5557") == "10.0.0.9:5557"
    # other nodes: node 0's host (dist_init_addr), the local daemon's peer port
    assert topology.rendezvous(None, nnodes=2, node_rank=1, dist_init_addr="node0:20000",
                               own_address="10.0.0.2:6001") == "node0:6001"
    assert topology.rendezvous(None, nnodes=2, node_rank=1, dist_init_addr="[fd00::1]:20000",
                               own_address="[fd00::2]:6001") == "[fd00::1]:6001"


def test_bootstrap_host():
    assert topology.bootstrap_host("b", nnodes=2, dist_init_addr="node0:1", serving_host="x") == "b"
    assert topology.bootstrap_host(None, nnodes=2, dist_init_addr="node0:1", serving_host="x") == "node0"
    assert topology.bootstrap_host(None, nnodes=1, dist_init_addr="node0:1", serving_host="x") == "x"
    assert topology.bootstrap_host(None, nnodes=1, dist_init_addr=None, serving_host="0.0.0.0") == "127.0.0.1"
    assert topology.bootstrap_host(None, nnodes=1, dist_init_addr=None, serving_host=None) == "127.0.0.1"

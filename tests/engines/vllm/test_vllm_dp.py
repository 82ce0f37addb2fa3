"""vLLM data-parallel (MoE DP) prefill ranks on the connector's worker side, against real daemons.

Two prefill DP ranks of one instance ``M`` (attention TP 1 each, vLLM's own CPU KV caches in
their own processes, ``rank_worker.py``): DP rank 0 on daemon a, DP rank 1 on daemon b, both
naming a as the rendezvous (``kv_connector_extra_config.rendezvous``). A decode rank of ``N``
on daemon d loads a request that only DP rank 1 computed, with the ``kv_transfer_params``
the prefill scheduler hands out (``source_dp_rank`` 1, the rendezvous as source address):
its daemon learns DP rank 1's rank from a, and the bytes land exactly (``kv_oracle``). The DP
fields are set on the config the connector reads, as vLLM's engine core sets them; vLLM's DP
process groups are not built (the connector does not use them).

The rig runs twice: its daemons on tcp, then on NIXL alone (``transport_util``); the transfer
must be carried by that transport alone, exactly its KV bytes, sent by DP rank 1's daemon
(DP rank 0's sends nothing) and received by the decode daemon.
"""

from __future__ import annotations

import glob
import shutil

import pytest

import vllm_util as vu
from kvxferd.tools.sim import Cluster, free_port
from ops_support import close_cluster, in_parallel
from procs import JsonProc, close_ranks, daemon_status
from test_vllm_worker import NUM_BLOCKS, PAGE_BYTES, Instance, check, save, step_all, steps_until
from transport_util import TRANSPORTS, Carried, daemon_env, require


@pytest.fixture(scope="module", params=TRANSPORTS)
def dp_rig(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    transport = request.param
    require(transport)
    root = tmp_path_factory.mktemp(f"vllm-dp-{transport}")
    shm_before = set(glob.glob("/dev/shm/kvxferd-vllm-*"))
    model = vu.make_tiny_llama(root / "model")
    cluster = Cluster()
    daemons = {n: cluster.daemon(f"node-{n}", start=False) for n in "abd"}
    in_parallel(*[lambda d=d: d.start(daemon_env(transport)) for d in daemons.values()])
    procs: list[JsonProc] = []
    rendezvous = daemons["a"].address

    def rank(name: str, node: str, role: str, dp: list[int] | None, **extra: str) -> JsonProc:
        d = daemons[node]
        kv = vu.kv_transfer_config(kv_role=role, instance=name, socket_path=d.socket_path, **extra)
        proc = JsonProc("rank_worker.py", {"tp": 1, "rank": 0, "dist_port": free_port(), "model_dir": str(model),
                                           "num_blocks": NUM_BLOCKS, "block_size": vu.BLOCK, "kv": kv, "dp": dp},
                        root / f"{name}-{node}.log")
        procs.append(proc)
        return proc

    try:
        p0 = rank("M", "a", "kv_producer", [0, 2], address=daemons["a"].address, rendezvous=rendezvous)
        p1 = rank("M", "b", "kv_producer", [1, 2], address=daemons["b"].address, rendezvous=rendezvous)
        dec = rank("N", "d", "kv_consumer", None)
        for p in procs:
            ev = p.next(300)
            assert ev["event"] == "registered", ev
        yield daemons, Instance("M0", daemons["a"], [p0]), Instance("M1", daemons["b"], [p1]), \
            Instance("N", daemons["d"], [dec]), transport
    finally:
        close_ranks(procs)
        close_cluster(cluster, keep_root=True)  # its daemon logs go below, once the daemons ended well
    assert set(glob.glob("/dev/shm/kvxferd-vllm-*")) == shm_before
    # each daemon outlived the ranks that unregistered from it, and stopped cleanly when told
    exits = {n: d.proc.returncode for n, d in daemons.items()}
    assert exits == {n: 0 for n in exits}, f"daemon exit codes {exits}; their logs are in {cluster.root}"
    shutil.rmtree(cluster.root, ignore_errors=True)


def test_decode_loads_from_the_dp_rank_its_params_name(dp_rig):
    daemons, dp0, dp1, dec, transport = dp_rig
    ranks_a = {r["instance"]: r.get("dp_size") for r in daemon_status(daemons["a"])["ranks"]}
    ranks_b = {r["instance"]: r.get("dp_size") for r in daemon_status(daemons["b"])["ranks"]}
    assert ranks_a == {"M.prefill@dp0": 2} and ranks_b == {"M.prefill@dp1": 2}
    tid, n = "dp-req-1", 70
    src_blocks, dst_blocks = [3, 7, 5], [9, 2, 11]
    for r in dp1.ranks:  # only DP rank 1 computed the request
        r.call(cmd="fill", rid=tid, blocks=src_blocks, n=n)
    wire, rendezvous = Carried([daemons["b"]], [daemons["d"]]), Carried([daemons["a"]], [])
    params = {"transfer_id": tid, "source_instance": "M.prefill", "source_address": daemons["a"].address,
              "num_tokens": n, "source_dp_rank": 1}
    step_all(dec, {"loads": [{"req_id": "d-1", "params": params, "block_ids": dst_blocks, "start": 0}]})
    step_all(dp1, save("p-1", tid, src_blocks, n, n))
    sent = steps_until(dp1, "sending", "p-1", finished=("p-1",))
    got = steps_until(dec, "recving", "d-1")
    assert all(r["errors"] == [] for r in got), got
    assert all(r["sending"] == ["p-1"] for r in sent), sent
    [report] = check(dec, tid, dst_blocks, n)
    assert report["mismatches"] == 0, report
    # the request's pages, all heads, every layer: sent by DP rank 1's daemon, none by DP rank 0's
    wire.assert_only(transport, -(-n // vu.BLOCK) * PAGE_BYTES * vu.MODEL["num_hidden_layers"])
    assert set(rendezvous.delta().values()) == {0}, rendezvous.delta()
    # DP rank 0 never saw the request: its step reports nothing sent
    assert step_all(dp0, {}) == [{"event": "step", "sending": [], "recving": [], "errors": [], "failed": []}]

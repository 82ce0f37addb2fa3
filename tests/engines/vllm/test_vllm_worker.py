"""The connector's worker side on vLLM's own CPU KV caches, against real daemons, byte-exact.

Every worker rank is its own process (``rank_worker.py``) with vLLM's distributed groups
initialised (gloo), its KV cache allocated by vLLM's ``allocate_kv_cache`` in the CPU
backend's layout ``[num_blocks, heads, block_size, 2 * head_size]``, and the connector
built as a WORKER. The tests hand each rank the step plans vLLM's scheduler side would
(that side is tested under vLLM's real Scheduler in test_vllm_scheduler.py) and check the
decode ranks' bytes against ``kv_oracle``, which knows the layout and nothing else.

vLLM instances (``kv_both``, so each registers a prefill and a decode rank):
  A: TP 2 on daemon a        B: TP 1 on daemon b
Two prefill sources whose bytes nobody checks are kvxferd's simulated engines (real
processes registering the same packed layout), which start in a second instead of vLLM's
twenty: C on daemon c (killed by one test) and W with 64-token pages (the page size B
does not have), on daemon a; and a simulated decode rank V with 64-token pages on daemon b,
which A's prefill pages are refused to. D: TP 1 on daemon d, which flips a landed byte of
every chunk that carries digests (its test-only fault injection), fed by the simulated
source S on daemon a.

The rig runs twice: its daemons on tcp, then on NIXL alone (``transport_util``); every
byte-exact transfer checks that its transport carried exactly its KV bytes, sent and
received, and the other transport none.
"""

from __future__ import annotations

import glob
import os
import signal
import time
import uuid
from typing import Any

import pytest

import vllm_util as vu
from kvxferd.model.geometry import InstanceSpec
from kvxferd.tools.sim import Cluster, free_port
from e2e_util import finished, wait_in_flight
from nixl_util import metric
from ops_support import close_cluster, in_parallel
from procs import JsonProc, close_ranks, daemon_status
from transport_util import TRANSPORTS, Carried, daemon_env, require

NUM_BLOCKS = 16
PAGE_BYTES = vu.BLOCK * vu.MODEL["num_key_value_heads"] * 2 * vu.HEAD * 4   # one layer's page, all heads, float32
#: daemon d: integrity off, but one landed byte of every chunk with digests flipped before its check
CORRUPTING = '[integrity]\nmode = "off"\ncorrupt_landed_every = 1\n'
WAIT = 180.0  # bounds a stuck request, not a slow machine: outcomes come much sooner when all is well


class Instance:
    def __init__(self, name: str, daemon: Any, ranks: list[Any], block: int = vu.BLOCK,
                 prefill_name: str | None = None) -> None:
        self.name, self.daemon, self.ranks, self.block = name, daemon, ranks, block
        self.prefill_name = prefill_name or f"{name}.prefill"   # the connector's naming

    def params(self, transfer_id: str, n: int) -> dict[str, Any]:
        return {"transfer_id": transfer_id, "source_instance": self.prefill_name,
                "source_address": self.daemon.address, "num_tokens": n}


def sim_spec(page_size: int) -> InstanceSpec:
    return InstanceSpec(attention="mha", num_layers=vu.MODEL["num_hidden_layers"], total_kv_heads=2,
                        head_dim=vu.HEAD, dtype="float32", page_size=page_size, layout="packed_page")


@pytest.fixture(scope="module", params=TRANSPORTS)
def rig(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    transport = request.param
    require(transport)
    root = tmp_path_factory.mktemp(f"vllm-worker-{transport}")
    shm_before = set(glob.glob("/dev/shm/kvxferd-vllm-*"))
    model = vu.make_tiny_llama(root / "model")
    cluster = Cluster()
    daemons = {n: cluster.daemon(f"node-{n}", start=False) for n in "abc"}
    daemons["d"] = cluster.daemon("node-d", start=False, extra_toml=CORRUPTING)
    in_parallel(*[lambda d=d: d.start(daemon_env(transport)) for d in daemons.values()])
    procs: list[JsonProc] = []

    def ranks(name: str, node: str, tp: int, block: int = vu.BLOCK, **extra: Any) -> list[JsonProc]:
        d, port = daemons[node], free_port()
        kv = vu.kv_transfer_config(instance=name, address=d.address, socket_path=d.socket_path, **extra)
        out = [JsonProc("rank_worker.py", {"tp": tp, "rank": r, "dist_port": port, "model_dir": str(model),
                                            "num_blocks": NUM_BLOCKS, "block_size": block, "kv": kv},
                        root / f"{name}-{r}.log") for r in range(tp)]
        procs.extend(out)
        return out

    inst = {"A": Instance("A", daemons["a"], ranks("A", "a", 2)),
            # B asks for integrity "full" (kv_connector_extra_config); the daemons run with it off
            "B": Instance("B", daemons["b"], ranks("B", "b", 1, integrity="full")),
            "D": Instance("D", daemons["d"], ranks("D", "d", 1, integrity="full"))}
    dead = f"dead-{uuid.uuid4().hex[:8]}"
    try:
        c, w, v, s = cluster.instances((daemons["c"], dead, "prefill", sim_spec(vu.BLOCK), NUM_BLOCKS),
                                       (daemons["a"], "W", "prefill", sim_spec(64), NUM_BLOCKS),
                                       (daemons["b"], "V", "decode", sim_spec(64), NUM_BLOCKS),
                                       (daemons["a"], "S", "prefill", sim_spec(vu.BLOCK), NUM_BLOCKS))
        inst["C"] = Instance("C", daemons["c"], c, prefill_name=dead)
        inst["W"] = Instance("W", daemons["a"], w, block=64, prefill_name="W")
        inst["V"] = Instance("V", daemons["b"], v, block=64)
        inst["S"] = Instance("S", daemons["a"], s, prefill_name="S")
        for p in procs:
            ev = p.next(300)
            assert ev["event"] == "registered", ev
        inst["transport"] = transport
        yield inst
    finally:
        close_ranks(procs)
        # the source whose daemon was killed still waits for its held request: it is killed,
        # so its shared-memory file is removed here
        for w in cluster.workers:
            if w.instance == dead:
                w.kill()
        for path in glob.glob(f"/dev/shm/kvxferd-{dead}-*"):
            os.unlink(path)
        close_cluster(cluster)
    # the vLLM ranks unregistered and unlinked the shared-memory files their KV was moved into
    assert set(glob.glob("/dev/shm/kvxferd-vllm-*")) == shm_before


def steps_until(inst: Instance, key: str, req_id: str, *, finished: tuple[str, ...] = (),
                plan: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Step every rank of ``inst`` (first with ``plan``) until each reports ``req_id`` under ``key``.

    Returns each rank's accumulated report (errors included). The step that starts a load is one
    of them: a refusal can be reported by that very step."""
    reports: list[dict[str, Any]] = [{"sending": [], "recving": [], "errors": [], "failed": []} for _ in inst.ranks]
    first = True
    deadline = time.monotonic() + WAIT
    while True:
        for rank, report in zip(inst.ranks, reports):
            if req_id in report[key]:
                continue
            ev = rank.call(cmd="step", plan=(plan or {}) if first else {}, finished=list(finished))
            for k in report:
                report[k] += ev[k]
        first = False
        if all(req_id in r[key] for r in reports):
            return reports
        assert time.monotonic() < deadline, f"{inst.name} never reported {req_id} in {key}: {reports}"
        time.sleep(0.05)


def step_all(inst: Instance, plan: dict[str, Any], finished: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    return [r.call(cmd="step", plan=plan, finished=list(finished)) for r in inst.ranks]


def load(req_id: str, src: Instance, tid: str, n: int, blocks: list[int], start: int = 0) -> dict[str, Any]:
    return {"loads": [{"req_id": req_id, "params": src.params(tid, n), "block_ids": blocks, "start": start}]}


def save(req_id: str, tid: str, blocks: list[int], computed: int, n: int,
         qos_class: str | None = None) -> dict[str, Any]:
    return {"saves": [{"req_id": req_id, "transfer_id": tid, "block_ids": blocks, "computed": computed,
                       "num_tokens": n, "qos_class": qos_class}]}


def check(inst: Instance, tid: str, blocks: list[int], n: int, start: int = 0) -> list[dict[str, Any]]:
    return [r.call(cmd="check", rid=tid, blocks=blocks, n=n, start=start) for r in inst.ranks]


def transfer(src: Instance, dst: Instance, tid: str, n: int, src_blocks: list[int], dst_blocks: list[int], *,
             computed_steps: list[int], transport: str, start: int = 0, qos_class: str | None = None) -> None:
    """Decode expects, prefill fills and saves step by step; both sides report; decode bytes checked,
    and the bytes each transport carried: the pages ``[start, n)`` covers, all heads, every layer."""
    wire = Carried([src.daemon], [dst.daemon])
    for r in src.ranks:
        r.call(cmd="fill", rid=tid, blocks=src_blocks, n=n)
    canary_before = [set(c["canary_blocks"]) for c in check(dst, tid, dst_blocks, start, start)]
    step_all(dst, load(f"d-{tid}", src, tid, n, dst_blocks, start))
    for computed in computed_steps:
        step_all(src, save(f"p-{tid}", tid, src_blocks, computed, n, qos_class))
    sent = steps_until(src, "sending", f"p-{tid}", finished=(f"p-{tid}",))
    got = steps_until(dst, "recving", f"d-{tid}")
    assert all(r["errors"] == [] for r in got), got
    assert all(r["sending"] == [f"p-{tid}"] for r in sent), sent
    for report, before in zip(check(dst, tid, dst_blocks, n, start), canary_before):
        assert report["mismatches"] == 0, report
        # no byte outside the pages [start, n) covers: prefix pages and other blocks keep their canary
        assert before - set(dst_blocks[start // dst.block:]) <= set(report["canary_blocks"]), report
        assert set(dst_blocks[start // dst.block:]).isdisjoint(report["canary_blocks"]), report
    wire.assert_only(transport, (-(-n // dst.block) - start // dst.block) * PAGE_BYTES * vu.MODEL["num_hidden_layers"])


def test_tp2_prefill_to_tp1_decode_in_chunks(rig):
    """B registered with integrity "full" on a daemon in "off": every chunk it receives is checked."""
    checked = metric(rig["B"].daemon, "kvxferd_integrity_checked_chunks_total")
    # 100 tokens: computed 50 sends [0, 32) (whole pages only), then 100 sends [32, 100)
    transfer(rig["A"], rig["B"], "t21", 100, [5, 2, 9, 14], [11, 3, 7, 0], computed_steps=[50, 100],
             transport=rig["transport"])
    # two chunks from each of A's two ranks
    assert metric(rig["B"].daemon, "kvxferd_integrity_checked_chunks_total") - checked == 4
    assert metric(rig["B"].daemon, "kvxferd_integrity_failures_total") == 0


def test_tp1_prefill_to_tp2_decode(rig):
    """The save asks the latency class (from the request's vLLM priority): the prefill daemon runs
    every byte of it as latency work."""
    latency = metric(rig["B"].daemon, "kvxferd_transfer_class_bytes_total", **{"class": "latency"})
    transfer(rig["B"], rig["A"], "t12", 70, [1, 6, 4], [8, 12, 2], computed_steps=[70], transport=rig["transport"],
             qos_class="latency")
    moved = -(-70 // rig["A"].block) * PAGE_BYTES * vu.MODEL["num_hidden_layers"]  # A's two ranks' halves: every page
    assert metric(rig["B"].daemon, "kvxferd_transfer_class_bytes_total", **{"class": "latency"}) - latency == moved


def test_decode_prefix_moves_only_the_rest(rig):
    # decode holds the first two pages already (a local prefix hit): they must stay as they were
    # the prefix pages hold a canary before; transfer() checks they still do after
    assert {13, 15} <= set(rig["B"].ranks[0].call(cmd="check", rid="-", blocks=[], n=0, start=0)["canary_blocks"])
    transfer(rig["A"], rig["B"], "tpre", 90, [3, 10, 6], [13, 15, 9], computed_steps=[90], start=64,
             transport=rig["transport"])


def _half_sent(src: Instance, dst: Instance, tid: str, n: int, src_blocks: list[int], dst_blocks: list[int]) -> None:
    for r in src.ranks:
        r.call(cmd="fill", rid=tid, blocks=src_blocks, n=n)
    step_all(dst, load(f"d-{tid}", src, tid, n, dst_blocks))
    step_all(src, save(f"p-{tid}", tid, src_blocks, 40, n))     # [0, 32) goes out, the rest never


def test_abort_from_the_prefill_side_fails_both_and_frees_both(rig):
    src, dst = rig["A"], rig["B"]
    _half_sent(src, dst, "tab1", 80, [7, 8, 12], [5, 6, 10])
    plan = {"aborts": [["p-tab1", "tab1", "prefill"]]}
    sent = steps_until(src, "sending", "p-tab1", finished=("p-tab1",), plan=plan)
    got = steps_until(dst, "recving", "d-tab1")
    assert all(r["sending"] == ["p-tab1"] for r in sent)
    # the failed load names every block it was to fill, so vLLM recomputes (or fails) them
    assert all(set(r["errors"]) == {5, 6, 10} for r in got), got


def test_abort_from_the_decode_side_fails_both(rig):
    src, dst = rig["B"], rig["A"]
    _half_sent(src, dst, "tab2", 80, [9, 10, 11], [13, 14, 15])
    got = steps_until(dst, "recving", "d-tab2", plan={"aborts": [["d-tab2", "tab2", "decode"]]})
    assert all(set(r["errors"]) == {13, 14, 15} for r in got), got
    sent = steps_until(src, "sending", "p-tab2", finished=("p-tab2",))
    assert sent[0]["sending"] == ["p-tab2"]


def test_a_preempted_prefill_lets_go_of_its_pages_before_the_step_goes_on(rig):
    src, dst = rig["A"], rig["B"]
    _half_sent(src, dst, "tpmt", 80, [0, 1, 11], [1, 2, 5])
    reports = step_all(src, {"preempted": [["p-tpmt", "tpmt"]]})
    # handle_preemptions returned: the prefill daemon has already failed its side, so no
    # data thread reads the pages vLLM is about to give to another request
    status = daemon_status(src.daemon)
    ranks = [r["rank_id"] for r in status["ranks"] if r["instance"] == "A.prefill"]
    failed = [f for f in status["recent_failures"] if f["request_id"] == "tpmt" and f["side"] == "prefill"]
    assert len(ranks) == 2 and sorted(f["rank_id"] for f in failed) == sorted(ranks), failed
    assert all(r["sending"] == [] for r in reports)
    # a preempted request is not finished, so it is never reported as sent
    assert all(r["sending"] == [] for r in step_all(src, {}, finished=("p-tpmt",)))
    got = steps_until(dst, "recving", "d-tpmt")
    assert set(got[0]["errors"]) == {1, 2, 5}


def test_a_dead_prefill_daemon_fails_the_load_with_its_code(rig):
    src, dst = rig["C"], rig["B"]
    step_all(dst, load("d-tdead", src, "tdead", 80, [12, 13, 14]))
    (sim,) = src.ranks                       # sends [0, 32) and holds the rest back
    sim.command(cmd="send", request_id="tdead", pages=[1, 2, 3], n=80, chunks=[[0, 32], [32, 80]], hold_last=True)
    wait_in_flight(dst.daemon, "decode:transferring")
    src.daemon.proc.send_signal(signal.SIGKILL)
    src.daemon.proc.wait()
    got = steps_until(dst, "recving", "d-tdead")
    assert set(got[0]["errors"]) == {12, 13, 14}
    failures = [f for f in daemon_status(dst.daemon)["recent_failures"] if f["request_id"] == "tdead"]
    assert failures and failures[-1]["code"] == "peer_dead", failures


def test_a_chunk_that_fails_its_integrity_check_is_a_load_error_of_every_block(rig):
    """D asked for integrity "full"; its daemon changes a landed byte: the request fails with
    code ``integrity`` and vLLM hears it as load errors of every block of the request (its
    policy recomputes them), never as a finished load."""
    src, dst = rig["S"], rig["D"]
    failures = metric(dst.daemon, "kvxferd_integrity_failures_total")
    step_all(dst, load("d-tint", src, "tint", 80, [4, 9, 2]))
    (sim,) = src.ranks
    sim.command(cmd="send", request_id="tint", pages=[1, 2, 3], n=80)
    got = steps_until(dst, "recving", "d-tint")
    assert set(got[0]["errors"]) == {4, 9, 2}, got
    ends = [f for f in daemon_status(dst.daemon)["recent_failures"] if f["request_id"] == "tint"]
    assert ends and ends[-1]["code"] == "integrity" and "layer" in ends[-1]["reason"], ends
    assert metric(dst.daemon, "kvxferd_integrity_failures_total") > failures
    sent = finished(sim, "tint")
    # NIXL's writes are one-sided: its source may have heard done (its bytes left) before the check ran
    assert sent["code"] == "integrity" or (rig["transport"] == "nixl" and sent["state"] == "done"), sent


def test_page_sizes_that_differ_are_refused_at_the_handshake_naming_both(rig):
    src, dst = rig["W"], rig["B"]          # 64-token pages into 32-token pages
    got = steps_until(dst, "recving", "d-tpage", plan=load("d-tpage", src, "tpage", 100, [1, 2, 3, 4]))
    assert set(got[0]["errors"]) == {1, 2, 3, 4}
    failures = [f for f in daemon_status(dst.daemon)["recent_failures"] if f["request_id"] == "tpage"]
    assert failures and failures[-1]["code"] == "incompatible", failures
    reason = failures[-1]["reason"]
    assert "page_size" in reason and "64" in reason and "32" in reason, reason


def test_a_refusal_on_the_decode_side_frees_the_prefill_workers_blocks(rig):
    """V (64-token pages) is refused A's 32-token pages at the handshake. A's prefill workers report
    the request finished sending, so vLLM frees its blocks, as soon as the refusal reached their
    daemon: whether they had sent it before (their daemon held it, bound to nothing) or send it after.
    Their ranks stay registered, and what failed the request on the prefill side is the refusal,
    with the decode side's reason, not a timeout."""
    src, (v,) = rig["A"], rig["V"].ranks
    tids = [f"tref-{order}" for order in ("send_first", "expect_first")]
    for tid in tids:
        req, blocks = f"p-{tid}", [4, 9, 13]
        if tid.endswith("send_first"):
            step_all(src, save(req, tid, blocks, 70, 70))
            wait_in_flight(src.daemon, "prefill:bootstrapping")
        v.command(cmd="expect", request_id=tid, pages=[1, 2], n=70, source_instance=src.prefill_name,
                  source_address=src.daemon.address)
        refused = finished(v, tid)
        assert (refused["state"], refused["code"]) == ("failed", "incompatible"), refused
        plan = save(req, tid, blocks, 70, 70) if tid.endswith("expect_first") else None
        sent = steps_until(src, "sending", req, finished=(req,), plan=plan)
        assert all(r["sending"] == [req] for r in sent), sent
    status = daemon_status(src.daemon)
    assert len([r for r in status["ranks"] if r["instance"] == src.prefill_name]) == 2
    failures = [f for f in status["recent_failures"] if f["request_id"] in tids and f["side"] == "prefill"]
    assert len(failures) == 4, failures  # each request at both of A's prefill ranks
    assert all(f["code"] == "incompatible" and "page_size" in f["reason"] for f in failures), failures

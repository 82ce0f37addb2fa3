"""The connector's scheduler side, driven by vLLM's real Scheduler.

vLLM builds the connector from ``kv_connector_module_path`` exactly as an engine does; the
tests play the model runner's part (its outputs, and the connector output its workers
would report) and check what the scheduler does with the connector's answers: which
blocks it keeps, what it tells workers, what it returns to the client.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import vllm_util as vu
from kvxferd.adapters.vllm import KvxferdConnector, KvxferdMetadata
from kvxferd.errors import ConfigError

ADDRESS = "10.0.0.7:5557"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vu.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def make(model_dir: Path, *, budget: int = 256, **extra):
    extra.setdefault("instance", "llama-a")
    extra.setdefault("address", ADDRESS)
    policy = extra.pop("policy", None)
    kv = vu.kv_transfer_config(**extra)
    if policy:
        kv["kv_load_failure_policy"] = policy
    return vu.scheduler(vu.vllm_config(model_dir, kv=kv, max_num_batched_tokens=budget))


def plan_of(out):
    meta = out.kv_connector_metadata
    assert isinstance(meta, KvxferdMetadata), meta
    return meta.plan


def step(sched, **kv_output):
    """One engine step: schedule, 'run' it, feed the output back. Returns (plan, outputs by request)."""
    out = sched.schedule()
    engine_out = sched.update_from_output(out, vu.runner_output(sched, out, **kv_output))
    outputs = {o.request_id: o for eo in engine_out.values() for o in eo.outputs}
    return plan_of(out), out, outputs


def free_blocks(sched) -> int:
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


def prefill_params(model_dir: Path, prompt: list[int]) -> dict:
    """Run a prefill scheduler to the end and return the kv_transfer_params it emits."""
    sched = make(model_dir, instance="prefill-a")
    sched.add_request(vu.request("p", prompt, kv_transfer_params={"do_remote_decode": True}))
    _, _, outputs = step(sched)
    return outputs["p"].kv_transfer_params


def test_scheduler_builds_the_connector_from_its_module_path(model_dir):
    sched = make(model_dir)
    assert type(sched.connector) is KvxferdConnector
    assert KvxferdConnector.get_required_kvcache_layout(None) == "NHD"


def test_chunked_prefill_plans_each_chunk_holds_blocks_and_returns_json_params(model_dir):
    sched = make(model_dir, budget=64)
    before = free_blocks(sched)
    sched.add_request(vu.request("a", list(range(1, 101)), kv_transfer_params={"do_remote_decode": True}))

    plan, out, outputs = step(sched)
    assert out.num_scheduled_tokens == {"a": 64}
    (save,) = plan.saves
    assert (save.req_id, save.computed, save.num_tokens, len(save.block_ids)) == ("a", 64, 100, 2)
    assert "a" not in outputs or not outputs["a"].finished

    plan, out, outputs = step(sched)
    assert out.num_scheduled_tokens == {"a": 36}
    (last,) = plan.saves
    assert last.transfer_id == save.transfer_id and last.computed == 100 and len(last.block_ids) == 4
    assert last.block_ids[:2] == save.block_ids
    params = outputs["a"].kv_transfer_params
    assert outputs["a"].finished
    # the only link to the decode engine: plain JSON naming the transfer, the instance and the daemon
    assert json.loads(json.dumps(params)) == params
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["kvxferd"] == {"transfer_id": save.transfer_id, "source_instance": "llama-a.prefill",
                                 "source_address": ADDRESS, "num_tokens": 100}

    # the request finished, but its four blocks stay pinned until the workers report the send
    plan, _, _ = step(sched)
    assert "a" in sched.requests and free_blocks(sched) == before - 4
    assert plan.saves == () and plan.aborts == ()
    step(sched, finished_sending={"a"})
    assert "a" not in sched.requests and free_blocks(sched) == before


def test_plain_requests_are_untouched(model_dir):
    sched = make(model_dir)
    before = free_blocks(sched)
    sched.add_request(vu.request("plain", list(range(1, 41))))
    plan, _, outputs = step(sched)
    assert plan.saves == () and plan.loads == ()
    assert outputs["plain"].finished and outputs["plain"].kv_transfer_params is None
    assert free_blocks(sched) == before


def test_decode_loads_asynchronously_then_recomputes_only_the_last_token(model_dir):
    prompt = list(range(3, 43))   # 40 tokens: one full block and a partial one
    params = prefill_params(model_dir, prompt)
    sched = make(model_dir, instance="decode-a")
    sched.add_request(vu.request("d", prompt, max_tokens=4, kv_transfer_params=params))

    plan, out, _ = step(sched)
    (load,) = plan.loads
    assert load.req_id == "d" and load.start == 0 and len(load.block_ids) == 2
    assert load.params.transfer_id == params["kvxferd"]["transfer_id"]
    assert load.params.source_instance == "prefill-a.prefill" and load.params.num_tokens == 40
    assert out.num_scheduled_tokens == {}             # waiting for remote KV, nothing computed
    assert sched.requests["d"].status.name == "WAITING_FOR_REMOTE_KVS"

    plan, out, _ = step(sched)                        # still waiting: no second load
    assert plan.loads == () and out.num_scheduled_tokens == {}
    step(sched, finished_recving={"d"})
    plan, out, _ = step(sched)
    assert out.num_scheduled_tokens == {"d": 1}       # the 39 loaded tokens are not recomputed
    assert plan.loads == ()


def test_decode_prefix_hit_loads_only_the_rest(model_dir):
    prompt = list(range(5, 75))   # 70 tokens: two full blocks and a partial one
    params = prefill_params(model_dir, prompt)
    sched = make(model_dir, instance="decode-a")
    sched.add_request(vu.request("warm", prompt[:64] + [1, 2, 3], max_tokens=2))   # same first two blocks
    step(sched)
    cached = list(sched.kv_cache_manager.get_block_ids("warm")[0][:2])
    _, _, outputs = step(sched)
    assert outputs["warm"].finished
    sched.add_request(vu.request("d", prompt, max_tokens=2, kv_transfer_params=params))
    plan, _, _ = step(sched)
    (load,) = plan.loads
    assert load.start == 64 and len(load.block_ids) == 3
    assert list(load.block_ids[:2]) == cached      # the local hit's own blocks; only the third is loaded


def test_abort_of_a_prefill_midway_aborts_the_transfer_and_holds_blocks_until_terminal(model_dir):
    from vllm.v1.request import RequestStatus

    sched = make(model_dir, budget=64)
    before = free_blocks(sched)
    sched.add_request(vu.request("a", list(range(1, 101)), kv_transfer_params={"do_remote_decode": True}))
    plan, _, _ = step(sched)
    tid = plan.saves[0].transfer_id
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    plan, _, outputs = step(sched)
    assert plan.aborts == (("a", tid, "prefill"),)
    assert "a" in sched.requests and free_blocks(sched) < before     # the daemon may still read them
    step(sched, finished_sending={"a"})
    assert "a" not in sched.requests and free_blocks(sched) == before


def test_abort_of_a_decode_waiting_for_kv_aborts_the_load(model_dir):
    from vllm.v1.request import RequestStatus

    prompt = list(range(3, 43))
    params = prefill_params(model_dir, prompt)
    sched = make(model_dir, instance="decode-a")
    before = free_blocks(sched)
    sched.add_request(vu.request("d", prompt, kv_transfer_params=params))
    step(sched)
    sched.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    plan, _, _ = step(sched)
    assert plan.aborts == (("d", params["kvxferd"]["transfer_id"], "decode"),)
    assert free_blocks(sched) < before                                # the daemon may still write them
    step(sched, finished_recving={"d"})
    assert free_blocks(sched) == before


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_load_is_recomputed_or_failed_as_vllm_is_told(model_dir, policy):
    prompt = list(range(3, 43))
    params = prefill_params(model_dir, prompt)
    sched = make(model_dir, instance="decode-a", policy=policy)
    sched.add_request(vu.request("d", prompt, max_tokens=2, kv_transfer_params=params))
    plan, _, _ = step(sched)
    blocks = set(plan.loads[0].block_ids)
    _, _, outputs = step(sched, finished_recving={"d"}, invalid_block_ids=blocks)
    if policy == "fail":
        assert outputs["d"].finished and outputs["d"].finish_reason.name == "ERROR"
        return
    plan, out, _ = step(sched)
    assert out.num_scheduled_tokens == {"d": 40} and plan.loads == ()   # all of it, locally


def test_malformed_or_mismatched_params_are_computed_locally(model_dir, caplog):
    prompt = list(range(3, 43))
    params = prefill_params(model_dir, prompt)
    sched = make(model_dir, instance="decode-a")
    sched.add_request(vu.request("bad", prompt[::-1], kv_transfer_params={"do_remote_prefill": True}))
    other = dict(params, kvxferd={**params["kvxferd"], "num_tokens": 41})
    sched.add_request(vu.request("len", prompt, kv_transfer_params=other))
    plan, out, _ = step(sched)
    assert plan.loads == ()
    assert out.num_scheduled_tokens == {"bad": 40, "len": 40}
    assert "kv_transfer_params.kvxferd" in caplog.text or "bad_kv_transfer_params" in caplog.text


def test_a_producer_without_the_daemon_address_is_refused_at_start(model_dir):
    with pytest.raises(ConfigError) as err:
        vu.scheduler(vu.vllm_config(model_dir, kv=vu.kv_transfer_config(instance="a")))
    assert err.value.field == "kv_connector_extra_config.address" and "host:control_port" in str(err.value)
    with pytest.raises(ConfigError) as err:
        vu.scheduler(vu.vllm_config(model_dir, kv=vu.kv_transfer_config(instance="a", adress="x:1")))
    assert err.value.field == "kv_connector_extra_config.adress"
    consumer = vu.scheduler(vu.vllm_config(model_dir, kv=vu.kv_transfer_config("kv_consumer", instance="a")))
    assert type(consumer.connector) is KvxferdConnector


def test_a_requests_vllm_priority_becomes_the_transfer_class_it_asks(model_dir):
    """latency_priority = 0: vLLM's priority 0 (or more urgent, lower) asks latency, any other bulk;
    the class rides in every save of the request, and the worker sends it with the first chunk."""
    sched = make(model_dir, latency_priority=0)
    sched.add_request(vu.request("chat", list(range(1, 21)), kv_transfer_params={"do_remote_decode": True},
                                 priority=0))
    sched.add_request(vu.request("batch", list(range(31, 51)), kv_transfer_params={"do_remote_decode": True},
                                 priority=3))
    plan, _, _ = step(sched)
    assert {s.req_id: s.qos_class for s in plan.saves} == {"chat": "latency", "batch": "bulk"}
    unset = make(model_dir)  # no latency_priority: requests ask no class, the daemon's qos.instances decides
    unset.add_request(vu.request("x", list(range(1, 21)), kv_transfer_params={"do_remote_decode": True},
                                 priority=0))
    plan, _, _ = step(unset)
    assert [s.qos_class for s in plan.saves] == [None]
    with pytest.raises(ConfigError) as err:
        make(model_dir, latency_priority="high")
    assert err.value.field == "kv_connector_extra_config.latency_priority"

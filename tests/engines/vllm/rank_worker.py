"""One vLLM worker rank in its own process: vLLM's parallel state, vLLM's KV allocation, the connector.

Started by the tests as ``python rank_worker.py '<json>'``; reads JSON commands on stdin and
prints JSON events on stdout (like ``kvxferd.tools.sim``'s workers). The rank is real vLLM as far
as the connector can tell: vLLM's distributed groups are initialised (gloo, one process per
TP rank), the KV cache comes from vLLM's own ``allocate_kv_cache`` in the CPU backend's
layout, and the connector is built as a WORKER from the same config an engine would use.
What a model runner would do per step (bind the scheduler's metadata, start loads, save,
collect completions) is done on command, with the step plan the test gives.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

import kv_oracle  # noqa: E402
import vllm_util as vu  # noqa: E402


# vLLM logs to stdout: the protocol gets its own copy of fd 1, and fd 1 goes to stderr
_PROTOCOL = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)


def emit(obj: dict[str, Any]) -> None:
    _PROTOCOL.write(json.dumps(obj) + "\n")
    _PROTOCOL.flush()


def plan_from(data: dict[str, Any]) -> Any:
    from kvxferd.adapters.vllm.logic import LoadSpec, SaveSpec, StepPlan, TransferParams

    return StepPlan(
        loads=tuple(LoadSpec(d["req_id"], TransferParams(**d["params"]), tuple(d["block_ids"]), d["start"],
                             _groups(d)) for d in data.get("loads", ())),
        saves=tuple(SaveSpec(d["req_id"], d["transfer_id"], tuple(d["block_ids"]), d["computed"], d["num_tokens"],
                             _groups(d), d.get("qos_class")) for d in data.get("saves", ())),
        aborts=tuple(tuple(a) for a in data.get("aborts", ())),
        preempted=tuple(tuple(p) for p in data.get("preempted", ())))


def _groups(d: dict[str, Any]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((name, tuple(ids)) for name, ids in sorted(d.get("groups", {}).items()))


def main() -> int:
    cfg = json.loads(sys.argv[1])
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.parallel_state import (destroy_distributed_environment, destroy_model_parallel,
                                                 init_distributed_environment, initialize_model_parallel)
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from kvxferd.adapters.vllm import KvxferdConnector, KvxferdMetadata

    tp, rank, block = cfg["tp"], cfg["rank"], cfg.get("block_size", vu.BLOCK)
    config = vu.vllm_config(Path(cfg["model_dir"]), kv=cfg["kv"], tp=tp, block_size=block)
    # what vLLM's CPU worker sets before this call (v1/worker/cpu_worker.py): the name its CPU
    # shared-memory communicator gives the TP group, the same on every rank (the init port); where
    # vLLM's CPU ops provide that communicator, building the TP group without it raises KeyError
    os.environ["VLLM_DIST_IDENT"] = str(cfg["dist_port"])
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{cfg['dist_port']}")
        initialize_model_parallel(tensor_model_parallel_size=tp)
        kv_heads = vu.MODEL["num_key_value_heads"]
        local = max(1, kv_heads // tp)
        heads = (rank * local, rank * local + local)
        num_blocks = cfg["num_blocks"]
        hybrid = cfg.get("hybrid")
        if hybrid:
            # vLLM's hybrid manager: a sliding-window group (layers 0, 2) and a full-attention
            # group (1, 3) overlaid on one allocation, as get_kv_cache_config_from_groups lays them
            names = [f"model.layers.{i}.self_attn.attn" for i in range(vu.HYBRID_LAYERS)]
            kv_cache_config = vu.hybrid_kv_cache_config(config, num_blocks, local_heads=local,
                                                        sliding_window=hybrid["sliding_window"])
            layer_group = {i: ("swa0" if i % 2 == 0 else "") for i in range(vu.HYBRID_LAYERS)}
            kernel_sizes = [block, block]
        else:
            spec = FullAttentionSpec(block, num_kv_heads=local, head_size=vu.HEAD, dtype=torch.float32)
            names = [f"model.layers.{i}.self_attn.attn" for i in range(vu.MODEL["num_hidden_layers"])]
            page = spec.page_size_bytes
            kv_cache_config = KVCacheConfig(
                num_blocks=num_blocks,
                kv_cache_tensors=[KVCacheTensor(size=page * num_blocks * len(names), layers=names,
                                                layer_stride=page * num_blocks, block_stride=page)],
                kv_cache_groups=[KVCacheGroupSpec(names, spec)])
            layer_group = {i: "" for i in range(len(names))}
            kernel_sizes = [block]
        kv_caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC, kernel_sizes)
        for t in kv_caches.values():
            kv_oracle.fill_canary(t)
        if cfg.get("dp"):
            # a DP rank as vLLM's engine core marks it on the config its workers get (rank, size,
            # index); vLLM's DP process groups are not built here: the connector does not use them
            dp_rank, dp_size = cfg["dp"]
            config.parallel_config.data_parallel_size = dp_size
            config.parallel_config.data_parallel_rank = dp_rank
            config.parallel_config.data_parallel_index = dp_rank
        connector = KvxferdConnector(config, KVConnectorRole.WORKER, kv_cache_config)
        try:
            connector.register_kv_caches(kv_caches)
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            emit({"event": "register_failed", "error": str(exc), "code": getattr(exc, "code", "")})
            return 1
        layers = {i: kv_caches[name] for i, name in enumerate(names)}
        emit({"event": "registered", "shape": list(layers[0].shape), "ranks": connector.worker.ranks})

        def blocks_of(cmd: dict[str, Any], layer: int) -> list[int]:
            group = layer_group[layer]
            return cmd["groups"][group] if group else cmd["blocks"]

        for line in sys.stdin:
            if not line.strip():
                continue
            cmd = json.loads(line)
            try:
                op = cmd["cmd"]
                if op == "fill":
                    for layer, t in layers.items():
                        kv_oracle.write(t, layer, cmd["rid"], blocks_of(cmd, layer), cmd.get("start", 0), cmd["n"],
                                        heads, kv_heads)
                    emit({"event": "filled"})
                elif op == "step":
                    meta = KvxferdMetadata(plan_from(cmd.get("plan", {})))
                    connector.handle_preemptions(meta)
                    connector.bind_connector_metadata(meta)
                    connector.start_load_kv(None)
                    connector.wait_for_save()
                    results = connector.get_transfer_results(set(cmd.get("finished", ())))
                    errors = connector.get_block_ids_with_load_errors()
                    connector.clear_connector_metadata()
                    emit({"event": "step", "sending": sorted(results.finished_sending),
                          "recving": sorted(results.finished_recving), "errors": sorted(errors),
                          "failed": sorted(results.failed_recving)})
                elif op == "check":
                    # a sliding-window layer is checked from the first token its group moves
                    bad = sum(kv_oracle.mismatches(t, layer, cmd["rid"], blocks_of(cmd, layer),
                                                   cmd["window_start"] if layer_group[layer] else cmd["start"],
                                                   cmd["n"], heads, kv_heads) for layer, t in layers.items())
                    canary = set.intersection(*(kv_oracle.canary_blocks(t) for t in layers.values()))
                    emit({"event": "check", "mismatches": bad, "canary_blocks": sorted(canary)})
            except Exception as exc:  # noqa: BLE001 - reported to the test
                emit({"event": "error", "cmd": cmd.get("cmd"), "error": f"{type(exc).__name__}: {exc}",
                      "trace": traceback.format_exc()[-2000:]})
        connector.shutdown()
        destroy_model_parallel()
        destroy_distributed_environment()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Building real vLLM pieces for the connector tests: a tiny local model, configs, a Scheduler.

The tiny Llama and the connector's ``kv_transfer_config`` are the package's (``make demo-vllm``
runs the same): they are named here too, so the tests read ``vu.MODEL``, ``vu.kv_transfer_config``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvxferd.adapters.vllm.logic import kv_transfer_config  # noqa: F401 - named for the tests
from kvxferd.tools.tiny_model import BLOCK, HEAD, MODEL, make_tiny_llama  # noqa: F401 - named for the tests

HYBRID_LAYERS = 4             # gpt-oss's pattern, small: sliding-window layers 0 and 2, full attention 1 and 3
SLIDING_WINDOW = 40


def make_tiny_hybrid(path: Path, seed: int = 0, sliding_window: int = SLIDING_WINDOW) -> Path:
    """The tiny Llama with gpt-oss's alternating sliding-window / full-attention layers
    (``layer_types``, which vLLM's Llama reads per layer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**MODEL, "num_hidden_layers": HYBRID_LAYERS},
                         layer_types=["sliding_attention", "full_attention"] * (HYBRID_LAYERS // 2),
                         sliding_window=sliding_window)
    LlamaForCausalLM(config).save_pretrained(str(path))
    return path


def hybrid_kv_cache_config(config: Any, num_blocks: int, *, local_heads: int = MODEL["num_key_value_heads"],
                           sliding_window: int = SLIDING_WINDOW, layout: str = "LBHNC") -> Any:
    """vLLM's own KVCacheConfig for the hybrid layers: its grouping (sliding-window group first,
    as vLLM orders a gpt-oss-shaped model) and its overlaid allocation (get_kv_cache_config_from_groups)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

    full = FullAttentionSpec(BLOCK, num_kv_heads=local_heads, head_size=HEAD, dtype=torch.float32)
    swa = SlidingWindowSpec(BLOCK, num_kv_heads=local_heads, head_size=HEAD, dtype=torch.float32,
                            sliding_window=sliding_window)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(HYBRID_LAYERS)]
    groups = [KVCacheGroupSpec(names[0::2], swa), KVCacheGroupSpec(names[1::2], full)]
    config.cache_config.kv_cache_layout = layout
    config.cache_config.num_gpu_blocks = num_blocks
    return get_kv_cache_config_from_groups(config, groups, available_memory=num_blocks * 2 * full.page_size_bytes)


def vllm_config(model_dir: Path, *, kv: dict[str, Any], max_num_batched_tokens: int = 256,
                tp: int = 1, block_size: int = BLOCK) -> Any:
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig)

    model = ModelConfig(model=str(model_dir), dtype="float32", max_model_len=256, skip_tokenizer_init=True,
                        seed=0, enforce_eager=True)
    return VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_model_len=256, is_encoder_decoder=False,
                                         max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=16,
                                         enable_chunked_prefill=True),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(**kv),
    )


def scheduler(config: Any, num_blocks: int = 64, kv_cache_config: Any = None) -> Any:
    """vLLM's own Scheduler; it builds the connector from kv_connector_module_path."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    if kv_cache_config is None:
        spec = FullAttentionSpec(BLOCK, num_kv_heads=MODEL["num_key_value_heads"], head_size=HEAD,
                                 dtype=torch.float32)
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(MODEL["num_hidden_layers"])]
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                        kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(vllm_config=config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(config), block_size=BLOCK)


def request(request_id: str, prompt: list[int], *, max_tokens: int = 1,
            kv_transfer_params: dict[str, Any] | None = None, priority: int = 0) -> Any:
    """A request as vLLM's engine core builds it: params from ``extra_args``, block hashes for the prefix cache."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None)
    return Request(request_id=request_id, prompt_token_ids=list(prompt), sampling_params=params,
                   pooling_params=None, block_hasher=get_request_block_hasher(BLOCK, sha256), priority=priority)


def runner_output(sched: Any, out: Any, *, finished_sending: set[str] | None = None,
                  finished_recving: set[str] | None = None, invalid_block_ids: set[int] | None = None,
                  failed_recving: set[str] | None = None) -> Any:
    """What a model runner returns for ``out``: one token for every request whose prompt is complete."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        req = sched.requests[req_id]
        done_prefill = req.num_computed_tokens >= req.num_prompt_tokens
        sampled.append([7] if done_prefill else [])
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled,
        kv_connector_output=KVConnectorOutput(finished_sending=finished_sending, finished_recving=finished_recving,
                                              invalid_block_ids=invalid_block_ids or set(),
                                              failed_recving=failed_recving or set()))

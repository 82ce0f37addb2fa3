"""A tiny Llama made locally, for real vLLM engines on a CPU: no download, a few seconds.

Randomly initialised (a seed fixes the weights) and saved like any Hugging Face model, so
``vllm.LLM(model=path)`` loads it; with ``skip_tokenizer_init`` the engines take token ids, so
it needs no tokenizer. ``make demo-vllm`` (:mod:`kvxferd.tools.demo_vllm`) and the vLLM engine
tests (tests/engines/vllm) run it. Needs ``transformers`` (vLLM's environment has it); imported
only when a model is written.
"""

from __future__ import annotations

from pathlib import Path

#: tokens per KV block: the CPU attention backend wants multiples of 32
BLOCK = 32
MODEL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
#: 32: the CPU attention backend's smallest head size
HEAD = MODEL["hidden_size"] // MODEL["num_attention_heads"]
#: bytes of one block of one layer's KV in float32 (K and V of every KV head)
PAGE_BYTES = BLOCK * MODEL["num_key_value_heads"] * 2 * HEAD * 4


def make_tiny_llama(path: Path, seed: int = 0) -> Path:
    """A randomly initialised Llama small enough for a CPU, saved like any Hugging Face model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(str(path))
    return path


def kv_bytes(num_tokens: int, start: int = 0) -> int:
    """KV bytes of tokens ``[start, num_tokens)`` of a prompt as whole blocks move (``start`` on a block
    boundary, e.g. after a prefix-cache hit), every layer."""
    blocks = -(-num_tokens // BLOCK) - start // BLOCK
    return blocks * PAGE_BYTES * MODEL["num_hidden_layers"]

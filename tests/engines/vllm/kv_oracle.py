"""The byte oracle for vLLM's CPU KV layout, independent of the connector and the daemon.

A request's *logical* KV is ``[layers][tokens, kv_heads, 2, head_size]`` (K then V): the
project's byte oracle (``kvxferd.tools.oracle.logical_units``), one unit per (layer, K or
V, token, head), every 8-byte word of a request different. vLLM's CPU cache keeps, per
layer, ``[num_blocks, heads, block_size, 2 * head_size]`` (float32); inside one (block,
head) the first ``head_size * block_size`` values are K transposed ``[head_size,
block_size]`` and the rest V ``[block_size, head_size]``. This module writes and reads
tokens through that definition only, so a wrong page, head, layer or token offset anywhere
in the transfer shows as a mismatch. Values are compared as int32 bit patterns (the
oracle's bits include NaNs).
"""

from __future__ import annotations

import torch

from kvxferd.tools.oracle import logical_units

CANARY = 0x5A5A5A5A


def logical(request_id: str, layer: int, n_tokens: int, kv_heads: int, head_size: int) -> torch.Tensor:
    """``[n_tokens, kv_heads, 2, head_size]`` int32 bit patterns of one layer of a request."""
    units = logical_units(request_id, (layer, layer + 1), 2, n_tokens, (0, kv_heads), head_size * 4)[0]
    return units.permute(1, 2, 0, 3).contiguous().view(torch.int32)


def _kv_views(cache: torch.Tensor, block: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K as [block_size, head_size], V as [block_size, head_size]) int32 views of one (block, head)."""
    _, _, n, two_c = cache.shape
    c = two_c // 2
    flat = cache[block, head].view(torch.int32).reshape(-1)
    return flat[:c * n].view(c, n).t(), flat[c * n:].view(n, c)


def write(cache: torch.Tensor, layer: int, request_id: str, blocks: list[int], start: int, end: int,
          heads: tuple[int, int], kv_heads: int) -> None:
    """Write tokens ``[start, end)`` of the request's global heads ``heads`` into a rank's layer tensor."""
    _, _, n, two_c = cache.shape
    data = logical(request_id, layer, end, kv_heads, two_c // 2)
    for t in range(start, end):
        for local, h in enumerate(range(*heads)):
            k, v = _kv_views(cache, blocks[t // n], local)
            k[t % n] = data[t, h, 0]
            v[t % n] = data[t, h, 1]


def mismatches(cache: torch.Tensor, layer: int, request_id: str, blocks: list[int], start: int, end: int,
               heads: tuple[int, int], kv_heads: int) -> int:
    """How many (token, head, K/V) rows of ``[start, end)`` differ from the oracle."""
    _, _, n, two_c = cache.shape
    data = logical(request_id, layer, end, kv_heads, two_c // 2)
    bad = 0
    for t in range(start, end):
        for local, h in enumerate(range(*heads)):
            k, v = _kv_views(cache, blocks[t // n], local)
            bad += int(not torch.equal(k[t % n], data[t, h, 0])) + int(not torch.equal(v[t % n], data[t, h, 1]))
    return bad


def fill_canary(cache: torch.Tensor) -> None:
    cache.view(torch.int32).fill_(CANARY)


def canary_blocks(cache: torch.Tensor) -> set[int]:
    """Blocks still holding nothing but the canary."""
    as_int = cache.view(torch.int32).reshape(cache.shape[0], -1)
    return {int(b) for b in torch.nonzero((as_int == CANARY).all(dim=1)).flatten()}

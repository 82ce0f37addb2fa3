"""The byte oracle of the simulated engines (kvxferd/tools/oracle.py): deterministic, different in
every place, and a check that catches misplaced, misordered and corrupted bytes."""

from __future__ import annotations

import torch

from e2e_util import spec
from kvxferd.model.geometry import RankGeometry
from kvxferd.sdk.kv_cache import allocate_cpu
from kvxferd.tools.oracle import check_rank, fill_rank, logical_cache, logical_pages


def _words(t: torch.Tensor) -> torch.Tensor:
    """The 8-byte words of each unit (last dimension), as int64 values."""
    return t.reshape(-1, t.shape[-1])[:, :t.shape[-1] // 8 * 8].contiguous().view(torch.int64).flatten()


def test_logical_cache_is_deterministic_per_request_and_layer_range():
    s = spec(num_layers=6, total_kv_heads=4, head_dim=32)
    whole = logical_cache("r-1", 50, s, (0, 6))
    assert whole.shape == (6, 2, 50, 4, 64) and whole.dtype == torch.uint8
    assert torch.equal(logical_cache("r-1", 50, s, (0, 6)), whole)
    assert torch.equal(logical_cache("r-1", 50, s, (2, 5)), whole[2:5])  # a PP rank rebuilds its own layers
    assert torch.equal(logical_cache("r-1", 20, s, (0, 6)), whole[:, :, :20])  # token i never depends on n
    assert torch.equal(logical_cache("r-1", 50, s, (0, 6), (1, 3)), whole[:, :, :, 1:3])  # a TP rank's heads
    other = logical_cache("r-2", 50, s, (0, 6))
    assert float((other == whole).float().mean()) < 0.01  # another request: other bytes


def test_every_word_of_a_request_is_different():
    """A word moved to any other layer, kind, token, head or offset no longer matches."""
    for s in (spec(num_layers=4, total_kv_heads=8, head_dim=64),
              spec(num_layers=3, attention="mla", head_dim=576),
              spec(num_layers=2, total_kv_heads=4, head_dim=24, dtype="float8_e4m3fn")):  # 24-byte heads
        words = _words(logical_cache("r-words", 40, s, (0, s.num_layers)))
        assert torch.unique(words).numel() == words.numel(), s
    packed = spec(num_layers=2, total_kv_heads=4, head_dim=16, page_size=8, layout="packed_page")
    words = _words(logical_pages("r-words", 40, packed, (0, 2)))
    assert torch.unique(words).numel() == words.numel()


def test_check_catches_swapped_rows_and_a_single_wrong_byte():
    s = spec(num_layers=2, total_kv_heads=4, head_dim=16)
    geo = RankGeometry(s, 0, 0, 8)
    pages, n = [5, 1, 6], 10
    with allocate_cpu(geo, name="oracle-check") as cache:
        fill_rank(cache, geo, "r-check", pages, n)
        assert check_rank(cache, geo, "r-check", pages, n) == 0
        assert check_rank(cache, geo, "r-other", pages, n) > 0  # another request's bytes
        assert check_rank(cache, geo, "r-check", [1, 5, 6], n) > 0  # pages in another order
        rows = cache.v(1).view(torch.uint8).reshape(-1, s.row_bytes)
        a, b = 5 * 4 + 2, 1 * 4 + 0  # token 2 and token 4
        saved = rows[[a, b]].clone()
        rows[[a, b]] = saved.flip(0)  # two tokens swapped
        assert check_rank(cache, geo, "r-check", pages, n) == 2 * s.row_bytes - int((saved[0] == saved[1]).sum()) * 2
        rows[[a, b]] = saved
        heads = rows[a].view(s.kv_heads, -1)
        heads[[0, 3]] = heads[[3, 0]].clone()  # two heads of one token swapped
        assert check_rank(cache, geo, "r-check", pages, n) > 0
        rows[a] = saved[0]
        rows[a, 7] ^= 1  # one bit
        assert check_rank(cache, geo, "r-check", pages, n) == 1

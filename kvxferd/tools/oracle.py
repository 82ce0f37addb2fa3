"""The byte oracle: what every byte of a request's KV cache should be, and checks against it.

Every request has a *logical* KV cache ``[layers, kinds, tokens, heads, head_bytes]``
derived from a key (the request id) alone. A prefill rank writes its own slice of it (its
heads, its layers) into its pages; a decode rank checks that its pages hold exactly its
own slice of the same logical cache. Neither side uses the planner to decide what it
should hold, so a planner or transport bug shows up as a byte mismatch. The logical
bytes are a hash pattern keyed by (key, global layer, kind, token, global head) and word
offset, computed with vectorised ops: every 8-byte word of a request differs, so a
misplaced or misordered word never matches, and filling and checking stay cheap next to
the transfer they verify. Fills and checks go one layer at a time, so their temporaries
stay the size of one layer however long the request.

The simulated engines (:mod:`kvxferd.tools.sim`), ``kvxferd demo``, ``kvxferd bench`` and
the tests all use this one oracle.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from ..model.geometry import InstanceSpec, RankGeometry

CANARY = 0xA5


def head_bytes(spec: InstanceSpec) -> int:
    """Bytes of one head in one token row (NHD_kv: its K and its V)."""
    return spec.head_slot_bits // 8


# splitmix64's finalizer constants and step (numpy uint64 arithmetic wraps, and shifts fast)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_STEP = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64, for torch
PACKED_KIND = 7  # the kind number of packed_page units in the oracle's keys (NHD kinds are 0..2)


def _mix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _request_seed(request_id: str) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little"))


def _pattern(request_id: str, key: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``[*key.shape, nbytes]`` bytes: a unit's bytes from its unique key, vectorised.

    Each unit (one key) gets a 64-bit hash of (request, key); its i-th 8-byte word is that
    hash plus ``i`` times an odd constant. Two words in different places therefore hold
    different values (but for a 2^-64 chance), so a misplaced, misordered or foreign word
    shows as a mismatch, and the cost is one add per word instead of a random generator.
    """
    unit = _mix64(_mix64(key.numpy().astype(np.uint64)) ^ _request_seed(request_id)).view(np.int64)
    words = -(-nbytes // 8)
    full = torch.from_numpy(unit).unsqueeze(-1) + torch.arange(words, dtype=torch.int64) * _STEP
    return full.view(torch.uint8)[..., :nbytes]


def logical_units(request_id: str, layers: tuple[int, int], kinds: int, n_tokens: int, heads: tuple[int, int],
                  nbytes: int) -> torch.Tensor:
    """``[layers, kinds, tokens, heads, nbytes]`` bytes: one unit per (global layer, kind, token,
    global head), keyed by those coordinates alone, so any rank rebuilds exactly the layers and
    heads it holds, whatever its engine's layout, and bytes in the wrong place never match."""
    layer = torch.arange(*layers, dtype=torch.int64).view(-1, 1, 1, 1)
    kind = torch.arange(kinds, dtype=torch.int64).view(1, -1, 1, 1)
    token = torch.arange(n_tokens, dtype=torch.int64).view(1, 1, -1, 1)
    head = torch.arange(*heads, dtype=torch.int64).view(1, 1, 1, -1)
    key = (((layer * 8 + kind) << 28) + token << 16) + head
    return _pattern(request_id, key, nbytes)


def logical_cache(request_id: str, n_tokens: int, spec: InstanceSpec, layers: tuple[int, int],
                  heads: tuple[int, int] | None = None) -> torch.Tensor:
    """``[layers, kinds, tokens, heads, head_bytes]`` bytes of a request, for a layer range
    (and a head range: by default all ``spec.kv_heads``), in kvxferd's NHD terms."""
    return logical_units(request_id, layers, len(spec.region_kinds), n_tokens, heads or (0, spec.kv_heads),
                         head_bytes(spec))


def logical_pages(request_id: str, n_tokens: int, spec: InstanceSpec, layers: tuple[int, int],
                  heads: tuple[int, int] | None = None) -> torch.Tensor:
    """packed_page: ``[layers, pages, heads, unit_bytes]`` bytes of a request, one opaque unit
    (K transposed then V of ``page_size`` tokens) per (page of the request, head).

    A request of ``n_tokens`` fills ``ceil(n_tokens / page_size)`` pages; the layout moves
    them whole, so the oracle owns every byte of them, the tail of the last one included.
    """
    n_pages = -(-n_tokens // spec.page_size)
    layer = torch.arange(*layers, dtype=torch.int64).view(-1, 1, 1)
    page = torch.arange(n_pages, dtype=torch.int64).view(1, -1, 1)
    head = torch.arange(*(heads or (0, spec.kv_heads)), dtype=torch.int64).view(1, 1, -1)
    key = (((layer * 8 + PACKED_KIND) << 28) + page << 16) + head
    return _pattern(request_id, key, spec.head_slot_bits // 8)


def _packed_table(cache: Any, geometry: RankGeometry, layer: int) -> torch.Tensor:
    """``[num_pages, local_heads, unit_bytes]`` bytes of one packed region."""
    spec = geometry.spec
    return cache.tensors[(layer, "kv")].view(torch.uint8).reshape(geometry.num_pages, spec.local_heads, -1)


def _request_pages(pages: list[int], spec: InstanceSpec, n_tokens: int) -> torch.Tensor:
    return torch.as_tensor(list(pages)[:-(-n_tokens // spec.page_size)], dtype=torch.int64)


def _token_rows(pages: list[int], page_size: int, start: int, end: int) -> torch.Tensor:
    t = np.arange(start, end)
    return torch.from_numpy(np.asarray(pages, dtype=np.int64)[t // page_size] * page_size + t % page_size)


def fill_rank(cache: Any, geometry: RankGeometry, request_id: str, pages: list[int], n_tokens: int) -> None:
    """Write this rank's slice (its layers, its heads) of the logical cache into ``pages``."""
    spec = geometry.spec
    if spec.packed:
        idx = _request_pages(pages, spec, n_tokens)
        for layer in range(*geometry.layers):
            logical = logical_pages(request_id, n_tokens, spec, (layer, layer + 1), geometry.heads)[0]
            _packed_table(cache, geometry, layer).index_copy_(0, idx, logical.contiguous())
        return
    rows = _token_rows(pages, spec.page_size, 0, n_tokens)
    for layer in range(*geometry.layers):
        logical = logical_cache(request_id, n_tokens, spec, (layer, layer + 1), geometry.heads)[0]
        for k, kind in enumerate(spec.region_kinds):
            _wide(_row_table(cache, spec, layer, kind)).index_copy_(0, rows, _wide(logical[k].reshape(n_tokens, -1)))


def check_rank(cache: Any, geometry: RankGeometry, request_id: str, pages: list[int], n_tokens: int) -> int:
    """Number of mismatching bytes between this rank's pages and its logical slice."""
    spec = geometry.spec
    bad = 0
    if spec.packed:
        idx = _request_pages(pages, spec, n_tokens)
        for layer in range(*geometry.layers):
            logical = logical_pages(request_id, n_tokens, spec, (layer, layer + 1), geometry.heads)[0]
            bad += _mismatched(_packed_table(cache, geometry, layer).index_select(0, idx), logical)
        return bad
    rows = _token_rows(pages, spec.page_size, 0, n_tokens)
    for layer in range(*geometry.layers):
        logical = logical_cache(request_id, n_tokens, spec, (layer, layer + 1), geometry.heads)[0]
        for k, kind in enumerate(spec.region_kinds):
            got = _wide(_row_table(cache, spec, layer, kind)).index_select(0, rows)
            bad += _mismatched(got, _wide(logical[k].reshape(n_tokens, -1)))
    return bad


def _row_table(cache: Any, spec: InstanceSpec, layer: int, kind: str) -> torch.Tensor:
    """``[slots, row_bytes]`` bytes of one region."""
    return cache.tensors[(layer, kind)].view(torch.uint8).reshape(-1, spec.row_bytes)


def _wide(rows: torch.Tensor) -> torch.Tensor:
    """Byte rows as 8-byte words where they allow it: a copy or comparison per word, not per byte."""
    if rows.shape[-1] % 8 == 0 and rows.is_contiguous() and rows.data_ptr() % 8 == 0:
        return rows.view(torch.int64)
    return rows


def _mismatched(got: torch.Tensor, want: torch.Tensor) -> int:
    """Differing bytes; the common all-equal case costs one comparison, not a count."""
    if torch.equal(got, want):
        return 0
    return int((got.contiguous().view(torch.uint8) != want.contiguous().view(torch.uint8)).sum())


def untouched(cache: Any, geometry: RankGeometry, pages: list[int]) -> int:
    """Bytes that differ from the canary in the given (never allocated) pages of the default
    group (cache groups: :func:`kvxferd.tools.oracle_groups.untouched_group`)."""
    bad = 0
    idx = torch.as_tensor(list(pages), dtype=torch.int64)
    for (_, kind), tensor in cache.tensors.items():
        if "." in kind:  # a cache group's region: its pages are numbered apart
            continue
        flat = tensor.view(torch.uint8).reshape(geometry.num_pages, -1)
        bad += int((flat.index_select(0, idx) != CANARY).sum())
    return bad


def reset_pages(cache: Any, geometry: RankGeometry, pages: list[int], value: int = CANARY) -> None:
    """Set every byte of the given pages (all regions) to ``value``: the canary, before a check."""
    idx = torch.as_tensor(list(pages), dtype=torch.int64)
    for (_, kind), tensor in cache.tensors.items():
        if "." not in kind:
            tensor.view(torch.uint8).reshape(geometry.num_pages, -1).index_fill_(0, idx, value)


def canary_report(cache: Any, geometry: RankGeometry, allowed: list[list[Any]]) -> dict[str, Any]:
    """Every byte of the rank's shared-memory file that is not the canary, outside ``allowed``.

    ``allowed`` lists ``[pages, n_tokens]`` of legitimate destinations (or of pages the engine
    filled itself): only the token rows ``[0, n)`` laid out on those pages may differ from the
    canary. Everything else (other pages, the unused tail of a last page, the padding between
    regions) must still hold it. Returns the count of such bytes, where the first ones are, and
    every page that changed at all.
    """
    spec = geometry.spec
    whole = np.frombuffer(cache._mmap, dtype=np.uint8)  # the whole file, padding included
    may = np.zeros(whole.size, dtype=bool)
    row = np.arange(spec.row_bytes, dtype=np.int64)
    descriptors = cache.descriptors()
    for pages, n in allowed:
        if spec.packed:  # slots are whole pages of page_bytes
            rows = _request_pages(list(pages), spec, int(n)).numpy()
        else:
            rows = _token_rows(list(pages), spec.page_size, 0, int(n)).numpy()
        for d in descriptors:
            if "." not in d["kind"]:
                may[(d["offset"] + rows[:, None] * spec.row_bytes + row).ravel()] = True
    for d in descriptors:  # cache groups' regions are checked by oracle_groups, not here
        if "." in d["kind"]:
            may[d["offset"]:d["offset"] + d["nbytes"]] = True
    changed = whole != CANARY
    outside = np.flatnonzero(changed & ~may)
    page_bytes = spec.page_bytes

    def where(offset: int) -> str:
        for d in descriptors:
            if d["offset"] <= offset < d["offset"] + d["nbytes"]:
                return f"layer{d['layer']}/{d['kind']}/page{(offset - d['offset']) // page_bytes}"
        return "padding"

    changed_pages: set[int] = set()
    for d in descriptors:
        if "." in d["kind"]:
            continue
        region = changed[d["offset"]:d["offset"] + d["nbytes"]].reshape(geometry.num_pages, -1)
        changed_pages.update(int(p) for p in np.flatnonzero(region.any(axis=1)))
    return {"outside_bytes": int(outside.size), "outside_at": [where(int(o)) for o in outside[:8]],
            "changed_pages": sorted(changed_pages), "changed_bytes": int(changed.sum())}

"""The byte oracle for cache groups: what each group of a request should hold, and checks.

A group's logical bytes are keyed like the default group's (global layer of the group,
kind, token, global head), under the key ``<request>#<group>``, so no byte of one group
can pass for another's. A state group's "tokens" are its rows per slot and its "heads" the
channels TP splits (the group's spec, :mod:`kvxferd.model.groups`): a rank rebuilds exactly the
channels it holds, and a decode rank at another TP checks its own.

What the decode side should hold, derived here from the group definition alone (not
from the daemon's code): a draft group every token; a window group the last ``window``
tokens ``[n - window, n)`` and nothing before them (pages wholly before the window keep
the canary: :func:`untouched_group`); a state group its slot's rows.
"""

from __future__ import annotations

from typing import Any

import torch

from ..model.geometry import RankGeometry
from .oracle import CANARY, _mismatched, _token_rows, _wide, logical_cache


def group_key(request_id: str, group: str) -> str:
    return f"{request_id}#{group}"


def _rows(geometry: RankGeometry, group: str, table: list[int], n_tokens: int) -> tuple[int, int, torch.Tensor]:
    """(first token, end, slot rows) of what the decode side should hold of ``group``."""
    part = geometry.group(group)
    g = geometry.spec.group(group)
    if g.kind == "state":
        rows = part.spec.page_size
        return 0, rows, _token_rows(table, rows, 0, rows)
    lo = max(0, n_tokens - g.window) if g.kind == "window" and g.window else 0
    return lo, n_tokens, _token_rows(table, part.spec.page_size, lo, n_tokens)


def _channels(geometry: RankGeometry, group: str) -> list[tuple[int, int]]:
    """Global channel (head) ranges this rank holds of a group, in its memory order: one range,
    or one per part when the split dimension concatenates parts TP splits one by one."""
    part = geometry.group(group)
    g = geometry.spec.group(group)
    if g.kind != "state" or not g.split_parts:
        return [part.heads]
    tp, rank = part.spec.tp_size, geometry.tp_rank
    out, before = [], 0
    for size in g.split_parts:  # restated here, not taken from the planner
        local = size // tp
        out.append((before + rank * local, before + (rank + 1) * local))
        before += size
    return out


def _logical(geometry: RankGeometry, group: str, request_id: str, n: int, layer: int) -> torch.Tensor:
    """``[kinds, tokens, local heads, head bytes]`` the rank holds of one layer of the group."""
    part = geometry.group(group)
    pieces = [logical_cache(group_key(request_id, group), n, part.spec, (layer, layer + 1), heads)[0]
              for heads in _channels(geometry, group)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)


def _region(cache: Any, geometry: RankGeometry, group: str, layer: int, kind: str) -> torch.Tensor:
    part = geometry.group(group)
    return cache.tensors[(layer, f"{group}.{kind}")].view(torch.uint8).reshape(-1, part.spec.row_bytes)


def fill_group(cache: Any, geometry: RankGeometry, group: str, request_id: str, table: list[int],
               n_tokens: int) -> None:
    """Write this rank's slice of the group: every token of a KV group (the prefill side has
    them all), the rows of a state slot."""
    part = geometry.group(group)
    if geometry.spec.group(group).kind == "state":
        n = part.spec.page_size
        rows = _token_rows(table, n, 0, n)
    else:
        n = n_tokens
        rows = _token_rows(table, part.spec.page_size, 0, n)
    for layer in range(*part.layers):
        logical = _logical(geometry, group, request_id, n, layer)
        for k, kind in enumerate(part.spec.region_kinds):
            _wide(_region(cache, geometry, group, layer, kind)).index_copy_(0, rows, _wide(logical[k].reshape(n, -1)))


def check_group(cache: Any, geometry: RankGeometry, group: str, request_id: str, table: list[int],
                n_tokens: int) -> int:
    """Mismatching bytes of what the decode side should hold of ``group``."""
    part = geometry.group(group)
    lo, hi, rows = _rows(geometry, group, table, n_tokens)
    bad = 0
    for layer in range(*part.layers):
        logical = _logical(geometry, group, request_id, hi, layer)
        for k, kind in enumerate(part.spec.region_kinds):
            got = _wide(_region(cache, geometry, group, layer, kind)).index_select(0, rows)
            bad += _mismatched(got, _wide(logical[k, lo:hi].reshape(hi - lo, -1)))
    return bad


def untouched_group(cache: Any, geometry: RankGeometry, group: str, pages: list[int]) -> int:
    """Bytes that differ from the canary in the given pages (or state slots) of one group."""
    part = geometry.group(group)
    idx = torch.as_tensor(list(pages), dtype=torch.int64)
    bad = 0
    for kind in geometry.kinds_of(group):
        for layer in range(*part.layers):
            flat = cache.tensors[(layer, kind)].view(torch.uint8).reshape(part.num_pages, -1)
            bad += int((flat.index_select(0, idx) != CANARY).sum())
    return bad


def untouched_rows(cache: Any, geometry: RankGeometry, group: str, table: list[int], start: int, end: int) -> int:
    """Bytes that differ from the canary in the token rows ``[start, end)`` of a KV group (the
    rows before a window that share its first page)."""
    part = geometry.group(group)
    rows = _token_rows(table, part.spec.page_size, start, end)
    bad = 0
    for layer in range(*part.layers):
        for kind in part.spec.region_kinds:
            bad += int((_region(cache, geometry, group, layer, kind).index_select(0, rows) != CANARY).sum())
    return bad


def fill_groups(cache: Any, geometry: RankGeometry, request_id: str, tables: dict[str, list[int]],
                n_tokens: int) -> None:
    for group, table in (tables or {}).items():
        fill_group(cache, geometry, group, request_id, table, n_tokens)


def check_groups(cache: Any, geometry: RankGeometry, request_id: str, tables: dict[str, list[int]],
                 n_tokens: int) -> dict[str, int]:
    """Mismatching bytes per group."""
    return {group: check_group(cache, geometry, group, request_id, table, n_tokens)
            for group, table in (tables or {}).items()}

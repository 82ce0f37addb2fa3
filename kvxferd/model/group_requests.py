"""What a request moves of each cache group: page tables and state slots, checked; token ranges.

An engine names, per request, a page table for every KV group (window, draft) and one
state slot for every state group (``groups={"swa": [...], "conv": [slot]}``). A decode
``expect``'s tables cover the request from token 0, like its ``pages``; a prefill
``send``'s cover the chunk from its first token, like its ``pages``; a state slot is
needed with the last chunk only (the state after the prompt's last token is what moves).

What moves of each group, the same on both daemons:

- draft: the same tokens as the full-attention KV, ``[start, num_tokens)``;
- window: the last ``window`` tokens of the prompt, ``[max(start, num_tokens - window),
  num_tokens)`` (in a packed layout from the first token of the page that holds
  ``num_tokens - window``: pages move whole); the pages wholly before them are never read
  nor written (a real engine may name any valid page there, e.g. its padding page);
- state: the slot's ``page_size`` rows, once, with the last chunk.

Pure functions: the engine endpoint checks with them, the lifecycle and the inbox derive
token ranges and slots with them.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..errors import RequestError
from .geometry import InstanceSpec, RankGeometry
from .group_plan import window_origin
from .segments import as_pages, unit_slots


def _tables(geometry: RankGeometry, raw: Mapping[str, Any] | None) -> dict[str, Any]:
    raw = dict(raw or {})
    names = [g.name for g in geometry.spec.groups]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise RequestError(f"groups names {unknown[0]!r}, not a cache group of this instance ({names})",
                           field=f"groups.{unknown[0]}", fix="name only the cache groups of the rank's geometry")
    return raw


def _slot(geometry: RankGeometry, name: str, value: Any) -> np.ndarray:
    part = geometry.group(name)
    slot = as_pages(value, part.num_pages, f"groups.{name}")
    if slot.size != 1:
        raise RequestError(f"state group {name!r} takes one state slot per request, got {slot.size}",
                           field=f"groups.{name}", fix="send the request's state slot as [slot]")
    return slot


def expect_tables(geometry: RankGeometry, raw: Mapping[str, Any] | None,
                  num_tokens: int | None) -> dict[str, np.ndarray]:
    """A decode expect's group tables, every group present and in range."""
    raw = _tables(geometry, raw)
    out: dict[str, np.ndarray] = {}
    for g in geometry.spec.groups:
        if g.name not in raw:
            what = "its state slot" if g.kind == "state" else "a page table from token 0"
            raise RequestError(f"expect names no {g.kind} group {g.name!r} of this instance", field=f"groups.{g.name}",
                               fix=f"send groups={{{g.name!r}: ...}} with {what}")
        if g.kind == "state":
            out[g.name] = _slot(geometry, g.name, raw[g.name])
            continue
        part = geometry.group(g.name)
        pages = as_pages(raw[g.name], part.num_pages, f"groups.{g.name}")
        if g.kind == "window" and num_tokens is None:
            raise RequestError(f"sliding-window group {g.name!r} needs the request's length to find its window",
                               field="num_tokens", fix="send num_tokens with the expect")
        capacity = pages.size * part.spec.page_size
        if num_tokens is not None and num_tokens > capacity:
            raise RequestError(f"group {g.name!r}: num_tokens {num_tokens} exceeds the {capacity} tokens of its "
                               f"{pages.size} pages", field=f"groups.{g.name}",
                               fix=f"send a page of group {g.name!r} for every {part.spec.page_size} tokens")
        out[g.name] = pages
    return out


def send_tables(geometry: RankGeometry, raw: Mapping[str, Any] | None, start: int, end: int,
                last: bool) -> dict[str, np.ndarray]:
    """A prefill chunk's group tables: every KV group's pages for ``[start, end)``, and every
    state group's slot with the last chunk."""
    raw = _tables(geometry, raw)
    out: dict[str, np.ndarray] = {}
    for g in geometry.spec.groups:
        if g.kind == "state":
            if g.name in raw:
                out[g.name] = _slot(geometry, g.name, raw[g.name])
            elif last:
                raise RequestError(f"the last chunk names no slot of state group {g.name!r}",
                                   field=f"groups.{g.name}",
                                   fix=f"send groups={{{g.name!r}: [slot]}} with the last chunk")
            continue
        if g.name not in raw:
            raise RequestError(f"chunk [{start}, {end}) names no pages of {g.kind} group {g.name!r}",
                               field=f"groups.{g.name}", fix="send the group's pages of the chunk, as for pages")
        part = geometry.group(g.name)
        pages = as_pages(raw[g.name], part.num_pages, f"groups.{g.name}")
        ps = part.spec.page_size
        if end > start and (end - 1) // ps - start // ps >= pages.size:
            raise RequestError(f"chunk [{start}, {end}) needs {(end - 1) // ps - start // ps + 1} pages of group "
                               f"{g.name!r}, got {pages.size}", field=f"groups.{g.name}",
                               fix=f"send a page of group {g.name!r} for every {ps} tokens of the chunk")
        out[g.name] = pages
    return out


def group_origin(spec: InstanceSpec, name: str, start: int, num_tokens: int | None) -> int:
    """First token (or state row) of group ``name`` that moves (``""``: the default group)."""
    if not name:
        return start
    group = spec.group(name)
    if group.kind == "state":
        return 0
    if group.kind == "window":
        # num_tokens is required by an expect of an instance with a window group; unknown (0 or
        # None), the whole request moves
        if not num_tokens:
            return start
        origin = window_origin(num_tokens, group.window or 0, start)
        unit = spec.group_spec(name).slot_tokens
        # packed layouts move whole pages: the window starts at its first page (start is page-aligned)
        return max(start, origin // unit * unit)
    return start


def source_range(geometry: RankGeometry, name: str, chunk_start: int, chunk_end: int, last: bool, origin: int,
                 table: np.ndarray | None) -> tuple[int, int, np.ndarray] | None:
    """What a prefill chunk moves of group ``name``: (start, end, source slots), or None for
    nothing (a chunk before the window; a state group before the last chunk)."""
    part = geometry.group(name)
    if geometry.spec.group(name).kind == "state":
        if not last:
            return None
        assert table is not None, "checked at send"
        rows = part.spec.page_size
        return 0, rows, unit_slots(part.spec, table, 0, rows, 0)
    first = max(chunk_start, origin)
    if chunk_end <= first:
        return None
    assert table is not None, "checked at send"
    return first, chunk_end, unit_slots(part.spec, table, first, chunk_end, chunk_start)

"""Per-request copy segments, generated vectorised with numpy.

A chunk of a request covers tokens ``[start, end)``. On each side a token lives in a
*slot* (``page * page_size + offset``) of every region of that side; the slot arrays are
the same for every layer and kind, so they are computed once per (chunk, writer) and
reused for all of the writer's layers. Byte offsets are always relative to one region.

In the ``packed_page`` layout a slot is a whole page (tokens are not addressable inside
it): :func:`unit_slots` is where a token range becomes the pages it touches, and
:func:`check_whole_pages` refuses chunk boundaries that would cut a page in two. From
there on every function here works unchanged on slots of ``row_bytes``.

Wire order of a chunk between one writer and one destination: layers ascending, then
region kinds in ``REGION_KINDS`` order, then tokens ascending, each token contributing
``slice_bytes``. Both sides derive their own offsets from their own page tables, so a
peer never tells a daemon where to write: it only names the token range.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import RequestError
from .geometry import InstanceSpec
from .planner import Writer

INDEX_DTYPE = np.int64


def as_pages(pages: object, num_pages: int, field: str) -> np.ndarray:
    """Validate a page table (list or array of ints) against a rank's page count."""
    try:
        array = np.asarray(pages, dtype=INDEX_DTYPE)
    except (TypeError, ValueError, OverflowError) as exc:
        raise RequestError(f"{field} must be a list of integers ({exc})", field=field,
                           fix="send page indices as integers") from None
    if array.ndim != 1:
        raise RequestError(f"{field} must be a flat list, got shape {array.shape}", field=field,
                           fix="send a flat list of page indices")
    if array.size and (array.min() < 0 or array.max() >= num_pages):
        bad = int(array[(array < 0) | (array >= num_pages)][0])
        raise RequestError(f"{field} holds page {bad}, outside [0, {num_pages})", field=field,
                           fix=f"use page indices below the rank's num_pages ({num_pages})")
    return array


def slots(pages: np.ndarray, page_size: int, start: int, end: int, origin: int = 0,
          pitch: int | None = None) -> np.ndarray:
    """Slot of every token in ``[start, end)``.

    ``pages[i]`` holds tokens ``[origin_page*page_size + i*page_size, ...)`` where
    ``origin_page = origin // page_size``; the decode side uses origin 0 (its table covers
    the whole request), a prefill chunk uses its own first token. ``pitch``: slots from one
    page's start to the next when pages are not dense (``RankGeometry.slot_pitch``), so a
    slot times ``row_bytes`` is still its byte offset and nothing downstream changes.
    """
    if end < start or start < origin:
        raise RequestError(f"token range [{start}, {end}) does not start at or after {origin}",
                           field="tokens", fix="send start <= end")
    if end == start:
        return np.zeros(0, dtype=INDEX_DTYPE)
    first = start // page_size - origin // page_size  # page positions the range touches
    last = (end - 1) // page_size - origin // page_size
    if last >= pages.size:
        raise RequestError(f"token range [{start}, {end}) needs {last + 1} pages from token {origin}, "
                           f"page table has {pages.size}", field="pages",
                           fix="send a page for every page_size tokens of the range")
    # every slot of the touched pages, then the range's window of them: no per-token divisions
    touched = pages[first:last + 1].astype(INDEX_DTYPE, copy=False)
    every = (touched[:, None] * (pitch or page_size) + np.arange(page_size, dtype=INDEX_DTYPE)).ravel()
    skip = start % page_size
    return every[skip:skip + (end - start)]


def page_slots(pages: np.ndarray, page_size: int, start: int, end: int, origin: int = 0,
               pitch: int | None = None) -> np.ndarray:
    """The pages ``[start, end)`` touches, whole (packed layouts); same page-table convention as
    :func:`slots`. A slot is a page, so ``pitch`` is in pages (page_stride // page_bytes)."""
    if end < start or start < origin:
        raise RequestError(f"token range [{start}, {end}) does not start at or after {origin}",
                           field="tokens", fix="send start <= end")
    if end == start:
        return np.zeros(0, dtype=INDEX_DTYPE)
    first = start // page_size - origin // page_size
    last = (end - 1) // page_size - origin // page_size
    if last >= pages.size:
        raise RequestError(f"token range [{start}, {end}) needs {last + 1} pages from token {origin}, "
                           f"page table has {pages.size}", field="pages",
                           fix="send a page for every page_size tokens of the range")
    touched = pages[first:last + 1].astype(INDEX_DTYPE, copy=False)
    return touched if pitch is None else touched * pitch


def unit_slots(spec: InstanceSpec, pages: np.ndarray, start: int, end: int, origin: int = 0,
               pitch: int | None = None) -> np.ndarray:
    """Slots of ``[start, end)`` in ``spec``'s layout: token rows (NHD, NHD_kv) or whole pages
    (packed layouts). ``pitch``: the rank's ``slot_pitch`` (None: dense pages)."""
    if spec.slot_tokens == 1:
        return slots(pages, spec.page_size, start, end, origin, pitch)
    return page_slots(pages, spec.page_size, start, end, origin, pitch)


def slot_count(spec: InstanceSpec, start: int, end: int) -> int:
    """How many slots ``[start, end)`` covers (what a chunk's byte count is made of)."""
    unit = spec.slot_tokens
    if unit == 1 or end <= start:
        return max(0, end - start)
    return (end - 1) // unit - start // unit + 1


def check_whole_pages(spec: InstanceSpec, start: int, end: int, last: bool) -> None:
    """packed_page: a chunk starts on a page boundary and, unless last, ends on one.

    Two chunks sharing a page would both move it whole, each with the other's tokens
    unwritten, racing on the decode side.
    """
    unit = spec.slot_tokens
    if unit == 1:
        return
    fix = (f"cut chunks at multiples of page_size {unit} (only the last chunk may end mid-page): the "
           f"{spec.layout} layout moves whole pages")
    if start % unit:
        raise RequestError(f"chunk [{start}, {end}) starts at token {start}, not a multiple of page_size "
                           f"{unit}", field="start", fix=fix)
    if not last and end % unit:
        raise RequestError(f"chunk [{start}, {end}) is not the last one but ends at token {end}, not a "
                           f"multiple of page_size {unit}", field="end", fix=fix)


def clip_slots(chunk_slots: np.ndarray, spec: InstanceSpec, chunk_start: int, start: int) -> np.ndarray:
    """The slots of a chunk that begins at ``chunk_start``, from token ``start`` on.

    Used when the decode side already holds the tokens before ``start`` (a prefix hit) and
    the prefill engine sent the whole prompt (packed_page: ``start`` is page-aligned).
    """
    unit = spec.slot_tokens
    return chunk_slots[start // unit - chunk_start // unit:]


@dataclass(frozen=True)
class Runs:
    """Contiguous byte runs inside one region, in wire order."""

    offsets: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return int(self.offsets.size)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


def _run_starts(*slot_arrays: np.ndarray) -> np.ndarray:
    """Indices where any of the slot arrays stops being consecutive."""
    n = slot_arrays[0].size
    if n == 0:
        return np.zeros(0, dtype=INDEX_DTYPE)
    breaks = np.zeros(n, dtype=bool)
    breaks[0] = True
    for s in slot_arrays:
        breaks[1:] |= np.diff(s) != 1
    return np.flatnonzero(breaks)


def side_runs(slot_array: np.ndarray, row_bytes: int, head_offset_bytes: int,
              slice_bytes: int) -> Runs:
    """Runs for one side alone (what a socket sender or receiver touches)."""
    if slice_bytes == row_bytes:
        starts = _run_starts(slot_array)
        counts = np.diff(np.append(starts, slot_array.size))
        return Runs(slot_array[starts] * row_bytes, counts * row_bytes)
    return Runs(slot_array * row_bytes + head_offset_bytes,
                np.full(slot_array.size, slice_bytes, dtype=INDEX_DTYPE))


@dataclass(frozen=True)
class Segments:
    """Paired (src offset, dst offset, length) copy segments for one region pair."""

    src: np.ndarray
    dst: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return int(self.lengths.size)


def paired_segments(src_slots: np.ndarray, dst_slots: np.ndarray, writer: Writer) -> Segments:
    """Coalesced segments where both sides are contiguous (a local copy, the oracle)."""
    if src_slots.size != dst_slots.size:
        raise RequestError(f"source has {src_slots.size} tokens, destination {dst_slots.size}",
                           field="tokens", fix="send the same token range on both sides")
    head = writer.slice_bytes
    src_off = head_offset_bytes(writer, "src")
    dst_off = head_offset_bytes(writer, "dst")
    if writer.whole_rows:
        starts = _run_starts(src_slots, dst_slots)
        counts = np.diff(np.append(starts, src_slots.size))
        return Segments(src_slots[starts] * writer.src_row_bytes,
                        dst_slots[starts] * writer.dst_row_bytes, counts * head)
    return Segments(src_slots * writer.src_row_bytes + src_off,
                    dst_slots * writer.dst_row_bytes + dst_off,
                    np.full(src_slots.size, head, dtype=INDEX_DTYPE))


def head_offset_bytes(writer: Writer, side: str) -> int:
    """Byte offset of the writer's head slice inside one token row on ``side``."""
    per_head = writer.slice_bytes // (writer.heads[1] - writer.heads[0])
    heads = writer.src_head_offset if side == "src" else writer.dst_head_offset
    return heads * per_head


def request_segments(writer: Writer, src_pages: np.ndarray, src_page_size: int, src_origin: int,
                     dst_pages: np.ndarray, dst_page_size: int, start: int, end: int) -> Segments:
    """(plan writer, page tables, token range) -> coalesced copy segments per region pair.

    The same segments apply to every (layer, kind) region pair of the writer.
    """
    src = slots(src_pages, src_page_size, start, end, src_origin)
    dst = slots(dst_pages, dst_page_size, start, end, 0)
    return paired_segments(src, dst, writer)


def chunk_bytes(writer: Writer, kinds: int, units: int) -> int:
    """Bytes one writer sends one destination for ``units`` slots (tokens, or packed pages)."""
    return (writer.layers[1] - writer.layers[0]) * kinds * units * writer.slice_bytes

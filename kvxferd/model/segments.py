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

from ..errors import RequestError
from .geometry import InstanceSpec
from .plan import Writer

INDEX_DTYPE = np.int64
#: up to this many slots a chunk's runs are found with plain Python ints: numpy's fixed cost
#: per call (a dozen calls on arrays of a few elements) is most of the work for small chunks
SMALL_SLOTS = 64


def as_pages(pages: object, num_pages: int, field: str) -> np.ndarray:
    """Validate a page table (list or array of ints) against a rank's page count."""
    if type(pages) is list and len(pages) <= SMALL_SLOTS and all(type(p) is int for p in pages) \
            and (not pages or (min(pages) >= 0 and max(pages) < num_pages)):
        # a short list of valid ints (a small request): checked as ints, no numpy reductions;
        # anything else, refusals included, takes the general path and its messages
        return np.array(pages, dtype=INDEX_DTYPE)
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
    return token_offsets(pages, page_size, start, end, origin, pitch or page_size, 1, 0)


def _window(pages: np.ndarray, page_size: int, start: int, end: int, origin: int) -> tuple[int, int]:
    """Positions in ``pages`` of the first and last page ``[start, end)`` touches (end > start)."""
    if end < start or start < origin:
        raise RequestError(f"token range [{start}, {end}) does not start at or after {origin}",
                           field="tokens", fix="send start <= end")
    first = start // page_size - origin // page_size
    last = (end - 1) // page_size - origin // page_size
    if end > start and last >= pages.size:
        raise RequestError(f"token range [{start}, {end}) needs {last + 1} pages from token {origin}, "
                           f"page table has {pages.size}", field="pages",
                           fix="send a page for every page_size tokens of the range")
    return first, last


def token_offsets(pages: np.ndarray, page_size: int, start: int, end: int, origin: int, pitch: int,
                  scale: int, add: int, out: np.ndarray | None = None) -> np.ndarray:
    """``slot * scale + add`` for every token of ``[start, end)`` (see :func:`slots`), into ``out``
    (``end - start`` int64) when given.

    Built page by page (one multiply per page, then a broadcast add of the in-page steps)
    straight into the array returned: a per-token division, or a slot array followed by a
    separate byte-offset pass, costs several times more at 128k tokens, mostly in the page
    faults of fresh megabyte temporaries.
    """
    first, last = _window(pages, page_size, start, end, origin)
    n = end - start
    if first == last and out is None and n and pages.dtype == INDEX_DTYPE:
        # one page (a small request's common case): its in-page steps plus one base, one numpy call
        skip = start % page_size
        return _steps(page_size, scale)[skip:skip + n] + (int(pages[first]) * (pitch * scale) + add)
    if out is None:
        out = np.empty(n, dtype=INDEX_DTYPE)
    if n == 0:
        return out
    base = pages[first:last + 1].astype(INDEX_DTYPE, copy=False) * (pitch * scale)
    if add:
        base += add
    steps = _steps(page_size, scale)
    skip = start % page_size
    at = 0
    k = 0
    if skip:  # the first page, entered part-way
        at = min(n, page_size - skip)
        np.add(base[0], steps[skip:skip + at], out=out[:at])
        k = 1
    whole = (n - at) // page_size
    if whole:
        np.add(base[k:k + whole, None], steps, out=out[at:at + whole * page_size].reshape(whole, page_size))
        at += whole * page_size
        k += whole
    if at < n:  # the last page, left part-way
        np.add(base[k], steps[:n - at], out=out[at:])
    return out


_STEPS: dict[tuple[int, int], np.ndarray] = {}


def _steps(page_size: int, scale: int) -> np.ndarray:
    """``0, scale, 2 * scale, ...`` for one page, built once per (page size, scale) and read-only."""
    steps = _STEPS.get((page_size, scale))
    if steps is None:
        steps = np.arange(0, page_size * scale, scale, dtype=INDEX_DTYPE)
        steps.flags.writeable = False
        if len(_STEPS) < 256:  # a daemon sees a handful of geometries; never grow without bound
            _STEPS[(page_size, scale)] = steps
    return steps


def page_slots(pages: np.ndarray, page_size: int, start: int, end: int, origin: int = 0,
               pitch: int | None = None) -> np.ndarray:
    """The pages ``[start, end)`` touches, whole (packed layouts); same page-table convention as
    :func:`slots`. A slot is a page, so ``pitch`` is in pages (page_stride // page_bytes)."""
    first, last = _window(pages, page_size, start, end, origin)
    if end == start:
        return np.zeros(0, dtype=INDEX_DTYPE)
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
        if slot_array.size <= SMALL_SLOTS and slot_array.dtype == INDEX_DTYPE:
            listed = slot_array.tolist()
            offsets, _, lengths = paired_runs(listed, listed, row_bytes, row_bytes, row_bytes)
            return Runs(np.array(offsets, dtype=INDEX_DTYPE), np.array(lengths, dtype=INDEX_DTYPE))
        starts = _run_starts(slot_array)
        counts = np.diff(np.append(starts, slot_array.size))
        return Runs(slot_array[starts] * row_bytes, counts * row_bytes)
    return Runs(slot_array * row_bytes + head_offset_bytes,
                np.full(slot_array.size, slice_bytes, dtype=INDEX_DTYPE))


def hashed_pieces(src_slots: np.ndarray, dst_slots: np.ndarray, writer: Writer, src_head: int, dst_head: int,
                  checked: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A local copy cut into paired pieces (source offsets, destination offsets, lengths, and
    which are hashed) for a copy that hashes as it goes: slot ``i`` of both sides is checked
    where ``checked[i]``; the hashed pieces, in order, are every checked slot's slice in slot
    order (what each side's digest covers), each at most ``block`` bytes (or one slice), so it is
    still in cache when hashed. Whole rows coalesce where both sides run on; head slices go one
    slot a piece."""
    n = int(src_slots.size)
    if n != dst_slots.size or n != checked.size:
        raise RequestError(f"{n} source slots, {dst_slots.size} destination slots and {checked.size} checks",
                           field="tokens", fix="send the same token range on both sides")
    src_slots, dst_slots = np.asarray(src_slots, dtype=INDEX_DTYPE), np.asarray(dst_slots, dtype=INDEX_DTYPE)
    checked = np.asarray(checked, dtype=bool)
    size = writer.slice_bytes
    if n == 0:
        empty = np.zeros(0, dtype=INDEX_DTYPE)
        return empty, empty, empty, np.zeros(0, dtype=bool)
    if writer.whole_rows:
        per_block = max(1, block // size)
        index = np.arange(1, n)
        cut = ((src_slots[1:] != src_slots[:-1] + 1) | (dst_slots[1:] != dst_slots[:-1] + 1)
               | (checked[1:] != checked[:-1]) | (index % per_block == 0))
        starts = np.concatenate(([0], index[cut])).astype(INDEX_DTYPE)
    else:
        starts = np.arange(n, dtype=INDEX_DTYPE)
    lengths = np.diff(np.append(starts, n)) * size
    return (src_slots[starts] * writer.src_row_bytes + src_head, dst_slots[starts] * writer.dst_row_bytes + dst_head,
            lengths.astype(INDEX_DTYPE), checked[starts])


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
    if writer.whole_rows:
        if src_slots.size <= SMALL_SLOTS and src_slots.dtype == dst_slots.dtype == INDEX_DTYPE:
            runs = paired_runs(src_slots.tolist(), dst_slots.tolist(), writer.src_row_bytes,
                               writer.dst_row_bytes, head)
            return Segments(*(np.array(r, dtype=INDEX_DTYPE) for r in runs))
        starts = _run_starts(src_slots, dst_slots)
        counts = np.diff(np.append(starts, src_slots.size))
        return Segments(src_slots[starts] * writer.src_row_bytes,
                        dst_slots[starts] * writer.dst_row_bytes, counts * head)
    return Segments(src_slots * writer.src_row_bytes + head_offset_bytes(writer, "src"),
                    dst_slots * writer.dst_row_bytes + head_offset_bytes(writer, "dst"),
                    same_lengths(src_slots.size, head))


def paired_runs(src_slots: list[int], dst_slots: list[int], src_row: int, dst_row: int,
                row: int) -> tuple[list[int], list[int], list[int]]:
    """Whole-row runs of :func:`paired_segments` as lists of ints (source offsets, destination
    offsets, lengths), for chunks of a few slots where numpy's per-call cost would dominate."""
    src_off: list[int] = []
    dst_off: list[int] = []
    lengths: list[int] = []
    if not src_slots:
        return src_off, dst_off, lengths
    s0 = s_next = src_slots[0]
    d0 = d_next = dst_slots[0]
    for s, d in zip(src_slots, dst_slots):
        if s != s_next or d != d_next:
            src_off.append(s0 * src_row)
            dst_off.append(d0 * dst_row)
            lengths.append((s_next - s0) * row)
            s0, d0 = s, d
        s_next, d_next = s + 1, d + 1
    src_off.append(s0 * src_row)
    dst_off.append(d0 * dst_row)
    lengths.append((s_next - s0) * row)
    return src_off, dst_off, lengths


def same_lengths(n: int, length: int) -> np.ndarray:
    """``n`` equal run lengths as a read-only broadcast view: no memory per run."""
    return np.broadcast_to(np.asarray(length, dtype=INDEX_DTYPE), (n,))


def head_offset_bytes(writer: Writer, side: str) -> int:
    """Byte offset of the writer's head slice inside one token row on ``side``."""
    per_head = writer.slice_bytes // (writer.heads[1] - writer.heads[0])
    heads = writer.src_head_offset if side == "src" else writer.dst_head_offset
    return heads * per_head


def request_segments(writer: Writer, src_pages: np.ndarray, src_page_size: int, src_origin: int,
                     dst_pages: np.ndarray, dst_page_size: int, start: int, end: int) -> Segments:
    """(plan writer, page tables, token range) -> coalesced copy segments per region pair.

    The same segments apply to every (layer, kind) region pair of the writer. Equal to
    ``paired_segments(slots(src...), slots(dst...), writer)``, computed without per-token
    slot arrays: head slices get their byte offsets straight from the page tables, and
    whole rows look for run breaks only where a page starts on either side (inside a page
    slots are consecutive), so the work is per page, not per token.
    """
    if writer.whole_rows:
        return _whole_row_segments(writer, src_pages, src_page_size, src_origin, dst_pages, dst_page_size,
                                   start, end)
    # both sides in one allocation: two fresh megabyte arrays would each be handed back to
    # the system when freed and fault in again on the next request
    both = np.empty((2, max(0, end - start)), dtype=INDEX_DTYPE)
    src = token_offsets(src_pages, src_page_size, start, end, src_origin, src_page_size,
                        writer.src_row_bytes, head_offset_bytes(writer, "src"), out=both[0])
    dst = token_offsets(dst_pages, dst_page_size, start, end, 0, dst_page_size,
                        writer.dst_row_bytes, head_offset_bytes(writer, "dst"), out=both[1])
    return Segments(src, dst, same_lengths(src.size, writer.slice_bytes))


def _page_starts(page_size: int, start: int, end: int) -> np.ndarray:
    """Tokens in ``(start, end)`` that begin a page."""
    return np.arange(start // page_size * page_size + page_size, end, page_size, dtype=INDEX_DTYPE)


def _slot_at(pages: np.ndarray, page_size: int, origin: int, tokens: np.ndarray) -> np.ndarray:
    return pages[tokens // page_size - origin // page_size] * page_size + tokens % page_size


def _whole_row_segments(writer: Writer, src_pages: np.ndarray, src_ps: int, src_origin: int,
                        dst_pages: np.ndarray, dst_ps: int, start: int, end: int) -> Segments:
    _window(src_pages, src_ps, start, end, src_origin)  # the same refusals as slots()
    _window(dst_pages, dst_ps, start, end, 0)
    if end == start:
        empty = np.zeros(0, dtype=INDEX_DTYPE)
        return Segments(empty, empty, empty)
    src_pages = src_pages.astype(INDEX_DTYPE, copy=False)
    dst_pages = dst_pages.astype(INDEX_DTYPE, copy=False)
    if src_ps % dst_ps == 0:
        cand = _page_starts(dst_ps, start, end)
    elif dst_ps % src_ps == 0:
        cand = _page_starts(src_ps, start, end)
    else:
        cand = np.union1d(_page_starts(src_ps, start, end), _page_starts(dst_ps, start, end))
    before = cand - 1
    breaks = ((_slot_at(src_pages, src_ps, src_origin, cand) != _slot_at(src_pages, src_ps, src_origin, before) + 1)
              | (_slot_at(dst_pages, dst_ps, 0, cand) != _slot_at(dst_pages, dst_ps, 0, before) + 1))
    firsts = np.concatenate((np.array([start], dtype=INDEX_DTYPE), cand[breaks]))
    row = writer.slice_bytes
    counts = np.diff(np.append(firsts, end))
    return Segments(_slot_at(src_pages, src_ps, src_origin, firsts) * writer.src_row_bytes,
                    _slot_at(dst_pages, dst_ps, 0, firsts) * writer.dst_row_bytes, counts * row)


def chunk_bytes(writer: Writer, kinds: int, units: int) -> int:
    """Bytes one writer sends one destination for ``units`` slots (tokens, or packed pages)."""
    return (writer.layers[1] - writer.layers[0]) * kinds * units * writer.slice_bytes

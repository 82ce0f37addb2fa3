"""``request_segments`` and ``token_offsets`` against a per-token reference.

The generator works per page (byte offsets straight from the page tables, run breaks
looked for only where a page starts on either side). The reference here walks token by
token with plain integer arithmetic and merges neighbours by hand, so a wrong window, a
missed break or an off-by-one at a partial first or last page shows up as a difference.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.errors import RequestError
from kvxferd.model.plan import Writer
from kvxferd.model.segments import paired_segments, request_segments, slots, token_offsets

PAGE_SIZES = (1, 2, 3, 4, 5, 8, 16)


def ref_slot(table: list[int], page_size: int, origin: int, token: int) -> int:
    return table[token // page_size - origin // page_size] * page_size + token % page_size


def ref_segments(w: Writer, src: list[int], ps_s: int, origin: int, dst: list[int], ps_d: int,
                 start: int, end: int) -> list[tuple[int, int, int]]:
    per_head = w.slice_bytes // (w.heads[1] - w.heads[0])
    out: list[list[int]] = []
    for t in range(start, end):
        s = ref_slot(src, ps_s, origin, t) * w.src_row_bytes + w.src_head_offset * per_head
        d = ref_slot(dst, ps_d, 0, t) * w.dst_row_bytes + w.dst_head_offset * per_head
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += w.slice_bytes
        else:
            out.append([s, d, w.slice_bytes])
    return [tuple(x) for x in out]


@st.composite
def cases(draw: st.DrawFn) -> tuple:
    ps_s, ps_d = draw(st.sampled_from(PAGE_SIZES)), draw(st.sampled_from(PAGE_SIZES))
    origin = draw(st.integers(0, 40))
    start = draw(st.integers(origin, origin + 40))
    end = draw(st.integers(start, start + 120))
    n_src = max(1, (end - 1) // ps_s - origin // ps_s + 1)
    n_dst = max(1, (end - 1) // ps_d + 1)
    pool = 3 * (n_src + n_dst) + 4
    # consecutive tables merge into long runs; shuffled ones break at every page
    if draw(st.booleans()):
        first = draw(st.integers(0, pool))
        src = list(range(first, first + n_src))
        dst = list(range(first + 1, first + 1 + n_dst))
    else:
        src = draw(st.permutations(range(pool)))[:n_src]
        dst = draw(st.permutations(range(pool)))[:n_dst]
    heads = draw(st.integers(1, 4))
    per_head = draw(st.sampled_from((2, 16, 128)))
    if draw(st.booleans()):  # whole rows on both sides
        row = heads * per_head
        w = Writer(0, 0, (0, heads), (0, 1), 0, 0, row, row, row)
    else:
        src_heads, dst_heads = heads + draw(st.integers(0, 3)), heads + draw(st.integers(0, 3))
        w = Writer(0, 0, (0, heads), (0, 1), draw(st.integers(0, src_heads - heads)),
                   draw(st.integers(0, dst_heads - heads)), heads * per_head, src_heads * per_head,
                   dst_heads * per_head)
    return w, src, ps_s, origin, dst, ps_d, start, end


@settings(max_examples=400, deadline=None)
@given(cases())
def test_request_segments_match_per_token_reference(case: tuple) -> None:
    w, src, ps_s, origin, dst, ps_d, start, end = case
    segs = request_segments(w, np.array(src), ps_s, origin, np.array(dst), ps_d, start, end)
    got = list(zip(segs.src.tolist(), segs.dst.tolist(), segs.lengths.tolist()))
    assert got == ref_segments(w, src, ps_s, origin, dst, ps_d, start, end)
    # the general pairing of slot arrays (local and NIXL transports) agrees too
    general = paired_segments(slots(np.array(src), ps_s, start, end, origin),
                              slots(np.array(dst), ps_d, start, end, 0), w)
    assert list(zip(general.src.tolist(), general.dst.tolist(), general.lengths.tolist())) == got


@settings(max_examples=300, deadline=None)
@given(ps=st.sampled_from(PAGE_SIZES), origin=st.integers(0, 30), span=st.tuples(st.integers(0, 30),
       st.integers(0, 80)), pitch_extra=st.integers(0, 5), scale=st.integers(1, 4096),
       add=st.integers(0, 4096), seed=st.integers(0, 2**16))
def test_token_offsets_match_per_token_reference(ps: int, origin: int, span: tuple[int, int], pitch_extra: int,
                                                 scale: int, add: int, seed: int) -> None:
    start = origin + span[0]
    end = start + span[1]
    n_pages = max(1, (end - 1) // ps - origin // ps + 1)
    table = np.random.default_rng(seed).permutation(n_pages + 7)[:n_pages]
    pitch = ps + pitch_extra
    got = token_offsets(table, ps, start, end, origin, pitch, scale, add)
    want = [(int(table[t // ps - origin // ps]) * pitch + t % ps) * scale + add for t in range(start, end)]
    assert got.dtype == np.int64 and got.tolist() == want
    out = np.full(end - start, -1, dtype=np.int64)
    assert token_offsets(table, ps, start, end, origin, pitch, scale, add, out=out) is out
    assert out.tolist() == want


def test_request_segments_refuses_short_page_tables_like_slots() -> None:
    w = Writer(0, 0, (0, 1), (0, 1), 0, 0, 64, 64, 64)
    sliced = Writer(0, 0, (0, 1), (0, 1), 0, 1, 64, 64, 128)
    for writer in (w, sliced):
        with pytest.raises(RequestError) as err:
            request_segments(writer, np.array([0, 1]), 16, 0, np.array([0, 1, 2]), 16, 0, 40)
        assert err.value.field == "pages" and "needs 3 pages" in str(err.value)
        with pytest.raises(RequestError) as err:
            request_segments(writer, np.array([0, 1, 2]), 16, 20, np.array([0, 1, 2]), 16, 10, 40)
        assert err.value.field == "tokens"

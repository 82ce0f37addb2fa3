"""Which slots integrity checks (kvxferd.model.sampling), against brute-force oracles.

- ``covers`` equals the subset relation of the granule sets two samples check.
- What a source sends always covers what its destination asked, and is at least as strict as
  the source's own wish.
- Both sides of a chunk choose the same tokens whatever their page sizes and layouts (token
  rows or whole packed pages), so their digests are over the same bytes.
- ``period`` requests with a turning offset check every granule exactly once.
- Picks (granules chosen one by one) read back bit by bit; a chunk's window of them, and their
  wire form, choose the same granules.
- The page ledger checks every page on at least one of every ``period`` writes into it, whatever
  requests place it where, and no page more often than its share.
- The digests of the chosen slots are the same on a source and a destination of different page
  sizes, and a changed byte in a chosen slot changes them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.datapath.digest import region_digests
from kvxferd.model.sampling import (FULL, MODES, PageLedger, Picks, Policy, Sample, chosen, granules_of, period_of,
                                    stricter, to_send)

samples = st.integers(1, 24).flatmap(lambda p: st.builds(Sample, st.just(p), st.integers(0, p - 1)))
#: granules chosen one by one, as a decode daemon's ledger asks them: any set of granules in [first, first + n)
picked_samples = st.builds(
    lambda p, first, bits: Sample(p, 0, {"": Picks(first, bytes(bits))}),
    st.integers(2, 24), st.integers(0, 40), st.lists(st.integers(0, 255), max_size=12))


def picked(picks: Picks) -> set[int]:
    """The oracle: granules a Picks names, bit by bit (least significant first)."""
    return {picks.first + 8 * i + b for i, byte in enumerate(picks.bits) for b in range(8) if byte >> b & 1}


def checked(sample: Sample, n: int) -> set[int]:
    """The oracle: granules in [0, n) a sample checks, by its definition."""
    if sample.full:
        return set(range(n))
    if sample.picks:
        return {g for g in picked(sample.picks[""]) if g < n}
    return {g for g in range(n) if (g + sample.offset) % sample.period == 0}


@given(samples, samples)
def test_covers_is_the_subset_relation_of_the_checked_granules(a, b):
    n = 2 * math.lcm(a.period, b.period)
    assert a.covers(b) == (checked(b, n) <= checked(a, n))


@given(st.one_of(samples, picked_samples), st.one_of(samples, picked_samples), st.integers(0, 60), st.integers(1, 60))
def test_covers_over_a_chunks_granules_is_the_subset_relation_there(a, b, lo, n):
    span = np.arange(lo, lo + n)
    assert a.covers(b, "", span) == (checked(b, lo + n) - set(range(lo)) <= checked(a, lo + n))


@given(st.one_of(st.none(), samples), st.one_of(st.none(), samples, picked_samples))
def test_a_source_sends_what_covers_the_ask_and_is_as_strict_as_its_own_wish(own, asked):
    sent = to_send(own, asked)
    if own is None and asked is None:
        assert sent is None
        return
    assert sent is not None
    n = 200
    if asked is not None:
        assert sent.covers(asked, "", np.arange(n)), (own, asked, sent)
    if own is not None:
        assert sent.period <= own.period, (own, asked, sent)  # at least its own share
        if asked is not None and asked.picks and own.period < asked.period:  # ... over the granules asked
            span = range(asked.picks[""].first, asked.picks[""].first + asked.picks[""].count)
            assert checked(own, n) & set(span) <= checked(sent, n), (own, asked, sent)


@given(picked_samples, st.integers(0, 120), st.integers(1, 60), st.sampled_from([1, 2, 4, 8]))
def test_a_chunks_window_of_picks_and_their_wire_form_choose_what_the_request_chose(sample, start, length, g):
    lo, hi = granules_of(start, start + length, g)
    assert (lo, hi) == (start // g, (start + length - 1) // g + 1)
    window = sample.for_chunk("", lo, hi)
    assert Sample.from_wire(window.to_wire()) == window
    assert Sample.from_wire(sample.to_wire()) == sample
    span = np.arange(lo, hi)
    assert window.mask("", span).tolist() == [x in checked(sample, hi) for x in span]
    assert window.covers(sample, "", span) and sample.covers(window, "", span)
    assert picked(window.picks[""]) == checked(sample, hi) - set(range(lo))


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 12), st.sampled_from([(4, 4), (4, 8), (8, 4), (1, 1), (2, 16)]),
       st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12), st.integers(0, 100), st.booleans()),
                min_size=1, max_size=80))
def test_the_ledger_checks_every_page_within_period_writes_into_it_and_no_more_than_its_share(
        period, page_sizes, requests):
    """Requests write runs of pages (from a pool of 64, wherever they fall) starting at any token;
    each page's writes are replayed against what the picks chose for it. A request that failed
    wrote nothing an engine reads: the ledger undoes its write, and it is not replayed."""
    dst_ps, src_ps = page_sizes
    g = math.lcm(dst_ps, src_ps)
    per = g // dst_ps
    ledger = PageLedger()
    history: dict[int, list[bool]] = {}
    pool = np.random.default_rng(period).permutation(64)
    for first_page, n_pages, seed, failed in requests:
        start_page = seed % 3 * per  # a prefix of whole granules already on the decode side
        table = np.roll(pool, seed)[:start_page + n_pages]
        start, end = start_page * dst_ps, (start_page + n_pages) * dst_ps - seed % dst_ps
        picks = ledger.choose("d/0", "", table, dst_ps, start, end, g, period)
        if failed:  # wrote nothing an engine reads: not a write that counts
            ledger.undo("d/0", "", table, dst_ps, start, end, g, picks, period)
            continue
        for k in range(start // dst_ps, (end - 1) // dst_ps + 1):
            history.setdefault(int(table[k]), []).append(k // per in picked(picks))
    for page, writes in history.items():
        gaps = "".join("x" if c else "." for c in writes).split("x")
        assert all(len(run) < period for run in gaps), (page, writes)  # never `period` writes unchecked
        if per == 1:  # a page alone in its granule is checked only when due
            assert sum(writes) <= -(-len(writes) // period), (page, writes)


def test_a_fresh_cache_of_consecutive_pages_is_checked_about_one_page_in_period():
    ledger = PageLedger()
    picks = ledger.choose("d/0", "", np.arange(1000), 16, 0, 16000, 16, 20)
    assert len(picked(picks)) == 50  # page p falls due first at its (20 - p % 20)-th write
    again = ledger.choose("d/0", "", np.arange(1000), 16, 0, 16000, 16, 20)
    assert picked(again) == {p - 1 for p in picked(picks)}  # the next ones along fall due next
    ledger.forget("d/0")
    assert picked(ledger.choose("d/0", "", np.arange(1000), 16, 0, 16000, 16, 20)) == picked(picks)


def _tokens_of(chosen_slots: np.ndarray, all_slots: np.ndarray, slot_tokens: int, start: int, end: int) -> list[int]:
    """The tokens the chosen slots hold (slots are distinct values, so their positions are known)."""
    where = {int(s): i for i, s in enumerate(all_slots)}
    out = []
    for s in chosen_slots:
        i = where[int(s)]
        if slot_tokens == 1:
            out.append(start + i)
        else:
            first = (start // slot_tokens + i) * slot_tokens
            out += list(range(max(first, start), min(first + slot_tokens, end)))
    return out


@settings(max_examples=300)
@given(st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([1, 2, 4, 8, 16]), st.booleans(), st.booleans(),
       st.integers(0, 40), st.integers(1, 90), st.one_of(samples, picked_samples))
def test_both_sides_choose_the_same_tokens_whatever_their_pages(src_ps, dst_ps, src_packed, dst_packed, start_pages,
                                                                length, sample):
    g = math.lcm(src_ps, dst_ps)
    unit = math.lcm(src_ps if src_packed else 1, dst_ps if dst_packed else 1)
    start = start_pages * unit  # packed sides start chunks on their page boundaries
    end = start + length
    tokens = []
    for ps, packed in ((src_ps, src_packed), (dst_ps, dst_packed)):
        st_ = ps if packed else 1
        n = (end - 1) // st_ - start // st_ + 1 if packed else length
        slots = np.arange(1000, 1000 + n)
        tokens.append(_tokens_of(chosen(slots, st_, start, g, sample, ""), slots, st_, start, end))
    assert tokens[0] == tokens[1]
    assert tokens[0] == [t for t in range(start, end) if t // g in checked(sample, end // g + 1)]


@given(st.integers(1, 30), st.integers(1, 200))
def test_period_requests_in_a_row_check_every_granule_once(period, granules):
    policy = Policy("sampled", period)
    counts = [0] * granules
    for _ in range(period):
        s = policy.sample()
        for g in range(granules):
            counts[g] += (g + s.offset) % s.period == 0
    assert counts == [1] * granules


def test_the_policy_follows_the_stricter_of_the_daemon_and_the_instance():
    assert Policy("off").sample() is None
    assert Policy("off").sample("full") == FULL
    assert Policy("full").sample("sampled") == FULL
    assert Policy("off", period=4).sample("sampled").period == 4
    assert Policy("sampled", period=1).sample() == FULL
    assert [m for m in MODES] == ["off", "sampled", "full"]
    assert period_of(0.05) == 20 and period_of(1.0) == 1 and period_of(0.3) == 3


@pytest.mark.parametrize("src_ps,dst_ps", [(4, 16), (16, 4), (8, 8)])
def test_digests_of_the_chosen_slots_agree_across_page_sizes_and_find_a_changed_byte(src_ps, dst_ps):
    rng = np.random.default_rng(src_ps * 31 + dst_ps)
    row, tokens, start = 64, 100, 8
    # one source and one destination region of token rows; page tables shuffled on each side
    def side(ps):
        pages = rng.permutation(64)[: (start + tokens + ps - 1) // ps + 1]
        slots = np.array([pages[t // ps] * ps + t % ps for t in range(start, start + tokens)])
        return torch.zeros(64 * ps * row, dtype=torch.uint8), slots
    (src, s_slots), (dst, d_slots) = side(src_ps), side(dst_ps)
    payload = torch.from_numpy(rng.integers(0, 256, (tokens, row), dtype=np.uint8))
    for buf, slots in ((src, s_slots), (dst, d_slots)):
        buf.view(-1, row)[torch.from_numpy(slots)] = payload
    g = math.lcm(src_ps, dst_ps)
    sample = Sample(3, 1)
    a = region_digests([src], chosen(s_slots, 1, start, g, sample), row, 0, row)
    b = region_digests([dst], chosen(d_slots, 1, start, g, sample), row, 0, row)
    assert a == b
    picked = chosen(d_slots, 1, start, g, sample)
    skipped = np.setdiff1d(d_slots, picked)
    dst.view(-1, row)[int(skipped[0])][0] ^= 0xFF  # a slot outside the sample: not seen
    assert region_digests([dst], picked, row, 0, row) == b
    dst.view(-1, row)[int(picked[-1])][5] ^= 0x01  # one inside it: seen
    assert region_digests([dst], picked, row, 0, row) != b


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(MODES), st.sampled_from((None, *MODES)), st.integers(1, 64),
       st.one_of(st.none(), st.integers(1, 64)), st.one_of(st.none(), st.integers(1, 64)))
def test_a_pair_agrees_the_shorter_standing_period_and_no_request_of_it_asks_less(mode, asked, period, a, b):
    policy = Policy(mode, period)
    standing = policy.standing(asked)
    strictest = max(mode, asked or "off", key=MODES.index)
    assert standing == {"off": None, "sampled": period, "full": 1}[strictest]
    agreed = stricter(a, b)
    assert agreed == (None if a is None and b is None else min(x for x in (a, b) if x is not None))
    own = policy.sample(asked)
    floor = policy.at_least(own, agreed)
    if agreed is None:
        assert floor == own
    else:  # what a request of the pair checks is at least one granule in ``agreed``
        assert floor is not None and floor.period <= agreed
        assert floor == own or floor.period == agreed
        assert 0 <= floor.offset < floor.period

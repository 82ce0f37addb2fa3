"""The decode side's handshake table (kvxferd.lifecycle.handshakes): every state change it
allows, and the times it keeps. The handshake end to end (hellos, answers, refusals, retries,
restarted sources) is driven in process through tests/lifecycle_util.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvxferd.lifecycle import handshakes as hs_
from kvxferd.lifecycle.handshakes import AGREED, ASKING, PAUSED, HandshakeError, Handshakes
from lifecycle_util import spec

KEY = ("src:1", "p", "d")


def entry(failed: bool = False) -> SimpleNamespace:
    return SimpleNamespace(failure=("x", "y") if failed else None)


def test_a_first_destination_asks_and_the_others_wait_for_the_same_hello():
    book = Handshakes(answer_s=1.0, retry_s=0.5)
    first, second = entry(), entry()
    hs, fresh = book.need(KEY, spec(), first, now=10.0)
    assert fresh and hs.state == ASKING and hs.due == 11.0
    again, fresh = book.need(KEY, spec(), second, now=10.2)
    assert again is hs and not fresh and hs.waiting == [first, second]


def test_silence_asks_again_a_pause_ends_and_nobody_waiting_abandons():
    book = Handshakes(answer_s=1.0, retry_s=0.5)
    e = entry()
    hs, _ = book.need(KEY, spec(), e, now=0.0)
    assert book.due(0.9) == []
    assert book.due(1.0) == [(hs, "silent")]
    assert book.move(hs, "silent", 1.0) == ASKING and hs.due == 2.0
    assert book.move(hs, "retry", 1.5) == PAUSED and hs.due == 2.0
    assert book.due(2.0) == [(hs, "due")]
    e.failure = ("bootstrap_timeout", "late")
    assert book.due(2.0) == [(hs, "abandoned")]
    assert book.move(hs, "abandoned", 2.0) is None and book.get(KEY) is None


def test_an_agreed_handshake_holds_until_forgotten_and_is_never_due():
    book = Handshakes(answer_s=1.0, retry_s=0.5)
    first = entry()
    hs, _ = book.need(KEY, spec(), first, now=0.0)
    assert book.move(hs, "agreed", 0.1) == AGREED
    assert book.due(100.0) == []
    later, fresh = book.need(KEY, spec(), entry(), now=5.0)
    assert later is hs and not fresh and hs.waiting == [first]  # an agreed pair keeps no one waiting
    assert book.move(hs, "forgotten", 6.0) is None and book.get(KEY) is None


@pytest.mark.parametrize("state,happened", sorted(
    ((s, h) for s in (None, ASKING, PAUSED, AGREED)
     for h in {h for _s, h in hs_.TRANSITIONS} if (s, h) not in hs_.TRANSITIONS), key=str))
def test_a_happening_the_table_lacks_is_refused(state, happened):
    book = Handshakes(answer_s=1.0, retry_s=0.5)
    hs = hs_.Handshake(KEY, spec(), state=state)
    with pytest.raises(HandshakeError) as err:
        book.move(hs, happened, 0.0)
    assert repr(happened) in str(err.value) and str(state) in str(err.value)


def test_every_state_the_table_names_is_reachable_from_none():
    reached, frontier = {None}, [None]
    while frontier:
        state = frontier.pop()
        for (s, _h), nxt in hs_.TRANSITIONS.items():
            if s == state and nxt not in reached:
                reached.add(nxt)
                frontier.append(nxt)
    assert reached == {None, ASKING, PAUSED, AGREED}


def test_a_lost_member_is_remembered_past_the_handshake_until_the_pair_agrees_again():
    book = Handshakes(answer_s=1.0, retry_s=0.5)
    hs, _ = book.need(KEY, spec(), entry(), now=0.0)
    book.move(hs, "agreed", 0.1)
    book.member_lost(hs, "b:2", "p/tp2/pp0")
    book.move(hs, "forgotten", 1.0)
    assert book.get(KEY) is None and book.lost[KEY] == ("b:2", "p/tp2/pp0")
    again, fresh = book.need(KEY, spec(), entry(), now=2.0)
    assert fresh and book.move(again, "retry", 2.1) == PAUSED and KEY in book.lost  # still lost
    book.move(again, "due", 3.0)
    assert book.move(again, "agreed", 3.1) == AGREED and KEY not in book.lost  # its ranks are back


def test_lost_members_are_bounded_oldest_first():
    book = Handshakes(answer_s=1.0, retry_s=0.5)
    for i in range(hs_.MAX_LOST + 3):
        hs, _ = book.need((f"src:{i}", "p", "d"), spec(), entry(), now=0.0)
        book.member_lost(hs, "b:2", "p/tp2/pp0")
    assert len(book.lost) == hs_.MAX_LOST and ("src:0", "p", "d") not in book.lost
    assert (f"src:{hs_.MAX_LOST + 2}", "p", "d") in book.lost

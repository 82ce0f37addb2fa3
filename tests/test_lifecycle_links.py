"""Links to peer daemons in the lifecycle core: liveness, restarts and closing, in process.

The shells only carry messages and carry out :class:`~kvxferd.lifecycle.effects.LinkChanged`;
every decision (down, back, restarted, closed) and the failures it causes are the core's.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings, strategies as st

from kvxferd.lifecycle import events
from kvxferd.lifecycle.links import CONNECTING, DOWN, TRANSITIONS, UP, LinkError, Links
from lifecycle_util import Cluster, pages, spec

TIMEOUT = 5.0


def _pair():
    c = Cluster("P", "D")
    pn, dn = c.node("P"), c.node("D")
    return c, pn, dn, pn.rank("p", "prefill", spec()), dn.rank("d", "decode", spec())


def _changes(node, side=None):
    return [(ch.why, ch.before, ch.after) for ch in node.links if side is None or ch.side == side]


def test_every_state_of_the_table_is_reachable_and_a_missing_transition_is_refused():
    reached, frontier = {None}, [None]
    while frontier:
        state = frontier.pop()
        for (before, _happened), after in TRANSITIONS.items():
            if before == state and after not in reached:
                reached.add(after)
                frontier.append(after)
    assert reached == {None, CONNECTING, UP, DOWN}
    book = Links("prefill")
    link = book.open("a:1", "a:1", 0.0)
    for happened in ("idle",):  # a link that is not down is never closed for being idle
        with pytest.raises(LinkError, match="connecting.*'idle'"):
            book.move(link, happened, 1.0)
    assert book.get("a:1").state == CONNECTING  # a refused transition changes nothing


@pytest.mark.parametrize("state,happened", [(s, h) for s, h in itertools.product(
    (None, CONNECTING, UP, DOWN), ("opened", "heard", "silent", "idle", "closed")) if (s, h) not in TRANSITIONS])
def test_transitions_the_table_lacks_raise(state, happened):
    book = Links("decode")
    link = book.open("k", "d:1", 0.0)
    link.state = state
    with pytest.raises(LinkError):
        book.move(link, happened, 1.0)


def test_a_silent_source_goes_down_fails_what_waits_on_it_then_closes_once_nothing_does():
    c, pn, dn, p, d = _pair()
    dn.handle(events.LinkOpened(pn.address))
    dn.handle(events.SourceHeard(pn.address, pn.incarnation))
    assert dn.life.source_daemons.is_up(pn.address)
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    c.now += TIMEOUT / 2
    dn.handle(events.Heartbeat(TIMEOUT))
    assert dn.outcome("r", d) is None and dn.life.source_daemons.is_up(pn.address)  # not silent for long enough
    c.now += TIMEOUT
    dn.handle(events.Heartbeat(TIMEOUT))
    c.run()
    assert dn.outcome("r", d).code == "peer_dead" and "unresponsive for 7.5s" in dn.outcome("r", d).reason
    [down] = [ch for ch in dn.links if ch.why == "silent"]
    assert (down.before, down.after, down.daemon, down.silent_for) == (UP, DOWN, pn.address, 7.5)
    assert not any(e.from_source(pn.address) for e in dn.life.inbox.all())  # the failed request is told and gone
    link = dn.life.source_daemons.get(pn.address)
    c.now = link.retry_at + dn.life.source_daemons.backoff_max_s - 0.01
    dn.handle(events.Heartbeat(TIMEOUT))
    assert dn.life.source_daemons.get(pn.address) is link  # down, kept (its backoff is remembered)
    c.now += 0.02
    dn.handle(events.Heartbeat(TIMEOUT))
    assert _changes(dn)[-1] == ("idle", DOWN, None) and dn.life.source_daemons.get(pn.address) is None


def test_a_down_source_heard_again_is_back_up():
    c, pn, dn, p, d = _pair()
    dn.handle(events.LinkOpened(pn.address))
    c.now += 2 * TIMEOUT
    dn.handle(events.Heartbeat(TIMEOUT))
    assert dn.life.source_daemons.get(pn.address).state == DOWN
    dn.handle(events.SourceHeard(pn.address))  # an answer still on its way when its socket closed
    assert _changes(dn) == [("opened", None, CONNECTING), ("silent", CONNECTING, DOWN), ("heard", DOWN, UP)]


def test_another_incarnation_is_a_restart_failing_only_expects_the_old_process_can_have_had():
    c, pn, dn, p, d = _pair()
    dn.handle(events.SourceHeard(pn.address, "first"))
    dn.expect(d, "old", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    ping_left = c.now
    c.now += 0.1
    dn.expect(d, "new", pages(4, 4), "p", num_tokens=16, source_node=pn)
    c.run()
    assert dn.handle(events.SourceHeard(pn.address, "first")) is False  # the same process: nothing
    assert dn.handle(events.SourceHeard(pn.address, "second", sent_before=ping_left)) is True
    c.run()
    assert dn.outcome("old", d).code == "peer_restarted" and "first -> second" in dn.outcome("old", d).reason
    assert dn.outcome("new", d) is None  # its expect left after the ping the new process answered
    [restart] = [ch for ch in dn.links if ch.why == "restarted"]
    assert (restart.old_incarnation, restart.new_incarnation) == ("first", "second")
    assert dn.life.source_daemons.get(pn.address).incarnation == "second"
    for bad in ("", 7, "x" * 65, None):  # not an incarnation: learnt from nothing, no restart
        assert dn.handle(events.SourceHeard(pn.address, bad)) is False


def test_a_decode_daemon_is_known_from_its_ping_and_dropped_when_silent_failing_its_sources():
    c, pn, dn, p, d = _pair()
    pn.handle(events.DecodeHeard(dn.identity))  # nameless (an expect): an unknown link stays unknown
    assert len(pn.life.decode_daemons) == 0
    pn.handle(events.DecodeHeard(dn.identity, dn.address, dn.incarnation))
    assert pn.life.decode_daemons.is_up(dn.identity)
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    pn.send(p, "r", pages(1), 0, 4, False)
    c.run()
    c.now += 2 * TIMEOUT
    pn.handle(events.DecodeHeard(dn.identity))  # any message keeps it alive
    pn.handle(events.Heartbeat(TIMEOUT))
    assert pn.outcome("r", p) is None
    c.now += 2 * TIMEOUT
    pn.handle(events.Heartbeat(TIMEOUT))
    c.run()
    assert pn.outcome("r", p).code == "peer_dead"
    assert _changes(pn, "decode")[-1] == ("silent", UP, None) and len(pn.life.decode_daemons) == 0
    assert pn.life.routes.plan("p", "d") is None  # its routes went with it


def test_a_gone_connection_of_a_restarted_decode_daemon_fails_its_sources():
    c, pn, dn, p, d = _pair()
    pn.handle(events.DecodeHeard(dn.identity, dn.address, "old"))
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    pn.send(p, "r", pages(1), 0, 4, False)
    c.run()
    pn.handle(events.DecodeHeard(b"new-connection", dn.address, "new"))
    [other] = pn.life.decode_daemons.others(b"new-connection", dn.address, "new")
    assert other.key == dn.identity  # what the shell asks the socket about
    pn.handle(events.DecodeGone(dn.identity, dn.address, "old", "new"))
    c.run()
    assert pn.outcome("r", p).code == "peer_restarted" and "old -> new" in pn.outcome("r", p).reason
    assert pn.life.decode_daemons.get(dn.identity) is None and pn.life.decode_daemons.is_up(b"new-connection")
    pn.handle(events.DecodeGone(dn.identity, dn.address, "old", "new"))  # told twice: nothing more
    assert [ch.why for ch in pn.links].count("restarted") == 1


def test_a_source_that_never_answers_fails_its_waiters_then_backs_off_doubling_and_fails_requests_at_once():
    c, pn, dn, p, d = _pair()
    c.cut_links.add(pn.address)  # nothing reaches it, nothing comes back
    c.hold_hellos = True  # hellos sent stay in dn.hellos
    backoff = dn.life.source_daemons
    dn.handle(events.LinkOpened(pn.address))
    dn.expect(d, "r1", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    c.now += 2 * TIMEOUT
    dn.handle(events.Heartbeat(TIMEOUT))
    c.run()
    first = dn.outcome("r1", d)
    assert first.code == "peer_unreachable" and f"source daemon {pn.address} is unreachable: 1 try" in first.reason
    link = backoff.get(pn.address)
    assert link.state == DOWN and c.now + 0.5 * backoff.backoff_s <= link.retry_at <= c.now + backoff.backoff_s
    # backed off: a new request fails at once, and no hello leaves
    hellos = len(dn.hellos)
    dn.expect(d, "r2", pages(4, 4), "p", num_tokens=16, source_node=pn)
    c.run()
    assert dn.outcome("r2", d).code == "peer_unreachable" and "the next try in" in dn.outcome("r2", d).reason
    assert len(dn.hellos) == hellos
    # its backoff ran out: the next request tries it (the shell opens a socket, the hello goes)
    c.now = link.retry_at
    dn.expect(d, "r3", pages(4, 8), "p", num_tokens=16, source_node=pn)
    assert _changes(dn)[-1] == ("retry", DOWN, CONNECTING) and len(dn.hellos) == hellos + 1
    assert dn.outcome("r3", d) is None  # it waits for the try
    c.now += 2 * TIMEOUT
    dn.handle(events.Heartbeat(TIMEOUT))
    c.run()
    assert dn.outcome("r3", d).code == "peer_unreachable" and "2 tries" in dn.outcome("r3", d).reason
    assert c.now + backoff.backoff_s <= link.retry_at <= c.now + 2 * backoff.backoff_s  # doubled
    # tried and answered: back up, the backoff forgotten
    c.now = link.retry_at
    c.cut_links.discard(pn.address)
    dn.expect(d, "r4", pages(4, 12), "p", num_tokens=16, source_node=pn)
    dn.handle(events.SourceHeard(pn.address, pn.incarnation))
    c.hold_hellos = False
    c.answer_hello(dn, dn.hellos[-1])
    c.run()
    pn.send(p, "r4", pages(4), 0, 16, True)
    c.run()
    assert dn.outcome("r4", d).state == "done" and link.state == UP and link.tries == 0


def test_a_source_that_refused_the_key_and_then_went_down_fails_requests_as_auth_failed_until_heard():
    c, pn, dn, p, d = _pair()
    c.cut_links.add(pn.address)  # a refused key: nothing of this daemon's ever reaches the source
    c.hold_hellos = True
    dn.handle(events.LinkOpened(pn.address))
    dn.expect(d, "r1", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    refusal = f"source daemon {pn.address} refused this daemon's key (add it to its auth.allowed_keys)"
    dn.handle(events.SourceLost(pn.address, "auth_failed", refusal))
    c.run()
    assert dn.outcome("r1", d).code == "auth_failed"
    c.now += 2 * TIMEOUT  # no answer ever comes on the refused link: it goes down
    dn.handle(events.Heartbeat(TIMEOUT))
    link = dn.life.source_daemons.get(pn.address)
    assert link.state == DOWN and link.refused == refusal
    # backed off: a new request fails at once, and says it is the key, not reachability
    dn.expect(d, "r2", pages(4, 4), "p", num_tokens=16, source_node=pn)
    c.run()
    r2 = dn.outcome("r2", d)
    assert r2.code == "auth_failed" and r2.reason.startswith(refusal) and "the next try in" in r2.reason, r2
    # a try that is heard forgets the refusal: a later silence is plain unreachability again
    c.now = link.retry_at
    dn.expect(d, "r3", pages(4, 8), "p", num_tokens=16, source_node=pn)
    dn.handle(events.SourceHeard(pn.address, pn.incarnation))
    assert link.state == UP and link.refused == ""


def test_the_backoff_is_capped():
    book = Links("prefill", backoff_s=1.0, backoff_max_s=8.0)
    link = book.open("a:1", "a:1", 0.0)
    waits = []
    for _ in range(8):
        book.move(link, "silent", 100.0)
        waits.append(link.retry_at - 100.0)
        book.move(link, "retry", 100.0)
    assert all(0.5 * min(8.0, 2 ** k) <= w <= min(8.0, 2 ** k) for k, w in enumerate(waits)), waits
    assert max(waits) <= 8.0
    book.move(link, "heard", 101.0)
    assert link.tries == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2), st.sampled_from(
    ["opened", "heard", "silent", "retry", "idle", "closed", "named"]), st.integers(0, 2)), max_size=60))
def test_other_links_of_a_daemon_are_what_a_scan_of_every_link_finds(steps):
    """``others`` reads an index by daemon address (a ping asks it on every link): after any
    sequence of happenings it answers what a scan of every link would, for every key."""
    book = Links("decode")
    for key, daemon, happened, inc in steps:
        link = book.get(key)
        if happened == "named":
            if link is not None:
                book.incarnation(link, f"inc{inc}")
            continue
        if link is None:
            if happened in ("opened", "heard"):
                getattr(book, "open" if happened == "opened" else "heard")(key, f"d{daemon}", 0.0)
            continue
        if (link.state, happened) in TRANSITIONS:
            book.move(link, happened, 0.0)
        for k, d, i in itertools.product(range(6), range(3), range(3)):
            scan = sorted(x.key for x in book if x.key != k and x.daemon == f"d{d}" and x.incarnation
                          and x.incarnation != f"inc{i}")
            assert sorted(x.key for x in book.others(k, f"d{d}", f"inc{i}")) == scan

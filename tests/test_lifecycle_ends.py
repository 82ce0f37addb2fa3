"""Every end of a request on the decode side reaches its prefill side, through the in-process core.

A refusal at the handshake (computed by the prefill daemon or by the decode daemon), an abort by
the decode engine, a decode phase timeout and a dead decode rank each fail the prefill side with
the decode side's code and reason, whether the prefill engine's send came before the decode side
ended the request (a source the prefill daemon holds, bound to nothing) or after (the prefill
daemon keeps the decode side's word, so the send, and a poll, find the request failed). Ends a
link has no standing for, and late ones, change nothing.
"""

from __future__ import annotations

import pytest

from kvxferd.errors import RequestError
from kvxferd.lifecycle import events
from kvxferd.wire import messages

from lifecycle_util import Cluster, Node, pages, spec


def _refused_pair(by: str, remote: bool = True):
    """A prefill instance with 4-token pages and a decode instance with 8-token pages, on daemons that
    refuse page sizes that differ: the prefill daemon (``by="prefill"``: it answers the handshake
    refused) or only the decode daemon (``by="decode"``: the prefill daemon accepted the handshake,
    the decode daemon refuses the answer)."""
    c = Cluster("P", "D") if remote else Cluster("P")
    pn = c.node("P")
    dn = c.node("D") if remote else pn
    (pn if by == "prefill" else dn).cfg.peer.require_same_page_size = True
    return c, pn, dn, pn.rank("p", "prefill", spec(page=4)), dn.rank("d", "decode", spec(page=8))


def _pair():
    c = Cluster("P", "D")
    pn, dn = c.node("P"), c.node("D")
    return c, pn, dn, pn.rank("p", "prefill", spec()), dn.rank("d", "decode", spec())


def _ends(node, side: str, code: str) -> float:
    return node.metrics.peer_ends.labels(side, code)._value.get()


def _refused_reason(dn, d, request_id: str) -> str:
    told = dn.outcome(request_id, d)
    assert (told.state, told.code) == ("failed", "incompatible"), told
    assert "page_size" in told.reason and "4" in told.reason and "8" in told.reason, told.reason
    return told.reason


# -- a refusal at the handshake -------------------------------------------------------------------
@pytest.mark.parametrize("by", ["prefill", "decode"])
def test_a_refused_pair_fails_a_send_that_came_first_with_the_decode_sides_reason(by):
    c, pn, dn, p, d = _refused_pair(by)
    assert pn.send(p, "r", pages(2), 0, 8, True) == "bootstrapping"  # nothing knows the pair yet
    dn.expect(d, "r", pages(1), "p", num_tokens=8, source_node=pn)
    c.run()
    reason = _refused_reason(dn, d, "r")
    told = pn.outcome("r", p)
    assert (told.state, told.code, told.reason) == ("failed", "incompatible", reason)
    assert [m.op for m in c.sent_upstream] == ["ended"]  # the pair has no expect to abort
    assert _ends(pn, "prefill", "incompatible") == 1
    assert not pn.life.sources and pn.life.held_chunks == 0  # nothing of it is held any more


@pytest.mark.parametrize("by", ["prefill", "decode"])
def test_a_refused_pair_fails_a_send_that_comes_later_and_answers_its_poll(by):
    c, pn, dn, p, d = _refused_pair(by)
    dn.expect(d, "r", pages(1), "p", num_tokens=8, source_node=pn)
    c.run()
    reason = _refused_reason(dn, d, "r")
    assert pn.outcome("r", p) is None  # no prefill engine has heard of the request yet
    polled = pn.life.poll(p, "r")  # SGLang's sender polls before it sends
    assert (polled["state"], polled["code"], polled["reason"]) == ("failed", "incompatible", reason)
    assert pn.send(p, "r", pages(1), 0, 4, False) == "failed"
    told = pn.outcome("r", p)
    assert (told.state, told.code, told.reason) == ("failed", "incompatible", reason)
    with pytest.raises(RequestError) as info:  # the next chunk: the request is over, and why
        pn.send(p, "r", pages(1, 1), 4, 8, True)
    assert info.value.code == "request_finished" and "incompatible" in str(info.value)
    assert _ends(pn, "prefill", "incompatible") == 1 and pn.life.held_chunks == 0


@pytest.mark.parametrize("order", ["send_first", "expect_first"])
def test_a_pair_refused_on_one_daemon_fails_the_send_there(order):
    c, pn, _dn, p, d = _refused_pair("prefill", remote=False)
    if order == "send_first":
        pn.send(p, "r", pages(2), 0, 8, True)
    pn.expect(d, "r", pages(1), "p", num_tokens=8)
    c.run()
    reason = _refused_reason(pn, d, "r")
    if order == "expect_first":
        assert pn.send(p, "r", pages(2), 0, 8, True) == "failed"
    assert (pn.outcome("r", p).code, pn.outcome("r", p).reason) == ("incompatible", reason)
    assert _ends(pn, "prefill", "incompatible") == 1


def test_every_prefill_rank_of_a_refused_request_fails():
    c = Cluster("P", "D")
    pn, dn = c.node("P"), c.node("D")
    pn.cfg.peer.require_same_page_size = True
    prefill = [pn.rank("p", "prefill", spec(tp=2, page=4), tp=t) for t in range(2)]
    d = dn.rank("d", "decode", spec(page=8))
    pn.send(prefill[0], "r", pages(2), 0, 8, True)
    dn.expect(d, "r", pages(1), "p", num_tokens=8, source_node=pn)
    c.run()
    assert pn.send(prefill[1], "r", pages(2), 0, 8, True) == "failed"  # the rank that sends later too
    assert [pn.outcome("r", r).code for r in prefill] == ["incompatible", "incompatible"]


# -- aborts, timeouts and dead ranks of a request still bootstrapping ------------------------------
def _bootstrapping(order: str):
    """A decode rank whose bootstrap is held (the handshake did not return yet); in ``send_first`` the
    prefill engine sent the whole request before."""
    c, pn, dn, p, d = _pair()
    c.hold_hellos = True
    if order == "send_first":
        pn.send(p, "r", pages(4), 0, 16, True)
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    return c, pn, dn, p, d


def _end_by(kind: str, c, dn, d) -> tuple[str, str]:
    if kind == "abort":
        dn.handle(events.AbortCalled(d, "r", "the user went away"))
        return "aborted", "the user went away"
    if kind == "rank_gone":
        dn.handle(events.RankGone(d, "engine process 4242 exited"))
        return "rank_gone", "engine process 4242 exited"
    # the decode side times out first (its limit is shorter than the prefill side's)
    dn.cfg.timeouts.bootstrap_s = 1.0
    c.now += 1.5
    dn.handle(events.Tick())
    return "bootstrap_timeout", dn.outcome("r", d).reason


@pytest.mark.parametrize("order", ["send_first", "expect_first"])
@pytest.mark.parametrize("kind", ["abort", "rank_gone", "timeout"])
def test_a_decode_end_while_bootstrapping_reaches_the_prefill_side(kind, order):
    """The end leaves at once (a source bound to nothing fails with it), and once more when the
    bootstrap returns: that one follows the handshake on the link, so the source keeps it for a send
    that comes later (the held bootstrap here stands for a handshake that has not even left)."""
    c, pn, dn, p, d = _bootstrapping(order)
    code, reason = _end_by(kind, c, dn, d)
    c.run()
    assert (dn.outcome("r", d).code, dn.outcome("r", d).reason) == (code, reason)
    assert [m.op for m in c.sent_upstream] == ["ended"]
    if order == "send_first":
        told = pn.outcome("r", p)
        assert (told.state, told.code, told.reason) == ("failed", code, reason)
    c.hold_hellos = False
    c.run()
    assert [m.op for m in c.sent_upstream] == ["ended", "ended"]
    if order == "expect_first":
        assert pn.send(p, "r", pages(4), 0, 16, True) == "failed"
    told = pn.outcome("r", p)
    assert (told.state, told.code, told.reason) == ("failed", code, reason)
    assert len(pn.events_for("r", p)) == 1 and _ends(pn, "prefill", code) == 1


@pytest.mark.parametrize("order", ["expect_first", "send_first"])
def test_an_expect_the_source_refused_ends_its_prefill_side_at_once(order):
    """The source answered the expect with an error (busy here; a NIXL page table it cannot use
    did the same): it bound nothing, so an abort would find no request there, or be dropped
    before the prefill engine's send, and that send would wait out its bootstrap. The decode
    side says ``ended`` instead, which the source keeps for the pair."""
    c, pn, dn, p, d = _pair()
    c.refuse_expects["p"] = ("busy", "source daemon holds 1 requests in flight")
    if order == "send_first":
        assert pn.send(p, "r", pages(4), 0, 16, True) == "bootstrapping"
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    told_d = dn.outcome("r", d)
    assert (told_d.state, told_d.code) == ("failed", "busy") and "in flight" in told_d.reason
    assert [m.op for m in c.sent_upstream] == ["ended"]
    if order == "expect_first":
        assert pn.send(p, "r", pages(4), 0, 16, True) == "failed"
    told_p = pn.outcome("r", p)
    assert (told_p.state, told_p.code) == ("failed", "busy") and "in flight" in told_p.reason
    assert len(pn.events_for("r", p)) == 1


@pytest.mark.parametrize("kind", ["abort", "rank_gone", "timeout"])
def test_a_decode_end_after_the_expect_reached_the_source_is_an_abort(kind):
    c, pn, dn, p, d = _pair()
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    if kind == "timeout":
        dn.cfg.timeouts.waiting_for_input_s = 5.0  # the decode side's limit runs out first
        c.tick(6.0)
        code = "waiting_for_input_timeout"
    else:
        pn.send(p, "r", pages(1), 0, 4, False)
        c.run()
        code, _ = _end_by(kind, c, dn, d)
        c.run()
        assert pn.outcome("r", p).code == code
    assert [m.op for m in c.sent_upstream] == ["abort"]
    # the expect made the request's sources here: they failed, their engine was told, and a later
    # chunk is refused naming the decode side's code
    assert (pn.outcome("r", p).code, pn.life.poll(p, "r")["code"]) == (code, code)
    assert _ends(pn, "prefill", code) == 1
    with pytest.raises(RequestError) as info:
        pn.send(p, "r", pages(3, 1), 4, 16, True)
    assert info.value.code == "request_finished" and code in str(info.value)


def test_an_end_that_left_before_the_handshake_is_said_again_after_it():
    """The decode engine aborts in the very turn its expect came: the end leaves ahead of the handshake,
    so the source cannot take the link's word for the request yet (a send that comes later is not
    failed by it); once the handshake returned, the end goes again and the source keeps it."""
    c, pn, dn, p, d = _pair()
    c.hold_hellos = True
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    dn.handle(events.AbortCalled(d, "r", "gone"))
    c.run()
    assert pn.life.routes.ended("r", "p") is None  # no handshake over that link yet: not its word
    c.hold_hellos = False
    c.run()
    assert pn.life.routes.ended("r", "p") is not None
    assert pn.send(p, "r", pages(4), 0, 16, True) == "failed" and pn.outcome("r", p).code == "aborted"


def test_an_end_while_handshaking_again_is_an_end_not_an_abort():
    """The source answered the expect ``no_handshake`` (it restarted): the request is bound to nothing
    there. A failure before the expect goes again tells the source with ``ended``, which it keeps."""
    c, pn, dn, p, d = _pair()
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    fresh = c.nodes["P"] = Node("P", c)  # the source daemon restarted on its address: it knows nothing
    p = fresh.rank("p", "prefill", spec())
    c.hold_hellos = True
    dn.handle(events.NoHandshake(fresh.address, "r"))  # its answer to the expect
    dn.handle(events.AbortCalled(d, "r", "gone meanwhile"))
    c.run()
    assert [m.op for m in c.sent_upstream] == ["ended"]
    c.hold_hellos = False
    c.run()  # the handshake with the new process, and the end again behind it
    assert [m.op for m in c.sent_upstream] == ["ended", "ended"]
    assert fresh.send(p, "r", pages(4), 0, 16, True) == "failed" and fresh.outcome("r", p).reason == "gone meanwhile"


def test_an_end_of_one_decode_rank_fails_the_expect_of_another_rank_of_its_instance():
    """Decode TP 2 on one daemon: rank 0 is aborted while bootstrapping, rank 1's expect reaches the
    source after its end. The request cannot complete: the source fails it, and rank 1 hears it."""
    c = Cluster("P", "D")
    pn, dn = c.node("P"), c.node("D")
    p = pn.rank("p", "prefill", spec())
    d = [dn.rank("d", "decode", spec(tp=2), tp=t) for t in range(2)]
    pn.send(p, "r", pages(1), 0, 4, False)
    dn.expect(d[0], "r", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    c.hold_hellos = True
    dn.expect(d[1], "r", pages(4), "p", num_tokens=16, source_node=pn)
    c.hold_hellos = False
    # rank 0 already bound the request: an abort of rank 1 while it bootstraps is the same decode side's
    dn.handle(events.AbortCalled(d[1], "r", "rank 1 let go"))
    c.run()
    assert pn.outcome("r", p).code == "aborted" and dn.outcome("r", d[1]).code == "aborted"

    # the pair's handshake holds, so each expect leaves at once: rank 1's follows rank 0's end
    dn.expect(d[0], "s", pages(4, 4), "p", num_tokens=16, source_node=pn)
    dn.handle(events.AbortCalled(d[0], "s", "rank 0 let go"))
    dn.expect(d[1], "s", pages(4, 4), "p", num_tokens=16, source_node=pn)
    c.run()
    told = dn.outcome("s", d[1])
    assert (told.state, told.code, told.reason) == ("failed", "aborted", "rank 0 let go")
    # rank 0's expect bound the request at the source before its end: the source failed its side then,
    # and the prefill engine's send is refused naming the decode side's reason
    with pytest.raises(RequestError) as refused:
        pn.send(p, "s", pages(4), 0, 16, True)
    assert refused.value.code == "request_finished" and "rank 0 let go" in str(refused.value)


# -- what an end may not do ------------------------------------------------------------------------
def test_an_end_from_a_link_without_a_handshake_of_the_pair_is_not_kept():
    """A stranger's end is an abort at most: it fails sources bound to nothing (as any abort may),
    and is not kept, so a send that comes later moves as usual."""
    c, pn, dn, p, d = _pair()
    pn.send(p, "early", pages(1), 0, 4, True)
    for rid in ("early", "later"):
        pn.handle(events.DownstreamEnded(b"stranger", rid, "p", "d", "aborted", "not yours"))
    c.run()
    assert pn.outcome("early", p).code == "aborted"  # the abort rule: a source routed nowhere yet
    assert pn.life.routes.ended("later", "p") is None
    dn.expect(d, "later", pages(4), "p", num_tokens=16, source_node=pn)
    pn.send(p, "later", pages(4), 0, 16, True)
    c.run()
    assert dn.outcome("later", d).state == "done" and pn.outcome("later", p).state == "done"


def test_an_end_for_a_request_bound_to_another_decode_side_changes_nothing():
    c = Cluster("P", "D", "E")
    pn, dn, en = c.node("P"), c.node("D"), c.node("E")
    p, d, e = pn.rank("p", "prefill", spec()), dn.rank("d", "decode", spec()), en.rank("e", "decode", spec())
    en.expect(e, "other", pages(4), "p", num_tokens=16, source_node=pn)  # E handshakes p -> e
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    # E has a link for its own pair and for nothing else: it may not end D's request
    pn.handle(events.DownstreamEnded(en.identity, "r", "p", "d", "aborted", "not yours"))
    pn.handle(events.DownstreamEnded(en.identity, "r", "p", "e", "aborted", "not yours either"))
    pn.send(p, "r", pages(4), 0, 16, True)
    c.run()
    assert dn.outcome("r", d).state == "done" and pn.outcome("r", p).state == "done"
    assert _ends(pn, "prefill", "aborted") == 0


def test_a_late_end_of_a_finished_request_is_ignored():
    c, pn, dn, p, d = _pair()
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    pn.send(p, "r", pages(4), 0, 16, True)
    c.run()
    assert pn.outcome("r", p).state == "done"
    pn.handle(events.DownstreamEnded(dn.identity, "r", "p", "d", "aborted", "late"))
    pn.handle(events.DownstreamEnded(dn.identity, "unknown", "p", "d", "aborted", "stray"))
    c.run()
    assert len(pn.events_for("r", p)) == 1 and pn.life.poll(p, "r")["state"] == "done"
    assert _ends(pn, "prefill", "aborted") == 0 and not pn.life.sources


def test_ends_kept_are_bounded():
    c, pn, dn, p, d = _pair()
    dn.expect(d, "warm", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()  # D handshook the pair: its ends are kept
    cap = 2 * pn.cfg.limits.max_inflight_requests
    for i in range(cap + 10):
        pn.handle(events.DownstreamEnded(dn.identity, f"r{i}", "p", "d", "aborted", "x"))
    assert len(pn.life.routes._ends) == cap
    assert pn.life.routes.ended("r0", "p") is None and pn.life.routes.ended(f"r{cap + 9}", "p") is not None


def test_a_code_a_peer_makes_up_is_counted_under_other():
    c, pn, dn, p, d = _pair()
    for code in ("aborted", "Not A Code!", "x" * 60):
        pn.send(p, code, pages(1), 0, 4, True)
        pn.handle(events.DownstreamEnded(dn.identity, code, "p", "d", code, "why"))
    assert _ends(pn, "prefill", "aborted") == 1 and _ends(pn, "prefill", "other") == 2


def test_the_ended_message_is_bounded_and_validated():
    wire = messages.PeerEnded.of("r", "p", "d", "c" * 100, "m" * 2000).to_wire()
    assert len(wire["code"]) == messages.MAX_CODE and len(wire["reason"]) == messages.MAX_REASON
    assert messages.parse_peer(wire) == messages.PeerEnded("r", "p", "d", "c" * 64, "m" * 500)
    assert messages.PeerEnded.of("r", "p", "d", "", "").to_wire()["reason"]  # never empty: the schema needs one
    from kvxferd.errors import ProtocolError
    for broken in ({**wire, "prefill_instance": ""}, {**wire, "request_id": "x" * 257},
                   {k: v for k, v in wire.items() if k != "decode_instance"}, {**wire, "extra": 1}):
        with pytest.raises(ProtocolError):
            messages.parse_peer(broken)

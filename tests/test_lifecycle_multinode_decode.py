"""A decode instance over several daemons (rank 0 at D1, rank 1 at D2) through the in-process core:
the prefill side learns each destination rank's daemon from the link its expect came on, sends
each writer's chunks there, and a failure at any decode daemon reaches every other one."""

from __future__ import annotations

import pytest

from kvxferd.errors import PlanRefusal
from kvxferd.lifecycle import events
from kvxferd.lifecycle.outbox import Route
from kvxferd.lifecycle.routes import RouteBook
from kvxferd.model.planner import make_plan
from lifecycle_util import Cluster, nbytes_of, pages, spec


def _spread_both():
    """Prefill p TP4 (0-1 at A, 2-3 at B, A the rendezvous) -> decode d TP2 (0 at D1, 1 at D2)."""
    c = Cluster("A", "B", "D1", "D2")
    a, b, d1, d2 = (c.node(n) for n in ("A", "B", "D1", "D2"))
    p_spec, d_spec = spec(4, heads=4), spec(2, heads=4)
    prefill = [a.rank("p", "prefill", p_spec, tp=0), a.rank("p", "prefill", p_spec, tp=1),
               b.rank("p", "prefill", p_spec, tp=2), b.rank("p", "prefill", p_spec, tp=3)]
    decode = [d1.rank("d", "decode", d_spec, tp=0), d2.rank("d", "decode", d_spec, tp=1)]
    c.spread["p"] = {(0, 0): "A", (1, 0): "A", (2, 0): "B", (3, 0): "B"}
    return c, a, b, d1, d2, prefill, decode


def _expect_all(a, d1, d2, decode) -> None:
    d1.expect(decode[0], "r", pages(2), "p", num_tokens=8, source_node=a)
    d2.expect(decode[1], "r", pages(2, 10), "p", num_tokens=8, source_node=a)


def test_each_destination_rank_is_served_at_its_own_daemon():
    c, a, b, d1, d2, prefill, decode = _spread_both()
    _expect_all(a, d1, d2, decode)
    c.run()
    # each source daemon holds one route per decode daemon of the pair, and the request's binding
    # knows which daemon holds which destination rank
    for source in (a, b):
        assert source.life.routes.daemons("p", "d") == ["D1:1", "D2:1"]
        binding = source.life.routes.request("r", "p")
        assert {dst: r.daemon for dst, r in binding.routes.items()} == {(0, 0): "D1:1", (1, 0): "D2:1"}
    for t, rank in enumerate(prefill[:3]):
        (a if t < 2 else b).send(rank, "r", pages(2, 20 + 2 * t), 0, 8, True)
    c.run()
    # d/0's writers (0, 1) are at A and delivered; d/1 waits for rank 3 at B
    assert d1.outcome("r", decode[0]).state == "done" and d2.outcome("r", decode[1]) is None
    b.send(prefill[3], "r", pages(2, 30), 0, 8, True)
    c.run()
    for node, rank in ((d1, decode[0]), (d2, decode[1])):
        outcome = node.outcome("r", rank)
        assert outcome.state == "done" and outcome.bytes == nbytes_of(spec(2, heads=4), 8)
    for t, rank in enumerate(prefill):
        assert (a if t < 2 else b).outcome("r", rank).state == "done"
    assert not any(n.life.sources or n.inbox.all() for n in (a, b, d1, d2))


def test_one_writer_with_destinations_at_two_daemons_is_done_when_both_confirmed():
    """TP1 -> TP2: the one prefill rank writes both decode ranks, each at its own daemon."""
    c = Cluster("P", "D1", "D2")
    p, d1, d2 = c.node("P"), c.node("D1"), c.node("D2")
    src = p.rank("p", "prefill", spec(1, heads=2))
    dst = [d1.rank("d", "decode", spec(2, heads=2), tp=0), d2.rank("d", "decode", spec(2, heads=2), tp=1)]
    d1.expect(dst[0], "r", pages(2), "p", num_tokens=8, source_node=p)
    c.run()
    p.send(src, "r", pages(2, 4), 0, 8, True)
    c.run()
    assert d1.outcome("r", dst[0]).state == "done"
    assert p.outcome("r", src) is None  # d/1 has not expected yet: the source waits for it
    entry = p.life.sources[("r", src.id)]
    assert {dst: t.route.daemon for dst, t in entry.targets.items()} == {(0, 0): "D1:1"}
    d2.expect(dst[1], "r", pages(2), "p", num_tokens=8, source_node=p)
    c.run()
    assert d2.outcome("r", dst[1]).state == "done" and p.outcome("r", src).state == "done"


def test_a_decode_daemon_lost_fails_the_request_on_every_daemon_each_engine_told_once():
    c, a, b, d1, d2, prefill, decode = _spread_both()
    _expect_all(a, d1, d2, decode)
    c.run()
    for t, rank in enumerate(prefill):
        (a if t < 2 else b).send(rank, "r", pages(1, t), 0, 4, False)  # half of the request
    c.run()
    c.nodes.pop("D1")  # D1 is gone: nothing reaches it any more
    for source in (a, b):
        source.handle(events.DownstreamLost(d1.identity, "peer_dead", "decode daemon D1:1 unresponsive for 1.6s"))
    c.run()
    outcome = d2.outcome("r", decode[1])  # D2 hears it from the source daemons
    assert outcome is not None and outcome.state == "failed" and outcome.code == "peer_dead", outcome
    for t, rank in enumerate(prefill):
        outcome = (a if t < 2 else b).outcome("r", rank)
        assert outcome is not None and outcome.state == "failed" and outcome.code == "peer_dead", (rank.id, outcome)
    assert not any(n.life.sources or n.inbox.all() for n in (a, b, d2))
    assert a.life.routes.daemons("p", "d") == ["D2:1"]  # D1's route went, D2's stays


def test_an_abort_at_one_decode_daemon_fails_the_other_decode_daemons_rank():
    c, a, b, d1, d2, prefill, decode = _spread_both()
    _expect_all(a, d1, d2, decode)
    c.run()
    b.send(prefill[2], "r", pages(1), 0, 4, False)
    c.run()
    d2.handle(events.AbortCalled(decode[1], "r", "client went away"))
    c.run()
    assert d2.outcome("r", decode[1]).code == "aborted"
    outcome = d1.outcome("r", decode[0])  # asserts it was told once
    assert outcome is not None and outcome.state == "failed" and outcome.code == "aborted", outcome
    for t, rank in enumerate(prefill):
        outcome = (a if t < 2 else b).outcome("r", rank)
        assert outcome is not None and outcome.state == "failed", (rank.id, outcome)


def test_decode_daemons_of_one_instance_must_find_the_same_plan():
    book = RouteBook(16)
    p_spec = spec(2, heads=4)
    plan = make_plan(p_spec, spec(2, heads=4), mode="direct")
    book.set_pair("p", "d", plan, Route("tcp", ("127.0.0.1", 9), b"one", "D1:1"))
    other = make_plan(p_spec, spec(2, heads=4, page=8), mode="direct")
    with pytest.raises(PlanRefusal) as refused:
        book.check_pair("p", "d", other, "D2:1")
    message = str(refused.value)
    assert refused.value.field == "page_size" and "D1:1" in message and "D2:1" in message, message
    assert "page_size = 8" in message and "page_size = 4" in message and "fix:" in message, message
    staged = make_plan(p_spec, spec(2, heads=4), mode="staged")
    with pytest.raises(PlanRefusal) as refused:
        book.check_pair("p", "d", staged, "D2:1")
    assert refused.value.field == "mode" and "'staged'" in str(refused.value), refused.value
    # the same daemon may come back with another plan (a restart): it replaces its own route
    book.check_pair("p", "d", other, "D1:1")
    book.set_pair("p", "d", other, Route("tcp", ("127.0.0.1", 9), b"two", "D1:1"))
    assert book.plan("p", "d") == other and book.route_of("p", "d", b"two").daemon == "D1:1"
    assert book.route_of("p", "d", b"one") is None

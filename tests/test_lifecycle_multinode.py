"""A prefill instance over two daemons (ranks 0-1 at A, 2-3 at B) through the in-process core:
fan-in across daemons, expects naming the writers each daemon holds, failures on every daemon."""

from __future__ import annotations

import pytest

from kvxferd.errors import RequestError
from kvxferd.lifecycle import events
from kvxferd.model.geometry import rank_id
from lifecycle_util import Cluster, nbytes_of, pages, spec


def _spread(d_tp: int):
    c = Cluster("A", "B", "D")
    a, b, d = c.node("A"), c.node("B"), c.node("D")
    p_spec = spec(4, heads=4)
    prefill = [a.rank("p", "prefill", p_spec, tp=0), a.rank("p", "prefill", p_spec, tp=1),
               b.rank("p", "prefill", p_spec, tp=2), b.rank("p", "prefill", p_spec, tp=3)]
    decode = [d.rank("d", "decode", spec(d_tp, heads=4), tp=t) for t in range(d_tp)]
    c.spread["p"] = {(0, 0): "A", (1, 0): "A", (2, 0): "B", (3, 0): "B"}
    return c, a, b, d, prefill, decode


def _holder(a, b, t: int):
    return a if t < 2 else b


@pytest.mark.parametrize("d_tp", [2, 1], ids=["tp4_to_tp2", "tp4_to_tp1"])
def test_done_only_when_every_writer_on_every_daemon_delivered(d_tp):
    c, a, b, d, prefill, decode = _spread(d_tp)
    for rank in decode:
        d.expect(rank, "r", pages(2), "p", num_tokens=8, source_node=a)  # one address: the rendezvous
    c.run()
    for t in range(3):
        _holder(a, b, t).send(prefill[t], "r", pages(2, 4 * t), 0, 8, True)
    c.run()
    last_writers = {t // (4 // d_tp) for t in range(3, 4)}
    for rank in decode:
        outcome = d.outcome("r", rank)
        if rank.geometry.tp_rank in last_writers:
            assert outcome is None  # rank 3 (at B) has not delivered
        else:
            assert outcome is not None and outcome.state == "done"
    b.send(prefill[3], "r", pages(2, 30), 0, 8, True)
    c.run()
    for rank in decode:
        outcome = d.outcome("r", rank)
        assert outcome.state == "done" and outcome.bytes == nbytes_of(spec(d_tp, heads=4), 8)
    for t, rank in enumerate(prefill):
        assert _holder(a, b, t).outcome("r", rank).state == "done"
    # each daemon held sources only for its own ranks, and nothing is left anywhere
    assert not a.life.sources and not b.life.sources and not d.inbox.all()
    assert {k[1] for k in a.life.finished} == {rank_id("p", 0, 0), rank_id("p", 1, 0)}
    assert {k[1] for k in b.life.finished} == {rank_id("p", 2, 0), rank_id("p", 3, 0)}


def test_a_daemon_whose_ranks_write_nothing_for_a_rank_still_learns_the_route():
    c, a, b, d, prefill, decode = _spread(2)
    d.expect(decode[0], "r", pages(2), "p", num_tokens=8, source_node=a)  # writers 0, 1: all at A
    c.run()
    # B heard the expect with no writers: its ranks may send (poll says waiting), and finish
    assert b.life.poll(prefill[2], "r") == {"state": "waiting_for_input"}


def test_a_failure_at_one_source_daemon_fails_the_request_everywhere_each_engine_told_once():
    c, a, b, d, prefill, decode = _spread(2)
    for rank in decode:
        d.expect(rank, "r", pages(2), "p", num_tokens=8, source_node=a)
    c.run()
    b.send(prefill[2], "r", pages(2), 0, 8, False)
    b.send(prefill[3], "r", pages(2, 2), 0, 8, False)
    a.send(prefill[0], "r", pages(2), 0, 8, False)
    c.run()
    a.handle(events.AbortCalled(prefill[1], "r", "engine gave up"))
    c.run()
    for node, ranks in ((d, decode), (a, prefill[:2]), (b, prefill[2:])):
        for rank in ranks:
            outcome = node.outcome("r", rank)  # asserts it was told at most once
            assert outcome is not None and outcome.state == "failed", (rank.id, outcome)
    assert not a.life.sources and not b.life.sources and not d.inbox.all()


def test_a_source_daemon_lost_fails_the_request_and_the_other_daemon_hears_it():
    c, a, b, d, prefill, decode = _spread(2)
    for rank in decode:
        d.expect(rank, "r", pages(2), "p", num_tokens=8, source_node=a)
    c.run()
    a.send(prefill[0], "r", pages(2), 0, 8, True)
    c.run()
    assert a.outcome("r", prefill[0]).state == "done"  # its destination confirmed its bytes
    c.cut_links.add(b.address)
    d.handle(events.SourceLost(b.address, "peer_dead", "source daemon B:1 unresponsive"))
    c.run()
    assert [d.outcome("r", rank).state for rank in decode] == ["failed", "failed"]
    assert {d.outcome("r", rank).code for rank in decode} == {"peer_dead"}
    # A's rank 1 had not delivered: D's abort fails it, told once; rank 0 stays done
    assert a.outcome("r", prefill[1]).state == "failed" and a.outcome("r", prefill[1]).code == "peer_dead"
    assert a.outcome("r", prefill[0]).state == "done"
    with pytest.raises(RequestError, match="already failed"):
        a.send(prefill[1], "r", pages(2, 2), 0, 8, True)


def test_a_data_header_carries_the_token_of_the_link_of_its_writers_daemon():
    c, a, b, d, prefill, decode = _spread(2)
    d.expect(decode[0], "r", pages(2), "p", num_tokens=8, source_node=a)
    c.run()
    entry = d.inbox.get("r", decode[0].id)
    assert entry.source_daemons == {"A:1": ((0, 0), (1, 0)), "B:1": ()}
    header = {"request_id": "r", "decode_instance": "d", "dst": [0, 0], "src": [0, 0], "start": 0, "end": 8,
              "last": True, "nbytes": nbytes_of(spec(2, heads=4), 8) // 2, "token": b"token-B"}
    with pytest.raises(RequestError) as refused:
        d.inbox.begin(header, decode[0].id)
    assert refused.value.field == "token"
    sink = d.inbox.begin({**header, "token": b"token-A"}, decode[0].id)
    d.inbox.finish(sink, True)


def test_a_decode_side_abort_reaches_every_source_daemon_once():
    c, a, b, d, prefill, decode = _spread(1)
    d.expect(decode[0], "r", pages(2), "p", num_tokens=8, source_node=a)
    c.run()
    for t, rank in enumerate(prefill):
        _holder(a, b, t).send(rank, "r", pages(1, t), 0, 4, False)
    c.run()
    d.handle(events.AbortCalled(decode[0], "r", "client went away"))
    c.run()
    assert d.outcome("r", decode[0]).state == "failed"
    for t, rank in enumerate(prefill):
        outcome = _holder(a, b, t).outcome("r", rank)
        assert outcome.state == "failed" and outcome.code == "aborted", (rank.id, outcome)


def test_a_nixl_failure_waits_for_the_fence_of_every_source_daemon():
    """One-sided WRITEs from two source daemons: the decode engine hears the failure only once
    both daemons said no WRITE of the request is left in flight."""
    c, a, b, d, prefill, decode = _spread(1)
    c.kinds[("p", "d")] = "nixl"
    d.expect(decode[0], "r", pages(2), "p", num_tokens=8, source_node=a)
    c.run()
    c.hold_jobs = True
    for t, rank in enumerate(prefill):
        _holder(a, b, t).send(rank, "r", pages(1, t), 0, 4, False)
    c.run()
    assert a.jobs and b.jobs  # a WRITE in flight from each daemon
    d.handle(events.AbortCalled(decode[0], "r", "client went away"))
    c.run()
    entry = d.inbox.get("r", decode[0].id)
    assert entry.fence_waiting == {a.address, b.address} and d.outcome("r", decode[0]) is None
    while a.jobs:  # A's WRITEs return: A answers fenced, B still writes
        c.run_job(a, a.jobs.pop(0))
    c.run()
    assert entry.fence_waiting == {b.address} and d.outcome("r", decode[0]) is None
    while b.jobs:
        c.run_job(b, b.jobs.pop(0))
    c.run()
    assert d.outcome("r", decode[0]).code == "aborted"
    assert d.metrics.fences.labels("confirmed")._value.get() == 1


def test_an_instance_wholly_at_one_daemon_expects_as_before():
    """No rank map: one expect, naming no writers (every writer of the destination is there)."""
    c = Cluster("P", "D")
    p, d = c.node("P"), c.node("D")
    prefill = [p.rank("p", "prefill", spec(2), tp=t) for t in range(2)]
    (rank,) = [d.rank("d", "decode", spec(1))]
    d.expect(rank, "r", pages(2), "p", num_tokens=8, source_node=p)
    entry = d.inbox.get("r", rank.id)
    c.answer_hello(d, d.hellos.pop(0))
    effects_seen = [e for e in c.queue if type(e[1]).__name__ == "PeerExpected"]
    assert len(effects_seen) == 1 and effects_seen[0][1].writers is None
    assert entry.source_daemons == {} and entry.source_addresses() == [p.address]
    c.run()
    for t, r in enumerate(prefill):
        p.send(r, "r", pages(2, 2 * t), 0, 8, True)
    c.run()
    assert d.outcome("r", rank).state == "done"


def test_a_bootstrap_that_times_out_names_what_it_waited_for():
    c, a, b, d, prefill, decode = _spread(1)
    c.retry_reason["p"] = "missing ranks p/tp3/pp0"  # the rendezvous answers "retry later", again and again
    d.expect(decode[0], "r", pages(2), "p", num_tokens=8, source_node=a)
    c.run()
    c.tick(d.cfg.timeouts.bootstrap_s + 1)
    outcome = d.outcome("r", decode[0])
    assert outcome.code == "bootstrap_timeout" and "missing ranks p/tp3/pp0" in outcome.reason


def test_a_rank_map_naming_a_lost_daemon_is_asked_anew_and_follows_the_rendezvous():
    """The source instance's ranks at B register again at E after B died, and the rendezvous A's
    directory lists E. The decode daemon forgets the rank map that named B when it loses B, so the
    next request handshakes with A again, learns E, and completes; none waits for dead B."""
    c = Cluster("A", "B", "E", "D")
    a, b, e, d = c.node("A"), c.node("B"), c.node("E"), c.node("D")
    p_spec = spec(2, heads=4)
    pa = a.rank("p", "prefill", p_spec, tp=0)
    b.rank("p", "prefill", p_spec, tp=1)
    (rank,) = [d.rank("d", "decode", spec(1, heads=4))]
    c.spread["p"] = {(0, 0): "A", (1, 0): "B"}
    d.expect(rank, "r1", pages(2), "p", num_tokens=8, source_node=a)
    c.run()
    assert sorted(d.inbox.get("r1", rank.id).source_addresses()) == [a.address, b.address]
    # B dies; its rank registers again at E, and the rendezvous's directory says so
    c.cut_links.add(b.address)
    d.handle(events.SourceLost(b.address, "peer_dead", "source daemon B:1 unresponsive for 6.0s"))
    c.run()
    assert d.outcome("r1", rank).code == "peer_dead"
    pe = e.rank("p", "prefill", p_spec, tp=1)
    c.spread["p"] = {(0, 0): "A", (1, 0): "E"}
    d.expect(rank, "r2", pages(2, 2), "p", num_tokens=8, source_node=a)
    c.run()
    entry = d.inbox.get("r2", rank.id)
    assert sorted(entry.source_addresses()) == [a.address, e.address]
    pa_send = a.send(pa, "r2", pages(2), 0, 8, True)
    pe_send = e.send(pe, "r2", pages(2, 2), 0, 8, True)
    c.run()
    assert d.outcome("r2", rank).state == "done", (pa_send, pe_send)

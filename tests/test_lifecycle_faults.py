"""Failures through the in-process core: aborts from each side, timeouts, peer loss and restart,
and the rule that a failure is told only once no job touches the request's pages (the fence)."""

from __future__ import annotations

import pytest

from kvxferd.errors import PeerHungUp, RequestError
from kvxferd.lifecycle import events

from lifecycle_util import Cluster, pages, spec


def _pair(remote: bool = True, kind: str = "tcp"):
    c = Cluster("P", "D") if remote else Cluster("P")
    pn = c.node("P")
    dn = c.node("D") if remote else pn
    c.kinds[("p", "d")] = kind
    return c, pn, dn, pn.rank("p", "prefill", spec()), dn.rank("d", "decode", spec())


def _abort(node, rank, request_id, reason="stop"):
    return node.handle(events.AbortCalled(rank, request_id, reason))


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_abort_from_the_decode_engine_fails_both_sides_once(remote):
    c, pn, dn, p, d = _pair(remote)
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    pn.send(p, "r", pages(1), 0, 4, False)
    c.run()
    assert _abort(dn, d, "r", "user went away") == "failed"
    c.run()
    assert (dn.outcome("r", d).state, dn.outcome("r", d).code) == ("failed", "aborted")
    assert (pn.outcome("r", p).state, pn.outcome("r", p).code) == ("failed", "aborted")
    assert pn.outcome("r", p).reason == "user went away"
    with pytest.raises(RequestError) as info:  # later chunks of the failed request are refused
        pn.send(p, "r", pages(3, 1), 4, 16, True)
    assert info.value.code == "request_finished"


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_abort_from_the_prefill_engine_reaches_the_decode_side(remote):
    c, pn, dn, p, d = _pair(remote)
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    pn.send(p, "r", pages(1), 0, 4, False)
    c.run()
    _abort(pn, p, "r")
    c.run()
    assert dn.outcome("r", d).code == "aborted" and pn.outcome("r", p).code == "aborted"
    assert _abort(pn, p, "r") == "failed"  # aborting again answers the recorded outcome


def test_local_abort_of_many_destinations_is_bounded_and_tells_each_once():
    """A source failing fails every local destination of the request, which do not propagate back."""
    c = Cluster("P")
    pn = c.node("P")
    prefill = pn.rank("p", "prefill", spec(tp=1))
    decode = [pn.rank("d", "decode", spec(tp=2), tp=t) for t in range(2)]
    for d in decode:
        pn.expect(d, "r", pages(4), "p", num_tokens=16)
    c.run()
    _abort(pn, prefill, "r")
    c.run()
    assert [pn.outcome("r", d).code for d in decode] == ["aborted", "aborted"]
    assert len(pn.told) == 3


def test_a_failure_is_told_only_after_the_jobs_in_flight_returned():
    c, pn, dn, p, d = _pair(remote=False)
    dn.expect(d, "r", pages(4), "p", num_tokens=16)
    c.run()
    c.hold_jobs = True
    pn.send(p, "r", pages(4), 0, 16, True)
    c.run()
    assert len(pn.jobs) == 1
    _abort(pn, p, "r")
    c.run()
    assert pn.outcome("r", p) is None  # the job still reads the source pages
    c.hold_jobs = False
    c.run()
    assert pn.outcome("r", p).code == "aborted" and dn.outcome("r", d).code == "aborted"


def _nixl_write_in_flight():
    """A request over a NIXL route whose one WRITE is held in flight."""
    c, pn, dn, p, d = _pair(kind="nixl")
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    c.hold_jobs = True
    pn.send(p, "r", pages(4), 0, 16, True)
    c.run()
    return c, pn, dn, p, d


def test_one_sided_failure_waits_for_the_fence():
    """NIXL route: the decode side fails, and tells its engine only once the source says no WRITE is left."""
    c, pn, dn, p, d = _nixl_write_in_flight()
    _abort(dn, d, "r")
    c.run()
    assert dn.inbox.get("r", d.id).fence_until > 0
    assert dn.outcome("r", d) is None and pn.outcome("r", p) is None
    c.hold_jobs = False
    c.run()  # the WRITE returns (refused at the closed destination), the source answers fenced
    assert pn.outcome("r", p).state == "failed"
    assert dn.outcome("r", d).code == "aborted"
    assert dn.told.index(dn.outcome("r", d)) == 0


def test_a_one_sided_source_is_done_only_once_its_decode_rank_says_the_request_landed():
    """A WRITE completes before the decode daemon reads its header: the source's chunk is sent,
    yet the source rank is done only on the decode rank's ``landed``, and only that link's."""
    c, pn, dn, p, d = _pair(kind="nixl")
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    c.cut_links.add(pn.address)  # the decode side's word is held back
    pn.send(p, "r", pages(4), 0, 16, True)
    c.run()
    assert dn.outcome("r", d).state == "done"
    assert pn.outcome("r", p) is None and pn.life.sources[("r", p.id)].awaiting_landed()
    # a word about another decode instance, or from another link, confirms nothing
    pn.handle(events.DownstreamLanded(dn.identity, "r", "other", d.coords))
    pn.handle(events.DownstreamLanded(b"stranger", "r", "d", d.coords))
    assert pn.outcome("r", p) is None
    pn.handle(events.DownstreamLanded(dn.identity, "r", "d", d.coords))
    assert pn.outcome("r", p).state == "done"


def _sent_with_no_word_back(kind: str):
    """A whole request sent over ``kind`` while nothing the decode daemon says reaches the source."""
    c, pn, dn, p, d = _pair(kind=kind)
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    c.cut_links.add(pn.address)
    pn.send(p, "r", pages(4), 0, 16, True)
    c.run()
    return c, pn, dn, p, d


def test_a_one_sided_source_never_told_landed_fails_at_its_transfer_timeout():
    c, pn, dn, p, d = _sent_with_no_word_back("nixl")
    assert dn.outcome("r", d).state == "done" and pn.outcome("r", p) is None
    c.tick(pn.cfg.timeouts.transfer_s + 1)
    out = pn.outcome("r", p)
    assert out.state == "failed" and out.code == "transferring_timeout", out
    assert "waiting for decode rank [0, 0] of 'd' to say the request landed" in out.reason, out


def test_a_two_sided_source_needs_no_landed_word():
    c, pn, dn, p, d = _sent_with_no_word_back("tcp")
    assert dn.outcome("r", d).state == "done" and pn.outcome("r", p).state == "done"


def _hybrid_half_written():
    """A hybrid request over a NIXL route: the full-attention WRITE returned, the state group's
    (a job of its own) is still in flight."""
    from kvxferd.model.geometry import InstanceSpec
    from kvxferd.model.groups import Group
    hybrid = InstanceSpec(attention="mha", num_layers=2, head_dim=8, dtype="bfloat16", page_size=4, total_kv_heads=2,
                          groups=(Group("ssm", "state", 2, dtype="float32", shape=(4, 8), split_dim=0),))
    c = Cluster("P", "D")
    pn, dn = c.node("P"), c.node("D")
    c.kinds[("p", "d")] = "nixl"
    p, d = pn.rank("p", "prefill", hybrid), dn.rank("d", "decode", hybrid)
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn, groups={"ssm": [3]})
    c.run()
    c.hold_jobs = True
    pn.send(p, "r", pages(4), 0, 16, True, groups={"ssm": [5]})
    c.run()
    assert sorted(j.job.group for j in pn.jobs) == ["", "ssm"]
    full = next(j for j in pn.jobs if not j.job.group)
    pn.jobs.remove(full)
    c.run_job(pn, full)
    c.run()
    return c, pn, dn, p, d


def test_a_request_is_done_only_once_every_group_landed():
    c, pn, dn, p, d = _hybrid_half_written()
    assert dn.outcome("r", d) is None and pn.outcome("r", p) is None  # every token, yet no state
    c.hold_jobs = False
    c.run()
    assert dn.outcome("r", d).state == "done" and pn.outcome("r", p).state == "done"


def test_the_fence_covers_a_cache_groups_write():
    """The source answers the fence only once the state group's WRITE returned too."""
    c, pn, dn, p, d = _hybrid_half_written()
    _abort(dn, d, "r")
    c.run()
    assert dn.inbox.get("r", d.id).fence_until > 0 and dn.outcome("r", d) is None
    c.hold_jobs = False
    c.run()
    assert dn.outcome("r", d).code == "aborted" and pn.outcome("r", p).state == "failed"


def test_an_unanswered_fence_ends_at_its_deadline():
    c, pn, dn, p, d = _nixl_write_in_flight()
    _abort(dn, d, "r")
    c.queue.clear()  # the fence is lost on the way
    c.run()
    assert dn.outcome("r", d) is None
    c.tick(dn.cfg.timeouts.fence_s + 0.5)
    assert dn.outcome("r", d).code == "aborted"
    assert dn.metrics.fences.labels("unconfirmed")._value.get() == 1


def test_phase_timeouts_on_both_sides():
    c, pn, dn, p, d = _pair()
    c.hold_hellos = True
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    pn.send(p, "s", pages(1), 0, 4, True)  # nobody ever expects it
    c.tick(dn.cfg.timeouts.bootstrap_s + 1)
    assert dn.outcome("r", d).code == "bootstrap_timeout"  # the same code as a bootstrap that gave up
    assert pn.outcome("s", p).code == "bootstrap_timeout"


def test_waiting_for_input_timeout_aborts_the_source_side():
    c, pn, dn, p, d = _pair()
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    c.tick(dn.cfg.timeouts.waiting_for_input_s + 1)
    assert dn.outcome("r", d).code == "waiting_for_input_timeout"
    assert pn.life.routes.request("r", "p") is not None


def test_source_daemon_lost_fails_its_destinations_without_propagating():
    c, pn, dn, p, d = _pair()
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    pn.send(p, "r", pages(1), 0, 4, False)
    c.run()
    c.cut_links.add(pn.address)
    dn.handle(events.SourceLost(pn.address, "peer_dead", "silent"))
    c.run()
    assert dn.outcome("r", d).code == "peer_dead"
    assert pn.outcome("r", p) is None  # nothing was sent to the lost source


def test_decode_daemon_lost_fails_its_sources_and_forgets_its_routes():
    c, pn, dn, p, d = _pair()
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    pn.send(p, "r", pages(1), 0, 4, False)
    c.run()
    pn.handle(events.DownstreamLost(dn.identity, "peer_dead", "decode daemon silent"))
    c.run()
    assert pn.outcome("r", p).code == "peer_dead"
    assert pn.life.routes.plan("p", "d") is None and pn.life.routes.request("r", "p") is None
    assert [g.why for g in pn.gone] == ["decode daemon silent"]


def test_source_restart_spares_destinations_still_bootstrapping():
    """A restart noticed while a pair's hello is unanswered: the destinations bound at the old
    process fail, the one still bootstrapping does not, and its hello goes again, to the new one."""
    c, pn, dn, p, d = _pair()
    d2 = dn.rank("d2", "decode", spec(), pages=64)
    dn.expect(d, "old", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    c.hold_hellos = True
    dn.expect(d2, "new", pages(4, 4), "p", num_tokens=16, source_node=pn)
    assert len(dn.hellos) == 1
    dn.handle(events.SourceLost(pn.address, "peer_restarted", "restarted"))
    c.run()
    assert dn.outcome("old", d).code == "peer_restarted"
    assert dn.outcome("new", d2) is None and len(dn.hellos) == 2  # asked again: the new process answers
    c.hold_hellos = False
    pn.send(p, "new", pages(4), 0, 16, True)
    c.run()
    assert dn.outcome("new", d2).state == "done"


def test_source_restart_spares_expects_sent_after_the_answer_that_showed_it():
    """A source that restarted is noticed by an answer (a pong) from its new process. Expects sent
    after the message that answer answers went over the same connection to the new process (it
    answers them no_handshake and they handshake again); only earlier ones can have reached the
    old process and fail peer_restarted."""
    c, pn, dn, p, d = _pair()
    dn.expect(d, "old", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    ping_left = c.now
    c.now += 0.1
    dn.expect(d, "new", pages(4, 4), "p", num_tokens=16, source_node=pn)
    c.run()
    [new] = [e for e in dn.life.inbox.for_request("new")]
    assert new.expects_sent[pn.address] > ping_left and new.state == "waiting_for_input"
    dn.handle(events.SourceLost(pn.address, "peer_restarted", "restarted", sent_before=ping_left))
    c.run()
    assert dn.outcome("old", d).code == "peer_restarted"
    assert dn.outcome("new", d) is None  # the new process holds its expect
    pn.send(p, "new", pages(4), 0, 16, True)
    c.run()
    assert dn.outcome("new", d).state == "done"


def test_source_restart_without_a_date_fails_every_expect_sent():
    c, pn, dn, p, d = _pair()
    dn.expect(d, "a", pages(4), "p", num_tokens=16, source_node=pn)
    c.now += 0.1
    dn.expect(d, "b", pages(4, 4), "p", num_tokens=16, source_node=pn)
    c.run()
    dn.handle(events.SourceLost(pn.address, "peer_restarted", "restarted"))
    c.run()
    assert dn.outcome("a", d).code == "peer_restarted" and dn.outcome("b", d).code == "peer_restarted"


def test_no_handshake_answer_handshakes_again_once():
    c, pn, dn, p, d = _pair()
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    dn.handle(events.NoHandshake(pn.address, "r"))
    assert dn.inbox.get("r", d.id).state == "bootstrapping" and dn.hellos
    c.run()
    dn.handle(events.NoHandshake(pn.address, "r"))  # a second time: not again
    assert not dn.hellos
    pn.send(p, "r", pages(4), 0, 16, True)
    c.run()
    assert dn.outcome("r", d).state == "done"


def test_failed_chunk_fails_the_source_and_the_destination():
    c, pn, dn, p, d = _pair()
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    c.hold_jobs = True
    pn.send(p, "r", pages(4), 0, 16, True)
    c.run()
    c.run_job(pn, pn.jobs.pop(0), ok=False)
    c.hold_jobs = False
    c.run()
    assert pn.outcome("r", p).code == "transfer" and dn.outcome("r", d).code == "transfer"


def _hung_up(reason: str | None, error: str):
    """A chunk on the wire whose sender's socket error (``error``) reaches the source. With a
    ``reason`` the decode engine aborted first: its daemon cut the data connection and its reason to
    the source is queued, not delivered yet; without one nothing failed on the decode side."""
    c, pn, dn, p, d = _pair()
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    c.hold_jobs = True
    pn.send(p, "r", pages(1), 0, 4, False)
    c.run()
    job = pn.jobs.pop(0)
    if reason is not None:
        _abort(dn, d, "r", reason)
    pn.handle(events.JobFinished(job.entry, job.target, job.index, job.kind,
                                 error=PeerHungUp(error, field="transport")))
    return c, pn, dn, p, d


def _hung_up_before_the_reason():
    return _hung_up("user went away", "data connection failed: [Errno 32] Broken pipe")


def test_a_source_hung_up_on_reports_the_decode_sides_reason():
    c, pn, dn, p, d = _hung_up_before_the_reason()
    assert pn.outcome("r", p) is None  # the engine is not told the socket error while the reason may come
    with pytest.raises(RequestError) as info:  # a later chunk is refused, pointing at the finished event
        pn.send(p, "r", pages(3, 1), 4, 16, True)
    assert info.value.code == "request_finished" and "hung up" in str(info.value)
    c.run()
    told = pn.outcome("r", p)
    assert (told.state, told.code, told.reason) == ("failed", "aborted", "user went away")
    assert dn.outcome("r", d).code == "aborted"


def test_a_source_hung_up_on_without_a_reason_reports_the_socket_error_after_cut_reason_s():
    c, pn, dn, p, d = _hung_up_before_the_reason()
    c.queue.clear()  # the decode daemon died: its reason never comes
    c.tick(pn.cfg.timeouts.cut_reason_s / 2)
    assert pn.outcome("r", p) is None
    c.tick(pn.cfg.timeouts.cut_reason_s)
    told = pn.outcome("r", p)
    assert (told.state, told.code) == ("failed", "transfer") and "Broken pipe" in told.reason


def test_a_hang_up_no_reason_explains_reaches_the_decode_side_when_the_wait_ends():
    """The data connection broke (a reset on the way) while the decode daemon failed nothing: the
    decode side hears the socket error once cut_reason_s passed, not before, and once."""
    c, pn, dn, p, d = _hung_up(None, "[Errno 104] Connection reset by peer")
    c.run()
    assert dn.outcome("r", d) is None and pn.outcome("r", p) is None
    c.tick(pn.cfg.timeouts.cut_reason_s + 0.1)
    assert (pn.outcome("r", p).code, dn.outcome("r", d).code) == ("transfer", "transfer")
    assert "Connection reset" in dn.outcome("r", d).reason


def test_rank_gone_fails_its_requests_and_a_reused_id_is_refused():
    c, pn, dn, p, d = _pair(remote=False)
    dn.expect(d, "r", pages(4), "p", num_tokens=16)
    c.run()
    dn.handle(events.RankGone(d, "engine exited"))
    c.run()
    assert dn.outcome("r", d).code == "rank_gone"
    with pytest.raises(RequestError) as info:
        dn.expect(d, "r", pages(4), "p", num_tokens=16)
    assert info.value.code == "request_finished"


def test_shutdown_fails_everything_and_tells_what_is_left_at_the_end():
    c, pn, dn, p, d = _pair(remote=False)
    dn.expect(d, "r", pages(4), "p", num_tokens=16)
    c.run()
    c.hold_jobs = True
    pn.send(p, "r", pages(4), 0, 16, True)
    c.run()
    pn.handle(events.ShutDown())
    c.run()
    assert pn.outcome("r", p) is None  # its job still runs
    pn.handle(events.ShutDown(final=True))
    assert pn.outcome("r", p).code == "shutdown" and dn.outcome("r", d).code == "shutdown"

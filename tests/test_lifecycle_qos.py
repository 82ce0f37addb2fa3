"""Transfer classes and deadlines through the in-process core: what a request's chunk jobs ask of
the data plane's scheduler (class held to qos.instances, the operator's weight), and deadlines that
pass before the request is done fail it ``deadline`` rather than reporting it done late."""

from __future__ import annotations

from kvxferd.model.qos import QosPolicy

from lifecycle_util import Cluster, pages, spec


def _pair(policy: QosPolicy | None = None):
    c = Cluster("P", "D")
    pn, dn = c.node("P"), c.node("D")
    if policy is not None:
        pn.life.qos = policy
    c.kinds[("p", "d")] = "tcp"
    return c, pn, dn, pn.rank("p", "prefill", spec()), dn.rank("d", "decode", spec())


def _asked(policy: QosPolicy, asked: str | None, instance_rank: str = "p"):
    c, pn, dn, p, d = _pair(policy)
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    c.hold_jobs = True
    pn.send(p, "r", pages(4), 0, 16, True, qos_class=asked, budget_s=2.0)
    c.run()
    (job,) = pn.jobs
    return c, job.job.qos


def test_a_request_asks_its_class_and_the_operator_holds_it_to_the_instances_class():
    open_policy = QosPolicy.parse("bulk", [])
    c, qos = _asked(open_policy, "latency")
    assert (qos.cls, qos.instance, qos.weight) == ("latency", "p", 1.0)
    assert qos.deadline == c.now + 2.0  # the budget runs from the call
    assert _asked(open_policy, None)[1].cls == "bulk"  # no ask: the default class
    pinned = QosPolicy.parse("latency", ["p=bulk:3"])
    assert (_asked(pinned, "latency")[1].cls, _asked(pinned, "latency")[1].weight) == ("bulk", 3.0)
    lowered = QosPolicy.parse("bulk", ["p*=latency:2"])
    assert (_asked(lowered, "bulk")[1].cls, _asked(lowered, None)[1].cls) == ("bulk", "latency")


def test_a_request_whose_bytes_land_after_its_deadline_fails_deadline_never_done():
    c, pn, dn, p, d = _pair()
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    c.hold_jobs = True
    pn.send(p, "r", pages(4), 0, 16, True, budget_s=0.5)
    c.run()
    c.now += 0.75  # the job is still running when the deadline passes (no tick in between)
    c.hold_jobs = False
    c.run()
    out = pn.outcome("r", p)
    assert (out.state, out.code) == ("failed", "deadline"), out
    assert "250.0 ms after the request's deadline" in out.reason


def test_a_request_still_waiting_for_its_decode_side_at_its_deadline_fails_on_the_next_tick():
    c, pn, dn, p, d = _pair()
    pn.send(p, "r", pages(4), 0, 16, True, budget_s=0.5)  # no expect yet: it waits, bootstrapping
    c.tick(0.25)
    assert pn.outcome("r", p) is None
    c.tick(0.5)
    out = pn.outcome("r", p)
    assert (out.state, out.code) == ("failed", "deadline") and "deadline passed in state" in out.reason


def test_a_request_done_within_its_deadline_is_done():
    c, pn, dn, p, d = _pair()
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    pn.send(p, "r", pages(4), 0, 16, True, budget_s=0.5)
    c.run()
    assert pn.outcome("r", p).state == "done" and dn.outcome("r", d).state == "done"


def test_a_deadline_is_the_earlier_of_a_budget_and_a_wall_clock_time_and_one_past_is_zero():
    from kvxferd.model.qos import budget_s
    assert budget_s(None, None, 1000.0) is None
    assert budget_s(250.0, None, 1000.0) == 0.25
    assert budget_s(None, 1002.0, 1000.0) == 2.0
    assert budget_s(250.0, 1002.0, 1000.0) == 0.25  # the budget ends first
    assert budget_s(5000.0, 1002.0, 1000.0) == 2.0  # the wall-clock time comes first
    assert budget_s(None, 999.0, 1000.0) == 0.0  # already past: fails before a byte moves

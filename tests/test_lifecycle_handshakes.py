"""The decode side's handshakes, driven in process: real lifecycle cores on both sides, hellos
and answers carried by tests/lifecycle_util.py as the peer shells carry them.

One hello per instance pair, shared by its destinations; a refusal fails them naming the field;
"retry later" pauses and asks again; silence asks again; a restarted source is asked anew; a
handshake nobody waits for any more ends; a source instance on the decode daemon is planned
once it registers."""

from __future__ import annotations

import numpy as np

from kvxferd.lifecycle import events
from lifecycle_util import Cluster, pages, spec


def _pair(**cfg):
    c = Cluster("P", "D")
    pn, dn = c.node("P"), c.node("D")
    for key, value in cfg.items():
        setattr(pn.cfg.peer, key, value)
    return c, pn, dn, pn.rank("p", "prefill", spec()), dn.rank("d", "decode", spec())


def _handshakes(node, result: str) -> float:
    return node.metrics.handshakes.labels(result)._value.get()


def test_the_destinations_of_a_pair_share_one_hello_and_its_answer():
    c, pn, dn, p, d = _pair()
    c.hold_hellos = True
    for rid in ("a", "b", "c"):
        dn.expect(d, rid, pages(4, 4 * "abc".index(rid)), "p", num_tokens=16, source_node=pn)
    assert [(h.address, h.prefill, h.decode) for h in dn.hellos] == [(pn.address, "p", "d")]
    c.hold_hellos = False
    c.run()
    assert {dn.inbox.get(rid, d.id).state for rid in "abc"} == {"waiting_for_input"}
    assert _handshakes(dn, "ok") == 1
    dn.expect(d, "later", pages(4, 12), "p", num_tokens=16, source_node=pn)
    assert dn.hellos == [] and dn.inbox.get("later", d.id).state == "waiting_for_input"  # agreed: no hello


def test_a_refusal_fails_every_waiting_destination_naming_the_field_and_is_not_kept():
    c = Cluster("P", "D")
    pn, dn = c.node("P"), c.node("D")
    pn.cfg.peer.require_same_page_size = True
    pn.rank("p", "prefill", spec(page=4))
    d = dn.rank("d", "decode", spec(page=8))
    c.hold_hellos = True
    dn.expect(d, "a", pages(2), "p", num_tokens=16, source_node=pn)
    dn.expect(d, "b", pages(2, 2), "p", num_tokens=16, source_node=pn)
    c.hold_hellos = False
    c.run()
    for rid in "ab":
        told = dn.outcome(rid, d)
        assert (told.state, told.code) == ("failed", "incompatible") and "page_size" in told.reason, told
    assert pn.life.routes.linked("p", "d", dn.identity)  # the source remembers it refused that link
    assert dn.metrics.refusals.labels("page_size")._value.get() == 2
    assert len(dn.life.handshakes) == 0  # the next destination asks again
    dn.expect(d, "c", pages(2, 4), "p", num_tokens=16, source_node=pn)
    assert len(dn.hellos) == 1


def test_a_plan_that_would_leave_bytes_unwritten_is_refused_by_the_decode_side():
    """The source daemon plans once and sends the plan; the decode side checks it and plans nothing:
    a faulty source's plan fails the destinations ``incompatible`` before a byte moves."""
    c, pn, dn, p, d = _pair()
    c.tamper_plan = lambda rows: rows[:-1]
    dn.expect(d, "a", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    told = dn.outcome("a", d)
    assert (told.state, told.code) == ("failed", "incompatible") and "never be written" in told.reason, told
    assert dn.metrics.refusals.labels("plan")._value.get() == 1
    c.tamper_plan = None  # a sound answer next time: the pair agrees and the request lands
    dn.expect(d, "b", pages(4), "p", num_tokens=16, source_node=pn)
    pn.send(p, "b", pages(4, 8), 0, 16, True)
    c.run()
    assert dn.outcome("b", d).state == "done"


def test_retry_later_pauses_then_asks_again_and_a_timeout_names_what_the_source_said():
    c, pn, dn, p, d = _pair()
    c.retry_reason["p"] = "missing ranks p/tp1/pp0"
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    entry = dn.inbox.get("r", d.id)
    assert entry.state == "bootstrapping" and "missing ranks p/tp1/pp0" in entry.waiting_for
    c.hold_hellos = True
    c.tick(dn.cfg.timeouts.handshake_retry_s / 2)
    assert dn.hellos == []  # paused
    c.tick(dn.cfg.timeouts.handshake_retry_s)
    assert len(dn.hellos) == 1  # asked again
    del c.retry_reason["p"]
    c.hold_hellos = False
    c.run()
    assert entry.state == "waiting_for_input"
    pn.send(p, "r", pages(4), 0, 16, True)
    c.run()
    assert dn.outcome("r", d).state == "done"

    c.retry_reason["p"] = "missing ranks p/tp1/pp0"
    d2 = dn.rank("d2", "decode", spec())  # a pair not agreed yet: its hello hears "retry later" until it times out
    dn.expect(d2, "late", pages(4, 4), "p", num_tokens=16, source_node=pn)
    c.run()
    c.tick(dn.cfg.timeouts.bootstrap_s + 1)
    told = dn.outcome("late", d2)
    assert told.code == "bootstrap_timeout" and "missing ranks p/tp1/pp0" in told.reason, told


def test_silence_asks_again_and_the_answer_that_comes_is_taken():
    c, pn, dn, p, d = _pair()
    c.cut_links.add(pn.address)  # the hello is lost on the way
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    assert dn.inbox.get("r", d.id).state == "bootstrapping" and dn.hellos == []
    c.cut_links.clear()
    c.hold_hellos = True
    c.tick(0.5)
    assert dn.hellos == []  # not yet: an answer may still come
    c.tick(1.0)
    assert len(dn.hellos) == 1
    c.hold_hellos = False
    c.run()
    assert dn.inbox.get("r", d.id).state == "waiting_for_input"


def test_a_handshake_nobody_waits_for_ends_and_a_late_answer_changes_nothing():
    """A destination that failed while bootstrapping told its source ``ended`` ahead of the handshake:
    the handshake goes on within its bootstrap time (the end goes again behind it), then ends."""
    c, pn, dn, p, d = _pair()
    c.hold_hellos = True
    dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
    dn.handle(events.AbortCalled(d, "r", "the user went away"))
    c.tick(0.2)
    assert len(dn.life.handshakes) == 1
    c.tick(dn.cfg.timeouts.bootstrap_s)
    assert len(dn.life.handshakes) == 0 and _handshakes(dn, "timeout") == 1
    c.hold_hellos = False
    c.run()  # the answer to the hello that left: no handshake asks for it any more
    assert len(dn.life.handshakes) == 0 and _handshakes(dn, "ok") == 0
    assert dn.outcome("r", d).code == "aborted"


def test_an_agreed_pair_is_forgotten_when_its_source_goes_and_asked_anew_after():
    c, pn, dn, p, d = _pair()
    dn.expect(d, "a", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    assert [h["state"] for h in dn.life.handshakes.describe()] == []  # agreed ones are not listed
    dn.handle(events.SourceLost(pn.address, "peer_dead", "silent for 6s"))
    c.run()
    assert dn.outcome("a", d).code == "peer_dead" and len(dn.life.handshakes) == 0
    dn.expect(d, "b", pages(4, 4), "p", num_tokens=16, source_node=pn)
    assert len(dn.hellos) == 1  # asked anew
    c.run()
    pn.send(p, "b", pages(4), 0, 16, True)
    c.run()
    assert dn.outcome("b", d).state == "done"


def test_a_source_instance_on_the_decode_daemon_is_planned_once_it_registers():
    c = Cluster("N")
    n = c.node("N")
    d = n.rank("d", "decode", spec())
    n.expect(d, "r", pages(4), "p", num_tokens=16)
    c.run()
    entry = n.inbox.get("r", d.id)
    assert entry.state == "bootstrapping" and "'p'" in entry.waiting_for and n.hellos == []
    p = n.rank("p", "prefill", spec(), pages=64)
    c.tick(0.1)
    assert entry.state == "waiting_for_input"
    n.send(p, "r", pages(4, 8), 0, 16, True)
    c.run()
    assert n.outcome("r", d).state == "done"


def test_a_pair_agrees_the_stricter_sides_integrity_and_each_request_is_checked_at_least_at_it():
    """Each side of a pair names its standing integrity period in the handshake (its daemon's
    mode, or its instance's ask at register where stricter); the pair agrees the shorter, both
    sides show it in ``status``, and every request of the pair asks at least that, whatever
    the decode daemon's own mode."""
    from kvxferd.model.sampling import FULL, Policy

    for p_mode, d_mode, d_ask, agreed in (("full", "off", None, 1), ("sampled", "off", None, 20),
                                          ("sampled", "off", "full", 1), ("off", "sampled", None, 20),
                                          ("off", "off", None, None)):
        c, pn, dn, p, d = _pair()
        pn.life.integrity, dn.life.integrity = Policy(p_mode), Policy(d_mode)
        d.integrity = d_ask
        for rid in ("a", "b"):
            dn.expect(d, rid, pages(4, 4 * "ab".index(rid)), "p", num_tokens=16, source_node=pn)
        c.run()
        hs = dn.life.handshakes.get((pn.address, "p", "d"))
        assert hs.integrity == agreed and pn.life.routes.integrity("p", "d") == agreed, (p_mode, d_mode, d_ask)
        shown = {"off": "off", 1: "full", 20: "sampled 1/20"}[agreed or "off"]
        assert [x["integrity"] for x in dn.life.handshakes.integrity_pairs()] == [shown]
        assert [x["integrity"] for x in pn.life.routes.integrity_pairs()] == [shown]
        entries = [dn.inbox.get(rid, d.id) for rid in "ab"]
        if agreed is None:
            assert [e.integrity for e in entries] == [None, None]
        elif agreed == 1:
            assert [e.integrity for e in entries] == [FULL, FULL]
        else:  # one granule in 20, chosen page by page (a fresh cache: pages 19, 39, ... first)
            assert [e.integrity.period for e in entries] == [20, 20]
            assert [set(e.integrity.picks) for e in entries] == [{""}, {""}]


def test_a_decode_instance_asks_at_its_handshakes_the_strictest_integrity_any_of_its_ranks_asked():
    """The pair's hello carries the decode instance's standing period, as the source's answer
    carries the prefill instance's: the strictest of its ranks' asks at register, whichever rank's
    request opens the handshake (here rank 0, which asked nothing, while rank 1 asked full)."""
    from kvxferd.model.sampling import FULL

    c = Cluster("P", "D")
    pn, dn = c.node("P"), c.node("D")
    pn.rank("p", "prefill", spec())
    d0, d1 = (dn.rank("d", "decode", spec(tp=2), tp=t) for t in (0, 1))
    d1.integrity = "full"
    c.hold_hellos = True
    dn.expect(d0, "a", pages(4), "p", num_tokens=16, source_node=pn)
    c.run()
    assert [h.integrity for h in dn.hellos] == [1]
    c.hold_hellos = False
    c.run()
    assert dn.life.handshakes.get((pn.address, "p", "d")).integrity == 1
    assert dn.inbox.get("a", d0.id).integrity == FULL


def test_a_sampled_destination_checks_each_page_within_period_writes_and_its_source_digests_those():
    """The decode side's page ledger picks the granules of each request; ``period`` requests that
    write the same four pages check each page once, and the source sends digests of exactly what
    was picked."""
    from kvxferd.model.sampling import Policy

    c, pn, dn, p, d = _pair()
    dn.life.integrity = Policy("sampled", period=5)
    checks = {page: 0 for page in range(8, 12)}
    for i in range(5):
        rid = f"r{i}"
        dn.expect(d, rid, pages(4, 8), "p", num_tokens=16, source_node=pn)
        c.run()
        asked = dn.inbox.get(rid, d.id).integrity
        (source,) = pn.life.sources_of(rid)
        assert [t.digests for t in source.targets.values()] == [asked]  # the source covers the ask, no more
        picks = asked.picks[""]
        for g in range(4):  # granule g is page g of the table: page 8 + g
            checks[8 + g] += bool(picks.mask(np.array([g]))[0])
    assert checks == {8: 1, 9: 1, 10: 1, 11: 1}


def test_a_sampled_request_that_fails_leaves_its_pages_due_for_the_next():
    """A request aborted after its expect checked nothing an engine will read: the ledger forgets
    its write, so the next request into the same pages checks the granules it would have."""
    from kvxferd.model.sampling import Policy

    c, pn, dn, p, d = _pair()
    dn.life.integrity = Policy("sampled", period=5)
    chosen = []
    for rid in ("a", "b"):
        dn.expect(d, rid, pages(4, 8), "p", num_tokens=16, source_node=pn)
        c.run()
        chosen.append(dn.inbox.get(rid, d.id).integrity.picks[""])
        if rid == "a":
            dn.handle(events.AbortCalled(d, "a", "the user went away"))
            c.run()
            assert dn.outcome("a", d).state == "failed"
    assert chosen[0].mask(np.arange(4)).any() and chosen[1] == chosen[0]


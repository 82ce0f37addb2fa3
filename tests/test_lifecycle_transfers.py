"""Whole lifecycles through the in-process core: both orders, chunking, fan-in, local and remote."""

from __future__ import annotations

import pytest

from kvxferd.errors import RequestError
from lifecycle_util import Cluster, nbytes_of, pages, spec


def _pair(remote: bool, p_tp: int = 1, d_tp: int = 1):
    c = Cluster("P", "D") if remote else Cluster("P")
    pn = c.node("P")
    dn = c.node("D") if remote else pn
    prefill = [pn.rank("p", "prefill", spec(p_tp), tp=t) for t in range(p_tp)]
    decode = [dn.rank("d", "decode", spec(d_tp), tp=t) for t in range(d_tp)]
    return c, pn, dn, prefill, decode


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
@pytest.mark.parametrize("expect_first", [True, False], ids=["expect_first", "send_first"])
def test_one_request_completes_in_either_order(remote, expect_first):
    c, pn, dn, (p,), (d,) = _pair(remote)

    def expect():
        assert dn.expect(d, "r1", pages(4), "p", num_tokens=16, source_node=pn) == "bootstrapping"

    def send():
        assert pn.send(p, "r1", pages(4, 10), 0, 16, True, aux=b"meta") in ("bootstrapping", "transferring")

    (expect if expect_first else send)()
    c.run()
    assert dn.outcome("r1", d) is None and pn.outcome("r1", p) is None
    (send if expect_first else expect)()
    c.run()
    done_d, done_p = dn.outcome("r1", d), pn.outcome("r1", p)
    assert done_d is not None and done_d.state == "done" and done_d.bytes == nbytes_of(spec(), 16)
    assert done_d.aux == b"meta"
    assert done_p is not None and done_p.state == "done" and done_p.bytes == nbytes_of(spec(), 16)
    assert not dn.inbox.all() and not pn.life.sources  # nothing of the request is left behind


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_chunks_complete_only_with_the_last_and_a_gap_free_range(remote):
    c, pn, dn, (p,), (d,) = _pair(remote)
    dn.expect(d, "r", pages(6), "p", num_tokens=24, source_node=pn)
    pn.send(p, "r", pages(2, 10), 0, 8, False)
    c.run()
    pn.send(p, "r", pages(1, 13), 12, 16, False)  # out of order: [8, 12) is still missing
    c.run()
    assert dn.outcome("r", d) is None
    entry = dn.inbox.get("r", d.id)
    assert entry is not None and entry.state == "transferring"
    pn.send(p, "r", pages(1, 12), 8, 12, False)
    pn.send(p, "r", pages(2, 14), 16, 24, True)
    c.run()
    assert dn.outcome("r", d).state == "done" and dn.outcome("r", d).bytes == nbytes_of(spec(), 24)
    assert pn.outcome("r", p).state == "done"


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_fan_in_waits_for_every_writer(remote):
    """TP 2 -> 1: both prefill ranks write half of the heads of the one decode rank."""
    c, pn, dn, prefill, (d,) = _pair(remote, p_tp=2, d_tp=1)
    dn.expect(d, "r", pages(2), "p", num_tokens=8, source_node=pn)
    pn.send(prefill[0], "r", pages(2, 4), 0, 8, True)
    c.run()
    assert pn.outcome("r", prefill[0]).state == "done"
    assert dn.outcome("r", d) is None  # one writer of two delivered
    assert dn.inbox.get("r", d.id).bytes_received == nbytes_of(spec(), 8) // 2
    pn.send(prefill[1], "r", pages(2, 6), 0, 8, True)
    c.run()
    assert dn.outcome("r", d).state == "done" and dn.outcome("r", d).bytes == nbytes_of(spec(), 8)


def test_fan_out_and_a_replica_rank_that_writes_nothing_still_finishes():
    """TP 1 -> 2 over one daemon pair, and a prefill TP 2 -> decode TP 1 with one head: rank 1 replicates."""
    c, pn, dn, (p,), decode = _pair(True, p_tp=1, d_tp=2)
    for d in decode:
        dn.expect(d, "r", pages(2), "p", num_tokens=8, source_node=pn)
    pn.send(p, "r", pages(2), 0, 8, True)
    c.run()
    assert [dn.outcome("r", d).state for d in decode] == ["done", "done"]
    assert pn.outcome("r", p).state == "done"


def test_prefix_start_moves_only_the_rest():
    c, pn, dn, (p,), (d,) = _pair(True)
    dn.expect(d, "r", pages(4), "p", num_tokens=16, start=8, source_node=pn)
    pn.send(p, "r", pages(2), 0, 8, False)  # wholly before start: acknowledged without a byte
    pn.send(p, "r", pages(2, 2), 8, 16, True)
    c.run()
    assert dn.outcome("r", d).bytes == nbytes_of(spec(), 8) and pn.outcome("r", p).state == "done"


def test_many_requests_interleaved_each_told_once():
    c, pn, dn, (p,), (d,) = _pair(True)
    for i in range(20):
        dn.expect(d, f"r{i}", pages(1, i), "p", num_tokens=4, source_node=pn)
    for i in reversed(range(20)):
        pn.send(p, f"r{i}", pages(1, 30 + i), 0, 4, True)
    c.run()
    assert sorted(e.request_id for e in dn.told) == sorted(f"r{i}" for i in range(20))
    assert all(e.state == "done" for e in dn.told + pn.told) and len(pn.told) == 20


def test_chunks_held_before_their_destination_is_known_are_bounded():
    """Sends that arrive before any expect are held; past limits.max_pending_chunks a new request
    is refused busy, and the count comes back as requests end."""
    c, pn, dn, (p,), (d,) = _pair(remote=True)
    pn.cfg.limits.max_pending_chunks = 3
    pn.send(p, "a", pages(1), 0, 4, False)
    pn.send(p, "a", pages(1, 1), 4, 8, False)
    pn.send(p, "b", pages(1, 2), 0, 4, True)
    with pytest.raises(RequestError) as info:
        pn.send(p, "c", pages(1, 3), 0, 4, True)
    assert info.value.code == "busy" and "max_pending_chunks" in info.value.fix
    dn.expect(d, "b", pages(1), "p", num_tokens=4, source_node=pn)
    c.run()
    assert dn.outcome("b", d).state == "done" and pn.life.held_chunks == 2
    pn.send(p, "c", pages(1, 3), 0, 4, True)  # room again
    dn.expect(d, "c", pages(1, 1), "p", num_tokens=4, source_node=pn)
    dn.expect(d, "a", pages(3, 2), "p", num_tokens=12, source_node=pn)
    pn.send(p, "a", pages(1, 4), 8, 12, True)
    c.run()
    assert [dn.outcome(r, d).state for r in "abc"] == ["done"] * 3
    assert pn.life.held_chunks == 0 and not pn.life.sources

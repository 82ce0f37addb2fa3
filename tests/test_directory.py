"""The embedded directory: rank -> daemon, leases, and the checks named at the handshake."""

from __future__ import annotations

import dataclasses

import pytest

from kvxferd.directory.holders import Directory, RankSetIncomplete
from kvxferd.errors import PlanRefusal, RegistrationError
from lifecycle_util import spec


def _dir() -> Directory:
    return Directory("A:1", lease_s=3.0)


def test_ranks_over_two_daemons_are_complete_once_all_announced():
    d, s = _dir(), spec(4, heads=4)
    local = {(0, 0): s, (1, 0): s}
    with pytest.raises(RankSetIncomplete) as missing:
        d.ranks("p", "prefill", 0.0, local)
    assert "p/tp2/pp0" in str(missing.value) and "p/tp3/pp0" in str(missing.value)
    assert missing.value.missing == [(2, 0), (3, 0)]
    d.announce("p", "prefill", s, [(2, 0), (3, 0)], "B:1", "inc-b", 0.0, local)
    assert d.ranks("p", "prefill", 1.0, local) == {(0, 0): "A:1", (1, 0): "A:1", (2, 0): "B:1", (3, 0): "B:1"}


def test_a_lease_not_renewed_ends_and_a_renewal_keeps_it():
    d, s = _dir(), spec(2, heads=2)
    local = {(0, 0): s}
    d.announce("p", "prefill", s, [(1, 0)], "B:1", "inc", 0.0, local)
    d.announce("p", "prefill", s, [(1, 0)], "B:1", "inc", 2.0, local)  # renewed: good until 5.0
    assert d.ranks("p", "prefill", 4.5, local)[(1, 0)] == "B:1"
    with pytest.raises(RankSetIncomplete, match="p/tp1/pp0"):
        d.ranks("p", "prefill", 5.5, local)


def test_a_rank_with_another_spec_is_refused_naming_rank_field_and_both_values():
    d, s = _dir(), spec(2, heads=2)
    other = dataclasses.replace(s, page_size=8)
    local = {(0, 0): s}
    with pytest.raises(RegistrationError) as refused:
        d.announce("p", "prefill", other, [(1, 0)], "B:1", "inc", 0.0, local)
    text = str(refused.value)
    assert refused.value.field == "page_size"
    assert "p/tp1/pp0" in text and "p/tp0/pp0" in text and "= 8" in text and "= 4" in text
    with pytest.raises(PlanRefusal) as at_handshake:  # the decode side hears the same refusal
        d.ranks("p", "prefill", 0.0, local)
    assert at_handshake.value.field == "page_size" and "p/tp1/pp0" in str(at_handshake.value)


def test_a_rank_claimed_by_two_daemons_is_refused():
    d, s = _dir(), spec(2, heads=2)
    local = {(0, 0): s}
    with pytest.raises(RegistrationError, match="held by A:1") as here:
        d.announce("p", "prefill", s, [(0, 0)], "B:1", "inc", 0.0, local)
    assert here.value.field == "daemon"
    d2 = _dir()
    d2.announce("p", "prefill", s, [(1, 0)], "B:1", "inc", 0.0, local)
    with pytest.raises(RegistrationError, match="announced by C:1 but held by B:1"):
        d2.announce("p", "prefill", s, [(1, 0)], "C:1", "inc", 0.0, local)


def test_ranks_outside_the_spec_and_forgotten_daemons():
    d, s = _dir(), spec(2, heads=2)
    with pytest.raises(RegistrationError, match="outside") as outside:
        d.announce("p", "prefill", s, [(2, 0)], "B:1", "inc", 0.0, {})
    assert outside.value.field == "ranks"
    d.announce("p", "prefill", s, [(0, 0), (1, 0)], "B:1", "inc", 0.0, {})
    assert d.ranks("p", "prefill", 0.0, {}) == {(0, 0): "B:1", (1, 0): "B:1"}
    d.forget_daemon("B:1")
    with pytest.raises(RankSetIncomplete, match="no registered prefill rank"):
        d.ranks("p", "prefill", 0.0, {})


def test_an_announcement_replaces_the_daemons_set_and_a_rank_here_with_another_spec_is_refused():
    d, s = _dir(), spec(2, heads=2)
    d.announce("p", "prefill", s, [(0, 0), (1, 0)], "B:1", "inc", 0.0, {})
    d.announce("p", "prefill", s, [(1, 0)], "B:1", "inc", 0.0, {})  # rank 0 withdrawn
    assert set(d.remote("p", "prefill", 0.0)) == {(1, 0)}
    assert d.managed("p", "prefill") and not d.managed("q", "prefill")
    with pytest.raises(PlanRefusal) as refused:  # rank 0 registered here later, with another page size
        d.ranks("p", "prefill", 0.0, {(0, 0): dataclasses.replace(s, page_size=8)})
    assert refused.value.field == "page_size" and "p/tp1/pp0" in str(refused.value) and "B:1" in str(refused.value)


def test_the_directory_is_bounded():
    d, s = Directory("A:1", lease_s=3.0, max_ranks=2), spec(4, heads=4)
    d.announce("p", "prefill", s, [(0, 0), (1, 0)], "B:1", "inc", 0.0, {})
    with pytest.raises(RegistrationError, match="holds 2 announced ranks") as full:
        d.announce("p", "prefill", s, [(2, 0)], "C:1", "inc", 0.0, {})
    assert full.value.field == "ranks"
    d.announce("p", "prefill", s, [(0, 0), (1, 0)], "B:1", "inc", 1.0, {})  # a renewal still fits


# -- data-parallel instances: each DP rank is an instance <name>@dp<k>, all agreeing on dp_size ----

def test_dp_ranks_announce_their_dp_size_and_a_disagreeing_one_is_refused_naming_both_values():
    from kvxferd.model import dp
    d, s = _dir(), spec(1, heads=2)
    d.announce(dp.dp_instance("p", 2), "prefill", s, [(0, 0)], "B:1", "inc", 0.0, {}, dp_size=4)
    assert d.dp_seen("p", "prefill", 0.5) == dp.DpSize(4, "p@dp2/tp0/pp0", "B:1")
    with pytest.raises(RegistrationError) as refused:
        d.announce(dp.dp_instance("p", 3), "prefill", s, [(0, 0)], "C:1", "inc", 1.0, {}, dp_size=8)
    assert refused.value.field == "dp_size"
    assert "p@dp3/tp0/pp0 at C:1 has dp_size = 8" in str(refused.value), refused.value
    assert "p@dp2/tp0/pp0" in str(refused.value) and "dp_size = 4" in str(refused.value), refused.value
    with pytest.raises(PlanRefusal, match="dp_size = 8"):  # the handshake for that DP rank names it too
        d.ranks(dp.dp_instance("p", 3), "prefill", 1.5, {})
    # a DP rank outside its own dp_size; a rank registered here (local_dp) wins over announcements
    with pytest.raises(RegistrationError, match="DP rank 5, not below its dp_size = 4"):
        d.announce(dp.dp_instance("p", 5), "prefill", s, [(0, 0)], "C:1", "inc", 1.0, {}, dp_size=4)
    with pytest.raises(RegistrationError, match="at A:1 has dp_size = 2"):
        d.announce(dp.dp_instance("q", 1), "prefill", s, [(0, 0)], "B:1", "inc", 1.0, {}, dp_size=4,
                   local_dp=dp.DpSize(2, "q@dp0/tp0/pp0", "A:1"))


def test_dp_names_registration_and_request_checks():
    from kvxferd.errors import RequestError
    from kvxferd.model import dp
    assert dp.split(dp.dp_instance("p", 3)) == ("p", 3) and dp.split("p") == ("p", None)
    assert dp.split("a@dpx") == ("a@dpx", None)
    dp.check_registration("p", None, None)
    dp.check_registration("p", 3, 4)
    for args, field in ((("p", 1, None), "dp_size"), (("p", None, 4), "dp_rank"), (("p", 4, 4), "dp_rank"),
                        (("p@dp1", 0, 2), "instance")):
        with pytest.raises(RequestError) as refused:
            dp.check_registration(*args)
        assert refused.value.field == field and refused.value.fix, (args, refused.value)
    seen = dp.DpSize(4, "p@dp0/tp0/pp0", "A:1")
    dp.check_request("p", 3, seen, plain=False)
    with pytest.raises(PlanRefusal) as refused:
        dp.check_request("p", 4, seen, plain=False)
    assert refused.value.field == "dp_rank" and "dp_size = 4" in str(refused.value)
    assert (refused.value.prefill_value, refused.value.decode_value) == (4, 4)
    with pytest.raises(PlanRefusal, match="without data-parallel ranks"):
        dp.check_request("p", 0, None, plain=True)
    dp.check_request("p", 0, None, plain=False)  # not registered yet: the handshake waits instead

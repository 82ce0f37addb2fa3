"""The rank directory in etcd, pure parts: key layout, values, reading a range back into the
directory rules, and what a daemon writes and deletes; and the client against a port where
nothing listens. (Real etcd with real daemons: tests/test_e2e_etcd.py.)"""

from __future__ import annotations

import pytest

from kvxferd.directory import etcd_keys
from kvxferd.directory.etcd_client import EtcdClient, EtcdUnreachable, parse_endpoint, prefix_end
from kvxferd.directory.holders import Directory, RankSetIncomplete
from kvxferd.errors import ConfigError, PlanRefusal
from kvxferd.model.geometry import InstanceSpec
from kvxferd.ops import config
from kvxferd.tools.sim import free_port
from lifecycle_util import spec as _spec


def spec(*args, **kwargs) -> InstanceSpec:
    """As a daemon holds it: through the wire form (layer splits resolved)."""
    return InstanceSpec.from_dict(_spec(*args, **kwargs).to_dict())


def _kvs(*rows: tuple[str, tuple[int, int], str, object, int | None]) -> list[tuple[bytes, bytes, int]]:
    return [(etcd_keys.rank_key("c1", "prefill", inst, coords),
             etcd_keys.encode_value(daemon, f"inc-{daemon}", s, dp_size), 7)
            for inst, coords, daemon, s, dp_size in rows]


def test_keys_follow_the_documented_layout_and_a_prefix_range_covers_exactly_the_prefix():
    assert etcd_keys.rank_key("default", "prefill", "llama", (2, 1)) == b"/kvxferd/default/ranks/prefill/llama/2.1"
    assert etcd_keys.instance_prefix("default", "decode", "x") == b"/kvxferd/default/ranks/decode/x"
    assert prefix_end(b"/a/b") == b"/a/c"
    assert prefix_end(b"a\xff") == b"b"


def test_a_range_read_groups_ranks_by_instance_and_daemon_and_drops_lookalike_names():
    s = spec(4, heads=4)
    kvs = _kvs(("p", (0, 0), "A:1", s, None), ("p", (1, 0), "A:1", s, None), ("p", (2, 0), "B:1", s, None),
               ("p2", (0, 0), "C:1", s, None), ("p@dp1", (0, 0), "D:1", s, 2))
    parsed = etcd_keys.parse("c1", "prefill", "p", kvs)
    assert sorted(parsed.held) == ["p", "p@dp1"]  # p2 is another instance
    assert sorted(parsed.held["p"]["A:1"].ranks) == [(0, 0), (1, 0)] and parsed.held["p"]["B:1"].ranks == [(2, 0)]
    assert parsed.held["p@dp1"]["D:1"].dp_size == 2 and parsed.held["p"]["B:1"].incarnation == "inc-B:1"
    assert parsed.held["p"]["A:1"].spec == s and not parsed.bad


def test_a_bad_key_is_named_and_skipped_the_rest_is_read():
    s = spec(2, heads=2)
    kvs = _kvs(("p", (0, 0), "A:1", s, None)) + [
        (b"/kvxferd/c1/ranks/prefill/p/x.y", etcd_keys.encode_value("B:1", "i", s, None), 1),
        (b"/kvxferd/c1/ranks/prefill/p/1.0", b"{not json", 1),
        (b"/kvxferd/c1/ranks/prefill/p/1.0", b'{"daemon": "B:1", "spec": {}}', 1)]
    parsed = etcd_keys.parse("c1", "prefill", "p", kvs)
    assert list(parsed.held["p"]) == ["A:1"]
    assert [k for k, _ in parsed.bad] == ["/kvxferd/c1/ranks/prefill/p/x.y"] + ["/kvxferd/c1/ranks/prefill/p/1.0"] * 2


def test_fed_ranks_complete_the_set_and_keys_gone_from_etcd_withdraw_them():
    d, s = Directory("A:1", lease_s=5.0), spec(4, heads=4)
    local = {(0, 0): s, (1, 0): s}
    held = etcd_keys.parse("c1", "prefill", "p", _kvs(("p", (0, 0), "A:1", s, None), ("p", (1, 0), "A:1", s, None),
                                                      ("p", (2, 0), "B:1", s, None),
                                                      ("p", (3, 0), "B:1", s, None))).held
    assert etcd_keys.feed(d, "p", "prefill", held["p"], "A:1", 0.0, local, None) == []
    assert d.ranks("p", "prefill", 1.0, local) == {(0, 0): "A:1", (1, 0): "A:1", (2, 0): "B:1", (3, 0): "B:1"}
    # B's lease expired in etcd: its keys are gone, and the rank set names what is missing
    gone = etcd_keys.parse("c1", "prefill", "p",
                           _kvs(("p", (0, 0), "A:1", s, None), ("p", (1, 0), "A:1", s, None))).held
    etcd_keys.feed(d, "p", "prefill", gone["p"], "A:1", 2.0, local, None)
    with pytest.raises(RankSetIncomplete) as missing:
        d.ranks("p", "prefill", 2.0, local)
    assert missing.value.missing == [(2, 0), (3, 0)] and "p/tp2/pp0, p/tp3/pp0" in str(missing.value)


def test_a_rank_in_etcd_with_another_spec_is_refused_by_the_directory_rules_and_clears_when_fixed():
    d, s, odd = Directory("A:1", lease_s=5.0), spec(2, heads=2), spec(2, heads=2, page=8)
    local = {(0, 0): s}
    held = etcd_keys.parse("c1", "prefill", "p", _kvs(("p", (1, 0), "B:1", odd, None))).held["p"]
    refusals = etcd_keys.feed(d, "p", "prefill", held, "A:1", 0.0, local, None)
    assert len(refusals) == 1 and "p/tp1/pp0" in refusals[0] and "page_size" in refusals[0]
    with pytest.raises(PlanRefusal) as refused:
        d.ranks("p", "prefill", 0.5, local)
    assert refused.value.field == "page_size" and "= 8" in str(refused.value) and "= 4" in str(refused.value)
    fixed = etcd_keys.parse("c1", "prefill", "p", _kvs(("p", (1, 0), "B:1", s, None))).held["p"]
    assert etcd_keys.feed(d, "p", "prefill", fixed, "A:1", 1.0, local, None) == []
    assert d.ranks("p", "prefill", 1.5, local) == {(0, 0): "A:1", (1, 0): "B:1"}


def test_dp_ranks_with_different_dp_sizes_are_refused_naming_dp_size():
    d, s = Directory("A:1", lease_s=5.0), spec(1, heads=2)
    parsed = etcd_keys.parse("c1", "prefill", "m",
                             _kvs(("m@dp0", (0, 0), "B:1", s, 2), ("m@dp1", (0, 0), "C:1", s, 3))).held
    assert etcd_keys.feed(d, "m@dp0", "prefill", parsed["m@dp0"], "A:1", 0.0, {}, None) == []
    refusals = etcd_keys.feed(d, "m@dp1", "prefill", parsed["m@dp1"], "A:1", 0.0, {}, None)
    assert refusals and "dp_size" in refusals[0] and "3" in refusals[0] and "2" in refusals[0]


def test_a_daemon_writes_changed_ranks_and_deletes_those_that_went():
    s, t = spec(2, heads=2), spec(2, heads=2, page=8)
    want = etcd_keys.desired("c1", "B:1", "inc", [("p", "prefill", (0, 0), s, None), ("p", "prefill", (1, 0), s, None)])
    puts, deletes = etcd_keys.diff(want, {})
    assert sorted(puts) == [b"/kvxferd/c1/ranks/prefill/p/0.0", b"/kvxferd/c1/ranks/prefill/p/1.0"] and not deletes
    later = etcd_keys.desired("c1", "B:1", "inc", [("p", "prefill", (0, 0), t, None)])
    puts, deletes = etcd_keys.diff(later, want)
    assert list(puts) == [b"/kvxferd/c1/ranks/prefill/p/0.0"] and deletes == [b"/kvxferd/c1/ranks/prefill/p/1.0"]
    assert etcd_keys.diff(later, later) == ({}, [])


def test_lease_ttl_follows_the_peer_timeout_unless_set_and_is_at_least_two_seconds():
    cfg = config.Config()
    cfg.peer.peer_timeout_s = 5.0
    assert config.lease_ttl(cfg) == 5
    cfg.peer.peer_timeout_s = 1.2
    assert config.lease_ttl(cfg) == 2
    cfg.directory.lease_ttl_s = 7.5
    assert config.lease_ttl(cfg) == 8


def test_an_etcd_endpoint_is_checked_only_when_the_backend_is_etcd():
    config.load(None, environ={"KVXFERD_DIRECTORY_ETCD_ENDPOINTS": "nonsense"})  # embedded: not read
    with pytest.raises(ConfigError) as err:
        config.load(None, environ={"KVXFERD_DIRECTORY_BACKEND": "etcd", "KVXFERD_DIRECTORY_ETCD_ENDPOINTS": "nonsense"})
    assert err.value.field == "directory.etcd_endpoints" and "nonsense" in str(err.value) and err.value.fix
    assert parse_endpoint("http://10.0.0.1:2379").port == 2379 and parse_endpoint("http://h").port == 2379


def test_no_endpoint_answering_raises_a_typed_error_naming_each_endpoint():
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    client = EtcdClient(dead, timeout_s=2.0)
    with pytest.raises(EtcdUnreachable) as err:
        client.get_prefix(b"/kvxferd/")
    assert err.value.code == "directory_unreachable" and err.value.field == "directory.etcd_endpoints"
    assert all(url in str(err.value) for url in dead)


class _Fed:
    """The rendezvous side an EtcdDirectory feeds: nothing local, nothing managed."""

    def __init__(self) -> None:
        self.directory = Directory("127.0.0.1:1", 5.0)
        self.refusals: dict[tuple[str, str], str] = {}

    def local(self, instance, role):
        return {}

    def local_dp(self, base, role):
        return None


def test_an_unreachable_etcd_stays_named_through_rounds_that_had_nothing_to_send():
    import asyncio

    from kvxferd.control.advertised import Advertised
    from kvxferd.control.rendezvous_etcd import EtcdDirectory
    from kvxferd.lifecycle.registry import Registry

    cfg = config.Config()
    cfg.directory.backend = "etcd"
    cfg.directory.etcd_endpoints = [f"http://127.0.0.1:{free_port()}"]  # nothing listens
    errors: list[int] = []

    async def go() -> EtcdDirectory:
        d = EtcdDirectory(_Fed(), cfg, Advertised("127.0.0.1", 1, 2), Registry(8), lambda: errors.append(1))
        await d.read("far", "prefill")  # real requests (this read, and the round its ask starts), refused
        while d._busy:
            await asyncio.sleep(0.01)
        assert d.error and cfg.directory.etcd_endpoints[0] in d.error, d.error
        failed = len(errors)
        d._asked.clear()  # the ask is forgotten (as after ASKED_ROUNDS): a round has nothing to send
        d.kick()
        while d._busy:
            await asyncio.sleep(0.01)
        assert len(errors) == failed  # no request went out, so none failed
        await d.close()
        return d

    d = asyncio.run(go())
    assert d.error is not None and d.rounds == 0, (d.error, d.rounds)

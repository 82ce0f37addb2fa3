"""The rank directory in etcd (directory.backend = "etcd"), with a real etcd process on loopback
ports of its own and real daemons and engine processes: a prefill TP4 instance over two daemons
-> a decode TP2 instance at a third daemon, byte-exact; a daemon SIGKILLed loses its ranks when
its lease ends and the rank set is incomplete, by name; a clean stop revokes the lease; etcd unreachable leaves local work served."""

from __future__ import annotations

import random
import signal
import time
import urllib.request

import pytest

from e2e_util import NUM_PAGES, Node, both_orders_byte_exact, close, module_cluster, peer_socket, run_case, spec
from kvxferd import PROTOCOL_VERSION, cli
from kvxferd.directory import etcd_keys
from kvxferd.directory.etcd_client import EtcdClient, EtcdError
from kvxferd.directory.lookup import daemons_of, lookup
from kvxferd.errors import KvxferError
from kvxferd.sdk.client import EngineClient
from kvxferd.tools.sim import free_port
from kvxferd.wire import messages, protocol

from etcd_util import etcd_process

CLUSTER = "e2e"
LEASE_S = 2.0  # the smallest lease etcd grants


@pytest.fixture(scope="module")
def etcd():
    """An etcd of this module's own, on free loopback ports, its data dir removed after."""
    with etcd_process() as url:
        yield url


def _etcd_toml(url: str) -> str:
    return (f'[directory]\nbackend = "etcd"\netcd_endpoints = ["{url}"]\ncluster = "{CLUSTER}"\n'
            f"lease_ttl_s = {LEASE_S}\n[timeouts]\nbootstrap_s = 20.0\n")


@pytest.fixture(scope="module")
def cluster(request, etcd):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    yield from module_cluster(request, Node("node-a", _etcd_toml(etcd)), Node("node-b", _etcd_toml(etcd)),
                              Node("node-d", _etcd_toml(etcd)), Node("node-x", _etcd_toml(dead)))


def _status(daemon):
    with EngineClient(daemon.socket_path, timeout=10) as client:
        return client.status()


def _in_etcd(url: str, instance: str) -> dict[str, str]:
    """rank (tp.pp) -> the daemon its key names, as etcd holds it now."""
    kvs = EtcdClient([url]).get_prefix(etcd_keys.instance_prefix(CLUSTER, "prefill", instance) + b"/")
    parsed = etcd_keys.parse(CLUSTER, "prefill", instance, kvs)
    return {f"{tp}.{pp}": daemon for daemon, h in parsed.held.get(instance, {}).items() for tp, pp in h.ranks}


def _handshake(address: str, instance: str) -> dict:
    """A decode daemon's handshake for ``instance``, spoken by hand; the answer."""
    wire = messages.Handshake(PROTOCOL_VERSION, "127.0.0.1:9", "127.0.0.1:9", instance, "kd",
                              spec(total_kv_heads=4).to_dict(), "auto", ["tcp"], incarnation="t").to_wire()
    sock = peer_socket(address, recv_timeout_ms=10000)
    try:
        sock.send(protocol.encode({**wire, "seq": 1}))
        return protocol.decode(sock.recv(), 1 << 20)
    finally:
        sock.close(0)


def _until(check, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.1)


def test_tp4_over_two_daemons_to_tp2_with_the_directory_in_etcd_byte_exact(cluster, etcd, capsys):
    a, b, d = (cluster.daemons[n] for n in ("node-a", "node-b", "node-d"))
    pspec, dspec = spec(tp_size=4, total_kv_heads=4), spec(tp_size=2, total_kv_heads=4)
    prefill = cluster.spread_instance([a, a, b, b], "ep", "prefill", pspec, NUM_PAGES)
    (decode,) = cluster.instances((d, "ed", "decode", dspec, NUM_PAGES))
    try:
        # every daemon wrote its own ranks, each key naming its daemon
        want = {"0.0": a.address, "1.0": a.address, "2.0": b.address, "3.0": b.address}
        _until(lambda: _in_etcd(etcd, "ep") == want, "ranks of ep in etcd")
        both_orders_byte_exact(prefill, decode, "ep", 40, pspec.page_size, 10, a.address, random.Random(7))
        rendezvous = _status(a)["rendezvous"]
        assert rendezvous["rank_map"]["ep/prefill"] == want
        assert rendezvous["directory"]["backend"] == "etcd" and "error" not in rendezvous["directory"]
        assert rendezvous["directory"]["lease"]
        assert _status(b)["rendezvous"]["announcing"] == {"ep/prefill": a.address}
        plans = {p["address"]: p["plans"] for p in _status(d)["peers"] if p["side"] == "prefill"}
        assert "ep->ed" in plans[a.address] and "ep->ed" in plans[b.address]
        # `kvxferd plan --rendezvous`: the rank map read from etcd, at any daemon of the fleet
        expected = {(int(k[0]), 0): v for k, v in want.items()}
        assert daemons_of(lookup(a.address, "ep", "prefill", 10)) == expected
        assert daemons_of(lookup(d.address, "ep", "prefill", 10)) == expected
        assert cli.main(["status", "--socket", a.socket_path]) == 0
        out = capsys.readouterr().out
        assert f"  rank directory in etcd {etcd} (cluster {CLUSTER})" in out and "ERROR" not in out, out
        assert "  ep/prefill: rendezvous here, 4 ranks" in out, out
        assert cli.main(["plan", "--rendezvous", b.address, "--instance", "ep"]) == 0
        assert f"  tp3 pp0  {b.address}" in capsys.readouterr().out
    finally:
        close(prefill + decode)
    # closed ranks are deleted from etcd
    _until(lambda: _in_etcd(etcd, "ep") == {}, "ranks of ep deleted from etcd")


def test_dp_ranks_over_two_daemons_are_read_from_etcd_with_one_range(cluster, etcd):
    a, b = cluster.daemons["node-a"], cluster.daemons["node-b"]
    groups = cluster.dp_instance([a, b], "dq", "prefill", spec(total_kv_heads=4), NUM_PAGES)
    try:
        _until(lambda: _in_etcd(etcd, "dq@dp1") == {"0.0": b.address}, "DP rank 1 in etcd")
        answer = lookup(a.address, "dq", "prefill", 10)  # the rendezvous of both DP ranks
        assert answer["dp_size"] == 2 and not answer.get("missing"), answer
        assert answer["dp_ranks"] == [[0, [[0, 0, a.address]]], [1, [[0, 0, b.address]]]], answer
    finally:
        close([w for g in groups for w in g])


def test_a_daemon_killed_loses_its_ranks_with_its_lease_and_the_set_is_incomplete_by_name(cluster, etcd):
    a, b = cluster.daemons["node-a"], cluster.daemons["node-b"]  # B serves no later test
    prefill = cluster.spread_instance([a, b], "kp", "prefill", spec(tp_size=2, total_kv_heads=4), NUM_PAGES)
    try:
        _until(lambda: _in_etcd(etcd, "kp") == {"0.0": a.address, "1.0": b.address}, "ranks of kp in etcd")
        assert daemons_of(lookup(a.address, "kp", "prefill", 10)) == {(0, 0): a.address, (1, 0): b.address}
        b.signal(signal.SIGKILL)  # no revoke: its keys live until the lease runs out
        b.proc.wait()
        prefill[1].kill()  # its daemon is gone
        _until(lambda: _in_etcd(etcd, "kp") == {"0.0": a.address}, "B's keys gone with its lease")
        with pytest.raises(KvxferError) as missing:
            lookup(a.address, "kp", "prefill", 10)
        assert missing.value.code == "ranks_missing", missing.value
        assert "kp/tp1/pp0" in str(missing.value) and "kp/tp0/pp0" not in str(missing.value), missing.value
        assert _status(a)["rendezvous"]["rank_map"]["kp/prefill"] == {"0.0": a.address}
        # a decode daemon's handshake is told to wait, naming the missing ranks (until its bootstrap ends)
        answer = _handshake(a.address, "kp")
        assert answer["op"] == "handshake_retry", answer
        assert "missing ranks kp/tp1/pp0" in answer["reason"], answer
    finally:
        close(prefill[:1])


def test_a_lost_lease_is_replaced_and_a_clean_stop_revokes_it_at_once(cluster, etcd):
    d = cluster.daemons["node-d"]  # D serves no later test
    ((one,),) = cluster.instances((d, "sp", "prefill", spec(), NUM_PAGES))
    _until(lambda: _in_etcd(etcd, "sp") == {"0.0": d.address}, "sp in etcd")
    # etcd forgets the lease (as after a long partition): the daemon takes a new one and writes its ranks again
    lost = _status(d)["rendezvous"]["directory"]["lease"]
    EtcdClient([etcd]).revoke(int(lost, 16))
    _until(lambda: "event=directory_lease_lost" in d.log(), "the lease lost line")
    _until(lambda: _in_etcd(etcd, "sp") == {"0.0": d.address}, "sp in etcd again")
    assert _status(d)["rendezvous"]["directory"]["lease"] not in (None, lost)
    assert d.stop() == 0  # its engine still runs
    assert "event=directory_lease_revoked" in d.log()
    # revoked before the daemon exited: gone now, with no lease to wait out
    assert _in_etcd(etcd, "sp") == {}
    one.kill()  # its daemon is gone


def test_etcd_unreachable_is_named_and_local_work_goes_on(cluster):
    x = cluster.daemons["node-x"]
    endpoint = x.config_path.read_text().split('etcd_endpoints = ["', 1)[1].split('"', 1)[0]
    run_case(cluster, spec(), spec(), n_tokens=21, transport="local", prefill="node-x", tag="x")
    _until(lambda: f"event=directory_unreachable endpoint={endpoint}" in x.log(), "the unreachable line")
    directory = _status(x)["rendezvous"]["directory"]
    assert endpoint in directory["error"], directory
    with urllib.request.urlopen(x.metrics_url, timeout=10) as answer:
        metrics = answer.read().decode()
    errors = [line for line in metrics.splitlines() if line.startswith("kvxferd_directory_errors_total ")]
    assert errors and float(errors[0].split()[1]) >= 1, errors


def test_the_client_fails_over_to_an_answering_endpoint_and_bounds_what_it_reads(etcd):
    dead = f"http://127.0.0.1:{free_port()}"
    client = EtcdClient([dead, etcd])
    lease = client.grant(5)
    client.put(b"/kvxferd-test/a", b"x" * 500, lease)
    assert client.get_prefix(b"/kvxferd-test/") == [(b"/kvxferd-test/a", b"x" * 500, lease)]
    assert client.last_endpoint == etcd  # the dead one is passed over, the live one kept first
    assert client.keepalive(lease) > 0
    with pytest.raises(EtcdError) as big:
        EtcdClient([etcd], max_answer=200).get_prefix(b"/kvxferd-test/")
    assert "more than 200 bytes" in str(big.value) and big.value.endpoint == etcd
    with pytest.raises(EtcdError) as unknown:
        client.put(b"/kvxferd-test/b", b"y", lease=12345)  # a lease etcd never granted
    assert unknown.value.grpc_code == 5 and etcd in str(unknown.value) and "lease not found" in str(unknown.value)
    client.revoke(lease)
    assert client.get_prefix(b"/kvxferd-test/") == [] and client.keepalive(lease) == 0
    client.revoke(lease)  # revoking a lease that is gone already is no error

"""Hostile messages and directory values against real daemons (issue 43: messages and the directory).

Real `kvxferd serve` daemons on loopback, real engine processes, raw ZeroMQ clients for the
attacks: a 2,000-part message on the peer port and on the engine socket is dropped past its
bounds without the daemon holding it, its sender is dropped, everyone else is served and the
next real request is byte-exact; an engine batch past its byte budget is refused; a poisoned
directory value (an embedded announce, an etcd value) is refused before anything is sized by
it and is not parsed again while unchanged; a lookup of a huge instance answers a bounded
message; and the etcd client authenticates with a user name and password against a real etcd.

Memory is read from ``/proc/<pid>/status``: the peak (``VmHWM``, reset through
``/proc/<pid>/clear_refs``) against the resident size before, so a transient hold shows even
where the allocator returns it afterwards.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from etcd_util import etcd_process
from e2e_util import NUM_PAGES, Node, assert_verified, module_cluster, pages_for, peer_socket, spec, transfer
from kvxferd.directory import etcd_keys
from kvxferd.directory.etcd_client import Credentials, EtcdClient, EtcdError
from kvxferd.directory.holders import MAX_NAMED
from kvxferd.directory.lookup import lookup
from kvxferd.errors import KvxferError
from kvxferd.model.geometry import RankGeometry
from kvxferd.sdk.client import EngineClient
from kvxferd.tools.procstats import scrape
from kvxferd.tools.sim import Worker, free_port

MiB = 1 << 20
PARTS = 2000
PART_BYTES = 64 * 1024
MESSAGE_BYTES = PARTS * PART_BYTES  # what ZeroMQ itself buffers before the daemon reads a part
HELD_MAX = 64 * MiB  # what the daemon may hold beyond that
DIRECTORY_GROWTH_MAX = 16 * MiB
CLUSTER = "iso"
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def cluster(request):
    # defaults for every limit: the bounds under test are the ones a deployment gets
    yield from module_cluster(request, Node("prefill-node"), Node("decode-node"))


# -- helpers ------------------------------------------------------------------------------------

def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak(pid: int) -> int:
    """Reset the process's peak resident size to its current one; return that size."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return proc_status(pid)["VmRSS"]


def metric(daemon, name: str) -> float:
    return scrape(daemon.metrics_url).get(name, 0.0)


def wait_for(condition, what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def read_until(sock: zmq.Socket, want, what: str, timeout: float = DEADLINE_S) -> dict[str, Any]:
    """Read answers (each a msgpack map) until one satisfies ``want``; return it."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and sock.poll(int(left * 1000)), f"no answer: {what}"
        reply = msgpack.unpackb(sock.recv(), raw=False)
        if want(reply):
            return reply


def oversized(reply: dict[str, Any]) -> bool:
    return isinstance(reply.get("error"), dict) and reply["error"].get("code") == "message_too_large"


def engine_socket(daemon) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{daemon.socket_path}")
    return sock


def ping(seq: int, **extra: Any) -> bytes:
    return msgpack.packb({"op": "ping", "daemon": "127.0.0.1:1", "seq": seq, **extra}, use_bin_type=True)


def one_request(cluster, tag: str, seed: int) -> None:
    """A fresh prefill and decode instance move one request, byte-exact."""
    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    (p0,), (d0,) = cluster.instances((pd, f"{tag}p", "prefill", spec(), NUM_PAGES),
                                     (dd, f"{tag}d", "decode", spec(), NUM_PAGES))
    rng = random.Random(seed)
    dec, pre = transfer([p0], [d0], f"{tag}-req", 16, src_pages=pages_for(rng, NUM_PAGES, 16, 4),
                        dst_pages=pages_for(rng, NUM_PAGES, 16, 4), source_address=pd.address)
    assert_verified(dec, pre)


def flood(sock: zmq.Socket) -> None:
    """One message of 2,000 parts of 64 KiB (not msgpack: what each would cost to read, not to run)."""
    part = bytes(range(256)) * (PART_BYTES // 256)
    sock.send_multipart([part] * PARTS)


# -- ZeroMQ messages ----------------------------------------------------------------------------

def test_a_2000_part_message_on_the_peer_port_is_dropped_with_its_sender(cluster):
    pd = cluster.daemons["prefill-node"]
    one_request(cluster, "before-peer", 1)
    pid = pd.proc.pid
    base = reset_peak(pid)
    dropped_before = metric(pd, 'kvxferd_dropped_sender_messages_total{endpoint="peer"}')
    attacker = peer_socket(pd.address, recv_timeout_ms=None)
    try:
        flood(attacker)
        refusal = read_until(attacker, oversized, "message_too_large for the flood")
        assert refusal["op"] == "error" and refusal["error"]["field"] == "batch", refusal
        assert "limits.max_peer_batch_parts" in refusal["error"]["message"], refusal
        peak = proc_status(pid)["VmHWM"] - base
        print(f"flood: peak resident growth {peak / MiB:.1f} MiB, message {MESSAGE_BYTES / MiB:.0f} MiB")
        assert peak < MESSAGE_BYTES + HELD_MAX, (
            f"peak resident growth {peak / MiB:.0f} MiB for a {MESSAGE_BYTES / MiB:.0f} MiB message")
        assert metric(pd, 'kvxferd_oversized_messages_total{endpoint="peer",reason="parts"}') == 1
        # the sender is dropped: its next message is read and dropped unanswered
        attacker.send(ping(7))
        wait_for(lambda: metric(pd, 'kvxferd_dropped_sender_messages_total{endpoint="peer"}') > dropped_before,
                 "the dropped sender's ping counted as dropped")
        while attacker.poll(0):  # what is left is answers to the flood itself, never a pong
            assert msgpack.unpackb(attacker.recv(), raw=False).get("op") != "pong"
    finally:
        attacker.close(0)
    assert "event=sender_dropped endpoint=peer reason=parts" in pd.log()
    fresh = peer_socket(pd.address, recv_timeout_ms=30_000)
    try:  # any other sender is served
        fresh.send(ping(8))
        assert read_until(fresh, lambda r: r.get("seq") == 8, "pong to a fresh sender")["op"] == "pong"
    finally:
        fresh.close(0)
    one_request(cluster, "after-peer", 2)


def test_a_2000_part_message_on_the_engine_socket_is_dropped_with_its_sender(cluster):
    dd = cluster.daemons["decode-node"]
    pid = dd.proc.pid
    base = reset_peak(pid)
    attacker = engine_socket(dd)
    try:
        flood(attacker)
        refusal = read_until(attacker, oversized, "message_too_large for the flood")
        assert refusal["ok"] is False and refusal["error"]["field"] == "batch", refusal
        assert "limits.max_batch_bytes" in refusal["error"]["message"], refusal  # 64 MiB passed before 2,048 parts
        peak = proc_status(pid)["VmHWM"] - base
        print(f"flood: peak resident growth {peak / MiB:.1f} MiB, message {MESSAGE_BYTES / MiB:.0f} MiB")
        assert peak < MESSAGE_BYTES + HELD_MAX, (
            f"peak resident growth {peak / MiB:.0f} MiB for a {MESSAGE_BYTES / MiB:.0f} MiB message")
        assert metric(dd, 'kvxferd_oversized_messages_total{endpoint="engine",reason="bytes"}') == 1
        attacker.send(msgpack.packb({"op": "ping", "seq": 9}))
        wait_for(lambda: metric(dd, 'kvxferd_dropped_sender_messages_total{endpoint="engine"}') >= 1,
                 "the dropped engine's ping counted as dropped")
        while attacker.poll(0):
            assert msgpack.unpackb(attacker.recv(), raw=False).get("seq") != 9
    finally:
        attacker.close(0)
    assert "event=sender_dropped endpoint=engine reason=bytes" in dd.log()
    with EngineClient(dd.socket_path, timeout=30) as client:  # another engine connection is served
        assert client.call("ping")["ok"] is True
    one_request(cluster, "after-engine", 3)


def test_a_2000_part_message_from_a_source_daemon_is_dropped_past_its_bounds(cluster):
    """A decode daemon reads what a source daemon sends part by part too: a stand-in source answers
    the decode daemon's first message with 2,000 parts of 64 KiB; the rest past the bound is
    dropped unread, counted and logged, and the decode daemon serves a real pair after."""
    dd = cluster.daemons["decode-node"]
    pid = dd.proc.pid
    port = free_port()
    source = zmq.Context.instance().socket(zmq.ROUTER)
    source.setsockopt(zmq.LINGER, 0)
    source.bind(f"tcp://127.0.0.1:{port}")
    (d0,) = cluster.instance(dd, "srcflood-d", "decode", spec(), NUM_PAGES)
    base = reset_peak(pid)
    try:
        d0.command(cmd="expect", request_id="srcflood-req", pages=list(range(4)), n=16,
                   source_instance="srcflood-p", source_address=f"127.0.0.1:{port}")
        assert source.poll(int(DEADLINE_S * 1000)), "the decode daemon never spoke to its source"
        identity = source.recv_multipart()[0]
        part = bytes(range(256)) * (PART_BYTES // 256)
        source.send_multipart([identity] + [part] * PARTS)
        wait_for(lambda: metric(dd, 'kvxferd_oversized_messages_total{endpoint="source",reason="parts"}') == 1,
                 "the source's message counted as dropped past its parts")
        peak = proc_status(pid)["VmHWM"] - base
        print(f"source flood: peak resident growth {peak / MiB:.1f} MiB, message {MESSAGE_BYTES / MiB:.0f} MiB")
        assert peak < MESSAGE_BYTES + HELD_MAX, (
            f"peak resident growth {peak / MiB:.0f} MiB for a {MESSAGE_BYTES / MiB:.0f} MiB message")
        assert "event=source_message_dropped" in dd.log() and "reason=parts parts=2000" in dd.log()
    finally:
        d0.command(cmd="abort", request_id="srcflood-req", reason="test over")
        source.close(0)
    one_request(cluster, "after-source", 4)


def test_an_engine_batch_past_its_byte_budget_is_refused(cluster):
    """Five calls of 15 MiB each: every part within limits.max_message_bytes (16 MiB), the batch
    past limits.max_batch_bytes (64 MiB). The calls before the budget ran out are answered; the
    rest are not run, and the sender hears why."""
    dd = cluster.daemons["decode-node"]
    big = msgpack.packb({"op": "ping", "seq": 0, "pad": b"x" * (15 * MiB)}, use_bin_type=True)
    sock = engine_socket(dd)
    try:
        sock.send_multipart([big] * 5)
        answers = []
        refusal = read_until(sock, lambda r: answers.append(r) or oversized(r), "message_too_large for the batch")
    finally:
        sock.close(0)
    assert len(answers) == 5, answers  # four calls answered (refused by their schema: "pad"), then the budget
    assert all(not a["ok"] and a["error"]["field"] == "pad" for a in answers[:4]), answers[:4]
    assert "67108864" in refusal["error"]["message"] and "limits.max_batch_bytes" in refusal["error"]["message"]
    with EngineClient(dd.socket_path, timeout=30) as client:
        assert client.call("ping")["ok"] is True


# -- the directory ------------------------------------------------------------------------------

POISON = {"attention": "mha", "num_layers": 1_000_000, "head_dim": 16, "dtype": "bfloat16", "page_size": 4,
          "tp_size": 1, "pp_size": 1_000_000, "total_kv_heads": 4, "layout": "NHD"}


def test_a_poisoned_announce_is_refused_before_it_is_built(cluster):
    pd = cluster.daemons["prefill-node"]
    pid = pd.proc.pid
    base = reset_peak(pid)
    refused = 'kvxferd_directory_values_total{outcome="refused",source="announce"}'
    before = metric(pd, refused)
    sock = peer_socket(pd.address, recv_timeout_ms=30_000)
    try:
        sock.send(msgpack.packb({"op": "announce", "daemon": "127.0.0.1:9", "incarnation": "x", "instance": "poison",
                                 "role": "prefill", "spec": POISON, "ranks": [[0, 0]], "seq": 1}))
        reply = read_until(sock, lambda r: r.get("seq") == 1, "an answer to the announce")
    finally:
        sock.close(0)
    assert reply["op"] == "error" and reply["error"]["field"] in ("num_layers", "pp_size"), reply
    assert "exceeds" in reply["error"]["message"], reply
    growth = proc_status(pid)["VmHWM"] - base
    print(f"poisoned announce: peak resident growth {growth / MiB:.1f} MiB")
    assert growth < DIRECTORY_GROWTH_MAX, f"{growth / MiB:.1f} MiB"
    assert metric(pd, refused) == before + 1
    assert "event=announce_refused_here" in pd.log()


def test_a_lookup_of_a_huge_instance_answers_a_bounded_message(cluster):
    """One rank of a TP 1024 x PP 1024 instance: the 1,048,575 missing ranks are counted, a few named."""
    pd = cluster.daemons["prefill-node"]
    huge = spec(tp_size=1024, pp_size=1024, num_layers=1024, total_kv_heads=1024)
    w = Worker(pd, "huge", "prefill", RankGeometry(huge, 0, 0, 4), rendezvous=pd.address)
    cluster.workers.append(w)
    base = reset_peak(pd.proc.pid)
    sock = peer_socket(pd.address, recv_timeout_ms=30_000)
    try:
        sock.send(msgpack.packb({"op": "lookup", "instance": "huge", "role": "prefill", "seq": 2}))
        raw = b""
        while True:
            raw = sock.recv()
            if msgpack.unpackb(raw, raw=False).get("seq") == 2:
                break
    finally:
        sock.close(0)
    reply = msgpack.unpackb(raw, raw=False)
    assert reply["op"] == "error" and reply["error"]["code"] == "ranks_missing", reply
    message = reply["error"]["message"]
    assert "(1048575 of its 1048576;" in message, message
    assert message.count("huge/") == MAX_NAMED and "and 1048559 more" in message, message
    assert len(raw) < 4096, len(raw)
    growth = proc_status(pd.proc.pid)["VmHWM"] - base
    print(f"huge lookup: answer {len(raw)} bytes, peak resident growth {growth / MiB:.1f} MiB")
    assert growth < DIRECTORY_GROWTH_MAX, f"{growth / MiB:.1f} MiB"


# -- etcd ---------------------------------------------------------------------------------------

def _call(url: str, path: str, body: dict[str, Any], token: str | None = None) -> dict[str, Any]:
    headers = {"Content-Type": "application/json", **({"Authorization": token} if token else {})}
    req = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=10) as answer:  # noqa: S310 - a loopback etcd of the test's own
        return json.loads(answer.read())


@pytest.fixture(scope="module")
def etcd():
    with etcd_process("iso") as url:
        yield url


def test_a_poisoned_etcd_value_is_refused_once_and_not_parsed_again(cluster, etcd):
    rv = cluster.daemon("etcd-rv", extra_toml=f'[directory]\nbackend = "etcd"\netcd_endpoints = ["{etcd}"]\n'
                                              f'cluster = "{CLUSTER}"\n')
    value = json.dumps({"daemon": "127.0.0.1:9", "incarnation": "x", "spec": POISON, "dp_size": None}).encode()
    assert len(value) < 256  # a value of a few hundred bytes
    client = EtcdClient([etcd])
    try:
        client.put(etcd_keys.rank_key(CLUSTER, "prefill", "poisoned", (0, 0)), value)
    finally:
        client.close()
    base = reset_peak(rv.proc.pid)
    with pytest.raises(KvxferError) as refused:  # the lookup reads etcd now; the value is skipped
        lookup(rv.address, "poisoned", "prefill", timeout=30)
    assert refused.value.code == "ranks_missing", refused.value
    growth = proc_status(rv.proc.pid)["VmHWM"] - base
    print(f"poisoned etcd value: peak resident growth {growth / MiB:.1f} MiB")
    assert growth < DIRECTORY_GROWTH_MAX, f"{growth / MiB:.1f} MiB"
    counted = 'kvxferd_directory_values_total{outcome="refused",source="etcd"}'
    assert metric(rv, counted) == 1

    def status() -> dict[str, Any]:
        with EngineClient(rv.socket_path, timeout=30) as c:
            return c.status()["rendezvous"]["directory"]

    first = status()
    assert "poisoned/prefill" in first["reading"], first  # read every heartbeat from now on
    wait_for(lambda: status()["rounds"] >= first["rounds"] + 5, "five more directory rounds")
    assert metric(rv, counted) == 1  # read again each round, parsed once
    bad = [line for line in rv.log().splitlines() if "event=directory_bad_key" in line]
    assert len(bad) == 1 and "exceeds" in bad[0], bad


def _enable_auth(url: str, password: str) -> None:
    """What ``etcdctl user add root; etcdctl auth enable`` does, through the JSON gateway."""
    _call(url, "/v3/auth/user/add", {"name": "root", "password": password})
    _call(url, "/v3/auth/user/grant", {"user": "root", "role": "root"})
    _call(url, "/v3/auth/enable", {})


def test_etcd_user_and_password(cluster, tmp_path):
    with etcd_process("iso") as url:
        _enable_auth(url, "s3cret")
        key = b"/kvxferd/auth-test/k"
        anonymous = EtcdClient([url])
        try:
            with pytest.raises(EtcdError):
                anonymous.put(key, b"v")
        finally:
            anonymous.close()
        wrong = EtcdClient([url], credentials=Credentials("root", "nope"))
        try:
            with pytest.raises(EtcdError) as refused:
                wrong.put(key, b"v")
            assert "directory.etcd_password_file" in str(refused.value), refused.value
        finally:
            wrong.close()
        client = EtcdClient([url], credentials=Credentials("root", "s3cret"))
        try:
            client.put(key, b"v")
            assert client.get_prefix(key) == [(key, b"v", 0)]
            client._tokens[url] = "stale-token"  # as after a member restart: authenticated again, once
            assert client.get_prefix(key) == [(key, b"v", 0)]

            password = tmp_path / "etcd-password"
            password.write_text("s3cret\n")
            password.chmod(0o600)
            d = cluster.daemon("etcd-auth", extra_toml=(
                f'[directory]\nbackend = "etcd"\netcd_endpoints = ["{url}"]\ncluster = "{CLUSTER}"\n'
                f'etcd_username = "root"\netcd_password_file = "{password}"\n'))
            w = Worker(d, "authp", "prefill", RankGeometry(spec(), 0, 0, 4))
            cluster.workers.append(w)
            prefix = etcd_keys.instance_prefix(CLUSTER, "prefill", "authp")
            wait_for(lambda: len(client.get_prefix(prefix)) == 1, "the daemon's rank written to etcd with its token")
            with EngineClient(d.socket_path, timeout=30) as c:
                assert "error" not in c.status()["rendezvous"]["directory"]
            w.close()
            d.stop()
        finally:
            client.close()

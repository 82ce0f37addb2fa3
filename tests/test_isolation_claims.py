"""Claims bound to identity, against real daemons (issue 43: claims).

Real `kvxferd serve` daemons on loopback, real engine processes, raw ZeroMQ peers for the
attacks. A stranger that names a live decode instance in its handshake, at an address of its
own or at the decode daemon's own control address, is refused (the claimed address is called
back and does not confirm it; a stranger that does answer there is refused naming both daemons);
it gets none of the request's bytes and cannot lock the real decode daemon out, whose requests
stay byte-exact with the prefill engine told ``done`` only for them. Two decode daemons that give
one instance name: the second is refused naming both, the first keeps working. A peer cannot
withdraw or overwrite ranks another daemon announced. One peer's flood of expects leaves another
peer's requests served. With auth on, a keyed peer claiming an instance its key does not cover
gets nothing.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
import urllib.request
from typing import Any

import msgpack
import pytest
import zmq

from e2e_util import (NUM_PAGES, Node, assert_verified, cluster_run, finished, module_cluster, pages_for, peer_socket,
                      spec, transfer)
from kvxferd import PROTOCOL_VERSION
from kvxferd.model.geometry import RankGeometry
from kvxferd.sdk.client import EngineClient
from kvxferd.tools.sim import Worker, free_port
from kvxferd.wire import auth

DEADLINE_S = 60.0
# a small in-flight limit, so that one peer's share (limits.peer_share, a half) is quickly reached
CONFIG = ("[timeouts]\nbootstrap_s = 6.0\nwaiting_for_input_s = 4.0\ntransfer_s = 8.0\nhandshake_retry_s = 0.2\n"
          "drain_grace_s = 1.0\n[limits]\nmax_inflight_requests = 16\n")


@pytest.fixture(scope="module")
def cluster(request):
    yield from module_cluster(request, Node("prefill-node", CONFIG), Node("decode-node", CONFIG),
                              Node("twin-node", CONFIG))


def metric(daemon, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{" if labels else name + " "):
            head = line.split(" ")[0]
            if all(f'{k}="{v}"' in head for k, v in labels.items()) or not want:
                total += float(line.split()[-1])
    return total


def ask(sock: zmq.Socket, message: dict[str, Any], seq: int) -> dict[str, Any]:
    """Send one numbered message on a raw peer socket and read until its answer."""
    sock.send(msgpack.packb({**message, "seq": seq}, use_bin_type=True))
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if sock.poll(1000):
            reply = msgpack.unpackb(sock.recv(), raw=False)
            if reply.get("seq") == seq:
                return reply
    raise AssertionError(f"no answer to {message.get('op')} {seq}")


def hello(daemon: str, data_address: str, prefill: str, decode: str, **extra: Any) -> dict[str, Any]:
    return {"op": "handshake", "v": PROTOCOL_VERSION, "daemon": daemon, "data_address": data_address,
            "prefill_instance": prefill, "decode_instance": decode, "decode_spec": spec().to_dict(), "mode": "auto",
            "transports": ["tcp"], "data_token": os.urandom(16), "incarnation": "stranger", **extra}


class DataSink:
    """A tcp listener standing for a stranger's data address: counts the connections it gets."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.setblocking(False)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"

    def connections(self) -> int:
        n = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return n
            conn.close()
            n += 1

    def close(self) -> None:
        self.sock.close()


class Answerer:
    """A stranger that does listen at the address it claims, and confirms every call back (as a
    second decode daemon with its own name clash would): the claim it makes is then checked
    against the live daemons' instances."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"127.0.0.1:{port}"
        self.calls = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(100):
                continue
            identity, payload = self.sock.recv_multipart()
            msg = msgpack.unpackb(payload, raw=False)
            if msg.get("op") == "ping":
                self.calls += 1
                self.sock.send_multipart([identity, msgpack.packb(
                    {"op": "pong", "daemon": self.address, "incarnation": "stranger", "seq": msg.get("seq"),
                     "confirmed": True}, use_bin_type=True)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.sock.close(0)
        self.ctx.term()


def request(p, d, rid: str, source: str, rng: random.Random, n: int = 14):
    src, dst = pages_for(rng, NUM_PAGES, n, 4), pages_for(rng, NUM_PAGES, n, 4)
    return transfer(p, d, rid, n, src_pages=src, dst_pages=dst, source_address=source, chunks=[[0, 4], [4, n]])


def wait_idle(daemon, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    with EngineClient(daemon.socket_path, timeout=10) as client:
        while time.monotonic() < deadline:
            if not client.status()["requests"]:
                return
            time.sleep(0.1)
    raise AssertionError(f"{daemon.name} still holds requests")


def test_a_stranger_claiming_a_live_decode_instance_gets_nothing_and_locks_nobody_out(cluster):
    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    p, d = cluster.instances((pd, "cp", "prefill", spec(), NUM_PAGES), (dd, "cd", "decode", spec(), NUM_PAGES))
    rng = random.Random(1)
    assert_verified(*request(p, d, "claim-0", pd.address, rng))  # the decode instance is live, handshaken
    refused_before = metric(pd, "kvxferd_peer_claims_refused_total", op="handshake")
    sink = DataSink()
    answerer = Answerer()
    stranger = peer_socket(pd.address, recv_timeout_ms=None)
    try:
        # 1. at an address of its own where nothing listens: the call back finds nobody
        silent = f"127.0.0.1:{free_port()}"
        reply = ask(stranger, hello(silent, sink.address, "cp", "cd"), 1)
        assert reply["op"] == "handshake_refused", reply
        assert reply["error"]["code"] == "claim_refused" and reply["error"]["field"] == "daemon", reply
        assert silent in reply["error"]["message"] and "no decode daemon listens" in reply["error"]["message"]
        # 2. at an address of its own where it answers: the instance is held by a live daemon, both named
        reply = ask(stranger, hello(answerer.address, sink.address, "cp", "cd"), 2)
        assert reply["op"] == "handshake_refused", reply
        message = reply["error"]["message"]
        assert reply["error"]["code"] == "claim_refused" and dd.address in message and answerer.address in message
        assert answerer.calls >= 1
        # 3. at the decode daemon's own address, with its incarnation: the decode daemon does not confirm
        pong = ask(stranger, {"op": "ping", "daemon": answerer.address}, 3)
        probe = peer_socket(dd.address)
        try:  # anyone may learn a daemon's incarnation: it is no proof
            live = ask(probe, {"op": "ping", "daemon": answerer.address}, 4)
        finally:
            probe.close(0)
        reply = ask(stranger, hello(dd.address, sink.address, "cp", "cd", incarnation=live["incarnation"]), 5)
        assert pong["op"] == "pong" and reply["op"] == "handshake_refused", reply
        assert dd.address in reply["error"]["message"] and "did not send this handshake" in reply["error"]["message"]
        # the stranger's expect of a request the real decode instance is about to expect: no handshake of it
        reply = ask(stranger, {"op": "expect", "request_id": "claim-1", "prefill_instance": "cp",
                               "decode_instance": "cd", "dst": [0, 0], "num_tokens": 14}, 6)
        assert reply["op"] == "error" and reply["error"]["code"] == "no_handshake", reply
        # a pair no decode daemon handshook yet, claimed first by the stranger at the decode daemon's
        # address (and kept claimed with pings): the real decode daemon still gets in
        p2, d2 = cluster.instances((pd, "cp2", "prefill", spec(), NUM_PAGES),
                                   (dd, "cd2", "decode", spec(), NUM_PAGES))
        reply = ask(stranger, hello(dd.address, sink.address, "cp2", "cd2", incarnation=live["incarnation"]), 7)
        assert reply["op"] == "handshake_refused", reply
        stop = threading.Event()

        def keep_pinging() -> None:
            while not stop.wait(0.2):
                stranger.send(msgpack.packb({"op": "ping", "daemon": dd.address, "incarnation": live["incarnation"]}))

        pinger = threading.Thread(target=keep_pinging, daemon=True)
        pinger.start()
        try:
            dec, pre = request(p2, d2, "claim-2", pd.address, rng)
            dec1, pre1 = request(p, d, "claim-1", pd.address, rng)
        finally:
            stop.set()
            pinger.join(10)
        assert_verified(dec, pre)
        assert_verified(dec1, pre1)  # byte-exact, and the prefill engines told done for these bytes only
        assert sink.connections() == 0  # not one data connection reached the stranger's address
        assert metric(pd, "kvxferd_peer_claims_refused_total", op="handshake") >= refused_before + 4
        assert "event=claim_refused" in pd.log()
        assert pd.proc.poll() is None
    finally:
        stranger.close(0)
        answerer.close()
        sink.close()


def test_two_decode_daemons_with_one_instance_name_the_second_is_refused_naming_both(cluster):
    pd, dd, td = (cluster.daemons[n] for n in ("prefill-node", "decode-node", "twin-node"))
    p, d, twin = cluster.instances((pd, "tp", "prefill", spec(), NUM_PAGES), (dd, "twin", "decode", spec(), NUM_PAGES),
                                   (td, "twin", "decode", spec(), NUM_PAGES))
    rng = random.Random(2)
    assert_verified(*request(p, d, "twin-0", pd.address, rng))
    dec, pre = request(p, twin, "twin-1", pd.address, rng)
    assert dec[0]["state"] == "failed" and dec[0]["code"] == "claim_refused", dec
    assert dd.address in dec[0]["reason"] and td.address in dec[0]["reason"], dec
    # never done: no byte of it went anywhere. The prefill engine hears it failed, or, where the
    # decode side's end reached the prefill daemon before its send did, that its send was refused
    assert pre[0].get("state") == "failed" or (pre[0].get("event") == "error" and "twin-1" in str(pre[0])), pre
    assert_verified(*request(p, d, "twin-2", pd.address, rng))  # the first holder keeps working
    wait_idle(pd)


def test_a_peer_cannot_withdraw_or_overwrite_ranks_another_daemon_announced(cluster):
    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    ranks = [Worker(daemon, "spread", "prefill", RankGeometry(spec(tp_size=2), tp, 0, NUM_PAGES), rendezvous=pd.address)
             for tp, daemon in ((0, pd), (1, dd))]  # rank 1 is announced by the decode daemon to its rendezvous
    cluster.workers.extend(ranks)
    lookup = {"op": "lookup", "instance": "spread", "role": "prefill"}
    sock = peer_socket(pd.address, recv_timeout_ms=None)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while True:  # the decode daemon announces the rank to its rendezvous
            reply = ask(sock, lookup, 1)
            if dd.address in str(reply):
                break
            assert time.monotonic() < deadline, reply
            time.sleep(0.2)
        before = metric(pd, "kvxferd_peer_claims_refused_total", reason="not_owner")
        withdraw = {"op": "announce", "daemon": dd.address, "incarnation": "x", "instance": "spread",
                    "role": "prefill", "spec": spec(tp_size=2).to_dict(), "ranks": []}
        reply = ask(sock, withdraw, 2)
        assert reply["op"] == "error" and reply["error"]["code"] == "claim_refused", reply
        assert dd.address in reply["error"]["message"], reply
        reply = ask(sock, {**withdraw, "ranks": [[0, 0]]}, 3)  # an overwrite: its rank set replaced
        assert reply["op"] == "error" and reply["error"]["code"] == "claim_refused", reply
        assert metric(pd, "kvxferd_peer_claims_refused_total", reason="not_owner") == before + 2
        reply = ask(sock, lookup, 4)
        assert dd.address in str(reply), reply  # the rank is still the decode daemon's
    finally:
        sock.close(0)
        for rank in ranks:
            rank.close()


def test_one_peer_flooding_expects_leaves_another_peers_requests_served(cluster):
    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    p, d = cluster.instances((pd, "fp", "prefill", spec(), NUM_PAGES), (dd, "fd", "decode", spec(), NUM_PAGES))
    answerer = Answerer()
    sink = DataSink()
    flooder = peer_socket(pd.address, recv_timeout_ms=None)
    try:
        # the other peer is linked first (a peer alone may use the whole limit: nobody to leave room for)
        for w in d:
            w.command(cmd="expect", request_id="fair-first", pages=[60, 61], n=8, source_instance="fp",
                      source_address=pd.address)
        for w in p:
            w.command(cmd="send", request_id="fair-first", pages=[62, 63], n=8)
        assert_verified([finished(w, "fair-first") for w in d], [finished(w, "fair-first") for w in p])
        reply = ask(flooder, hello(answerer.address, sink.address, "fp", "flood"), 1)
        assert reply["op"] == "handshake_ok", reply
        n = 40  # limits.max_inflight_requests is 16: with two decode daemons linked, the flooder's share is 8
        for i in range(n):
            flooder.send(msgpack.packb({"op": "expect", "request_id": f"flood-{i}", "prefill_instance": "fp",
                                        "decode_instance": "flood", "dst": [0, 0], "num_tokens": 4}))
        flooder.send(msgpack.packb({"op": "ping", "daemon": answerer.address, "seq": 2}))
        busy = []
        while True:  # every expect is answered (or not: accepted) before the closing ping's pong
            assert flooder.poll(DEADLINE_S * 1000), "no pong after the flood"
            r = msgpack.unpackb(flooder.recv(), raw=False)
            if r.get("op") == "pong" and r.get("seq") == 2:
                break
            if (r.get("error") or {}).get("code") == "busy":
                busy.append(r)
        assert len(busy) == n - 8, len(busy)
        assert all("limits.peer_share" in r["error"]["message"] for r in busy), busy[0]
        # the other peer's requests, several at once, while the flooder holds its share
        for w in d:
            for i in range(4):
                w.command(cmd="expect", request_id=f"fair-{i}", pages=[4 * i, 4 * i + 1], n=8, source_instance="fp",
                          source_address=pd.address)
        for w in p:
            for i in range(4):
                w.command(cmd="send", request_id=f"fair-{i}", pages=[40 + 2 * i, 41 + 2 * i], n=8)
        for i in range(4):
            assert_verified([finished(w, f"fair-{i}") for w in d], [finished(w, f"fair-{i}") for w in p])
        assert metric(pd, "kvxferd_peer_claims_refused_total", op="expect", reason="quota") >= n - 8
        assert sink.connections() == 0
    finally:
        flooder.close(0)
        answerer.close()
        sink.close()
    wait_idle(pd)


def _keys(tmp_path, name):
    pair = auth.generate()
    return pair, auth.write_keypair(tmp_path / f"{name}.key", pair)


def test_with_auth_a_keyed_peer_claiming_what_its_key_does_not_cover_gets_nothing(tmp_path):
    p_pair, p_key = _keys(tmp_path, "prefill")
    d_pair, d_key = _keys(tmp_path, "decode")
    s_pair, _ = _keys(tmp_path, "stranger")
    with cluster_run() as c:
        pd = c.daemon("auth-prefill", start=False)
        dd = c.daemon("auth-decode", start=False)
        claims = [f"{d_pair.public}={dd.address};ka*", f"{s_pair.public}=127.0.0.1:1;own-*"]
        pd.config_path.write_text(pd.config_path.read_text() + CONFIG + (
            f'[auth]\nenabled = true\nsecret_key_file = "{p_key}"\nallowed_keys = {[d_pair.public, s_pair.public]!r}\n'
            f'key_claims = {claims!r}\n').replace("'", '"'))
        dd.config_path.write_text(dd.config_path.read_text() + CONFIG + (
            f'[auth]\nenabled = true\nsecret_key_file = "{d_key}"\nallowed_keys = []\n'
            f'peer_keys = {[f"{pd.address}={p_pair.public}"]!r}\n').replace("'", '"'))
        for daemon in (pd, dd):
            daemon.start()
        p, d = c.instances((pd, "kp", "prefill", spec(), NUM_PAGES), (dd, "ka", "decode", spec(), NUM_PAGES))
        rng = random.Random(5)
        assert_verified(*request(p, d, "keyed-0", pd.address, rng))
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_secretkey = s_pair.secret.encode()
        sock.curve_publickey = s_pair.public.encode()
        sock.curve_serverkey = p_pair.public.encode()
        sock.connect(f"tcp://{pd.address}")
        sink = DataSink()
        try:
            # its key covers 127.0.0.1:1 and own-*: not the decode instance, not the decode daemon
            reply = ask(sock, hello("127.0.0.1:1", sink.address, "kp", "ka"), 1)
            assert reply["op"] == "handshake_refused" and reply["error"]["code"] == "claim_refused", reply
            assert s_pair.public in reply["error"]["message"] and "'ka'" in reply["error"]["message"], reply
            reply = ask(sock, hello(dd.address, sink.address, "kp", "own-1"), 2)
            assert reply["op"] == "handshake_refused" and dd.address in reply["error"]["message"], reply
            reply = ask(sock, {"op": "expect", "request_id": "keyed-1", "prefill_instance": "kp",
                               "decode_instance": "ka", "dst": [0, 0], "num_tokens": 14}, 3)
            assert reply["op"] == "error" and reply["error"]["code"] == "claim_refused", reply
            reply = ask(sock, {"op": "announce", "daemon": dd.address, "incarnation": "x", "instance": "ka",
                               "role": "prefill", "spec": spec().to_dict(), "ranks": []}, 4)
            assert reply["op"] == "error" and reply["error"]["code"] == "claim_refused", reply
            assert_verified(*request(p, d, "keyed-1", pd.address, rng))
            assert sink.connections() == 0
            assert metric(pd, "kvxferd_peer_claims_refused_total", reason="key") == 4
            log = pd.log()
            assert "event=unscoped_peer_key" not in log  # both keys are scoped
        finally:
            sock.close(0)
            sink.close()

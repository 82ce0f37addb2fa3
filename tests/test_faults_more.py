"""More faults through real processes: paused peers, killed engines, a killed decode daemon,
replayed control messages from a stranger, and aborts while bytes are moving.

The rules every case checks: each request reaches a terminal state within its configured
deadline; nothing is reported done unless the decode engine verified every byte (the sim
worker checks on done); no byte lands outside the destination pages; unaffected peers keep
being served; and a returning peer or engine works again.
"""

from __future__ import annotations

import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from e2e_util import (Node, assert_verified, close, cluster_run, finished, module_cluster, pages_for, peer_socket, spec,
                      start_nodes, transfer)
from kvxferd import PROTOCOL_VERSION
from kvxferd.sdk.client import EngineClient
from kvxferd.tools.sim import HEARTBEAT_S, PEER_TIMEOUT_S  # what Cluster configures
from test_fuzz_engine import canary, wait_idle

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import reliability_report as rr  # noqa: E402

NUM_PAGES = 32
HEARTBEAT_DEADLINE_S = PEER_TIMEOUT_S + HEARTBEAT_S  # silence is noticed at the first heartbeat tick past it
LONG = ("[timeouts]\nbootstrap_s = 20.0\nwaiting_for_input_s = 20.0\ntransfer_s = 20.0\ndrain_grace_s = 1.0\n"
        "handshake_retry_s = 0.2\n")
SHORT_TRANSFER_S = 3.0
# how long a test waits for a state the daemons reach by themselves: generous, because these bounds
# only matter when something is stuck, and a busy machine must not look stuck
STATE_WAIT_S = 60.0
IDLE_WAIT_S = 30.0
SHORT = (f"[timeouts]\nbootstrap_s = 4.0\nwaiting_for_input_s = {SHORT_TRANSFER_S}\n"
         f"transfer_s = {SHORT_TRANSFER_S}\ndrain_grace_s = 1.0\nhandshake_retry_s = 0.2\n")


@pytest.fixture(scope="module")
def cluster(request):
    """Prefill node A and decode node B with long phase timeouts (so heartbeats, not timeouts, act),
    and a second prefill node C whose requests to B must not notice A's trouble."""
    yield from module_cluster(request, *(Node(name, LONG) for name in ("node-a", "node-b", "node-c")))


@pytest.fixture(scope="module")
def short_cluster(request):
    """Two daemons with short phase timeouts, for faults that only a timeout can end."""
    yield from module_cluster(request, *(Node(name, SHORT) for name in ("short-a", "short-b")))


def terminal(worker, request_id: str, since: float, timeout: float = 30) -> tuple[dict[str, Any], float]:
    ev = finished(worker, request_id, timeout=timeout)
    return ev, round(ev.get("t", time.time()) - since, 2)


def verified_request(prefill, decode, tag: str, source_address: str | None, n: int = 21) -> list[Any]:
    """One chunked request, verified byte-exact; returns its destination as [pages, n]."""
    rng = random.Random(tag)
    num_pages = decode[0].geometry.num_pages
    dst = pages_for(rng, num_pages, n, decode[0].geometry.spec.page_size)
    dec, pre = transfer(prefill, decode, tag, n, src_pages=pages_for(rng, num_pages, n, 4), dst_pages=dst,
                        source_address=source_address, chunks=[[0, 8], [8, n]])
    assert_verified(dec, pre)
    return [dst, n]


def hold(prefill, decode, request_id: str, source_address: str | None, src=(1, 2, 3), dst=(4, 5, 6),
         n: int = 12) -> None:
    """A request with its first chunk delivered and its last one held back by the prefill engine."""
    for w in decode:
        w.command(cmd="expect", request_id=request_id, pages=list(dst), n=n, source_instance=prefill[0].instance,
                  source_address=source_address)
    for w in prefill:
        w.command(cmd="send", request_id=request_id, pages=list(src), n=n, chunks=[[0, 4], [4, n]],
                  hold_last=True)


def status(d) -> dict[str, Any]:
    with EngineClient(d.socket_path, timeout=10) as client:
        return client.status()


def wait_requests(d, states: set[str], what: str = "", timeout: float = STATE_WAIT_S) -> None:
    """Until the daemon's request entries are all in ``states`` (and there are some)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reqs = status(d)["requests"]
        if reqs and set(reqs) == states:
            return
        time.sleep(0.05)
    raise AssertionError(f"{what or 'requests'} never reached {states}: {status(d)['requests']}")


def wait_first_chunk(d, request_id: str = "", timeout: float = STATE_WAIT_S) -> None:
    """Until the daemon's destination entries are all transferring (the first chunk arrived)."""
    wait_requests(d, {"decode:transferring"}, f"the first chunk of {request_id}", timeout)


def test_paused_prefill_daemon_fails_its_requests_then_serves_again(cluster):
    started = time.monotonic()
    a, b, c = (cluster.daemons[n] for n in ("node-a", "node-b", "node-c"))
    pa, pc, db, dc = cluster.instances((a, "sp", "prefill", spec(), NUM_PAGES),
                                     (c, "cp", "prefill", spec(), NUM_PAGES), (b, "sd", "decode", spec(), NUM_PAGES),
                                     (b, "cd", "decode", spec(), NUM_PAGES))
    try:
        allowed_b = [verified_request(pa, db, "pause-warm", a.address), [[4, 5, 6], 12]]
        allowed_c = [verified_request(pc, dc, "pause-warm-c", c.address), [[7, 8, 9], 10]]
        hold(pa, db, "pause-1", a.address)
        wait_first_chunk(b, "pause-1")
        dc[0].command(cmd="expect", request_id="pause-c", pages=[7, 8, 9], n=10, source_instance="cp",
                      source_address=c.address)
        stopped = time.time()
        a.signal(signal.SIGSTOP)
        try:
            # the unaffected peer C keeps being served while A is frozen
            pc[0].command(cmd="send", request_id="pause-c", pages=[10, 11, 12], n=10)
            ev_c = finished(dc[0], "pause-c", timeout=60)
            assert ev_c["state"] == "done" and ev_c["mismatched_bytes"] == 0, ev_c
            assert finished(pc[0], "pause-c")["state"] == "done"
            ev, after = terminal(db[0], "pause-1", stopped)
            # peer_dead: the heartbeats ended it, not the 20 s phase timeouts (those say *_timeout)
            assert ev["state"] == "failed" and ev["code"] == "peer_dead", ev
            time.sleep(0.5)  # A stays frozen past its own view of B's heartbeat deadline too
        finally:
            a.signal(signal.SIGCONT)
        resumed = time.time()
        # A, thawed, finds its decode peer silent or gets an abort: the source fails, it is never done
        pre, pre_after = terminal(pa[0], "pause-1", resumed)
        assert pre["state"] == "failed", pre
        # the returning peer works again: a new request handshakes anew and lands byte-exact
        allowed_b.append(verified_request(pa, db, "pause-2", a.address))
        allowed_c.append(verified_request(pc, dc, "pause-c-2", c.address))
        for d in (a, b, c):
            with EngineClient(d.socket_path, timeout=10) as client:
                assert wait_idle(client, IDLE_WAIT_S) == {}
        outside = canary(db[0], allowed_b)["outside_bytes"] + canary(dc[0], allowed_c)["outside_bytes"]
        assert outside == 0
    finally:
        close(pa + pc + db + dc)
    rr.record("faults", "peer_paused_past_heartbeat_deadline", {
        "survived": True, "terminal_after_s": after, "deadline_s": HEARTBEAT_DEADLINE_S,
        "outcome": f"decode side failed peer_dead {after}s after SIGSTOP; prefill side failed "
                   f"{pre['code']} {pre_after}s after SIGCONT; peer C served meanwhile; new requests to A "
                   f"verified after SIGCONT",
        "seconds": time.monotonic() - started})


def test_killed_engine_with_requests_in_flight(short_cluster):
    """The daemons do not watch engine connections: a dead engine's requests end by phase timeout on
    the other side (bounded by transfer_s), and a restarted engine re-registers and works."""
    started = time.monotonic()
    c = short_cluster
    a, b = c.daemons["short-a"], c.daemons["short-b"]
    workers = []
    try:
        pa, db = c.instances((a, "ep", "prefill", spec(), NUM_PAGES), (b, "ed", "decode", spec(), NUM_PAGES))
        workers += pa + db
        verified_request(pa, db, "ek-warm", a.address)
        # 1. the prefill engine dies after its first chunk
        hold(pa, db, "ek-1", a.address)
        wait_first_chunk(b, "ek-1")
        killed = time.time()
        pa[0].kill()
        ev, dec_after = terminal(db[0], "ek-1", killed)
        assert ev["state"] == "failed", ev
        # the daemon watches the engine process it can see: no need to wait for a phase timeout
        assert ev["code"] == "rank_gone", ev
        dec_code = ev["code"]
        # 2. the decode engine dies after expecting: the prefill side still ends, on its own deadline
        pa = c.instance(a, "ep", "prefill", spec(), NUM_PAGES)  # the engine restarts and re-registers
        workers += pa
        db[0].command(cmd="expect", request_id="ek-2", pages=[1, 2, 3], n=12, source_instance="ep",
                      source_address=a.address)
        deadline = time.monotonic() + STATE_WAIT_S
        while status(b)["requests"] != {"decode:waiting_for_input": 1}:
            assert time.monotonic() < deadline, status(b)["requests"]
            time.sleep(0.05)
        db[0].kill()
        killed = time.time()
        pa[0].command(cmd="send", request_id="ek-2", pages=[4, 5, 6], n=12, chunks=[[0, 4], [4, 12]])
        pre, pre_after = terminal(pa[0], "ek-2", killed)
        # done when its bytes landed before the decode daemon noticed the death (the pages are
        # still mapped, so nothing is lost), failed rank_gone when the death was noticed first
        # (or the send itself is refused: the request already failed rank_gone on this side)
        assert pre.get("state") == "done" or pre.get("code") in ("rank_gone", "request_finished"), pre
        # both daemons hold nothing afterwards, and restarted engines work
        db = c.instance(b, "ed", "decode", spec(), NUM_PAGES)
        workers += db
        verified_request(pa, db, "ek-3", a.address)
        for d in (a, b):
            with EngineClient(d.socket_path, timeout=10) as client:
                assert wait_idle(client, IDLE_WAIT_S) == {}
    finally:
        close(workers)
    rr.record("faults", "engine_killed_with_requests_in_flight", {
        "survived": True, "terminal_after_s": dec_after, "deadline_s": SHORT_TRANSFER_S,
        "outcome": f"prefill engine SIGKILLed mid-request: decode side failed {dec_code} after {dec_after}s "
                   f"(the daemon watches registered engine processes); decode engine SIGKILLed: "
                   f"prefill side ended {pre.get('state') or pre.get('code')} after {pre_after}s; restarted "
                   f"engines re-registered and "
                   f"transferred byte-exact",
        "seconds": time.monotonic() - started,
        "notes": ["engine death is noticed by the daemon polling the engine's pid (with its start time); "
                  "an engine in another pid namespace falls back to the phase timeouts"]})


def test_decode_daemon_sigkilled_mid_transfer_fails_the_prefill_side_promptly(cluster):
    started = time.monotonic()
    a, b = cluster.daemons["node-a"], cluster.daemons["node-b"]
    pa, db = cluster.instances((a, "kp", "prefill", spec(), NUM_PAGES), (b, "kd", "decode", spec(), NUM_PAGES))
    try:
        verified_request(pa, db, "dk-warm", a.address)
        hold(pa, db, "dk-1", a.address)
        wait_first_chunk(b, "dk-1")
        killed = time.time()
        b.signal(signal.SIGKILL)
        b.proc.wait()
        pre, after = terminal(pa[0], "dk-1", killed)
        assert pre["state"] == "failed", pre
        # heartbeats or the broken data connection ended it, not the 20 s phase timeouts (*_timeout)
        assert pre["reason"] and pre["code"] in ("peer_dead", "transfer", "peer_refused"), pre
        # the held last chunk is refused: the request is over, its pages are the engine's again
        pa[0].command(cmd="send_chunks", request_id="dk-1", pages=[1, 2, 3], n=12, chunks=[[4, 12, True]])
        late = finished(pa[0], "dk-1")
        assert late["event"] == "error", late
        for w in db:  # its engine waits for an answer that will never come
            w.kill()
        # the decode daemon comes back on the same ports; new engines register; transfers work again
        b.start()
        db = cluster.instance(b, "kd", "decode", spec(), NUM_PAGES)
        verified_request(pa, db, "dk-2", a.address)
        with EngineClient(a.socket_path, timeout=10) as client:
            assert wait_idle(client, IDLE_WAIT_S) == {}
    finally:
        close(pa + db)
    rr.record("faults", "decode_daemon_sigkilled_mid_transfer", {
        "survived": True, "terminal_after_s": after, "deadline_s": HEARTBEAT_DEADLINE_S,
        "outcome": f"prefill side failed {pre['code']} {after}s after SIGKILL ({pre['reason'][:80]}); "
                   f"source pages reported failed, never done; the late last chunk was refused; the restarted "
                   f"daemon served a new request byte-exact",
        "seconds": time.monotonic() - started})


def drain_replies(sock: zmq.Socket, seq: int) -> list[dict[str, Any]]:
    sock.send(msgpack.packb({"op": "ping", "daemon": "127.0.0.1:1", "seq": seq}))
    out = []
    while True:
        reply = msgpack.unpackb(sock.recv(), raw=False)
        if reply.get("op") == "pong" and reply.get("seq") == seq:
            return out
        out.append(reply)


def no_more_events(worker, wait: float = 1.0) -> list[dict[str, Any]]:
    time.sleep(wait)
    out = []
    while not worker.events.empty():
        out.append(worker.events.get_nowait())
    return out


def test_replayed_and_reordered_control_messages_do_not_corrupt_or_double_complete(short_cluster):
    started = time.monotonic()
    a, b = short_cluster.daemons["short-a"], short_cluster.daemons["short-b"]
    pa, db = short_cluster.instances((a, "rp", "prefill", spec(), NUM_PAGES),
                             (b, "rd", "decode", spec(), NUM_PAGES))
    sock = peer_socket(a.address)
    outcomes = []
    try:
        verified_request(pa, db, "rp-1", a.address)
        expect = {"op": "expect", "request_id": "rp-1", "prefill_instance": "rp", "decode_instance": "rd",
                  "dst": [0, 0], "num_tokens": 21}
        abort = {"op": "abort", "request_id": "rp-1", "reason": "replayed", "code": "aborted"}
        ended = {"op": "ended", "request_id": "rp-1", "prefill_instance": "rp", "decode_instance": "rd",
                 "code": "incompatible", "reason": "replayed"}
        # 1. replays of a finished request from a stranger: answered or ignored, never acted on
        for msg in (expect, expect, abort, ended, expect, abort):
            sock.send(msgpack.packb(msg))
        replies = drain_replies(sock, 1)
        assert all(r["op"] == "error" for r in replies), replies
        assert no_more_events(pa[0]) == [] and no_more_events(db[0], 0) == []
        outcomes.append("replayed expect/abort of a finished request: no event, no entry")
        # 2. a stranger's abort of a request in flight between A and B must not touch it
        hold(pa, db, "rp-2", a.address)
        wait_first_chunk(b, "rp-2")
        sock.send(msgpack.packb({**abort, "request_id": "rp-2"}))
        sock.send(msgpack.packb({**ended, "request_id": "rp-2"}))
        sock.send(msgpack.packb({**expect, "request_id": "rp-2"}))  # and an expect reordered after it
        # and ends of requests not sent yet, from a link that never handshook their pair: not kept
        for i in range(3):
            sock.send(msgpack.packb({**ended, "request_id": f"rp-3-{i}"}))
        drain_replies(sock, 2)
        pa[0].command(cmd="send_chunks", request_id="rp-2", pages=[1, 2, 3], n=12, chunks=[[4, 12, True]])
        ev, pre = finished(db[0], "rp-2"), finished(pa[0], "rp-2")
        assert_verified([ev], [pre])
        assert no_more_events(pa[0], 0.5) == [] and no_more_events(db[0], 0) == []
        outcomes.append("stranger's abort + reordered expect of an in-flight request: ignored, request verified")
        # 3. a replayed handshake (a copy of B's) from the stranger, then B's own requests
        hs = {"op": "handshake", "seq": 9, "v": PROTOCOL_VERSION, "daemon": b.address,
              "data_address": f"127.0.0.1:{b.data_port}", "prefill_instance": "rp", "decode_instance": "rd",
              "decode_spec": spec().to_dict(), "mode": "auto", "transports": ["tcp"]}
        for _ in range(3):
            sock.send(msgpack.packb(hs))
        replies = drain_replies(sock, 3)
        # the stranger cannot show it is B (B's address is called back, and the replay carries no
        # token of B's links): refused, and it takes nothing over
        assert [r["op"] for r in replies] == ["handshake_refused"] * 3, replies
        assert all(r["error"]["code"] == "claim_refused" for r in replies), replies
        rng = random.Random(3)
        results = []
        for i in range(3):
            src, dst = pages_for(rng, NUM_PAGES, 9, 4), pages_for(rng, NUM_PAGES, 9, 4)
            dec, prf = transfer(pa, db, f"rp-3-{i}", 9, src_pages=src, dst_pages=dst, source_address=a.address)
            if dec[0]["state"] == "done":
                assert_verified(dec, prf)
            else:  # never done with wrong bytes; both sides terminal
                assert dec[0]["event"] == "finished" and dec[0]["state"] == "failed", dec
                assert prf[0]["state"] in ("failed", "done"), prf
            results.append(f"{dec[0]['state']}" + (f"({dec[0]['code']})" if dec[0]["state"] == "failed" else ""))
        assert results == ["done"] * 3, results  # B's route was never taken over
        outcomes.append(f"replayed handshake: next requests of the real peer {', '.join(results)}")
        for d in (a, b):
            with EngineClient(d.socket_path, timeout=10) as client:
                assert wait_idle(client, 10) == {}
    finally:
        sock.close(0)
        close(pa + db)
    rr.record("faults", "replayed_and_reordered_control_messages", {
        "survived": True, "outcome": "; ".join(outcomes), "terminal_after_s": "n/a", "deadline_s": "n/a",
        "seconds": time.monotonic() - started,
        "notes": [f"a stranger replaying a decode daemon's handshake takes over the instance pair's route: "
                  f"the real peer's next requests ended {', '.join(results)}"] if results[0] != "done" else []})


def test_abort_while_bytes_are_moving(cluster):
    """Aborts fired at varying moments into 1 MiB-per-chunk requests: each request ends terminal on
    both sides, done only byte-exact, and nothing lands outside its destination pages."""
    started = time.monotonic()
    a, b = cluster.daemons["node-a"], cluster.daemons["node-b"]
    big = spec(head_dim=128, page_size=16)
    n, pages_per_req, num_pages = 1024, 64, 64 * 9
    pa, db = cluster.instances((a, "ap", "prefill", big, num_pages), (b, "ad", "decode", big, num_pages))
    outcomes: dict[str, int] = {}
    allowed = []
    partial = 0
    try:
        for i, delay in enumerate((0.0, 0.0, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15)):
            dst = list(range(i * pages_per_req, (i + 1) * pages_per_req))
            src = list(range(num_pages - (i + 1) * pages_per_req, num_pages - i * pages_per_req))
            rid = f"ab-{i}"
            db[0].command(cmd="expect", request_id=rid, pages=dst, n=n, source_instance="ap",
                          source_address=a.address)
            time.sleep(0.3 if i == 0 else 0.05)  # the first one waits for the handshake
            pa[0].command(cmd="send", request_id=rid, pages=src, n=n, chunks=[[k, k + 128] for k in range(0, n, 128)])
            time.sleep(delay)
            (db if i % 2 == 0 else pa)[0].command(cmd="abort", request_id=rid, reason="client went away")
            dec, pre = finished(db[0], rid), finished(pa[0], rid)
            assert dec["event"] == "finished", dec
            while pre["event"] == "error":  # a later chunk refused: the request ended, or is ending
                assert pre["code"] == "request_finished", pre
                pre = finished(pa[0], rid)
            # the prefill engine hears the decode side's reason, never the socket error of its hang-up
            assert pre["state"] == "done" or pre["code"] == "aborted", pre
            if dec["state"] == "done":
                assert dec["mismatched_bytes"] == 0, dec
            else:
                assert dec["code"] == "aborted", dec
                written = set(canary(db[0], [[dst, n]])["changed_pages"]) & set(dst)
                partial += 0 < len(written) < len(dst)  # some chunks landed before the abort
            allowed.append([dst, n])
            key = f"decode {dec['state']} / prefill {pre['state']}"
            outcomes[key] = outcomes.get(key, 0) + 1
        report = canary(db[0], allowed)
        assert report["outside_bytes"] == 0, report
        verified_request(pa, db, "ab-after", a.address, n=40)
        for d in (a, b):
            with EngineClient(d.socket_path, timeout=10) as client:
                assert wait_idle(client, IDLE_WAIT_S) == {}
    finally:
        close(pa + db)
    rr.record("faults", "abort_during_transfer", {
        "survived": True, "outcome": "8 aborted 1 MiB-chunk requests: "
                                     + ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items()))
                                     + f"; {partial} aborted with "
                                     f"their destination partly written (mid-transfer)",
        "terminal_after_s": "n/a", "deadline_s": "n/a", "seconds": time.monotonic() - started})


def test_prefill_abort_before_the_decode_side_expects_reaches_the_decode_side(short_cluster):
    """Prefill aborts (or times out) a request before the decode daemon's expect arrives: the late
    expect must learn the request failed, not wait for bytes until its own phase timeout."""
    started = time.monotonic()
    a, b = short_cluster.daemons["short-a"], short_cluster.daemons["short-b"]
    pa, db, pl = short_cluster.instances((a, "lp", "prefill", spec(), NUM_PAGES),
                                 (b, "ld", "decode", spec(), NUM_PAGES), (b, "llp", "prefill", spec(), NUM_PAGES))
    codes = []
    try:
        verified_request(pa, db, "late-warm", a.address)  # the instance pair has handshaken
        for i, source in enumerate((a.address, None)):
            rid = f"late-{i}"
            if source is None:  # the same race with both instances on one daemon (local transport)
                prefill, source_instance = pl, "llp"
            else:
                prefill, source_instance = pa, "lp"
            prefill[0].command(cmd="send", request_id=rid, pages=[1, 2, 3], n=12, chunks=[[0, 4], [4, 12]],
                               hold_last=True)
            prefill[0].command(cmd="abort", request_id=rid, reason="preempted before decode was ready")
            pre = finished(prefill[0], rid)
            assert pre["state"] == "failed" and pre["code"] == "aborted", pre
            asked = time.time()
            db[0].command(cmd="expect", request_id=rid, pages=[4, 5, 6], n=12, source_instance=source_instance,
                          source_address=source)
            ev, after = terminal(db[0], rid, asked)
            assert ev["state"] == "failed" and ev["code"] == "aborted", ev
            assert after < SHORT_TRANSFER_S, after  # told, not timed out
            codes.append(f"{'remote' if source else 'local'}: {ev['code']} after {after}s")
        verified_request(pa, db, "late-after", a.address)
    finally:
        close(pa + db + pl)
    rr.record("faults", "prefill_abort_before_decode_expect", {
        "survived": True, "outcome": "late expect told the request was aborted (" + "; ".join(codes) + ")",
        "terminal_after_s": "n/a", "deadline_s": SHORT_TRANSFER_S, "seconds": time.monotonic() - started})


# a failed source must not wait out its socket timeout on a receiver that stopped reading: with
# transfer_s this long, only the cut of its connection can end the send within a test's wait
STALL_TIMEOUTS = "[timeouts]\ntransfer_s = 900.0\nwaiting_for_input_s = 900.0\n"
NO_HEARTBEAT_DEATH = {"KVXFERD_PEER_PEER_TIMEOUT_S": "900"}  # the pause is not noticed by heartbeats


def test_a_failed_source_cuts_its_send_to_a_receiver_that_stopped_reading(request):
    """The decode daemon freezes (SIGSTOP) while a 64 MiB chunk is on its way: the sender blocks
    once the socket buffers are full. The prefill engine aborts; its failure reaches it at once
    (the daemon cuts the chunk's connection), not after the 900 s socket timeout. Thawed, the
    decode side hears the abort, and both daemons end idle."""
    started = time.monotonic()
    big = spec(num_layers=16, total_kv_heads=8, head_dim=128, page_size=16)  # 1 MiB a page
    n, num_pages = 1024, 64
    with cluster_run(request) as c:
        a, b = start_nodes(c, Node("stall-a", STALL_TIMEOUTS, NO_HEARTBEAT_DEATH),
                           Node("stall-b", STALL_TIMEOUTS, NO_HEARTBEAT_DEATH))
        pa, db = c.instances((a, "sp", "prefill", big, num_pages), (b, "sd", "decode", big, num_pages))
        verified_request(pa, db, "stall-warm", a.address, n=40)
        rid = "stall-1"
        db[0].command(cmd="expect", request_id=rid, pages=list(range(num_pages)), n=n, source_instance="sp",
                      source_address=a.address)
        wait_requests(a, {"prefill:waiting_for_input"})  # the expect reached the source
        b.signal(signal.SIGSTOP)
        try:
            pa[0].command(cmd="send", request_id=rid, pages=list(range(num_pages)), n=n)
            wait_requests(a, {"prefill:transferring"})
            pa[0].command(cmd="abort", request_id=rid, reason="client went away")
            pre = finished(pa[0], rid)
            assert pre["event"] == "finished" and pre["state"] == "failed" and pre["code"] == "aborted", pre
        finally:
            b.signal(signal.SIGCONT)
        dec = finished(db[0], rid)
        assert dec["event"] == "finished" and dec["state"] == "failed" and dec["code"] == "aborted", dec
        verified_request(pa, db, "stall-after", a.address, n=40)
        for d in (a, b):
            with EngineClient(d.socket_path, timeout=10) as client:
                assert wait_idle(client, IDLE_WAIT_S) == {}
    rr.record("faults", "abort_of_a_send_to_a_frozen_receiver", {
        "survived": True, "outcome": "64 MiB chunk to a SIGSTOPped decode daemon, prefill abort: the prefill "
                                     "engine heard 'aborted' with the 900 s socket timeout still running; "
                                     "the thawed decode side failed 'aborted'",
        "terminal_after_s": "n/a", "deadline_s": "n/a", "seconds": time.monotonic() - started})

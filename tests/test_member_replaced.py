"""A member daemon of a spread prefill instance is replaced, and nothing restarts anywhere.

Prefill TP4 over A (ranks 0-1, the rendezvous) and B (ranks 2-3); decode TP2 at D. Real daemons
and engine processes on 127.0.0.1, over tcp and over NIXL (UCX on loopback tcp). The phase
timeouts are far beyond the test's own waits, so a request that waited for one instead of
failing at once would outlast the wait: only the member's loss seen by heartbeats can end it.

- B dies: a request sent before its ranks come back fails at once, naming B, not by timeout;
  its ranks register again at a new daemon E under A, and the next request lands byte-exact.
- A (the rendezvous itself) dies and restarts on the same ports: its ranks register there
  again, B's ranks are announced to the new process, and the next request lands byte-exact.
"""

from __future__ import annotations

import signal
import time

import pytest

from e2e_util import NUM_PAGES, Node, assert_verified, cluster_run, finished, spec, start_nodes, transfer
from kvxferd.model.geometry import RankGeometry
from kvxferd.sdk.client import EngineClient
from kvxferd.tools.sim import Worker
from nixl_util import NIXL_ENV, NIXL_MISSING, metric

NEVER_S = 300.0  # phase timeouts: far beyond any wait below
WAIT_S = 60.0  # how long the test waits for a prompt outcome
LONG = (f"[timeouts]\nbootstrap_s = {NEVER_S}\nwaiting_for_input_s = {NEVER_S}\ntransfer_s = {NEVER_S}\n"
        "drain_grace_s = 1.0\n")
TRANSPORTS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(bool(NIXL_MISSING), reason=f"NIXL: {NIXL_MISSING}"))]
PSPEC, DSPEC = spec(tp_size=4, total_kv_heads=4), spec(tp_size=2, total_kv_heads=4)


def _status(daemon) -> dict:
    with EngineClient(daemon.socket_path, timeout=30) as client:
        return client.status()


def _until(what: str, ok, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.1)


def _directory_lists(rendezvous, ranks: dict[str, str]) -> bool:
    return _status(rendezvous).get("rendezvous", {}).get("remote_ranks", {}).get("mp/prefill") == ranks


def _start(c, transport: str, *names: str):
    env = NIXL_ENV if transport == "nixl" else {}
    return start_nodes(c, *[Node(n, LONG, env=env) for n in names]), env


def _received_over(daemon, transport: str) -> float:
    return metric(daemon, "kvxferd_received_bytes_total", transport=transport)


def _land(prefill, decode, rid: str, source, d, transport: str, pages: tuple[list[int], list[int]]) -> None:
    before = _received_over(d, transport)
    dec, pre = transfer(prefill, decode, rid, 12, src_pages=pages[0], dst_pages=pages[1],
                        source_address=source.address)
    assert_verified(dec, pre)
    assert _received_over(d, transport) > before, f"{rid}: no byte arrived over {transport}"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_dead_member_fails_requests_by_name_and_its_replacement_serves_without_restarts(request, transport):
    with cluster_run(request) as c:
        (a, b, d, e), env = _start(c, transport, "node-a", "node-b", "node-d", "node-e")
        prefill = c.spread_instance([a, a, b, b], "mp", "prefill", PSPEC, NUM_PAGES)
        (decode,) = c.instances((d, "md", "decode", DSPEC, NUM_PAGES))
        _land(prefill, decode, "m-1", a, d, transport, ([1, 2, 3], [4, 5, 6]))

        b.signal(signal.SIGKILL)
        b.proc.wait()
        for w in prefill[2:]:
            w.kill()  # their daemon is gone
        _until("D saw B go down", lambda: not any(p["address"] == b.address and p["state"] == "up"
                                                  for p in _status(d)["peers"]))
        # before B's ranks are back: D fails the request at once, naming B, while A's ranks still send
        for w in decode:
            w.command(cmd="expect", request_id="m-dead", pages=[7, 8, 9], n=12, source_instance="mp",
                      source_address=a.address)
        for w in prefill[:2]:
            w.command(cmd="send", request_id="m-dead", pages=[7, 8, 9], n=12)
        for w in decode:
            ev = finished(w, "m-dead", timeout=WAIT_S)
            assert ev["event"] == "finished" and ev["state"] == "failed", ev
            assert ev["code"] in ("peer_dead", "peer_unreachable"), ev
            assert b.address in ev["reason"] and a.address in ev["reason"], ev
        for w in prefill[:2]:  # A's ranks hear the same from D
            ev = finished(w, "m-dead", timeout=WAIT_S)
            assert ev["event"] == "finished" and ev["state"] == "failed" and ev["code"] == "peer_dead", ev
            assert b.address in ev["reason"], ev

        again = [Worker(e, "mp", "prefill", RankGeometry(PSPEC, tp, 0, NUM_PAGES), wait=False, rendezvous=a.address)
                 for tp in (2, 3)]
        c.workers.extend(again)
        for w in again:
            w.wait_registered()
        _until("A's directory lists E", lambda: _directory_lists(a, {"2.0": e.address, "3.0": e.address}))
        _land(prefill[:2] + again, decode, "m-2", a, d, transport, ([10, 11, 12], [13, 14, 15]))
        assert all(x.proc.poll() is None for x in (a, d, e)), "a daemon restarted or died"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_restarted_rendezvous_learns_its_members_again_and_serves_without_other_restarts(request, transport):
    with cluster_run(request) as c:
        (a, b, d), env = _start(c, transport, "node-a", "node-b", "node-d")
        prefill = c.spread_instance([a, a, b, b], "mp", "prefill", PSPEC, NUM_PAGES)
        (decode,) = c.instances((d, "md", "decode", DSPEC, NUM_PAGES))
        _land(prefill, decode, "r-1", a, d, transport, ([1, 2, 3], [4, 5, 6]))
        b_pid, d_pid = b.proc.pid, d.proc.pid

        old = _status(a)["incarnation"]
        a.signal(signal.SIGKILL)
        a.proc.wait()
        for w in prefill[:2]:
            w.kill()  # their daemon is gone
        a.start(env or None)
        assert _status(a)["incarnation"] != old
        back = [Worker(a, "mp", "prefill", RankGeometry(PSPEC, tp, 0, NUM_PAGES), wait=False, rendezvous=a.address)
                for tp in (0, 1)]
        c.workers.extend(back)
        for w in back:
            w.wait_registered()
        _until("the new A's directory lists B's ranks", lambda: _directory_lists(a, {"2.0": b.address,
                                                                                     "3.0": b.address}))
        _land(back + prefill[2:], decode, "r-2", a, d, transport, ([7, 8, 9], [10, 11, 12]))
        assert (b.proc.pid, d.proc.pid) == (b_pid, d_pid) and b.proc.poll() is None and d.proc.poll() is None

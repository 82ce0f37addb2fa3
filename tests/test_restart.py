"""A restarted peer daemon is a new incarnation.

Real daemons on 127.0.0.1, SIGKILLed and started again on the same ports (what
``Restart=on-failure`` does). The phase timeouts and the heartbeat deadline are set far
beyond the test's own waits, so only the incarnation change can end a pending request:
had it waited for a timeout, the test's wait would run out first. Every request that
arrives after the restart must succeed byte-exact, the first one included.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from e2e_util import Cluster, Worker, assert_verified, close, finished, in_parallel, spec, transfer
from kvxferd.sdk.client import EngineClient
from kvxferd.tools.sim import HEARTBEAT_S, PEER_TIMEOUT_S
from nixl_util import NIXL_ENV, NIXL_MISSING

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import reliability_report as rr  # noqa: E402

NUM_PAGES = 32
NEVER_S = 600.0  # phase timeouts and peer_timeout_s: far beyond any wait below
WAIT_S = 60.0  # how long the test waits for a prompt outcome (ten times less than NEVER_S)
LONG = (f"[timeouts]\nbootstrap_s = {NEVER_S}\nwaiting_for_input_s = {NEVER_S}\ntransfer_s = {NEVER_S}\n"
        "handshake_retry_s = 0.2\ndrain_grace_s = 1.0\n")


def slow_heartbeats(d, interval: float | None = None) -> None:
    """Heartbeats never declare the peer dead within the test (and, with ``interval``, are rare)."""
    text = d.config_path.read_text().replace(f"peer_timeout_s = {PEER_TIMEOUT_S}", f"peer_timeout_s = {NEVER_S}")
    if interval is not None:
        text = text.replace(f"heartbeat_interval_s = {HEARTBEAT_S}", f"heartbeat_interval_s = {interval}")
    d.config_path.write_text(text)


def status(d) -> dict:
    with EngineClient(d.socket_path, timeout=30) as client:
        return client.status()


def wait_state(d, wanted: dict[str, int], timeout: float = WAIT_S) -> None:
    import time
    deadline = time.monotonic() + timeout
    while status(d)["requests"] != wanted:
        if time.monotonic() > deadline:
            raise AssertionError(f"{d.name}: {status(d)['requests']} never became {wanted}")
        time.sleep(0.05)


def restart(c: Cluster, d, engines: list[Worker], env: dict[str, str] | None = None) -> tuple[str, list[Worker]]:
    """SIGKILL the daemon and start it again on the same ports; its engines lost it, so they are
    killed and the instance comes back as new engines that register there. Returns the old
    incarnation and the new engines."""
    old = status(d)["incarnation"]
    d.killed_at = time.time()
    d.signal(signal.SIGKILL)
    d.proc.wait()
    d.start(env)
    assert status(d)["incarnation"] != old
    for w in engines:
        w.kill()
    return old, c.instance(d, engines[0].instance, engines[0].role, spec(), NUM_PAGES)


def warm_pair(c: Cluster, decode_heartbeat: float | None = None, env: dict[str, str] | None = None):
    """A prefill and a decode daemon with one engine each, linked by a first request verified byte-exact."""
    pd = c.daemon("prefill-node", extra_toml=LONG, start=False)
    dd = c.daemon("decode-node", extra_toml=LONG, start=False)
    slow_heartbeats(pd)
    slow_heartbeats(dd, decode_heartbeat)
    in_parallel(lambda: pd.start(env), lambda: dd.start(env))
    prefill, decode = c.instances((pd, "rp", "prefill", spec(), NUM_PAGES), (dd, "rd", "decode", spec(), NUM_PAGES))
    dec, pre = transfer(prefill, decode, "warm", 13, src_pages=[1, 2, 3, 4], dst_pages=[5, 6, 7, 8],
                        source_address=pd.address)
    assert_verified(dec, pre)
    return pd, dd, prefill, decode


def expect_only(decode, request_id: str, source: str, dst=(1, 2, 3), n: int = 12) -> None:
    for w in decode:
        w.command(cmd="expect", request_id=request_id, pages=list(dst), n=n, source_instance="rp",
                  source_address=source)


@pytest.mark.parametrize("transport", ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(
    bool(NIXL_MISSING), reason=f"NIXL: {NIXL_MISSING}"))])
def test_restarted_prefill_daemon_fails_pending_requests_and_serves_the_next(cluster, transport):
    started = time.monotonic()
    env = NIXL_ENV if transport == "nixl" else None
    pd, dd, prefill, decode = warm_pair(cluster, env=env)
    # the decode side waits for a request the prefill daemon knows (its expect arrived there)
    expect_only(decode, "pending", pd.address)
    wait_state(dd, {"decode:waiting_for_input": 1})
    wait_state(pd, {"prefill:waiting_for_input": 1})
    old, prefill = restart(cluster, pd, prefill, env)  # its engine comes back and registers again
    # heartbeats resume from the new process: the change of incarnation ends the request at once
    ev = finished(decode[0], "pending", timeout=WAIT_S)
    assert ev["state"] == "failed" and ev["code"] == "peer_restarted", ev
    assert pd.address in ev["reason"] and old in ev["reason"], ev
    after = round(ev["t"] - pd.killed_at, 2)
    # the first request after the restart handshakes again by itself and lands byte-exact
    dec, pre = transfer(prefill, decode, "after", 21, src_pages=[9, 10, 11, 12, 13, 14],
                        dst_pages=[15, 16, 17, 18, 19, 20], source_address=pd.address, chunks=[[0, 8], [8, 21]])
    assert_verified(dec, pre)
    st = status(dd)
    assert st["requests"] == {}
    [peer] = [p for p in st["peers"] if p["address"] == pd.address]
    assert peer["incarnation"] == status(pd)["incarnation"] and peer["state"] == "up", peer
    if transport == "nixl":
        # the old incarnation's agent is no source any more; the new one is
        assert st["transports"]["nixl"].endswith("1 sources)"), st["transports"]
        assert st["transports"]["landing"]["rings"] == 1, st["transports"]  # the old ring was retired
    close(prefill + decode)
    rr.record("faults", f"prefill_daemon_restarted_{transport}", {
        "survived": True, "terminal_after_s": after, "deadline_s": NEVER_S,
        "outcome": f"SIGKILL + restart on the same ports ({transport}): the pending request failed "
                   f"peer_restarted {after}s after the kill, the new process's start-up included (new incarnation seen in its pongs); the first "
                   f"request after the restart handshook again and verified byte-exact",
        "seconds": time.monotonic() - started})


def test_first_request_after_an_unnoticed_restart_handshakes_again(cluster):
    """Heartbeats too rare to notice the restart: the new daemon's ``no_handshake`` answer to the
    first expect triggers a new handshake instead of failing that request, and the handshake
    reveals the new incarnation, which fails the request pending at the old one."""
    started = time.monotonic()
    pd, dd, prefill, decode = warm_pair(cluster, decode_heartbeat=NEVER_S / 4)
    expect_only(decode, "pending", pd.address)
    wait_state(pd, {"prefill:waiting_for_input": 1})
    _, prefill = restart(cluster, pd, prefill)
    dec, pre = transfer(prefill, decode, "after", 13, src_pages=[9, 10, 11, 12], dst_pages=[13, 14, 15, 16],
                        source_address=pd.address)
    assert_verified(dec, pre)
    ev = finished(decode[0], "pending", timeout=WAIT_S)
    assert ev["state"] == "failed" and ev["code"] == "peer_restarted", ev
    assert status(dd)["requests"] == {}
    # it went the way the docstring says: no heartbeat noticed it, the no_handshake answer did
    log = dd.log()
    assert "event=handshake_again" in log and "event=peer_restarted" in log, log[-3000:]
    assert log.index("event=handshake_again") < log.index("event=peer_restarted")
    close(prefill + decode)
    rr.record("faults", "prefill_daemon_restarted_unnoticed", {
        "survived": True, "terminal_after_s": round(ev["t"] - pd.killed_at, 2), "deadline_s": NEVER_S,
        "outcome": "restart no heartbeat saw: the first expect after it was answered no_handshake, handshook "
                   "again and verified byte-exact; that handshake showed the new incarnation and failed the "
                   "request pending at the old one with peer_restarted",
        "seconds": time.monotonic() - started})


def test_restarted_decode_daemon_fails_its_pending_sources_and_serves_the_next(cluster):
    started = time.monotonic()
    pd, dd, prefill, decode = warm_pair(cluster)
    # a request whose first chunk landed and whose last one the prefill engine still holds
    expect_only(decode, "pending", pd.address)
    for w in prefill:
        w.command(cmd="send", request_id="pending", pages=[1, 2, 3], n=12, chunks=[[0, 4], [4, 12]],
                  hold_last=True)
    wait_state(dd, {"decode:transferring": 1})
    old, decode = restart(cluster, dd, decode)
    # the new decode daemon's first request: its handshake replaces the dead link at once
    dec, pre = transfer(prefill, decode, "after", 13, src_pages=[9, 10, 11, 12], dst_pages=[13, 14, 15, 16],
                        source_address=pd.address)
    assert_verified(dec, pre)
    ev = finished(prefill[0], "pending", timeout=WAIT_S)
    assert ev["state"] == "failed" and ev["code"] == "peer_restarted", ev
    assert dd.address in ev["reason"] and old in ev["reason"], ev
    after = round(ev["t"] - dd.killed_at, 2)
    assert "event=peer_restarted" in pd.log() and "side=decode" in pd.log()
    st = status(pd)
    assert st["requests"] == {}
    decode_peers = [p for p in st["peers"] if p["side"] == "decode"]
    assert [p["incarnation"] for p in decode_peers] == [status(dd)["incarnation"]], decode_peers
    close(prefill + decode)
    rr.record("faults", "decode_daemon_restarted", {
        "survived": True, "terminal_after_s": after, "deadline_s": NEVER_S,
        "outcome": f"SIGKILL + restart on the same ports: the new daemon's first handshake replaced the dead "
                   f"link at once (old connection closed, new incarnation); the prefill side's pending "
                   f"request failed peer_restarted {after}s after the kill (the new daemon's and engine's start-up included), the new request verified byte-exact",
        "seconds": time.monotonic() - started})

"""A source daemon that never answers, through a real decode daemon: the requests waiting for it
fail peer_unreachable after the peer timeout (not the bootstrap's), later ones fail at once
while it is backed off, its socket is closed meanwhile, and status shows the backoff."""

from __future__ import annotations

import socket
import time

from e2e_util import NUM_PAGES, Node, close, cluster_run, finished, spec, start_nodes
from kvxferd.sdk.client import EngineClient

# a peer timeout far shorter than the bootstrap's: peer_unreachable can only come from the link
CFG = "[timeouts]\nbootstrap_s = 60.0\nwaiting_for_input_s = 60.0\ndrain_grace_s = 1.0\n"
PEER = {"KVXFERD_PEER_HEARTBEAT_INTERVAL_S": "0.25", "KVXFERD_PEER_PEER_TIMEOUT_S": "1.0",
        "KVXFERD_PEER_UNREACHABLE_BACKOFF_MAX_S": "30.0"}


def _nobody_listens() -> str:
    """An address on loopback where nothing listens (a port taken and given back)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _peer(daemon, address):
    with EngineClient(daemon.socket_path, timeout=10) as client:
        return next((p for p in client.status()["peers"] if p["address"] == address), None)


def test_an_unreachable_source_fails_its_requests_then_backs_off_and_fails_new_ones_at_once(request):
    dead = _nobody_listens()
    with cluster_run(request) as c:
        (d,) = start_nodes(c, Node("decode-node", CFG, PEER))
        (decode,) = c.instances((d, "ud", "decode", spec(), NUM_PAGES))
        try:
            decode[0].command(cmd="expect", request_id="u-1", pages=[1, 2], n=8, source_instance="up",
                              source_address=dead)
            ev = finished(decode[0], "u-1", timeout=30)
            assert ev["state"] == "failed" and ev["code"] == "peer_unreachable", ev
            assert f"source daemon {dead} is unreachable: 1 try" in ev["reason"], ev
            peer = _peer(d, dead)
            assert peer is not None and peer["state"] == "down" and peer["silent_tries"] == 1, peer
            # backed off (up to 30 s after more tries; at least 0.125 s after the first): a request that
            # comes now either fails at once, or, once the backoff ran out, tries the peer again and fails
            # after the peer timeout with one more try counted
            decode[0].command(cmd="expect", request_id="u-2", pages=[3, 4], n=8, source_instance="up",
                              source_address=dead)
            ev = finished(decode[0], "u-2", timeout=30)
            assert ev["state"] == "failed" and ev["code"] == "peer_unreachable", ev
            assert "the next try in" in ev["reason"] and "peer.advertise_host" in ev["reason"], ev
            tries = _peer(d, dead)["silent_tries"]
            assert tries in (1, 2)
            deadline = time.monotonic() + 30
            while tries < 3 and time.monotonic() < deadline:  # the backoff grows with each silent try
                rid = f"u-more-{time.monotonic()}"
                decode[0].command(cmd="expect", request_id=rid, pages=[5, 6], n=8, source_instance="up",
                                  source_address=dead)
                assert finished(decode[0], rid, timeout=30)["code"] == "peer_unreachable"
                tries = _peer(d, dead)["silent_tries"]
            assert tries >= 3
            # now backed off for about a second or more: the next request fails before any try
            peer = _peer(d, dead)
            if peer["retry_in_s"] > 0.3:
                decode[0].command(cmd="expect", request_id="u-fast", pages=[7, 8], n=8, source_instance="up",
                                  source_address=dead)
                ev = finished(decode[0], "u-fast", timeout=30)
                assert ev["code"] == "peer_unreachable" and _peer(d, dead)["silent_tries"] == tries, ev
        finally:
            close(decode)

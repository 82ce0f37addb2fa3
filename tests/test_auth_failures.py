"""Authentication failures are reported on both sides at once, not as a bootstrap timeout.

Real daemons with CURVE keys on 127.0.0.1. The refusing (prefill) daemon logs and counts the
refused key and address it learns from ZAP; the refused (decode) daemon learns of the refusal
from its socket's monitor events and fails the request with ``auth_failed`` naming the
address, well before ``timeouts.bootstrap_s``; both show it in ``kvxferd status``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from e2e_util import assert_verified, close, cluster_run, finished, in_parallel, spec, transfer
from kvxferd.wire import auth

from ops_support import Scrape, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import reliability_report as rr  # noqa: E402

NUM_PAGES = 16
#: long enough that a request failing on the handshake's own deadline could not pass as prompt
BOOTSTRAP_S = 120.0


def _keys(tmp_path, name):
    pair = auth.generate()
    return pair, auth.write_keypair(tmp_path / f"{name}.key", pair)


def _auth_toml(key_file, allowed, peer_keys):
    return (f'[auth]\nenabled = true\nsecret_key_file = "{key_file}"\n'
            f'allowed_keys = {list(allowed)!r}\npeer_keys = {list(peer_keys)!r}\n').replace("'", '"')


def _status(d) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvxferd", "status", "--json", "--socket", d.socket_path],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _human_status(d) -> str:
    out = subprocess.run([sys.executable, "-m", "kvxferd", "status", "--socket", d.socket_path],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_refused_key_is_logged_counted_and_fails_the_request_promptly(tmp_path):
    started = time.monotonic()
    p_pair, p_key = _keys(tmp_path, "prefill")
    d_pair, d_key = _keys(tmp_path, "decode")
    s_pair, s_key = _keys(tmp_path, "stranger")
    with cluster_run() as c:
        slow = f"[timeouts]\nbootstrap_s = {BOOTSTRAP_S}\n"
        pd = c.daemon("prefill-node", start=False)
        dd = c.daemon("decode-node", start=False)
        sd = c.daemon("stranger-node", start=False)
        pd.config_path.write_text(pd.config_path.read_text() + _auth_toml(p_key, [d_pair.public], []))
        dd.config_path.write_text(dd.config_path.read_text() + slow +
                                  _auth_toml(d_key, [], [f"{pd.address}={p_pair.public}"]))
        sd.config_path.write_text(sd.config_path.read_text() + slow +
                                  _auth_toml(s_key, [], [f"{pd.address}={p_pair.public}"]))
        in_parallel(pd.start, dd.start, sd.start)
        prefill, decode, outsider = c.instances((pd, "ap", "prefill", spec(), NUM_PAGES),
                                                (dd, "ad", "decode", spec(), NUM_PAGES),
                                                (sd, "sd", "decode", spec(), NUM_PAGES))

        asked = time.time()
        outsider[0].command(cmd="expect", request_id="auth-x", pages=[1, 2], n=5, source_instance="ap",
                            source_address=pd.address)
        # the event arrives long before bootstrap_s; had it waited for the deadline, this would time out
        ev = finished(outsider[0], "auth-x", timeout=BOOTSTRAP_S / 2)
        assert ev["state"] == "failed" and ev["code"] == "auth_failed", ev
        assert pd.address in ev["reason"] and "allowed_keys" in ev["reason"], ev
        assert s_pair.public in ev["reason"]  # the key the operator must add
        after = round(ev["t"] - asked, 2)

        # the refusing side logged the key and the address, and counted the refusal
        refused = wait_for(lambda: [line for line in pd.log().splitlines() if "event=auth_refused" in line],
                           what="event=auth_refused in the prefill daemon's log")
        assert s_pair.public in refused[0] and "peer=127.0.0.1" in refused[0] and "level=warning" in refused[0]
        assert Scrape(pd).value("kvxferd_auth_denied_total") >= 1
        assert Scrape(sd).value("kvxferd_transfer_failures_total", side="decode", reason="auth_failed") == 1
        assert Scrape(sd).value("kvxferd_peer_auth_failures_total") >= 1

        # both sides show it in `kvxferd status`
        here = _status(pd)["auth"]["refused_here"]
        assert any(r["key"] == s_pair.public and r["address"] == "127.0.0.1" and r["count"] >= 1 for r in here), here
        there = _status(sd)["auth"]["refused_by_peers"]
        assert any(r["address"] == pd.address and r["count"] >= 1 for r in there), there
        assert f"refused by {pd.address}" in _human_status(sd)
        assert s_pair.public in _human_status(pd)

        # a second request fails the same way, promptly: a fresh attempt refused again, or, once the
        # refused link went silent past peer.peer_timeout_s, at once for the backoff with the refusal
        outsider[0].command(cmd="expect", request_id="auth-y", pages=[3, 4], n=5, source_instance="ap",
                            source_address=pd.address)
        ev = finished(outsider[0], "auth-y", timeout=BOOTSTRAP_S / 2)
        assert ev["state"] == "failed" and ev["code"] == "auth_failed", ev
        assert s_pair.public in ev["reason"] and "allowed_keys" in ev["reason"], ev

        # the allowed daemon is served all along, byte-exact
        dec, pre = transfer(prefill, decode, "auth-ok", 13, src_pages=[1, 2, 3, 4], dst_pages=[5, 6, 7, 8],
                            source_address=pd.address)
        assert_verified(dec, pre)
        close(prefill + decode + outsider)
    rr.record("faults", "peer_key_not_allowed", {
        "survived": True, "terminal_after_s": after, "deadline_s": BOOTSTRAP_S,
        "outcome": f"a decode daemon whose CURVE key is not allowed: its request failed auth_failed {after}s "
                   "after the expect, naming the address and its key; the prefill daemon logged "
                   "event=auth_refused with the key and address and counted it; both show it in status; the "
                   "allowed daemon was served byte-exact meanwhile",
        "seconds": time.monotonic() - started})


def test_wrong_server_key_fails_promptly_naming_peer_keys(tmp_path):
    p_pair, p_key = _keys(tmp_path, "prefill")
    d_pair, d_key = _keys(tmp_path, "decode")
    wrong = auth.generate().public
    with cluster_run() as c:
        pd = c.daemon("prefill-node", start=False)
        dd = c.daemon("decode-node", start=False)
        pd.config_path.write_text(pd.config_path.read_text() + _auth_toml(p_key, [d_pair.public], []))
        dd.config_path.write_text(dd.config_path.read_text() + f"[timeouts]\nbootstrap_s = {BOOTSTRAP_S}\n" +
                                  _auth_toml(d_key, [], [f"{pd.address}={wrong}"]))
        in_parallel(pd.start, dd.start)
        prefill, decode = c.instances((pd, "ap", "prefill", spec(), NUM_PAGES), (dd, "ad", "decode", spec(), NUM_PAGES))
        decode[0].command(cmd="expect", request_id="wrong-1", pages=[1, 2], n=5, source_instance="ap",
                          source_address=pd.address)
        ev = finished(decode[0], "wrong-1", timeout=BOOTSTRAP_S / 2)
        assert ev["state"] == "failed" and ev["code"] == "auth_failed", ev
        assert pd.address in ev["reason"] and "auth.peer_keys" in ev["reason"], ev
        close(prefill + decode)

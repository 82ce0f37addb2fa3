"""Authenticated peers: CURVE allow-list on the control link, tokens on the data link."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request

import msgpack
import pytest
import zmq

from e2e_util import (assert_verified, close, cluster_run, finished, in_parallel, spec, start_nodes, transfer,
                      untouched_bytes, wait_in_flight)
from kvxferd.errors import ConfigError
from kvxferd.transport.framing import read_frame
from kvxferd.wire import auth, protocol

NUM_PAGES = 16


def _key_files(tmp_path, name):
    pair = auth.generate()
    return pair, auth.write_keypair(tmp_path / f"{name}.key", pair)


def _auth_toml(key_file, allowed, peer_keys):
    return (f'[auth]\nenabled = true\nsecret_key_file = "{key_file}"\n'
            f'allowed_keys = {list(allowed)!r}\npeer_keys = {list(peer_keys)!r}\n').replace("'", '"')


def test_keygen_writes_a_private_key_file(tmp_path):
    out = tmp_path / "node.key"
    proc = subprocess.run([sys.executable, "-m", "kvxferd", "keygen", "--out", str(out)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    pair = auth.read_keypair(out)
    assert (out.stat().st_mode & 0o777) == 0o600
    assert (tmp_path / "node.key.pub").read_text().strip() == pair.public
    assert pair.public in proc.stdout
    again = subprocess.run([sys.executable, "-m", "kvxferd", "keygen", "--out", str(out)], capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 1 and "refusing" in again.stderr


def test_bad_keys_are_config_errors():
    with pytest.raises(ConfigError) as err:
        auth.parse_peer_keys(["127.0.0.1:5557=short"])
    assert err.value.field == "auth.peer_keys"
    with pytest.raises(ConfigError) as err:
        auth.parse_peer_keys(["no-port-here"])
    assert err.value.field == "auth.peer_keys"
    key = auth.generate().public
    assert auth.parse_peer_keys([f"10.0.0.2:5557={key}"]) == {"10.0.0.2:5557": key}


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def test_allowed_peers_transfer_and_strangers_are_shut_out(tmp_path):
    p_pair, p_key = _key_files(tmp_path, "prefill")
    d_pair, d_key = _key_files(tmp_path, "decode")
    stranger, s_key = _key_files(tmp_path, "stranger")
    with cluster_run() as c:
        pd = c.daemon("prefill-node", start=False)
        dd = c.daemon("decode-node", start=False)
        sd = c.daemon("stranger-node", start=False)
        fast = "[timeouts]\nbootstrap_s = 3.0\n"
        pd.config_path.write_text(pd.config_path.read_text() + _auth_toml(p_key, [d_pair.public], []))
        dd.config_path.write_text(dd.config_path.read_text() + fast +
                                  _auth_toml(d_key, [], [f"{pd.address}={p_pair.public}"]))
        # the stranger knows the server key but its own key is not on the allow-list
        sd.config_path.write_text(sd.config_path.read_text() + fast +
                                  _auth_toml(s_key, [], [f"{pd.address}={p_pair.public}"]))
        in_parallel(pd.start, dd.start, sd.start)
        prefill, decode, outsider = c.instances((pd, "ap", "prefill", spec(tp_size=2), NUM_PAGES),
                                                (dd, "ad", "decode", spec(), NUM_PAGES),
                                                (sd, "sd", "decode", spec(), NUM_PAGES))
        dec, pre = transfer(prefill, decode, "auth-1", 13, src_pages=[1, 2, 3, 4], dst_pages=[5, 6, 7, 8],
                            source_address=pd.address)
        assert_verified(dec, pre)

        outsider[0].command(cmd="expect", request_id="auth-2", pages=[1, 2], n=5, source_instance="ap",
                            source_address=pd.address)
        ev = finished(outsider[0], "auth-2")
        assert ev["state"] == "failed" and ev["code"] == "auth_failed", ev
        assert _metric(pd.metrics_url, "kvxferd_auth_denied_total") >= 1

        # a plain (non-CURVE) client gets no answer at all from the authenticated endpoint
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{pd.address}")
        sock.send(msgpack.packb({"op": "ping", "daemon": "x:1"}))
        assert sock.poll(1000) == 0
        sock.close(0)
        close(prefill + decode + outsider)


def test_data_header_without_the_link_token_is_refused():
    with cluster_run() as c:
        pd, dd = start_nodes(c, "prefill-node", "decode-node")
        prefill, decode = c.instances((pd, "tp", "prefill", spec(), NUM_PAGES), (dd, "td", "decode", spec(), NUM_PAGES))
        # a legitimate request is expected, and its prefill is held back
        decode[0].command(cmd="expect", request_id="tok-1", pages=[1, 2], n=8, source_instance="tp",
                          source_address=pd.address)
        prefill[0].command(cmd="send", request_id="tok-1", pages=[3, 4], n=8, chunks=[[0, 4], [4, 8]],
                           hold_last=True)
        wait_in_flight(dd, "decode:transferring")
        # a process that knows the request id but not the token tries to write the rest
        header = {"op": "data", "request_id": "tok-1", "decode_instance": "td", "dst": [0, 0], "src": [0, 0],
                  "start": 4, "end": 8, "last": True,
                  "nbytes": 4 * 2 * 4 * 4 * 16 * 2}  # layers x kinds x tokens x heads x head_dim x bf16
        with socket.create_connection(("127.0.0.1", dd.data_port), timeout=5) as s:
            assert read_frame(s, 512)["op"] == "challenge"  # the port asks for the link's proof first
            s.sendall(protocol.frame(header))  # and is answered with a data frame
            s.sendall(b"\x00" * header["nbytes"])
            reply = read_frame(s, 65536)
        assert reply["ok"] is False and reply["error"]["field"] == "token"
        # the spoofed chunk wrote nothing: page 2 (tokens 4..7) still holds the canary
        assert untouched_bytes(decode[0], [2]) == 0
        # and the daemon keeps serving legitimate requests
        prefill[0].command(cmd="send", request_id="tok-1b", pages=[3, 4], n=8)
        decode[0].command(cmd="expect", request_id="tok-1b", pages=[5, 6], n=8, source_instance="tp",
                          source_address=pd.address)
        assert_verified([finished(decode[0], "tok-1b")], [finished(prefill[0], "tok-1b")])
        close(prefill + decode)

"""A daemon that cannot start leaves nothing behind and says which address of which setting failed.

Real ``kvxferd serve`` processes; the taken address is a real socket bound by the test (a TCP
port on 127.0.0.1, or the engine socket of another running daemon).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kvxferd.sdk.client import EngineClient
from kvxferd.tools.sim import DaemonProc


def serve_until_exit(d: DaemonProc, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVXFERD_")}
    return subprocess.run([sys.executable, "-m", "kvxferd", "serve", "--config", str(d.config_path)],
                          capture_output=True, text=True, env=env, timeout=timeout)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize("taken,setting", [("metrics_port", "metrics.bind"),
                                           ("control_port", "peer.control_port"),
                                           ("data_port", "peer.data_port")])
def test_taken_port_fails_start_naming_address_and_setting(cluster, taken, setting):
    d = cluster.daemon("failing", start=False)
    port = getattr(d, taken)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen(1)
        result = serve_until_exit(d)
    assert result.returncode != 0
    fatal = [line for line in result.stderr.splitlines() if "event=fatal" in line]
    assert fatal, result.stderr
    assert f"127.0.0.1:{port}" in fatal[0] and setting in fatal[0], fatal[0]
    assert "Traceback" not in result.stderr
    # nothing of the failed start outlives it: no engine socket file, every other port free
    assert not os.path.exists(d.socket_path), "the engine socket file outlived the failed start"
    for other in ("metrics_port", "control_port", "data_port"):
        if other != taken:
            assert port_free(getattr(d, other)), f"{other} still bound after the failed start"


def test_engine_socket_of_a_running_daemon_is_left_alone(cluster):
    """A second daemon pointed at the same engine socket fails, names it, and does not remove it."""
    first = cluster.daemon("first")
    second = cluster.daemon("second", start=False)
    text = second.config_path.read_text().replace(second.socket_path, first.socket_path)
    second.config_path.write_text(text)
    result = serve_until_exit(second)
    assert result.returncode != 0
    fatal = [line for line in result.stderr.splitlines() if "event=fatal" in line]
    assert fatal and first.socket_path in fatal[0] and "engine.socket_path" in fatal[0], result.stderr
    for port in (second.control_port, second.data_port, second.metrics_port):
        assert port_free(port)
    client = EngineClient(first.socket_path, timeout=10)  # the first daemon still serves its socket
    try:
        assert client.call("ping")["ok"] is True
    finally:
        client.close()


def test_harness_moves_a_first_start_off_a_taken_port(cluster):
    """Another run on the machine may take a port between allocation and bind; the harness's first
    start then moves to fresh ports (the daemon itself still refuses, as above)."""
    d = cluster.daemon("moved", start=False)
    taken = d.metrics_port
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen(1)
        d.start()
    assert d.metrics_port != taken
    assert f'bind = "127.0.0.1:{d.metrics_port}"' in d.config_path.read_text()
    assert "code=bind_failed" in d.log()  # the first attempt failed for the reason named
    client = EngineClient(d.socket_path, timeout=10)
    try:
        assert client.call("ping")["ok"] is True
    finally:
        client.close()


def test_free_port_never_repeats_in_a_process_and_avoids_the_ephemeral_range():
    from kvxferd.tools.sim import _ephemeral_floor, free_port
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(port < _ephemeral_floor() for port in ports), ports

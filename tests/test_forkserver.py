"""The fork server the suite starts its daemons and engine ranks from: a forked child behaves as
``python -m MODULE`` started the usual way (same output for the same input, exit codes,
signals, environment), and no child outlives the server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kvxferd.tools import launch
from kvxferd.tools.forkserver import ForkServer

WAIT_S = 60


@pytest.fixture(scope="module")
def server():
    s = ForkServer(launch._start)
    yield s
    s.close()


def _usual(args: list[str], stdin: str = "", env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, input=stdin, capture_output=True, text=True, env=env, timeout=WAIT_S)


def test_a_forked_child_reads_stdin_and_writes_stdout_as_a_usual_one(server):
    text = json.dumps({"b": [1, 2, {"c": "é"}], "a": None})
    args = [sys.executable, "-m", "json.tool", "--sort-keys"]
    child = server.spawn(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    assert child.pid != os.getpid() and child.stdin is not None and child.stdout is not None
    child.stdin.write(text)
    child.stdin.close()
    out = child.stdout.read()
    assert child.wait(WAIT_S) == 0
    assert out == _usual(args, text).stdout


def test_exit_codes_and_stderr_match_a_usual_start(server, tmp_path):
    args = [sys.executable, "-m", "kvxferd", "no-such-command"]
    log = tmp_path / "err.log"
    with open(log, "w") as fh:
        child = server.spawn(args, stdout=fh, stderr=subprocess.STDOUT)
    usual = _usual(args)
    assert child.wait(WAIT_S) == usual.returncode != 0
    assert log.read_text() == usual.stderr  # the usage error, word for word


def test_the_child_gets_the_environment_it_is_given(server):
    args = [sys.executable, "-m", "site", "--user-base"]
    env = {**os.environ, "PYTHONUSERBASE": "/nonexistent/kvxferd-user-base"}
    child = server.spawn(args, stdout=subprocess.PIPE, text=True, env=env)
    out = child.stdout.read()
    assert child.wait(WAIT_S) == _usual(args, env=env).returncode
    assert out.strip() == "/nonexistent/kvxferd-user-base"


def _long_running(server, **kwargs):
    """A child that runs until signalled (a local HTTP server on an OS-chosen loopback port)."""
    return server.spawn([sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kwargs)


def test_signals_reach_the_child_and_its_death_by_signal_is_reported(server):
    child = _long_running(server)
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    assert child.poll() is None
    child.kill()
    assert child.wait(WAIT_S) == -signal.SIGKILL
    other = _long_running(server, start_new_session=True)
    deadline = time.monotonic() + WAIT_S  # the child calls setsid() right after the fork
    while os.getsid(other.pid) != other.pid and time.monotonic() < deadline:
        time.sleep(0.02)
    assert os.getsid(other.pid) == other.pid  # a session of its own, as start_new_session gives
    other.terminate()
    assert other.wait(WAIT_S) == -signal.SIGTERM


def test_children_end_with_the_server():
    s = ForkServer(launch._start)
    child = _long_running(s)
    assert child.poll() is None
    s.close()
    deadline = time.monotonic() + WAIT_S
    while _alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child.pid), "a forked child outlived its server"
    assert child.wait(WAIT_S) == -signal.SIGTERM


def test_launch_forks_only_this_packages_modules_with_the_servers_environment():
    if not launch.fork_from_preloaded():
        pytest.skip("no fork server on this platform")
    same = launch._forkable([sys.executable, "-m", "kvxferd", "serve"], {"stdout": subprocess.DEVNULL})
    other_module = launch._forkable([sys.executable, "-m", "json.tool"], {})
    other_env = launch._forkable([sys.executable, "-m", "kvxferd"], {"env": {**os.environ, "PYTHONPATH": "/x"}})
    settings = launch._forkable([sys.executable, "-m", "kvxferd"],
                                {"env": {**os.environ, "KVXFERD_PEER_TRANSPORT": "nixl", "UCX_TLS": "tcp"}})
    cwd = launch._forkable([sys.executable, "-m", "kvxferd"], {"cwd": "/"})
    assert (same, other_module, other_env, settings, cwd) == (True, False, False, True, False)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

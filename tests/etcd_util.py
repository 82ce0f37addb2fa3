"""A real etcd of a test's own: free loopback ports, its data dir removed after."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from kvxferd.tools import launch
from kvxferd.tools.sim import free_port

ETCD = shutil.which("etcd")
START_S = 60.0  # a busy host may take a while to start it


@contextmanager
def etcd_process(name: str = "kvxferd-test") -> Iterator[str]:
    """Start etcd (the test skips, saying why, where there is none); yield its client URL."""
    if ETCD is None:
        pytest.skip("no etcd binary on PATH (Debian: apt-get install etcd-server)")
    data = tempfile.mkdtemp(prefix="kvxferd-etcd-")
    client_port, peer_port = free_port(), free_port()
    url, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    log = open(f"{data}/etcd.log", "wb")
    proc = launch.popen([ETCD, "--name", name, "--data-dir", f"{data}/data", "--listen-client-urls", url,
                         "--advertise-client-urls", url, "--listen-peer-urls", peer,
                         "--initial-advertise-peer-urls", peer, "--initial-cluster", f"{name}={peer}"],
                        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_S
        while True:
            assert proc.poll() is None, Path(f"{data}/etcd.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                    if b'"true"' in answer.read():
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, Path(f"{data}/etcd.log").read_text()[-2000:]
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(data, ignore_errors=True)

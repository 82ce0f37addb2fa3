"""Shared pieces of the NIXL tests: the probe that decides whether they can run, UCX pinned
to loopback, metric reading, multi-instance start-up, one byte-exact case runner, and a
stand-in prefill daemon with its own NIXL agent."""

from __future__ import annotations

import itertools
import os
import threading
import time
import urllib.request

import msgpack
import pytest
import zmq

from e2e_util import Cluster, carried_plan
from e2e_util import run_case as e2e_run_case
from kvxferd.tools.sim import Worker
from kvxferd.transport.nixl import api as nixl_api

#: UCX on loopback TCP only: no RDMA devices, no shared-memory shortcut between the daemons
UCX_ENV = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp"}
#: the NIXL tests of the in-place routes (direct WRITEs, ``place``) ask for them outright: a decode
#: daemon keeps its engines' memory private by default (tests/test_isolation_nixl.py covers that)
NIXL_ENV = {**UCX_ENV, "KVXFERD_PEER_TRANSPORT": "nixl", "KVXFERD_PEER_NIXL_ENGINE_MEMORY": "exposed"}
NUM_PAGES = 64


def _probe() -> str:
    """Empty if a NIXL agent with the UCX backend starts here, else why not."""
    ok, why = nixl_api.available()
    if not ok:
        return why
    saved = {k: os.environ.get(k) for k in UCX_ENV}
    os.environ.update(UCX_ENV)
    try:
        api = nixl_api.load_api()
        agent = api.nixl_agent("kvxferd-probe", api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        if "UCX" not in agent.backends:
            return f"NIXL started without its UCX backend (plugins: {agent.get_plugin_list()})"
    except Exception as exc:  # noqa: BLE001 - reported as the skip reason
        return f"NIXL agent with UCX failed to start: {type(exc).__name__}: {exc}"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ""


NIXL_MISSING = _probe()
needs_nixl = pytest.mark.skipif(bool(NIXL_MISSING),
                                reason=f"NIXL unusable here: {NIXL_MISSING} (make venv installs nixl-cu12)")


def metric(daemon, name: str, **labels: str) -> float:
    """Sum of a counter's samples on one daemon whose labels include ``labels``."""
    text = urllib.request.urlopen(daemon.metrics_url, timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def instances(cluster: Cluster, *wanted: tuple) -> list[list[Worker]]:
    """Several (daemon, name, role, spec) instances of NUM_PAGES pages, started together."""
    return cluster.instances(*((d, name, role, ispec, NUM_PAGES) for d, name, role, ispec in wanted))


#: long phase timeouts, so that only heartbeats or deadlines under test can end a request
SLOW_TIMEOUTS = "[timeouts]\nbootstrap_s = 30.0\nwaiting_for_input_s = 30.0\ntransfer_s = 30.0\ndrain_grace_s = 1.0\n"


def run_case(cluster: Cluster, pspec, dspec, *, prefill: str = "prefill-nixl", decode: str = "decode-nixl",
             n_tokens: int, chunks=None, order: str = "expect_first", requests: int = 2) -> None:
    """Byte-exact requests between fresh instances on two NIXL daemons; a WRITE never strays
    outside the requests' pages."""
    e2e_run_case(cluster, pspec, dspec, prefill=prefill, decode=decode, n_tokens=n_tokens, chunks=chunks,
                 order=order, requests=requests, seed=n_tokens, aux=b"first-token", tag="nx-", num_pages=NUM_PAGES)


_FAKES = itertools.count(1)


class FakePrefillDaemon:
    """Just enough of a prefill daemon's peer endpoint, with its own NIXL agent, to send notifications."""

    def __init__(self, pspec, mode: str = "direct") -> None:
        self.pspec = pspec
        self.mode = mode
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        api = nixl_api.load_api()
        # a name of its own: a decode daemon knows a peer's landing ring by its agent's name, and
        # stand-ins of one test process outlive each other there
        self.agent = api.nixl_agent(f"fake-prefill-{os.getpid()}-{next(_FAKES)}", api.nixl_agent_config(
            enable_prog_thread=True, backends=["UCX"]))
        self.handshake: dict | None = None
        self.expects: list[dict] = []
        self.aborts: list[dict] = []
        self.fences: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            identity, payload = self.sock.recv_multipart()
            msg = msgpack.unpackb(payload)
            reply = None
            if msg["op"] == "ping":
                reply = {"op": "pong", "daemon": self.address}
            elif msg["op"] == "handshake":
                self.handshake = msg
                reply = {"op": "handshake_ok", "seq": msg["seq"], "prefill_spec": self.pspec.to_dict(),
                         "mode": self.mode, "plan": carried_plan(self.pspec, msg, self.mode),
                         "transport": "nixl", "nixl_agent": self.agent.name,
                         "nixl_md": [self.agent.get_agent_metadata()]}  # so the decode side can notify us
            elif msg["op"] == "expect":
                self.expects.append(msg)
            elif msg["op"] == "abort":
                self.aborts.append(msg)
            elif msg["op"] == "fence":  # recorded, never answered: the decode side must not wait forever
                self.fences.append(msg)
            if reply is not None:
                self.sock.send_multipart([identity, msgpack.packb(reply, use_bin_type=True)])

    def engage(self, decode_worker: Worker, request_id: str, pages: list[int], n: int) -> dict:
        """Have a decode rank expect a request from this stand-in; once the decode daemon's handshake
        and expect have arrived, load its NIXL metadata (so notifications can be sent) and return
        the handshake."""
        decode_worker.command(cmd="expect", request_id=request_id, pages=pages, n=n,
                              source_instance=f"{decode_worker.instance}-src", source_address=self.address)
        deadline = time.monotonic() + 20
        while not self.expects:
            assert time.monotonic() < deadline, "decode daemon never sent its expect"
            time.sleep(0.02)
        assert self.handshake is not None
        for md in self.handshake["nixl_md"]:
            self.agent.add_remote_agent(md)
        return self.handshake

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close(0)
        self.ctx.term()

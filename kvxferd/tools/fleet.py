"""A fleet in one process: many fake peer daemons that speak the real peer protocol to one real
daemon, to measure what a large deployment costs that daemon.

A real daemon is measured from both sides of its peer links:

- **as destination** (a decode daemon): :class:`FakeSource` daemons, each a ROUTER on its own
  loopback port holding one prefill instance. The daemon's own engine (this process) expects
  one request from each; the daemon dials the source, handshakes (the fake plans the pair with
  the project's planner and sends the plan, as a real source does), sends its expect, and the
  fake aborts the request: no KV moves, yet every step of a link's life ran, and the link then
  stays up on heartbeats. Addresses where nothing listens make the same daemon's dead peers.
- **as source** (a prefill daemon): :class:`FakeDecode` daemons, each a DEALER connected to the
  daemon, ping it every heartbeat and handshake for its one registered prefill instance: all at
  once, a fleet restart's handshake storm.

:func:`measure` returns what the fleet rows of ``kvxferd bench`` print: the daemon's CPU while
idle, ``status`` latency, open descriptors and RSS per link, and how long the storm took. The
fakes run on one thread with one poller; the daemon runs in its own process, as in production.
``python -m kvxferd.tools.fleet --links 100`` runs it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import zmq

from .. import PROTOCOL_VERSION
from ..control.decode_links import PING_BURST
from ..model.geometry import InstanceSpec, RankGeometry
from ..model.plan_wire import plan_to_wire
from ..model.planner import make_plan
from ..wire import messages, protocol
from .bench.model import pct
from .procstats import open_fds, rss_kb
from .sim import Cluster, DaemonProc

#: the one geometry every fake instance and the daemon's own rank use: small, so a request is cheap
SPEC = InstanceSpec("mha", num_layers=2, head_dim=16, dtype="float16", page_size=16, total_kv_heads=2)
MAX_BYTES = 1 << 20
ABORT_REASON = "fleet simulator: this source sends no KV"


def _unheld_port() -> int:
    """A loopback port nobody listens on now (the kernel's pick; a fleet needs more ports than
    :func:`~kvxferd.tools.sim.free_port`'s block holds). For dead peers and names only."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _seq(msg: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    return {**answer, "seq": msg["seq"]} if isinstance(msg.get("seq"), int) else answer


def _drain(recv: Callable[[int], Any]) -> Iterator[Any]:
    """What a socket holds now, message by message (``recv`` is its non-blocking receive)."""
    while True:
        try:
            yield recv(zmq.NOBLOCK)
        except zmq.Again:
            return


class FakeSource:
    """A prefill daemon with one instance: answers pings, hellos (with the plan) and expects (an abort)."""

    def __init__(self, ctx: zmq.Context, index: int) -> None:
        self.instance = f"fleet-p{index}"
        self.incarnation = f"fleet-src-{os.getpid()}-{index}"
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")  # the kernel's pick, held from here on
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT).removeprefix("tcp://")

    def on_message(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        op = msg.get("op")
        if op == "ping":
            return _seq(msg, messages.Pong(self.address, self.incarnation).to_wire())
        if op == "handshake":
            hello = messages.parse_peer(msg)
            assert isinstance(hello, messages.Handshake)
            decode = InstanceSpec.from_dict(hello.decode_spec)
            plan = make_plan(SPEC, decode, mode=hello.mode, require_same_page_size=True)
            return _seq(msg, messages.HandshakeOk(SPEC.to_dict(), plan.mode, plan_to_wire(plan), self.incarnation,
                                                  {"transport": "tcp"}).to_wire())
        if op == "expect":
            return messages.PeerAbort(str(msg.get("request_id")), ABORT_REASON, "peer_aborted").to_wire()
        return None

    def serve(self) -> None:
        for frames in _drain(self.sock.recv_multipart):
            identity, parts = frames[0], frames[1:]
            for data in parts:
                answer = self.on_message(protocol.decode(data, MAX_BYTES))
                if answer is not None:
                    self.sock.send_multipart([identity, protocol.encode(answer)])


class FakeDecode:
    """A decode daemon with one instance: pings the daemon every heartbeat, handshakes once."""

    def __init__(self, ctx: zmq.Context, index: int, target: str, prefill_instance: str) -> None:
        self.address = f"127.0.0.1:{_unheld_port()}"  # named in its messages; nothing listens there
        self.instance = f"fleet-d{index}"
        self.prefill_instance = prefill_instance
        self.incarnation = f"fleet-dst-{os.getpid()}-{index}"
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{target}")
        self.seq = 0
        self.answer: str | None = None  # the handshake's answer: handshake_ok, handshake_refused, ...
        self.answered_at = 0.0
        self.pongs = 0

    def _send(self, message: dict[str, Any]) -> None:
        self.seq += 1
        self.sock.send(protocol.encode({**message, "seq": self.seq}))

    def ping(self) -> None:
        self._send(messages.PeerPing(self.address, self.incarnation).to_wire())

    def hello(self) -> None:
        self._send(messages.Handshake(PROTOCOL_VERSION, self.address, self.address, self.prefill_instance,
                                      self.instance, SPEC.to_dict(), "auto", ["tcp"], os.urandom(16),
                                      self.incarnation).to_wire())

    def serve(self) -> None:
        for data in _drain(self.sock.recv):
            op = protocol.decode(data, MAX_BYTES).get("op")
            if op == "pong":
                self.pongs += 1
            elif op in ("handshake_ok", "handshake_refused", "handshake_retry", "error") and self.answer is None:
                self.answer, self.answered_at = str(op), time.monotonic()


class Fleet:
    """The fake daemons and the one thread that serves them; commands reach it through a queue."""

    def __init__(self, heartbeat_s: float = 1.0) -> None:
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, 1 << 15)  # libzmq's default (1,023) is one fleet size's worth
        self.heartbeat_s = heartbeat_s
        self.sources: list[FakeSource] = []
        self.decodes: list[FakeDecode] = []
        self.by_socket: dict[zmq.Socket, FakeSource | FakeDecode] = {}
        self.poller = zmq.Poller()
        self.commands: queue.Queue[tuple[Callable[[], Any], queue.Queue[Any]]] = queue.Queue()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="fleet", daemon=True)
        self.thread.start()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the fleet's thread (sockets belong to it) and return its result."""
        done: queue.Queue[Any] = queue.Queue()
        self.commands.put((fn, done))
        ok, value = done.get(timeout=120)
        if not ok:
            raise value
        return value

    def add_sources(self, n: int) -> list[FakeSource]:
        def add() -> list[FakeSource]:
            new = [FakeSource(self.ctx, len(self.sources) + i) for i in range(n)]
            self._watch(new)
            self.sources += new
            return new
        return self.call(add)

    def add_decodes(self, n: int, target: str, prefill_instance: str) -> list[FakeDecode]:
        """``n`` decode daemons connected to ``target``: they ping at once and every heartbeat after."""
        def add() -> list[FakeDecode]:
            new = [FakeDecode(self.ctx, len(self.decodes) + i, target, prefill_instance) for i in range(n)]
            self._watch(new)
            self.decodes += new
            for d in new:
                d.ping()
            return new
        return self.call(add)

    def storm(self, decodes: list[FakeDecode]) -> None:
        """Every one of ``decodes`` sends its hello in the same instant."""
        self.call(lambda: [d.hello() for d in decodes])

    def _watch(self, fakes: list[Any]) -> None:
        for fake in fakes:
            self.by_socket[fake.sock] = fake
            self.poller.register(fake.sock, zmq.POLLIN)

    def _run(self) -> None:
        next_beat = time.monotonic() + self.heartbeat_s
        due: deque[tuple[float, list[FakeDecode]]] = deque()
        while not self._stop.is_set():
            try:
                for sock, _ in self.poller.poll(20) if self.by_socket else ():
                    self.by_socket[sock].serve()
                while True:
                    try:
                        fn, done = self.commands.get_nowait()
                    except queue.Empty:
                        break
                    try:
                        done.put((True, fn()))
                    except Exception as exc:  # noqa: BLE001 - handed to the caller
                        done.put((False, exc))
                if not self.by_socket:
                    time.sleep(0.02)
                if time.monotonic() >= next_beat:  # pings spread over the interval, as a daemon's are
                    next_beat = time.monotonic() + self.heartbeat_s
                    groups = [self.decodes[i:i + PING_BURST] for i in range(0, len(self.decodes), PING_BURST)]
                    step = self.heartbeat_s / max(1, len(groups))
                    now = time.monotonic()
                    due.extend((now + k * step, group) for k, group in enumerate(groups))
                while due and due[0][0] <= time.monotonic():
                    for d in due.popleft()[1]:
                        d.ping()
            except Exception as exc:  # noqa: BLE001 - a fake's bug: reported, the rest keep serving
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)
        for sock in self.by_socket:
            sock.close(0)
        self.ctx.term()


# -- measuring one real daemon among them ------------------------------------------------------------

@dataclass
class Idle:
    """What the daemon costs while nothing happens but heartbeats."""

    links: int
    cpu_pct: float  # of one core
    status_p50_ms: float
    status_p99_ms: float
    fds: int
    rss_mib: float
    peers_listed: int  # links ``status`` lists in the state asked for


def idle(daemon: DaemonProc, links: int, seconds: float, state: str, status_calls: int = 50) -> Idle:
    """The daemon's CPU over ``seconds`` with nobody calling it, then ``status_calls`` status calls,
    made from a process of their own: this one runs the fake fleet, whose thread would hold the
    interpreter lock while a call's answer waits to be read (what would be timed is this process)."""
    from .bench.machine import proc_cpu
    assert daemon.proc is not None
    pid = daemon.proc.pid
    cpu0, t0 = proc_cpu(pid), time.monotonic()
    time.sleep(seconds)
    cpu = (proc_cpu(pid) - cpu0) / (time.monotonic() - t0) * 100
    out = subprocess.run([sys.executable, "-m", "kvxferd.tools.fleet", "--status-calls", daemon.socket_path,
                          str(status_calls), state], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"fleet: status calls failed: {out.stderr[-300:]}")
    took, listed = json.loads(out.stdout)
    return Idle(links, round(cpu, 2), round(pct(took, 0.5), 2), round(pct(took, 0.99), 2), open_fds(pid),
                round(rss_kb(pid) / 1024, 1), listed)


def status_calls(socket_path: str, calls: int, state: str) -> tuple[list[float], int]:
    """``calls`` status calls, 20 ms apart: each one's ms, and the peers the last listed in ``state``."""
    from ..sdk.client import EngineClient
    took, listed = [], 0
    with EngineClient(socket_path, timeout=60) as client:
        for _ in range(calls):
            t = time.perf_counter()
            status = client.status()
            took.append((time.perf_counter() - t) * 1000)
            listed = sum(1 for p in status.get("peers", []) if p.get("state") == state)
            time.sleep(0.02)
    return took, listed


@dataclass
class Report:
    """One fleet run: the daemon at rest, then with ``links`` peers of each kind."""

    links: int
    baseline: dict[str, Idle] = field(default_factory=dict)  # per daemon (decode, decode-dead, prefill), before any peer
    live_sources: Idle | None = None  # the decode daemon with ``links`` live source daemons
    dead_sources: Idle | None = None  # another decode daemon, with ``links`` unreachable source daemons
    live_decodes: Idle | None = None  # the prefill daemon with ``links`` live decode daemons
    storm_s: float = 0.0  # the prefill daemon: all ``links`` hellos sent at once until the last answer
    storm_answers: dict[str, int] = field(default_factory=dict)
    dial_s: float = 0.0  # the decode daemon: one request to each source until the last ended
    ends: dict[str, int] = field(default_factory=dict)  # how those requests ended, by code
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict
        return asdict(self)


def _register(client: Any, role: str, instance: str) -> tuple[str, Any]:
    from ..sdk.kv_cache import allocate_cpu
    geometry = RankGeometry(SPEC, 0, 0, 4)
    cache = allocate_cpu(geometry, name=f"{instance}-0-0")
    return client.register(instance, role, geometry, cache.descriptors()), cache


def _wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"fleet: {what} within {timeout:.0f} s")
        time.sleep(0.05)


def _dial(client: Any, rank_id: str, addresses: list[tuple[str, str]], tag: str, timeout: float
          ) -> tuple[float, dict[str, int]]:
    """One request to each (source instance, address); returns the seconds until the last ended
    and the ends by code."""
    t0 = time.monotonic()
    reqs = [{"request_id": f"{tag}-{i}", "source_instance": inst, "source_address": addr, "pages": [0],
             "num_tokens": 8} for i, (inst, addr) in enumerate(addresses)]
    ends: dict[str, int] = {}
    for start in range(0, len(reqs), 256):
        for outcome in client.expect_many(rank_id, reqs[start:start + 256]):
            if not isinstance(outcome, str):  # refused at once
                code = getattr(outcome, "code", None) or "refused"
                ends[code] = ends.get(code, 0) + 1
    while sum(ends.values()) < len(reqs):
        event = client.wait_any(max(0.1, timeout - (time.monotonic() - t0)))
        if event is None:
            raise RuntimeError(f"fleet: {len(reqs) - sum(ends.values())} of {len(reqs)} requests had no end "
                               f"within {timeout:.0f} s")
        code = event.get("code") or event.get("state") or "?"
        ends[str(code)] = ends.get(str(code), 0) + 1
    return time.monotonic() - t0, ends


def measure(links: int, idle_s: float = 10.0, heartbeat_s: float = 1.0, timeout_s: float = 5.0,
            kinds: tuple[str, ...] = ("live_sources", "dead_sources", "live_decodes"),
            say: Callable[[str], None] = lambda _m: None) -> Report:
    """Run the fleet against real daemons (a decode daemon with live sources, another with dead ones,
    a prefill daemon with live decode daemons) and measure each."""
    from ..sdk.client import EngineClient
    report = Report(links)
    cluster = Cluster()
    fleet = Fleet(heartbeat_s)
    caches: list[Any] = []
    clients: list[Any] = []
    try:
        def daemon_with_rank(name: str, role: str, instance: str, state: str,
                             env: dict[str, str] | None = None) -> tuple[DaemonProc, Any, str]:
            """A daemon with one rank of this process registered, and its idle figures before any peer."""
            d = cluster.daemon(name, heartbeat_s=heartbeat_s, peer_timeout_s=timeout_s, env=env)
            c = EngineClient(d.socket_path, timeout=60)
            clients.append(c)
            rank_id, cache = _register(c, role, instance)
            caches.append(cache)
            report.baseline[name.removeprefix("fleet-")] = idle(d, 0, idle_s, state)
            return d, c, rank_id

        if "live_sources" in kinds:
            dec, client, rid = daemon_with_rank("fleet-decode", "decode", "fleet-dst", "up")
            say(f"fleet: {links} live source daemons")
            sources = fleet.add_sources(links)
            report.dial_s, report.ends = _dial(client, rid, [(s.instance, s.address) for s in sources],
                                               "live", 60 + links * 0.1)
            _wait_until(lambda: sum(1 for p in client.status().get("peers", []) if p.get("state") == "up")
                        >= links, 30, f"{links} source links up")
            report.live_sources = idle(dec, links, idle_s, "up")
        if "dead_sources" in kinds:  # a daemon of its own: its figures are the dead links' alone
            say(f"fleet: {links} dead source daemons")
            gone, gclient, grid = daemon_with_rank("fleet-decode-dead", "decode", "fleet-dst-dead", "down")
            dead = [(f"fleet-gone{i}", f"127.0.0.1:{_unheld_port()}") for i in range(links)]
            _, dead_ends = _dial(gclient, grid, dead, "dead", 60 + timeout_s * 4 + links * 0.1)
            report.ends.update({f"dead:{k}": v for k, v in dead_ends.items()})
            report.dead_sources = idle(gone, links, idle_s, "down")
        if "live_decodes" in kinds:
            # the fake decode daemons dial out and listen nowhere, so the prefill daemon's call back to the
            # addresses they claim (peer.confirm_claims) could never be answered: it is off for this one
            pre, _, _ = daemon_with_rank("fleet-prefill", "prefill", "fleet-src", "up",
                                               env={"KVXFERD_PEER_CONFIRM_CLAIMS": "false"})
            say(f"fleet: {links} live decode daemons, their handshakes at once")
            decodes = fleet.add_decodes(links, pre.address, "fleet-src")
            _wait_until(lambda: all(d.pongs for d in decodes), 60 + links * 0.05, f"{links} decode links answered")
            t0 = time.monotonic()
            fleet.storm(decodes)
            _wait_until(lambda: all(d.answer for d in decodes), 60 + links * 0.05, f"{links} handshakes answered")
            report.storm_s = round(max(d.answered_at for d in decodes) - t0, 3)
            for d in decodes:
                report.storm_answers[str(d.answer)] = report.storm_answers.get(str(d.answer), 0) + 1
            report.live_decodes = idle(pre, links, idle_s, "up")
    finally:
        report.errors = list(fleet.errors)
        for c in clients:
            c.close()
        fleet.close()
        for cache in caches:
            cache.close()
        for d in cluster.daemons.values():
            code = d.stop()
            if code not in (0, None):
                report.errors.append(f"daemon {d.name} exited {code}")
        shutil.rmtree(cluster.root, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvxferd.tools.fleet", description=__doc__.split("\n\n")[0])
    ap.add_argument("--links", type=int, default=100, help="fake peer daemons of each kind")
    ap.add_argument("--idle-s", type=float, default=10.0, help="seconds each idle CPU reading spans")
    ap.add_argument("--status-calls", nargs=3, metavar=("SOCKET", "CALLS", "STATE"),
                    help=argparse.SUPPRESS)  # the status calls of one idle reading, from a process of their own
    args = ap.parse_args(argv)
    if args.status_calls:
        path, calls, state = args.status_calls
        print(json.dumps(status_calls(path, int(calls), state)))
        return 0
    report = measure(args.links, args.idle_s, say=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(report.to_dict(), indent=1))
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())

"""Simulated engine ranks and a loopback cluster, for the demo, the tests and the benchmark.

A worker is a real process: ``python -m kvxferd.tools.sim worker ...`` registers a
shared-memory KV cache with its daemon, reads JSON commands on stdin (``expect``, ``send``,
``abort``, ...) and prints JSON events on stdout. A prefill worker fills its pages from the
byte oracle (:mod:`kvxferd.tools.oracle`) before it sends; a decode worker checks its pages
against it when a request is done and reports the mismatching bytes.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..model.geometry import InstanceSpec, RankGeometry
from . import jsonlines, launch
from .jsonlines import read_events, send_command
from .oracle import CANARY, canary_report, check_rank, fill_rank, untouched
from .oracle_groups import check_groups, fill_groups, untouched_group, untouched_rows

# -- the worker process -------------------------------------------------------------------

def worker_main(argv: list[str]) -> int:
    import argparse

    from ..sdk.client import EngineClient
    from ..sdk.kv_cache import allocate_cpu

    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--instance", required=True)
    ap.add_argument("--role", required=True)
    ap.add_argument("--geometry", required=True, help="rank geometry JSON")
    ap.add_argument("--rendezvous", default=None, help="the instance's rendezvous daemon (host:port)")
    ap.add_argument("--dp", default=None, help="dp_rank,dp_size of a data-parallel rank")
    ap.add_argument("--integrity", default=None, help="the integrity mode the instance asks for at register")
    args = ap.parse_args(argv)
    geometry = RankGeometry.from_dict(json.loads(args.geometry))
    args.dp = tuple(int(x) for x in args.dp.split(",")) if args.dp else None
    tag = f"-dp{args.dp[0]}" if args.dp else ""
    cache = allocate_cpu(geometry, name=f"{args.instance}{tag}-{geometry.tp_rank}-{geometry.pp_rank}", fill=CANARY)
    client = EngineClient(args.socket, timeout=30)
    out_lock = threading.Lock()

    def emit(obj: dict[str, Any]) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    from ..ops.signals import cleanup_on_signals
    with cleanup_on_signals():  # SIGTERM: unlink the cache file on the way out
        try:
            return _worker_serve(args, client, cache, geometry, emit)
        finally:
            client.close()
            cache.close()


def _worker_serve(args: Any, client: Any, cache: Any, geometry: RankGeometry, emit: Any) -> int:
    try:
        rid = client.register(args.instance, args.role, geometry, cache.descriptors(), args.rendezvous, args.dp,
                              args.integrity)
    except Exception as exc:  # noqa: BLE001 - reported to the orchestrator
        emit({"event": "register_failed", "error": str(exc), "code": getattr(exc, "code", "")})
        return 1
    # a named cache file, so the orchestrator could remove it if this process is killed (a memfd,
    # the default, goes by itself); the memfd's name tells tests which mappings are this cache
    emit({"event": "registered", "rank_id": rid, "shm": cache.path, "memfd": cache.name})
    commands: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            if line.strip():
                commands.put(json.loads(line))
        commands.put(None)

    threading.Thread(target=read_stdin, daemon=True).start()
    pending: dict[str, dict[str, Any]] = {}
    #: request -> its daemon event and whether it was reported: the daemon may tell an outcome (the
    #: decode side aborted) before this engine's send for it, which then meets request_finished
    ended: OrderedDict[str, tuple[dict[str, Any], bool]] = OrderedDict()
    running = True
    while running or pending:
        try:
            while True:
                cmd = commands.get_nowait()
                if cmd is None:
                    running = False
                    break
                if cmd["cmd"] == "register":  # again (a restarted daemon): the same memory, same descriptors
                    try:
                        rid = client.register(args.instance, args.role, geometry, cache.descriptors(), args.rendezvous,
                                              args.dp, args.integrity)
                        emit({"event": "registered", "rank_id": rid, "shm": cache.path, "memfd": cache.name})
                    except Exception as exc:  # noqa: BLE001 - reported to the orchestrator
                        emit({"event": "register_failed", "error": str(exc), "code": getattr(exc, "code", "")})
                    continue
                _worker_command(client, rid, cache, geometry, cmd, pending, ended, emit)
        except queue.Empty:
            pass
        if not running and not pending:
            break
        event = client.wait_any(0.02)
        if event is not None:
            ended[event.get("request_id")] = (event, event.get("request_id") in pending)
            while len(ended) > 4096:
                ended.popitem(last=False)
        if event is not None and event.get("request_id") in pending:
            info = pending.pop(event["request_id"])
            result = {"event": "finished", "request_id": event["request_id"], "state": event["state"],
                      "code": event.get("code"), "reason": event.get("reason"), "t": time.time()}
            if "fill_s" in info:
                result["fill_s"] = info["fill_s"]  # the oracle's time, apart from the daemons'
            if args.role == "decode" and event["state"] == "done":
                t0 = time.perf_counter()
                result["mismatched_bytes"] = check_rank(cache, geometry, event["request_id"], info["pages"],
                                                        info["n"])
                if info.get("groups"):  # cache groups: every group checked, reported apart too
                    per_group = check_groups(cache, geometry, event["request_id"], info["groups"], info["n"])
                    result["group_mismatched_bytes"] = per_group
                    result["mismatched_bytes"] += sum(per_group.values())
                result["check_s"] = time.perf_counter() - t0
                aux = event.get("aux")
                result["aux"] = aux.hex() if isinstance(aux, bytes) else None
            emit(result)
    return 0


def _worker_command(client: Any, rid: str, cache: Any, geometry: RankGeometry, cmd: dict[str, Any],
                    pending: dict[str, dict[str, Any]], ended: OrderedDict[str, tuple[dict[str, Any], bool]],
                    emit: Any) -> None:
    op = cmd["cmd"]
    try:
        if op == "expect":
            pending[cmd["request_id"]] = {"pages": cmd["pages"], "n": cmd["n"], "groups": cmd.get("groups")}
            call = client._expect_call(rid, {
                "request_id": cmd["request_id"], "source_instance": cmd["source_instance"],
                "source_address": cmd.get("source_address"), "pages": cmd["pages"], "num_tokens": cmd["n"],
                "source_dp_rank": cmd.get("source_dp_rank"), "groups": cmd.get("groups")})
            if cmd.get("then_abort"):  # the abort in the same message: the daemon has it before any handshake
                for reply in client.batch([call, ("abort", {"rank_id": rid, "request_id": cmd["request_id"],
                                                            "reason": cmd["then_abort"]})]):
                    client._check(reply)
            else:
                client.call(call[0], **call[1])
        elif op == "send":
            t0 = time.perf_counter()
            fill_rank(cache, geometry, cmd["request_id"], cmd["pages"], cmd["n"])
            fill_groups(cache, geometry, cmd["request_id"], cmd.get("groups") or {}, cmd["n"])
            pending[cmd["request_id"]] = {"pages": cmd["pages"], "n": cmd["n"], "fill_s": time.perf_counter() - t0}
            ps = geometry.spec.page_size
            chunks = cmd.get("chunks") or [[0, cmd["n"]]]
            if cmd.get("hold_last"):
                chunks = chunks[:-1]  # leave the request open on purpose (abort and fault tests)
            for i, (start, end) in enumerate(chunks):
                last = i == len(chunks) - 1 and not cmd.get("hold_last")
                client.send(rid, cmd["request_id"], pages=cmd["pages"][start // ps:-(-end // ps)], start=start,
                            end=end, last=last, aux=bytes.fromhex(cmd["aux"]) if last and cmd.get("aux") else None,
                            groups=chunk_groups(geometry, cmd.get("groups"), start, end, last),
                            qos_class=cmd.get("qos_class") if i == 0 else None,
                            budget_ms=cmd.get("budget_ms") if i == 0 else None,
                            deadline_at=cmd.get("deadline_at") if i == 0 else None)
        elif op == "expect_many":  # one batched call for many requests; refusals come back per request
            reqs = cmd["requests"]
            for r in reqs:
                pending[r["request_id"]] = {"pages": r["pages"], "n": r["n"]}
            outcomes = client.expect_many(rid, [{"request_id": r["request_id"], "pages": r["pages"],
                                                 "num_tokens": r["n"], "source_instance": cmd["source_instance"],
                                                 "source_address": cmd.get("source_address")} for r in reqs])
            _batch_refusals(reqs, outcomes, "expect", pending, emit)
        elif op == "send_many":  # every request whole, in one batched call
            reqs = cmd["requests"]
            ps = geometry.spec.page_size
            for r in reqs:
                fill_rank(cache, geometry, r["request_id"], r["pages"], r["n"])
                pending[r["request_id"]] = {"pages": r["pages"], "n": r["n"]}
            outcomes = client.send_many(rid, [{"request_id": r["request_id"], "pages": r["pages"][:-(-r["n"] // ps)],
                                               "start": 0, "end": r["n"], "last": True,
                                               "aux": bytes.fromhex(r["aux"]) if r.get("aux") else None}
                                              for r in reqs])
            _batch_refusals(reqs, outcomes, "send", pending, emit)
        elif op == "send_chunks":  # explicit [start, end, last] chunks, e.g. the rest of a held request
            t0 = time.perf_counter()
            fill_rank(cache, geometry, cmd["request_id"], cmd["pages"], cmd["n"])
            pending[cmd["request_id"]] = {"pages": cmd["pages"], "n": cmd["n"], "fill_s": time.perf_counter() - t0}
            ps = geometry.spec.page_size
            for start, end, last in cmd["chunks"]:
                client.send(rid, cmd["request_id"], pages=cmd["pages"][start // ps:-(-end // ps)], start=start,
                            end=end, last=bool(last), aux=bytes.fromhex(cmd["aux"]) if last and cmd.get("aux") else None)
        elif op == "abort":
            client.abort(rid, cmd["request_id"], cmd.get("reason"))
        elif op == "canary":
            emit({"event": "canary", **canary_report(cache, geometry, cmd.get("allowed") or [])})
        elif op == "untouched":
            if cmd.get("group"):  # a cache group's pages (or state slots); rows: [table, start, end]
                bad = untouched_group(cache, geometry, cmd["group"], cmd["pages"])
                if cmd.get("rows"):
                    table, lo, hi = cmd["rows"]
                    bad += untouched_rows(cache, geometry, cmd["group"], table, lo, hi)
            else:
                bad = untouched(cache, geometry, cmd["pages"])
            emit({"event": "untouched", "bad_bytes": bad})
        elif op == "status":
            emit({"event": "status", "status": client.status()})
    except Exception as exc:  # noqa: BLE001 - the orchestrator asserts on it
        request_id = cmd.get("request_id", "")
        ending = op == "send" and getattr(exc, "code", "") == "request_finished"
        if not ending or request_id in ended:
            pending.pop(request_id, None)
        # else the request is ending at the daemon: its finished event is still to come
        emit({"event": "error", "cmd": op, "request_id": cmd.get("request_id"), "error": str(exc),
              "code": getattr(exc, "code", ""), "field": getattr(exc, "field", None)})
        if ending and request_id in ended and not ended[request_id][1]:  # told before this send: report it now
            event = ended[request_id][0]
            ended[request_id] = (event, True)
            emit({"event": "finished", "request_id": request_id, "state": event["state"],
                  "code": event.get("code"), "reason": event.get("reason"), "t": time.time()})


def chunk_groups(geometry: RankGeometry, tables: dict[str, list[int]] | None, start: int, end: int,
                 last: bool) -> dict[str, list[int]] | None:
    """What a chunk ``[start, end)`` names of the cache groups: each KV group's pages of the chunk,
    each state group's slot with the last chunk."""
    if not tables:
        return None
    out = {}
    for name, table in tables.items():
        if geometry.spec.group(name).kind == "state":
            if last:
                out[name] = table
            continue
        ps = geometry.group(name).spec.page_size
        out[name] = table[start // ps:-(-end // ps)]
    return out


def _batch_refusals(reqs: list[dict[str, Any]], outcomes: list[Any], op: str, pending: dict[str, dict[str, Any]],
                    emit: Any) -> None:
    """A batched call's refused items, reported like a refused single call."""
    for r, outcome in zip(reqs, outcomes):
        if isinstance(outcome, Exception):
            pending.pop(r["request_id"], None)
            emit({"event": "error", "cmd": op, "request_id": r["request_id"], "error": str(outcome),
                  "code": getattr(outcome, "code", ""), "field": getattr(outcome, "field", None)})


# -- orchestration ------------------------------------------------------------------------

#: a daemon that accepts NIXL alone (a pair that fell back to tcp is refused), UCX on loopback tcp
#: (no RDMA device, no shared-memory shortcut between the daemons)
ONLY_NIXL = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp", "KVXFERD_PEER_TRANSPORT": "nixl",
             "KVXFERD_PEER_TRANSPORTS": "nixl"}


def in_parallel(*calls: Callable[[], Any]) -> list[Any]:
    """Run blocking start-ups (or shutdowns) side by side: each daemon or engine process imports torch.
    Every call runs to its end; then the first error, if any, is raised."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int, call: Callable[[], Any]) -> None:
        try:
            results[i] = call()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


#: peer liveness in the harness's configs: quick enough for tests that kill a daemon, slow
#: enough that a daemon starved of CPU on a busy machine is not declared dead
HEARTBEAT_S = 0.25
PEER_TIMEOUT_S = 5.0

_PORT_FLOOR = 20000
_PORT_BLOCK = 1000
_next_port: list[int] = []


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port nobody holds now and this process has not handed out before.

    Asking the kernel for port 0 and closing it races: the same number goes to the next outgoing
    connection or to a parallel test worker before the daemon binds it. So ports come from below
    the ephemeral range, walked in order, from a block of their own: the lower half of the blocks
    goes to pytest-xdist workers by number, the upper half to every other process (a tool, a
    test run without workers) by its pid, so two such runs side by side rarely share a block."""
    if not _next_port:
        blocks = max(1, (_ephemeral_floor() - _PORT_FLOOR) // _PORT_BLOCK)
        workers = max(1, blocks // 2)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        if worker.startswith("gw") and worker[2:].isdigit():
            index = int(worker[2:]) % workers
        else:
            index = workers + os.getpid() % max(1, blocks - workers) if blocks > 1 else 0
        _next_port.append(_PORT_FLOOR + index * _PORT_BLOCK + os.getpid() % (_PORT_BLOCK // 2))
    start = _PORT_FLOOR + (_next_port[0] - _PORT_FLOOR) // _PORT_BLOCK * _PORT_BLOCK
    for _ in range(_PORT_BLOCK):
        port = _next_port[0]
        _next_port[0] = start + (port + 1 - start) % _PORT_BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {start}..{start + _PORT_BLOCK - 1}")


START_ATTEMPTS = 5  # a first start whose ports another run took moves to fresh ones this often
_PORT_KEYS = re.compile(r'^(control_port = |data_port = |bind = "127\.0\.0\.1:)(\d+)', re.M)


@dataclass
class DaemonProc:
    name: str
    workdir: Path
    socket_path: str
    control_port: int
    data_port: int
    metrics_port: int
    config_path: Path
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    answered: bool = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.control_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self, env: dict[str, str] | None = None) -> None:
        """Start and wait until it answers. A first start that finds one of its ports taken (another
        run on the machine got there first) moves to fresh ports and tries again; a restart keeps its
        ports, because its peers know them."""
        for attempt in range(START_ATTEMPTS):
            try:
                return self._start_once(env)
            except RuntimeError as exc:
                if "code=bind_failed" not in str(exc) or self.answered or attempt == START_ATTEMPTS - 1:
                    raise
                self._move_ports()

    def _move_ports(self) -> None:
        fresh = {"control_port = ": free_port(), "data_port = ": free_port(), 'bind = "127.0.0.1:': free_port()}
        self.config_path.write_text(_PORT_KEYS.sub(lambda m: m.group(1) + str(fresh[m.group(1)]),
                                                   self.config_path.read_text()))
        self.control_port, self.data_port = fresh["control_port = "], fresh["data_port = "]
        self.metrics_port = fresh['bind = "127.0.0.1:']

    def _start_once(self, env: dict[str, str] | None) -> None:
        self.log_path = self.workdir / f"{self.name}.log"
        with open(self.log_path, "ab") as log:
            # its own session (a terminal's Ctrl-C is the tool's to handle), yet it dies with the tool
            self.proc = launch.popen([sys.executable, "-m", "kvxferd", "serve", "--config", str(self.config_path)],
                                     stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                     start_new_session=True)
        deadline = time.monotonic() + 60
        from ..sdk.client import EngineClient
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon {self.name} exited: {self.log()}")
            if os.path.exists(self.socket_path):
                c = EngineClient(self.socket_path, timeout=1)
                try:
                    c.call("ping")
                    self.answered = True
                    return
                except Exception:  # noqa: BLE001 - not up yet
                    pass
                finally:
                    c.close()
            time.sleep(0.05)
        raise RuntimeError(f"daemon {self.name} did not start: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 20) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class Worker:
    """A simulated engine rank process."""

    def __init__(self, daemon: DaemonProc, instance: str, role: str, geometry: RankGeometry,
                 wait: bool = True, rendezvous: str | None = None, dp: tuple[int, int] | None = None,
                 integrity: str | None = None) -> None:
        self.instance = instance
        self.role = role
        self.geometry = geometry
        self.proc = launch.popen(
            [sys.executable, "-m", "kvxferd.tools.sim", "worker", "--socket", daemon.socket_path, "--instance", instance,
             "--role", role, "--geometry", json.dumps(geometry.to_dict())]
            + (["--rendezvous", rendezvous] if rendezvous else [])
            + (["--dp", f"{dp[0]},{dp[1]}"] if dp else [])
            + (["--integrity", integrity] if integrity else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.events = read_events(self.proc)
        self.rank_id = ""
        self.shm_path = ""
        self.memfd = ""
        if wait:
            self.wait_registered()

    def wait_registered(self, timeout: float = 60) -> None:
        first = self.next_event(timeout)
        if first.get("event") != "registered":
            raise RuntimeError(f"worker {self.instance} tp{self.geometry.tp_rank} pp{self.geometry.pp_rank}: {first}")
        self.rank_id = first["rank_id"]
        self.shm_path = first.get("shm") or ""
        self.memfd = first.get("memfd") or ""

    def command(self, **cmd: Any) -> None:
        send_command(self.proc, cmd)

    def next_event(self, timeout: float) -> dict[str, Any]:
        return self.events.get(timeout=timeout)

    def close(self) -> None:
        jsonlines.close(self.proc, 10)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@dataclass
class Cluster:
    """Daemons in one temp dir, with configs for loopback."""

    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvxferd-")))
    daemons: dict[str, DaemonProc] = field(default_factory=dict)
    workers: list[Worker] = field(default_factory=list)

    def daemon(self, name: str, extra_toml: str = "", start: bool = True,
               env: dict[str, str] | None = None, heartbeat_s: float = HEARTBEAT_S,
               peer_timeout_s: float = PEER_TIMEOUT_S) -> DaemonProc:
        """A daemon of this cluster, started now unless ``start`` is False (``env``: for a start now;
        a later ``start`` takes its own)."""
        d = DaemonProc(name, self.root, str(self.root / f"{name}.sock"), free_port(), free_port(), free_port(),
                       self.root / f"{name}.toml")
        d.config_path.write_text(
            f'[daemon]\ninstance_name = "{name}"\nlog_level = "info"\n'
            f'[engine]\nsocket_path = "{d.socket_path}"\nsocket_mode = "0600"\n'
            f'[peer]\nbind_host = "127.0.0.1"\ncontrol_port = {d.control_port}\ndata_port = {d.data_port}\n'
            f'heartbeat_interval_s = {heartbeat_s}\npeer_timeout_s = {peer_timeout_s}\n'
            f'[metrics]\nbind = "127.0.0.1:{d.metrics_port}"\n' + extra_toml)
        self.daemons[name] = d
        if start:
            d.start(env)
        return d

    def instance(self, daemon: DaemonProc, name: str, role: str, spec: InstanceSpec, num_pages: int) -> list[Worker]:
        return self.instances((daemon, name, role, spec, num_pages))[0]

    def instances(self, *wanted: tuple[Any, ...], integrity: str | None = None) -> list[list[Worker]]:
        """The engine ranks of several (daemon, name, role, spec, num_pages) instances, registered
        (``integrity``: the mode each asks for). Every engine process starts before any is waited
        for, so their imports overlap."""
        groups = []
        for daemon, name, role, spec, num_pages in wanted:
            group = [Worker(daemon, name, role, RankGeometry(spec, tp, pp, num_pages), wait=False, integrity=integrity)
                     for pp in range(spec.pp_size) for tp in range(spec.tp_size)]
            self.workers.extend(group)
            groups.append(group)
        for group in groups:
            for w in group:
                w.wait_registered()
        return groups

    def spread_instance(self, placement: list[DaemonProc], name: str, role: str, spec: InstanceSpec,
                        num_pages: int) -> list[Worker]:
        """An instance whose rank ``i`` (tp-major, then pp) registers at ``placement[i]``, every rank
        naming the first daemon as the instance's rendezvous."""
        coords = [(tp, pp) for pp in range(spec.pp_size) for tp in range(spec.tp_size)]
        assert len(placement) == len(coords), "one daemon per rank"
        rendezvous = placement[0].address
        group = [Worker(d, name, role, RankGeometry(spec, tp, pp, num_pages), wait=False, rendezvous=rendezvous)
                 for d, (tp, pp) in zip(placement, coords)]
        self.workers.extend(group)
        for w in group:
            w.wait_registered()
        return group

    def dp_instance(self, placement: list[DaemonProc], name: str, role: str, spec: InstanceSpec,
                    num_pages: int) -> list[list[Worker]]:
        """A data-parallel instance of ``len(placement)`` DP ranks, each a TP x PP group of ``spec``
        wholly at its daemon, every rank naming the first daemon as the rendezvous; the workers
        per DP rank."""
        rendezvous, dp_size = placement[0].address, len(placement)
        coords = [(tp, pp) for pp in range(spec.pp_size) for tp in range(spec.tp_size)]
        groups = [[Worker(d, name, role, RankGeometry(spec, tp, pp, num_pages), wait=False, rendezvous=rendezvous,
                          dp=(k, dp_size)) for tp, pp in coords] for k, d in enumerate(placement)]
        for group in groups:
            self.workers.extend(group)
        for group in groups:
            for w in group:
                w.wait_registered()
        return groups

    def close(self, keep_root: bool = False) -> None:
        """Stop engines and daemons; remove the run dir unless ``keep_root`` (its logs, to debug)."""
        for w in self.workers:
            w.close()
            if w.shm_path:  # a killed worker could not unlink its cache file
                Path(w.shm_path).unlink(missing_ok=True)
        for d in self.daemons.values():
            d.stop()
        if not keep_root:
            shutil.rmtree(self.root, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        sys.exit(worker_main(sys.argv[2:]))
    print("usage: python -m kvxferd.tools.sim worker ...", file=sys.stderr)
    sys.exit(1)

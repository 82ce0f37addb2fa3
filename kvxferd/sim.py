"""Simulated engine ranks and a loopback cluster, for the demo, the tests and the benchmark.

The oracle: every request has a *logical* KV cache ``[layers, kinds, tokens, heads,
head_bytes]`` derived from its id alone. A prefill rank writes its own slice of it (its
heads, its layers) into its pages; a decode rank checks that its pages hold exactly its
own slice of the same logical cache. Neither side uses the planner to decide what it
should hold, so a planner or transport bug shows up as a byte mismatch. The logical
bytes are a hash pattern keyed by (request, global layer, kind, token, global head) and
word offset, computed with vectorised ops: every 8-byte word of a request differs, so a
misplaced or misordered word never matches, and filling and checking stay cheap next to
the transfer they verify.

A worker is a real process: ``python -m kvxferd.sim worker ...`` reads JSON commands on
stdin and prints JSON results on stdout.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .geometry import InstanceSpec, RankGeometry

CANARY = 0xA5


def head_bytes(spec: InstanceSpec) -> int:
    """Bytes of one head in one token row (NHD_kv: its K and its V)."""
    return spec.head_slot_bits // 8


# splitmix64's finalizer constants and step (numpy uint64 arithmetic wraps, and shifts fast)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_STEP = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64, for torch
PACKED_KIND = 7  # the kind number of packed_page units in the oracle's keys (NHD kinds are 0..2)


def _mix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _request_seed(request_id: str) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little"))


def _pattern(request_id: str, key: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``[*key.shape, nbytes]`` bytes: a unit's bytes from its unique key, vectorised.

    Each unit (one key) gets a 64-bit hash of (request, key); its i-th 8-byte word is that
    hash plus ``i`` times an odd constant. Two words in different places therefore hold
    different values (but for a 2^-64 chance), so a misplaced, misordered or foreign word
    shows as a mismatch, and the cost is one add per word instead of a random generator.
    """
    unit = _mix64(_mix64(key.numpy().astype(np.uint64)) ^ _request_seed(request_id)).view(np.int64)
    words = -(-nbytes // 8)
    full = torch.from_numpy(unit).unsqueeze(-1) + torch.arange(words, dtype=torch.int64) * _STEP
    return full.view(torch.uint8)[..., :nbytes]


def logical_cache(request_id: str, n_tokens: int, spec: InstanceSpec, layers: tuple[int, int],
                  heads: tuple[int, int] | None = None) -> torch.Tensor:
    """``[layers, kinds, tokens, heads, head_bytes]`` bytes of a request, for a layer range
    (and a head range: by default all ``spec.kv_heads``).

    Every (global layer, kind, token, global head) is its own unit of the pattern, keyed by
    those coordinates alone, so any rank rebuilds exactly the layers and heads it holds, and
    bytes in the wrong layer, kind, token or head never match.
    """
    kinds = len(spec.region_kinds)
    layer = torch.arange(*layers, dtype=torch.int64).view(-1, 1, 1, 1)
    kind = torch.arange(kinds, dtype=torch.int64).view(1, -1, 1, 1)
    token = torch.arange(n_tokens, dtype=torch.int64).view(1, 1, -1, 1)
    head = torch.arange(*(heads or (0, spec.kv_heads)), dtype=torch.int64).view(1, 1, 1, -1)
    key = (((layer * 8 + kind) << 28) + token << 16) + head
    return _pattern(request_id, key, head_bytes(spec))


def logical_pages(request_id: str, n_tokens: int, spec: InstanceSpec, layers: tuple[int, int],
                  heads: tuple[int, int] | None = None) -> torch.Tensor:
    """packed_page: ``[layers, pages, heads, unit_bytes]`` bytes of a request, one opaque unit
    (K transposed then V of ``page_size`` tokens) per (page of the request, head).

    A request of ``n_tokens`` fills ``ceil(n_tokens / page_size)`` pages; the layout moves
    them whole, so the oracle owns every byte of them, the tail of the last one included.
    """
    n_pages = -(-n_tokens // spec.page_size)
    layer = torch.arange(*layers, dtype=torch.int64).view(-1, 1, 1)
    page = torch.arange(n_pages, dtype=torch.int64).view(1, -1, 1)
    head = torch.arange(*(heads or (0, spec.kv_heads)), dtype=torch.int64).view(1, 1, -1)
    key = (((layer * 8 + PACKED_KIND) << 28) + page << 16) + head
    return _pattern(request_id, key, spec.head_slot_bits // 8)


def _packed_table(cache: Any, geometry: RankGeometry, layer: int) -> torch.Tensor:
    """``[num_pages, local_heads, unit_bytes]`` bytes of one packed region."""
    spec = geometry.spec
    return cache.tensors[(layer, "kv")].view(torch.uint8).reshape(geometry.num_pages, spec.local_heads, -1)


def _request_pages(pages: list[int], spec: InstanceSpec, n_tokens: int) -> torch.Tensor:
    return torch.as_tensor(list(pages)[:-(-n_tokens // spec.page_size)], dtype=torch.int64)


def _token_rows(pages: list[int], page_size: int, start: int, end: int) -> torch.Tensor:
    t = np.arange(start, end)
    return torch.from_numpy(np.asarray(pages, dtype=np.int64)[t // page_size] * page_size + t % page_size)


def fill_rank(cache: Any, geometry: RankGeometry, request_id: str, pages: list[int], n_tokens: int) -> None:
    spec = geometry.spec
    h0, h1 = geometry.heads
    if spec.packed:
        logical = logical_pages(request_id, n_tokens, spec, geometry.layers, (h0, h1))
        idx = _request_pages(pages, spec, n_tokens)
        for i, layer in enumerate(range(*geometry.layers)):
            _packed_table(cache, geometry, layer).index_copy_(0, idx, logical[i].contiguous())
        return
    logical = logical_cache(request_id, n_tokens, spec, geometry.layers, (h0, h1))
    rows = _token_rows(pages, spec.page_size, 0, n_tokens)
    for i, layer in enumerate(range(*geometry.layers)):
        for k, kind in enumerate(spec.region_kinds):
            table = cache.tensors[(layer, kind)].view(torch.uint8).reshape(-1, spec.row_bytes)
            _wide(table).index_copy_(0, rows, _wide(logical[i, k].reshape(n_tokens, -1)))


def check_rank(cache: Any, geometry: RankGeometry, request_id: str, pages: list[int], n_tokens: int) -> int:
    """Number of mismatching bytes between this rank's pages and its logical slice."""
    spec = geometry.spec
    h0, h1 = geometry.heads
    if spec.packed:
        logical = logical_pages(request_id, n_tokens, spec, geometry.layers, (h0, h1))
        idx = _request_pages(pages, spec, n_tokens)
        return sum(_mismatched(_packed_table(cache, geometry, layer).index_select(0, idx), logical[i])
                   for i, layer in enumerate(range(*geometry.layers)))
    logical = logical_cache(request_id, n_tokens, spec, geometry.layers, (h0, h1))
    rows = _token_rows(pages, spec.page_size, 0, n_tokens)
    bad = 0
    for i, layer in enumerate(range(*geometry.layers)):
        for k, kind in enumerate(spec.region_kinds):
            table = cache.tensors[(layer, kind)].view(torch.uint8).reshape(-1, spec.row_bytes)
            got = _wide(table).index_select(0, rows)
            bad += _mismatched(got, _wide(logical[i, k].reshape(n_tokens, -1)))
    return bad


def _wide(rows: torch.Tensor) -> torch.Tensor:
    """Byte rows as 8-byte words where they allow it: a copy or comparison per word, not per byte."""
    if rows.shape[-1] % 8 == 0 and rows.is_contiguous() and rows.data_ptr() % 8 == 0:
        return rows.view(torch.int64)
    return rows


def _mismatched(got: torch.Tensor, want: torch.Tensor) -> int:
    """Differing bytes; the common all-equal case costs one comparison, not a count."""
    if torch.equal(got, want):
        return 0
    return int((got.contiguous().view(torch.uint8) != want.contiguous().view(torch.uint8)).sum())


def untouched(cache: Any, geometry: RankGeometry, pages: list[int]) -> int:
    """Bytes that differ from the canary in the given (never allocated) pages."""
    bad = 0
    idx = torch.as_tensor(pages, dtype=torch.int64)
    for tensor in cache.tensors.values():
        flat = tensor.view(torch.uint8).reshape(geometry.num_pages, -1)
        bad += int((flat.index_select(0, idx) != CANARY).sum())
    return bad


def canary_report(cache: Any, geometry: RankGeometry, allowed: list[list[Any]]) -> dict[str, Any]:
    """Every byte of the rank's shared-memory file that is not the canary, outside ``allowed``.

    ``allowed`` lists ``[pages, n_tokens]`` of legitimate destinations (or of pages the engine
    filled itself): only the token rows ``[0, n)`` laid out on those pages may differ from the
    canary. Everything else (other pages, the unused tail of a last page, the padding between
    regions) must still hold it. Returns the count of such bytes, where the first ones are, and
    every page that changed at all.
    """
    spec = geometry.spec
    whole = np.frombuffer(cache._mmap, dtype=np.uint8)  # the whole file, padding included
    may = np.zeros(whole.size, dtype=bool)
    row = np.arange(spec.row_bytes, dtype=np.int64)
    descriptors = cache.descriptors()
    for pages, n in allowed:
        if spec.packed:  # slots are whole pages of page_bytes
            rows = _request_pages(list(pages), spec, int(n)).numpy()
        else:
            rows = _token_rows(list(pages), spec.page_size, 0, int(n)).numpy()
        for d in descriptors:
            may[(d["offset"] + rows[:, None] * spec.row_bytes + row).ravel()] = True
    changed = whole != CANARY
    outside = np.flatnonzero(changed & ~may)
    page_bytes = spec.page_bytes

    def where(offset: int) -> str:
        for d in descriptors:
            if d["offset"] <= offset < d["offset"] + d["nbytes"]:
                return f"layer{d['layer']}/{d['kind']}/page{(offset - d['offset']) // page_bytes}"
        return "padding"

    changed_pages: set[int] = set()
    for d in descriptors:
        region = changed[d["offset"]:d["offset"] + d["nbytes"]].reshape(geometry.num_pages, -1)
        changed_pages.update(int(p) for p in np.flatnonzero(region.any(axis=1)))
    return {"outside_bytes": int(outside.size), "outside_at": [where(int(o)) for o in outside[:8]],
            "changed_pages": sorted(changed_pages), "changed_bytes": int(changed.sum())}


# -- the worker process -------------------------------------------------------------------

def worker_main(argv: list[str]) -> int:
    import argparse

    from .client import EngineClient
    from .memory import allocate_cpu

    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--instance", required=True)
    ap.add_argument("--role", required=True)
    ap.add_argument("--geometry", required=True, help="rank geometry JSON")
    args = ap.parse_args(argv)
    geometry = RankGeometry.from_dict(json.loads(args.geometry))
    cache = allocate_cpu(geometry, name=f"{args.instance}-{geometry.tp_rank}-{geometry.pp_rank}", fill=CANARY)
    client = EngineClient(args.socket, timeout=30)
    out_lock = threading.Lock()

    def emit(obj: dict[str, Any]) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    from .signals import cleanup_on_signals
    with cleanup_on_signals():  # SIGTERM: unlink the cache file on the way out
        try:
            return _worker_serve(args, client, cache, geometry, emit)
        finally:
            client.close()
            cache.close()


def _worker_serve(args: Any, client: Any, cache: Any, geometry: RankGeometry, emit: Any) -> int:
    try:
        rid = client.register(args.instance, args.role, geometry, cache.descriptors())
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
                        rid = client.register(args.instance, args.role, geometry, cache.descriptors())
                        emit({"event": "registered", "rank_id": rid, "shm": cache.path, "memfd": cache.name})
                    except Exception as exc:  # noqa: BLE001 - reported to the orchestrator
                        emit({"event": "register_failed", "error": str(exc), "code": getattr(exc, "code", "")})
                    continue
                _worker_command(client, rid, cache, geometry, cmd, pending, emit)
        except queue.Empty:
            pass
        if not running and not pending:
            break
        event = client.wait_any(0.02)
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
                result["check_s"] = time.perf_counter() - t0
                aux = event.get("aux")
                result["aux"] = aux.hex() if isinstance(aux, bytes) else None
            emit(result)
    return 0


def _worker_command(client: Any, rid: str, cache: Any, geometry: RankGeometry, cmd: dict[str, Any],
                    pending: dict[str, dict[str, Any]], emit: Any) -> None:
    op = cmd["cmd"]
    try:
        if op == "expect":
            pending[cmd["request_id"]] = {"pages": cmd["pages"], "n": cmd["n"]}
            client.expect(rid, cmd["request_id"], source_instance=cmd["source_instance"],
                          source_address=cmd.get("source_address"), pages=cmd["pages"], num_tokens=cmd["n"])
        elif op == "send":
            t0 = time.perf_counter()
            fill_rank(cache, geometry, cmd["request_id"], cmd["pages"], cmd["n"])
            pending[cmd["request_id"]] = {"pages": cmd["pages"], "n": cmd["n"], "fill_s": time.perf_counter() - t0}
            ps = geometry.spec.page_size
            chunks = cmd.get("chunks") or [[0, cmd["n"]]]
            if cmd.get("hold_last"):
                chunks = chunks[:-1]  # leave the request open on purpose (abort and fault tests)
            for i, (start, end) in enumerate(chunks):
                last = i == len(chunks) - 1 and not cmd.get("hold_last")
                client.send(rid, cmd["request_id"], pages=cmd["pages"][start // ps:-(-end // ps)], start=start,
                            end=end, last=last, aux=bytes.fromhex(cmd["aux"]) if last and cmd.get("aux") else None)
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
            emit({"event": "untouched", "bad_bytes": untouched(cache, geometry, cmd["pages"])})
        elif op == "status":
            emit({"event": "status", "status": client.status()})
    except Exception as exc:  # noqa: BLE001 - the orchestrator asserts on it
        pending.pop(cmd.get("request_id", ""), None)
        emit({"event": "error", "cmd": op, "request_id": cmd.get("request_id"), "error": str(exc),
              "code": getattr(exc, "code", ""), "field": getattr(exc, "field", None)})


# -- orchestration ------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.control_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self, env: dict[str, str] | None = None) -> None:
        self.log_path = self.workdir / f"{self.name}.log"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvxferd", "serve", "--config", str(self.config_path)],
                                     stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                     start_new_session=True)
        deadline = time.monotonic() + 60
        from .client import EngineClient
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon {self.name} exited: {self.log()}")
            if os.path.exists(self.socket_path):
                c = EngineClient(self.socket_path, timeout=1)
                try:
                    c.call("ping")
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
                 wait: bool = True) -> None:
        self.instance = instance
        self.role = role
        self.geometry = geometry
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvxferd.sim", "worker", "--socket", daemon.socket_path, "--instance", instance,
             "--role", role, "--geometry", json.dumps(geometry.to_dict())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
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

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except json.JSONDecodeError:
                pass
        self.events.put({"event": "exit"})

    def command(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def next_event(self, timeout: float) -> dict[str, Any]:
        return self.events.get(timeout=timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

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
               env: dict[str, str] | None = None) -> DaemonProc:
        d = DaemonProc(name, self.root, str(self.root / f"{name}.sock"), free_port(), free_port(), free_port(),
                       self.root / f"{name}.toml")
        d.config_path.write_text(
            f'[daemon]\ninstance_name = "{name}"\nlog_level = "info"\n'
            f'[engine]\nsocket_path = "{d.socket_path}"\nsocket_mode = "0600"\n'
            f'[peer]\nbind_host = "127.0.0.1"\ncontrol_port = {d.control_port}\ndata_port = {d.data_port}\n'
            f'heartbeat_interval_s = 0.25\npeer_timeout_s = 1.5\n'
            f'[metrics]\nbind = "127.0.0.1:{d.metrics_port}"\n' + extra_toml)
        self.daemons[name] = d
        if start:
            d.start(env)
        return d

    def instance(self, daemon: DaemonProc, name: str, role: str, spec: InstanceSpec, num_pages: int) -> list[Worker]:
        return self.instances((daemon, name, role, spec, num_pages))[0]

    def instances(self, *wanted: tuple[DaemonProc, str, str, InstanceSpec, int]) -> list[list[Worker]]:
        """The engine ranks of several (daemon, name, role, spec, num_pages) instances, registered.
        Every engine process starts before any is waited for, so their imports overlap."""
        groups = []
        for daemon, name, role, spec, num_pages in wanted:
            group = [Worker(daemon, name, role, RankGeometry(spec, tp, pp, num_pages), wait=False)
                     for pp in range(spec.pp_size) for tp in range(spec.tp_size)]
            self.workers.extend(group)
            groups.append(group)
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
    print("usage: python -m kvxferd.sim worker ...", file=sys.stderr)
    sys.exit(1)

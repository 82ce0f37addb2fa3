"""Running kvxferd as a service: systemd notify, the unit file, `kvxferd status`, graceful
drain on SIGTERM, structured logs.

Daemons and engines are real processes on 127.0.0.1; the notify socket is a real
AF_UNIX datagram socket, as systemd would provide.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import kvxferd
from kvxferd.model.geometry import RankGeometry
from kvxferd.ops import sdnotify
from kvxferd.sdk.client import DaemonError, EngineClient
from kvxferd.sdk.kv_cache import allocate_cpu
from kvxferd.tools.sim import Cluster, DaemonProc

from ops_support import (NUM_PAGES, base_url, http_get, in_parallel, next_for, pages, spec,
                         status_now, status_of, transfer, wait_for)

ROOT = Path(__file__).resolve().parent.parent
SLACK_S = 20.0  # generous bound for "exits soon after the grace period" on a loaded machine


def start_pair(cluster: Cluster, prefill_toml: str = "", decode_toml: str = "",
               decode_env: dict[str, str] | None = None, decode_runtime_dir: Path | None = None):
    """Prefill and decode daemons with one TP-1 engine rank each.

    With ``decode_runtime_dir`` the decode daemon's config names no socket path: it binds
    engine.sock in ``$RUNTIME_DIRECTORY``, as under systemd's RuntimeDirectory=.
    """
    pd = cluster.daemon("prefill-node", extra_toml=prefill_toml, start=False)
    dd = cluster.daemon("decode-node", extra_toml=decode_toml, start=False)
    env = dict(decode_env or {})
    if decode_runtime_dir is not None:
        text = dd.config_path.read_text()
        dd.config_path.write_text(text.replace(f'socket_path = "{dd.socket_path}"\n', ""))
        assert "socket_path" not in dd.config_path.read_text()
        dd.socket_path = str(decode_runtime_dir / "engine.sock")
        env["RUNTIME_DIRECTORY"] = str(decode_runtime_dir)
    in_parallel(lambda: pd.start(), lambda: dd.start(env))
    pw, dw = in_parallel(lambda: cluster.instance(pd, "prefill-a", "prefill", spec(), NUM_PAGES)[0],
                         lambda: cluster.instance(dd, "decode-a", "decode", spec(), NUM_PAGES)[0])
    return pd, dd, pw, dw


def kvxferd_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("KVXFERD_") and k not in ("RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR")}
    return subprocess.run([sys.executable, "-m", "kvxferd", *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, timeout=60)


def requests_of(d: DaemonProc) -> dict[str, int]:
    return status_now(d)["requests"]


def draining(d: DaemonProc) -> bool:
    return http_get(base_url(d) + "/readyz")[0] == 503


# -- systemd notify ----------------------------------------------------------------------

class NotifyListener:
    """A real NOTIFY_SOCKET; on READY=1 it checks at once that the engine socket and /healthz answer."""

    def __init__(self, path: Path, engine_socket: str, health_url: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.engine_socket = engine_socket
        self.health_url = health_url
        self.messages: list[tuple[float, dict[str, str]]] = []
        self.ready_probe: tuple[bool, int] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            if fields.get("READY") == "1" and self.ready_probe is None:
                listening = False
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                    try:
                        probe.connect(self.engine_socket)
                        listening = True
                    except OSError:
                        pass
                self.ready_probe = (listening, http_get(self.health_url)[0])
            self.messages.append((time.monotonic(), fields))

    def count(self, key: str) -> int:
        return sum(1 for _, m in self.messages if key in m)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def test_notify_ready_watchdog_stopping(cluster):
    d = cluster.daemon("svc", start=False)
    listener = NotifyListener(cluster.root / "notify.sock", d.socket_path, base_url(d) + "/healthz")
    try:
        # WatchdogSec=0.8s: a ping is due every 0.4 s / 2 = 0.2 s, faster than the 0.25 s heartbeat
        d.start(env={"NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "400000", "WATCHDOG_PID": ""})
        wait_for(lambda: listener.count("WATCHDOG") >= 3, timeout=30, what="three WATCHDOG=1")
        first = listener.messages[0][1]
        assert first.get("READY") == "1" and first.get("STATUS", "").startswith("serving"), first
        # READY=1 came only once the engine socket accepted connections and /healthz answered
        assert listener.ready_probe == (True, 200)
        assert listener.count("STOPPING") == 0
        d.signal(signal.SIGTERM)
        assert d.proc is not None and d.proc.wait(30) == 0
        wait_for(lambda: listener.count("STOPPING") == 1, timeout=10, what="STOPPING=1")
        stopping = next(m for _, m in listener.messages if "STOPPING" in m)
        assert stopping["STOPPING"] == "1" and stopping["STATUS"].startswith("draining 0 requests")
        kinds = [next(iter(m)) for _, m in listener.messages]
        assert kinds.count("READY") == 1
        assert kinds.index("STOPPING") > kinds.index("READY")
        assert set(kinds) <= {"READY", "WATCHDOG", "STOPPING"}, kinds
    finally:
        listener.close()


def test_sdnotify_abstract_socket_and_watchdog_env(monkeypatch):
    name = f"kvxferd-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.notify("READY=1") is True
        assert sock.recv(100) == b"READY=1"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert sdnotify.notify("READY=1") is False  # not under systemd: a no-op
    monkeypatch.setenv("WATCHDOG_USEC", "400000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert sdnotify.watchdog_interval() == pytest.approx(0.2)
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval() == pytest.approx(0.2)
    monkeypatch.setenv("WATCHDOG_PID", "1")  # meant for another process
    assert sdnotify.watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    assert sdnotify.watchdog_interval() is None


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze not on PATH (Debian: apt-get install systemd; .ci/run does)")
def test_systemd_unit_verifies(tmp_path):
    unit = (ROOT / "deploy/kvxferd.service").read_text()
    assert "ExecStart=/usr/local/bin/kvxferd serve" in unit
    assert "Type=notify" in unit and "WatchdogSec=" in unit and "RuntimeDirectory=kvxferd" in unit
    assert "KVXFERD_DAEMON_LOG_FORMAT=" in unit and "KVXFERD_LOG_FORMAT" not in unit
    # the installed binary does not exist here: point ExecStart at this environment's kvxferd script
    script = Path(sys.executable).parent / "kvxferd"
    if not os.access(script, os.X_OK):
        script = Path(shutil.which("kvxferd") or "/bin/true")
    copy = tmp_path / "kvxferd.service"
    copy.write_text(unit.replace("ExecStart=/usr/local/bin/kvxferd", f"ExecStart={script}"))
    out = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=120)
    diagnostics = (out.stdout + out.stderr).strip()
    assert out.returncode == 0 and not diagnostics, diagnostics


def test_container_and_unit_use_real_settings():
    """Every KVXFERD_* variable the deploy files set is a real setting."""
    from kvxferd.ops.config import unknown_env
    for path in ("Dockerfile", "deploy/kvxferd.service", "deploy/kubernetes/daemonset.yaml"):
        names = set(re.findall(r"\b(KVXFERD_[A-Z0-9_]+)", (ROOT / path).read_text()))
        names.discard("KVXFERD_")
        assert names, path
        assert unknown_env({n: "" for n in names}) == [], path


# -- kvxferd status ----------------------------------------------------------------------

def test_status_finds_the_daemon_and_reports_everything(cluster):
    runtime = cluster.root / "run-decode"
    pd, dd, pw, dw = start_pair(cluster, decode_runtime_dir=runtime)
    env = {"RUNTIME_DIRECTORY": str(runtime)}
    dec, pre = transfer(pw, dw, "st-ok", 20, pages(0, 20), pages(32, 20), pd.address)
    assert dec["state"] == pre["state"] == "done"
    # a failure with an awkward reason, and a request left waiting for its prefill
    dw.command(cmd="expect", request_id="st-abort", pages=pages(40, 5), n=5, source_instance="prefill-a",
               source_address=pd.address)
    dw.command(cmd="abort", request_id="st-abort", reason='operator said "stop" now')
    ev = next_for(dw, "st-abort")
    assert ev["state"] == "failed" and ev["code"] == "aborted"
    dw.command(cmd="expect", request_id="st-wait", pages=pages(48, 30), n=30, source_instance="prefill-a",
               source_address=pd.address)
    wait_for(lambda: requests_of(dd) == {"decode:waiting_for_input": 1}, what="st-wait bootstrapped")
    wait_for(lambda: requests_of(pd) == {"prefill:waiting_for_input": 1}, what="expect reached prefill")

    # no flags: found in $RUNTIME_DIRECTORY like `serve` chose it
    out = kvxferd_cli("status", "--json", env=env)
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert st["version"] == kvxferd.__version__ and st["name"] == "decode-node"
    assert st["uptime_s"] > 0 and st["ready"] is True and st["draining"] is False
    assert st["engine_endpoint"] == f"ipc://{runtime}/engine.sock"
    assert st["peer_endpoint"] == f"tcp://{dd.address}"
    assert st["metrics_url"] == dd.metrics_url
    assert http_get(st["metrics_url"])[0] == 200
    [rank] = st["ranks"]
    assert rank["rank_id"] == "decode-a/tp0/pp0" and rank["role"] == "decode"
    g = rank["geometry"]
    assert (g["attention"], g["num_layers"], g["total_kv_heads"], g["head_dim"], g["dtype"], g["page_size"],
            g["tp_size"], g["tp_rank"], g["pp_size"], g["num_pages"]) == \
        ("mha", 4, 2, 32, "bfloat16", 16, 1, 0, 1, NUM_PAGES)
    [peer] = st["peers"]
    assert peer["address"] == pd.address and peer["state"] == "up" and peer["side"] == "prefill"
    assert peer["plans"] == ["prefill-a->decode-a"]
    assert st["requests"] == {"decode:waiting_for_input": 1}
    [failure] = st["recent_failures"]
    assert failure["request_id"] == "st-abort" and failure["code"] == "aborted" and failure["side"] == "decode"
    assert 'operator said "stop" now' in failure["reason"]
    # the copy path this installation runs (the daemon is started from it), in status, metrics and the log
    from kvxferd.datapath import runcopy
    assert st["copy_path"] == runcopy.copy_path()
    assert f'kvxferd_copy_path{{path="{st["copy_path"]["path"]}"}} 1.0' in http_get(st["metrics_url"])[2]
    assert f"event=copy_path path={st['copy_path']['path']}" in dd.log()

    # the prefill daemon's view, by explicit socket
    ps = status_of(pd)
    assert [p["side"] for p in ps["peers"]] == ["decode"] and ps["peers"][0]["state"] == "up"
    assert ps["requests"] == {"prefill:waiting_for_input": 1}
    assert [r["role"] for r in ps["ranks"]] == ["prefill"]

    # for people
    out = kvxferd_cli("status", env=env)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for needle in (f"kvxferd {kvxferd.__version__}  decode-node", "ready", f"ipc://{runtime}/engine.sock",
                   dd.metrics_url,
                   "ranks (1)", "decode-a/tp0/pp0", "head_dim=32", "peers (1)", pd.address, "up",
                   "requests in flight (1)", "decode:waiting_for_input", "recent failures (1",
                   "st-abort", "aborted"):
        assert needle in text, (needle, text)

    # nobody there
    out = kvxferd_cli("status", "--socket", str(cluster.root / "nobody.sock"))
    assert out.returncode == 1 and "no daemon socket" in out.stderr

    dw.command(cmd="abort", request_id="st-wait")
    assert next_for(dw, "st-wait")["code"] == "aborted"


# -- graceful drain ----------------------------------------------------------------------

def test_sigterm_drains_the_decode_daemon(cluster):
    grace = 2.0
    pd, dd, pw, dw = start_pair(cluster, decode_toml=f"[timeouts]\ndrain_grace_s = {grace}\n")
    dec, pre = transfer(pw, dw, "dr-warm", 8, pages(0, 8), pages(32, 8), pd.address)  # handshake done
    assert dec["state"] == pre["state"] == "done"
    # r1 will be sent during the drain; r2 never is
    for rid, first in (("dr-1", 34), ("dr-2", 44)):
        dw.command(cmd="expect", request_id=rid, pages=pages(first, 40), n=40, source_instance="prefill-a",
                   source_address=pd.address)
    wait_for(lambda: requests_of(dd) == {"decode:waiting_for_input": 2}, what="both expects bootstrapped")
    wait_for(lambda: requests_of(pd) == {"prefill:waiting_for_input": 2}, what="both expects at the prefill")

    dd.signal(signal.SIGTERM)
    wait_for(lambda: draining(dd), timeout=10, what="/readyz 503 while draining")
    # the request in flight gets its data now, within the grace period ...
    pw.command(cmd="send", request_id="dr-1", pages=pages(0, 40), n=40)
    # ... while new work is refused
    dw.command(cmd="expect", request_id="dr-3", pages=pages(54, 4), n=4, source_instance="prefill-a",
               source_address=pd.address)
    refused = next_for(dw, "dr-3")
    assert refused["event"] == "error" and refused["code"] == "draining", refused
    assert "draining" in refused["error"]
    # dr-1 completes, byte-exact
    done = next_for(dw, "dr-1")
    assert done["state"] == "done" and done["mismatched_bytes"] == 0, done
    assert next_for(pw, "dr-1")["state"] == "done"
    # the one whose prefill never sends fails with a reason when the grace period ends
    failed = next_for(dw, "dr-2", timeout=grace + SLACK_S)
    assert failed["state"] == "failed" and failed["code"] == "shutdown" and failed["reason"], failed
    assert dd.proc is not None and dd.proc.wait(SLACK_S) == 0
    assert "event=stopped drained=False failed_on_exit=1" in dd.log()
    # the prefill daemon was told, and holds nothing for it
    wait_for(lambda: requests_of(pd) == {}, timeout=10, what="prefill side released dr-2")
    assert any(f["request_id"] == "dr-2" and f["code"] == "shutdown" for f in status_of(pd)["recent_failures"])


def test_sigterm_drains_the_prefill_daemon(cluster):
    """What the prefill engine handed over before SIGTERM still reaches its decode destination."""
    pd, dd, pw, dw = start_pair(cluster, prefill_toml="[timeouts]\ndrain_grace_s = 30.0\n")
    dec, pre = transfer(pw, dw, "pr-warm", 8, pages(0, 8), pages(32, 8), pd.address)
    assert dec["state"] == pre["state"] == "done"
    # pr-1 fully sent; pr-3 only its first chunk (the last one comes during the drain)
    pw.command(cmd="send", request_id="pr-1", pages=pages(0, 50), n=50, chunks=[[0, 32], [32, 50]])
    pw.command(cmd="send", request_id="pr-3", pages=pages(16, 40), n=40, chunks=[[0, 16], [16, 40]],
               hold_last=True)
    # no destination yet: the prefill side holds the chunks in state bootstrapping
    wait_for(lambda: requests_of(pd) == {"prefill:bootstrapping": 2}, what="pr-1, pr-3 held by the prefill daemon")

    pd.signal(signal.SIGTERM)
    wait_for(lambda: draining(pd), timeout=10, what="/readyz 503 while draining")
    pw.command(cmd="send", request_id="pr-2", pages=pages(8, 4), n=4)
    refused = next_for(pw, "pr-2")
    assert refused["event"] == "error" and refused["code"] == "draining", refused
    # a later chunk of a request already in flight is not new work
    pw.command(cmd="send", request_id="pr-3", pages=pages(16, 40), n=40, chunks=[[16, 40]])
    # the decode side asks for them only now; the draining daemon still serves them
    for rid, n, first in (("pr-1", 50, 40), ("pr-3", 40, 50)):
        dw.command(cmd="expect", request_id=rid, pages=pages(first, n), n=n, source_instance="prefill-a",
                   source_address=pd.address)
    for rid in ("pr-1", "pr-3"):
        done = next_for(dw, rid)
        assert done["state"] == "done" and done["mismatched_bytes"] == 0, done
        assert next_for(pw, rid)["state"] == "done"
    # nothing left: the daemon stops without waiting out its 30 s grace, and says it drained
    assert pd.proc is not None and pd.proc.wait(60) == 0
    assert "event=stopped drained=True failed_on_exit=0" in pd.log()


# -- structured logs ---------------------------------------------------------------------

def test_json_logs_one_object_per_line(cluster):
    d = cluster.daemon("jsonlog", start=False)
    d.start(env={"KVXFERD_DAEMON_LOG_FORMAT": "json", "KVXFERD_LOG_FORMAT": "typo-is-reported"})
    geometry = RankGeometry(spec(), 0, 0, 8)
    cache = allocate_cpu(geometry, name="ops-jsonlog")
    client = EngineClient(d.socket_path, timeout=30)
    try:
        rid = client.register("decode-j", "decode", geometry, cache.descriptors())
        client.expect(rid, "j-1", source_instance="nobody", pages=[0, 1], num_tokens=3)
        client.abort(rid, "j-1", 'reason with "quotes", spaces and a=b')
        assert client.wait(rid, "j-1", timeout=30)["code"] == "aborted"
        assert client.send_raw(b"\xc1 not msgpack")["ok"] is False
        with pytest.raises(DaemonError):
            client.send(rid, "j-2", pages=[0], start=0, end=1)  # a decode rank cannot send
        client.unregister(rid)
    finally:
        client.close()
        cache.close()
    d.signal(signal.SIGTERM)
    assert d.proc is not None and d.proc.wait(30) == 0
    lines = [line for line in d.log().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    for r in records:
        assert {"ts", "level", "logger"} <= set(r), r
    events = [r.get("event") for r in records]
    for event in ("listening", "rank_registered", "engine_error", "request_failed", "rank_unregistered",
                  "stopping", "stopped", "config_env_ignored"):
        assert event in events, (event, events)
    assert events.index("listening") < events.index("rank_registered") < events.index("stopping") \
        < events.index("stopped")
    failed = next(r for r in records if r.get("event") == "request_failed")
    assert failed["reason"] == 'reason with "quotes", spaces and a=b'
    assert failed["request"] == "j-1" and failed["code"] == "aborted" and failed["level"] == "info"
    ignored = next(r for r in records if r.get("event") == "config_env_ignored")
    assert ignored["var"] == "KVXFERD_LOG_FORMAT" and ignored["level"] == "warning"
    stopped = next(r for r in records if r.get("event") == "stopped")
    assert stopped["drained"] == "True"

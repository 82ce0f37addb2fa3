"""Child processes spoken to in JSON lines (vLLM engines and worker ranks), and the daemons' figures."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvxferd.tools import jsonlines, launch
from kvxferd.tools.jsonlines import read_events, send_command
from kvxferd.tools.sim import DaemonProc

HERE = Path(__file__).parent
EVENT_TIMEOUT = 120.0


class JsonProc:
    """A child that reads JSON commands on stdin and writes JSON events on stdout; stderr goes to a log."""

    def __init__(self, script: str, config: dict[str, Any], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")
        # dies with the test process even when that is killed before its fixtures' finally blocks run
        self.proc = launch.popen([sys.executable, str(HERE / script), json.dumps(config)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1)
        self.events = read_events(self.proc)

    def next(self, timeout: float = EVENT_TIMEOUT) -> dict[str, Any]:
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no answer within {timeout}s; log tail:\n{self.log_tail()}") from None
        if event.get("event") in ("exit", "error"):
            raise AssertionError(f"child failed: {event}; log tail:\n{self.log_tail()}")
        return event

    def call(self, timeout: float = EVENT_TIMEOUT, **cmd: Any) -> dict[str, Any]:
        send_command(self.proc, cmd)
        return self.next(timeout)

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def close(self, timeout: float = 30) -> None:
        jsonlines.close(self.proc, timeout)
        self._log.close()


def daemon_status(d: DaemonProc) -> dict[str, Any]:
    from kvxferd.client import EngineClient

    with EngineClient(d.socket_path, timeout=30) as client:
        return client.status()


def metric(d: DaemonProc, name: str, **labels: str) -> float:
    """Sum of a metric's samples on the daemon's real /metrics endpoint, parsed by prometheus_client."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(d.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

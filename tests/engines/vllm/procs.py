"""The scripts beside these tests (worker ranks) as JSON-lines children, and the daemons' figures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvxferd.tools import jsonlines
from kvxferd.tools.sim import DaemonProc

HERE = Path(__file__).parent


class JsonProc(jsonlines.JsonProc):
    """A script beside these tests (rank_worker.py) run as a JSON-lines child, given its config."""

    def __init__(self, script: str, config: dict[str, Any], log_path: Path) -> None:
        super().__init__([str(HERE / script), json.dumps(config)], log_path)


def daemon_status(d: DaemonProc) -> dict[str, Any]:
    from kvxferd.sdk.client import EngineClient

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

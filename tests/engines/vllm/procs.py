"""The scripts beside these tests (worker ranks) as JSON-lines children, and the daemons' figures."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any

from kvxferd.tools import jsonlines
from kvxferd.tools.sim import DaemonProc

HERE = Path(__file__).parent


class JsonProc(jsonlines.JsonProc):
    """A script beside these tests (rank_worker.py) run as a JSON-lines child, given its config."""

    def __init__(self, script: str, config: dict[str, Any], log_path: Path) -> None:
        super().__init__([str(HERE / script), json.dumps(config)], log_path)
        self.config = config


def close_ranks(procs: list[JsonProc]) -> None:
    """Close rank workers side by side (each takes seconds to shut vLLM down), then remove the shared
    memory vLLM's CPU communicator names after their group's port (rank_worker.py sets
    VLLM_DIST_IDENT to it): a rank that was killed could not unlink its own."""
    from ops_support import in_parallel

    in_parallel(*[p.close for p in procs])
    for port in {p.config.get("dist_port") for p in procs} - {None}:
        for path in glob.glob(f"/dev/shm/{port}-*-cpushm*"):
            os.unlink(path)


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

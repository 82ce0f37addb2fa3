"""Helpers for the operations tests: real daemons, real engine processes, the real HTTP endpoint."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Callable

from prometheus_client.parser import text_string_to_metric_families

from e2e_util import close_cluster, in_parallel  # noqa: F401 - re-exported for the engine tests
from kvxferd.model.geometry import InstanceSpec
from kvxferd.tools.sim import Cluster, DaemonProc, Worker

EVENT_TIMEOUT = 60.0

# A small GQA model: 4 layers, 2 KV heads of 32 bf16 values, 16-token pages.
MODEL = dict(attention="mha", num_layers=4, total_kv_heads=2, head_dim=32, dtype="bfloat16", page_size=16,
             model="ops-test")
NUM_PAGES = 64


def spec(**overrides: Any) -> InstanceSpec:
    return InstanceSpec(**{**MODEL, "tp_size": 1, "pp_size": 1, **overrides})


def kv_bytes(n_tokens: int, s: InstanceSpec | None = None) -> int:
    """Bytes of a request's KV cache: tokens x layers x (K, V) x kv_heads x head_dim x 2 (bf16)."""
    s = s or spec()
    return n_tokens * s.num_layers * 2 * s.kv_heads * s.head_dim * 2


def start_pair(cluster: Cluster, prefill_toml: str = "", decode_toml: str = "",
               decode_env: dict[str, str] | None = None, prefill_env: dict[str, str] | None = None
               ) -> tuple[DaemonProc, DaemonProc, Worker, Worker]:
    """A prefill daemon and a decode daemon, each with one TP-1 engine rank."""
    pd = cluster.daemon("prefill-node", extra_toml=prefill_toml, start=False)
    dd = cluster.daemon("decode-node", extra_toml=decode_toml, start=False)
    in_parallel(lambda: pd.start(prefill_env), lambda: dd.start(decode_env))
    pw, dw = in_parallel(lambda: cluster.instance(pd, "prefill-a", "prefill", spec(), NUM_PAGES)[0],
                         lambda: cluster.instance(dd, "decode-a", "decode", spec(), NUM_PAGES)[0])
    return pd, dd, pw, dw


def next_for(worker: Worker, request_id: str, timeout: float = EVENT_TIMEOUT) -> dict[str, Any]:
    """The worker's next ``finished`` or ``error`` event for ``request_id``.

    Events for other requests that arrive first are kept for their own ``next_for``.
    """
    kept: list[dict[str, Any]] = worker.__dict__.setdefault("backlog", [])
    for i, event in enumerate(kept):
        if event.get("request_id") == request_id:
            return kept.pop(i)
    deadline = time.monotonic() + timeout
    while True:
        event = worker.next_event(max(0.01, deadline - time.monotonic()))
        if event.get("event") == "exit":
            raise AssertionError(f"worker {worker.rank_id} exited while waiting for {request_id}")
        if event.get("event") not in ("finished", "error"):
            continue
        if event.get("request_id") == request_id:
            return event
        kept.append(event)


def transfer(pw: Worker, dw: Worker, request_id: str, n: int, src: list[int], dst: list[int],
             source_address: str | None, chunks: list[list[int]] | None = None
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    dw.command(cmd="expect", request_id=request_id, pages=dst, n=n, source_instance=pw.instance,
               source_address=source_address)
    pw.command(cmd="send", request_id=request_id, pages=src, n=n, chunks=chunks)
    return next_for(dw, request_id), next_for(pw, request_id)


def pages(first: int, n_tokens: int) -> list[int]:
    return list(range(first, first + -(-n_tokens // MODEL["page_size"])))


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def http_get(url: str, timeout: float = 10.0, headers: dict[str, str] | None = None) -> tuple[int, str, str]:
    """(status, content type, body) of a GET, 4xx/5xx included."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type", ""), err.read().decode()


def base_url(d: DaemonProc) -> str:
    return f"http://127.0.0.1:{d.metrics_port}"


class Scrape:
    """One scrape of ``/metrics``, parsed with prometheus_client's own parser."""

    def __init__(self, d: DaemonProc) -> None:
        status, self.content_type, self.text = http_get(base_url(d) + "/metrics")
        assert status == 200, status
        self.families = {f.name: f for f in text_string_to_metric_families(self.text)}
        self.samples = [s for f in self.families.values() for s in f.samples]

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples called ``name`` whose labels include ``labels`` (0 when none)."""
        return sum(s.value for s in self.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def series(self) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
        return {(s.name, tuple(sorted(s.labels.items()))) for s in self.samples}


def status_now(d: DaemonProc) -> dict[str, Any]:
    """The daemon's status over its engine socket (cheap enough to poll)."""
    from kvxferd.sdk.client import EngineClient
    with EngineClient(d.socket_path, timeout=30) as client:
        return client.status()


def status_of(d: DaemonProc) -> dict[str, Any]:
    """The daemon's status through the real CLI, as JSON."""
    out = subprocess.run([sys.executable, "-m", "kvxferd", "status", "--json", "--socket", d.socket_path],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)

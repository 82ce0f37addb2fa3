"""Helpers for end-to-end tests: real daemons, real engine processes, the byte oracle."""

from __future__ import annotations

import random
import time
from typing import Any

import zmq

from kvxferd.geometry import InstanceSpec
from kvxferd.tools.sim import Cluster, DaemonProc, Worker

EVENT_TIMEOUT = 60


def spec(**overrides: Any) -> InstanceSpec:
    base: dict[str, Any] = dict(attention="mha", num_layers=4, total_kv_heads=4, head_dim=16, dtype="bfloat16",
                                page_size=4, tp_size=1, pp_size=1)
    base.update(overrides)
    if base["attention"] == "mla":
        base.pop("total_kv_heads", None)
    return InstanceSpec(**base)


def pages_for(rng: random.Random, num_pages: int, n_tokens: int, page_size: int) -> list[int]:
    need = -(-n_tokens // page_size)
    return rng.sample(range(num_pages), need)


def finished(worker: Worker, request_id: str, timeout: float = EVENT_TIMEOUT) -> dict[str, Any]:
    """The worker's terminal event for ``request_id`` (errors count as terminal).

    Events of other requests that arrive first are kept for their own ``finished`` call.
    """
    stash: dict[str, dict[str, Any]] = worker.__dict__.setdefault("stash", {})
    if request_id in stash:
        return stash.pop(request_id)
    while True:
        event = worker.next_event(timeout)
        if event.get("event") == "exit":
            raise AssertionError(f"worker {worker.rank_id} exited")
        if event.get("event") not in ("finished", "error") or not event.get("request_id"):
            continue
        if event["request_id"] == request_id:
            return event
        stash[event["request_id"]] = event


def transfer(prefill: list[Worker], decode: list[Worker], request_id: str, n_tokens: int, *,
             src_pages: list[int], dst_pages: list[int], source_address: str | None,
             chunks: list[list[int]] | None = None, order: str = "expect_first",
             aux: bytes | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Drive one request through both instances; return (decode events, prefill events)."""
    def expect() -> None:
        for w in decode:
            w.command(cmd="expect", request_id=request_id, pages=dst_pages, n=n_tokens,
                      source_instance=prefill[0].instance, source_address=source_address)

    def send() -> None:
        for w in prefill:
            w.command(cmd="send", request_id=request_id, pages=src_pages, n=n_tokens, chunks=chunks,
                      aux=aux.hex() if aux else None)

    if order == "expect_first":
        expect()
        send()
    else:
        send()
        expect()
    return ([finished(w, request_id) for w in decode], [finished(w, request_id) for w in prefill])


def assert_verified(decode_events: list[dict[str, Any]], prefill_events: list[dict[str, Any]]) -> None:
    for ev in decode_events:
        assert ev["event"] == "finished" and ev["state"] == "done", ev
        assert ev["mismatched_bytes"] == 0, ev
    for ev in prefill_events:
        assert ev["event"] == "finished" and ev["state"] == "done", ev


def close(workers: list[Worker]) -> None:
    for w in workers:
        w.close()


def untouched_bytes(worker: Worker, pages: list[int]) -> int:
    worker.command(cmd="untouched", pages=pages)
    while True:
        ev = worker.next_event(EVENT_TIMEOUT)
        if ev.get("event") == "untouched":
            return int(ev["bad_bytes"])


def wait_in_flight(daemon, key: str, timeout: float = 60) -> None:
    """Wait until the daemon reports a request in ``side:state`` (both sides engaged)."""
    deadline = time.monotonic() + timeout
    from kvxferd.client import EngineClient
    with EngineClient(daemon.socket_path, timeout=5) as client:
        while time.monotonic() < deadline:
            if client.status()["requests"].get(key):
                return
            time.sleep(0.02)
    raise AssertionError(f"no request reached {key}")


__all__ = ["wait_in_flight", "Cluster", "DaemonProc", "Worker", "spec", "pages_for", "finished", "transfer", "assert_verified",
           "close", "untouched_bytes"]


def peer_socket(address: str, recv_timeout_ms: int | None = 5000) -> zmq.Socket:
    """A raw ZeroMQ DEALER on a daemon's peer port, for tests that speak the peer protocol by hand."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if recv_timeout_ms is not None:
        sock.setsockopt(zmq.RCVTIMEO, recv_timeout_ms)
    sock.connect(f"tcp://{address}")
    return sock

"""Helpers for end-to-end tests: real daemons, real engine processes, the byte oracle."""

from __future__ import annotations

import itertools
import os
import random
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pytest
import zmq

from kvxferd.model.geometry import InstanceSpec
from kvxferd.model.plan_wire import plan_to_wire
from kvxferd.model.planner import make_plan
from kvxferd.tools.sim import Cluster, DaemonProc, Worker, in_parallel  # noqa: F401 - in_parallel named for the tests

EVENT_TIMEOUT = 60
NUM_PAGES = 64
_ids = itertools.count()


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


def both_orders_byte_exact(prefill: list[Worker], decode: list[Worker], tag: str, n_tokens: int,
                           src_page_size: int, dst_pages: int, source_address: str, rng: random.Random) -> None:
    """Two requests, expect first (one chunk) then send first (two chunks), byte-exact on fresh
    destination pages; the decode pages no request used still hold the canary afterwards."""
    used: set[int] = set()
    for i, (order, chunks) in enumerate([("expect_first", None), ("send_first", [[0, 12], [12, n_tokens]])]):
        src = pages_for(rng, NUM_PAGES, n_tokens, src_page_size)
        dst = rng.sample([p for p in range(NUM_PAGES) if p not in used], dst_pages)
        used.update(dst)
        dec, pre = transfer(prefill, decode, f"{tag}-r{i}", n_tokens, src_pages=src, dst_pages=dst,
                            source_address=source_address, chunks=chunks, order=order)
        assert_verified(dec, pre)
    never = [p for p in range(NUM_PAGES) if p not in used]
    for w in decode:
        assert untouched_bytes(w, never) == 0


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


def hold_half_sent(prefill: list[Worker], decode: list[Worker], request_id: str, instance: str,
                   source_address: str) -> None:
    """A 16-token request expected by every decode rank and half sent by every prefill rank (the
    last chunk held), so that a daemon can be killed while it is in flight."""
    for w in decode:
        w.command(cmd="expect", request_id=request_id, pages=[1, 2, 3, 4], n=16, source_instance=instance,
                  source_address=source_address)
    for w in prefill:
        w.command(cmd="send", request_id=request_id, pages=[5, 6, 7, 8], n=16, chunks=[[0, 8], [8, 16]],
                  hold_last=True)


def wait_in_flight(daemon, key: str, timeout: float = 60) -> None:
    """Wait until the daemon reports a request in ``side:state`` (both sides engaged)."""
    deadline = time.monotonic() + timeout
    from kvxferd.sdk.client import EngineClient
    with EngineClient(daemon.socket_path, timeout=5) as client:
        while time.monotonic() < deadline:
            if client.status()["requests"].get(key):
                return
            time.sleep(0.02)
    raise AssertionError(f"no request reached {key}")


__all__ = ["wait_in_flight", "hold_half_sent", "Cluster", "DaemonProc", "Worker", "spec", "pages_for", "finished", "transfer", "assert_verified",
           "close", "untouched_bytes", "Node", "cluster_run", "start_nodes", "module_cluster", "run_case",
           "in_parallel", "close_cluster"]


def peer_socket(address: str, recv_timeout_ms: int | None = 5000) -> zmq.Socket:
    """A raw ZeroMQ DEALER on a daemon's peer port, for tests that speak the peer protocol by hand."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if recv_timeout_ms is not None:
        sock.setsockopt(zmq.RCVTIMEO, recv_timeout_ms)
    sock.connect(f"tcp://{address}")
    return sock


# -- clusters: started side by side, always stopped, their run dirs removed --------------------

def close_cluster(cluster: Cluster, keep_root: bool = False, kill_engines: bool = False) -> None:
    """Stop every engine, then every daemon (side by side); kill what does not stop. The run dir
    (configs, sockets, daemon logs) goes too, unless ``keep_root``. ``kill_engines``: SIGKILL the
    engines at once (their daemons were killed, nothing would ever finish their requests)."""
    try:
        if cluster.workers:
            in_parallel(*[w.kill if kill_engines else w.close for w in cluster.workers])
        if cluster.daemons:
            in_parallel(*[d.stop for d in cluster.daemons.values()])
    finally:
        for w in cluster.workers:
            if w.proc.poll() is None:
                w.kill()
        # Cluster.close() also unlinks the named cache files of killed engines, and the run dir
        cluster.close(keep_root=keep_root)


class KeptRunDir(UserWarning):
    """A run dir kept because its tests failed: the daemons' configs and logs, to look at."""


@contextmanager
def cluster_run(request: pytest.FixtureRequest | None = None, kill_engines: bool = False) -> Iterator[Cluster]:
    """A Cluster whose engines and daemons are stopped however the block ends (see close_cluster).

    Its run dir is removed when the block ends cleanly and (given the fixture's ``request``) no
    test failed while it was open; otherwise it stays for the daemon logs, named in a warning
    (pytest's warnings summary), and is left to the reader to remove. KVXFERD_KEEP_LOGS=1 keeps
    every run dir.
    """
    c = Cluster()
    failed = request.session.testsfailed if request is not None else 0
    clean = False
    try:
        yield c
        clean = (request is None or request.session.testsfailed == failed) and not os.environ.get("KVXFERD_KEEP_LOGS")
    finally:
        close_cluster(c, keep_root=not clean, kill_engines=kill_engines)
        if not clean:
            warnings.warn(KeptRunDir(f"a failed run's daemon configs and logs are kept in {c.root}"),
                          stacklevel=3)


@dataclass
class Node:
    """A daemon to start: its name, extra config and environment."""

    name: str
    extra_toml: str = ""
    env: dict[str, str] = field(default_factory=dict)


def start_nodes(cluster: Cluster, *nodes: str | Node) -> list[DaemonProc]:
    """Start daemons side by side (each imports torch), in the order given."""
    wanted = [n if isinstance(n, Node) else Node(n) for n in nodes]
    daemons = [cluster.daemon(n.name, extra_toml=n.extra_toml, start=False) for n in wanted]
    in_parallel(*[lambda d=d, n=n: d.start(n.env or None) for d, n in zip(daemons, wanted)])
    return daemons


def module_cluster(request: pytest.FixtureRequest, *nodes: str | Node) -> Iterator[Cluster]:
    """The body of a module's cluster fixture: ``yield from module_cluster(request, ...)``.

    The daemons start once per module; a failed start-up stops what did start.
    """
    with cluster_run(request) as c:
        start_nodes(c, *nodes)
        yield c


def run_case(cluster: Cluster, pspec: InstanceSpec, dspec: InstanceSpec, *, n_tokens: int,
             transport: str = "tcp", prefill: str = "prefill-node", decode: str = "decode-node",
             chunks: list[list[int]] | None = None, order: str = "expect_first", requests: int = 2,
             seed: int = 0, aux: bytes | None = None, tag: str = "", num_pages: int = NUM_PAGES,
             check: Callable[[list[Worker], list[list[Any]]], None] | None = None) -> None:
    """Fresh prefill and decode instances move ``requests`` requests, each verified byte-exact.

    Destinations never repeat, and pages that were never one still hold the canary afterwards.
    The first request carries ``aux``, which must reach the decode ranks unchanged (and the
    others none). ``transport="local"`` puts both instances on the prefill daemon. ``check``
    runs last with the decode ranks and every ``[dst pages, n_tokens]`` moved.
    """
    rng = random.Random(seed)
    n = next(_ids)
    pd = cluster.daemons[prefill]
    dd = pd if transport == "local" else cluster.daemons[decode]
    p_workers, d_workers = cluster.instances((pd, f"{tag}p{n}", "prefill", pspec, num_pages),
                                             (dd, f"{tag}d{n}", "decode", dspec, num_pages))
    try:
        used: set[int] = set()
        moved: list[list[Any]] = []
        for i in range(requests):
            src = pages_for(rng, num_pages, n_tokens, pspec.page_size)
            dst = rng.sample([p for p in range(num_pages) if p not in used], -(-n_tokens // dspec.page_size))
            used.update(dst)
            first_aux = aux if i == 0 else None
            dec, pre = transfer(p_workers, d_workers, f"{tag}req-{n}-{i}", n_tokens, src_pages=src, dst_pages=dst,
                                source_address=None if transport == "local" else pd.address, chunks=chunks,
                                order=order, aux=first_aux)
            assert_verified(dec, pre)
            assert all(ev["aux"] == (first_aux.hex() if first_aux else None) for ev in dec), dec
            moved.append([dst, n_tokens])
        never = [p for p in range(num_pages) if p not in used]
        for w in d_workers:
            assert untouched_bytes(w, never) == 0  # nothing strays outside the requests' pages
        if check is not None:
            check(d_workers, moved)
    finally:
        close(p_workers + d_workers)


def disjoint_requests(rng: random.Random, tag: str, count: int, n: int, page_size: int) -> list[dict]:
    """Requests on pages no two of them share (a batch fills every source before any moves)."""
    per = -(-n // page_size)
    pages = rng.sample(range(NUM_PAGES), count * per)
    return [{"request_id": f"{tag}-{i}", "pages": pages[i * per:(i + 1) * per], "n": n} for i in range(count)]


def sources_for(rng: random.Random, dst: list[dict]) -> list[dict]:
    """The same requests on prefill pages of their own, as many per request as its destination has."""
    pages = rng.sample(range(NUM_PAGES), sum(len(r["pages"]) for r in dst))
    out, at = [], 0
    for r in dst:
        out.append({**r, "pages": pages[at:at + len(r["pages"])]})
        at += len(r["pages"])
    return out


def move_batched_rounds(d0, p0, source_instance: str, source_address: str, rng: random.Random, tag: str,
                        rounds: int = 3, count: int = 20) -> None:
    """``rounds`` rounds of ``count`` one-page requests, each round one ``expect_many`` and one
    ``send_many``: every request done on both sides, byte-exact, nothing written outside its pages."""
    moved: set[int] = set()
    for rnd in range(rounds):  # the first round handshakes; the later ones find the plan
        dst = disjoint_requests(rng, f"{tag}{rnd}", count, 3, 4)
        d0.command(cmd="expect_many", requests=dst, source_instance=source_instance, source_address=source_address)
        p0.command(cmd="send_many", requests=sources_for(rng, dst))
        for r in dst:
            ev = finished(d0, r["request_id"])
            assert ev["event"] == "finished" and ev["state"] == "done", ev
            assert ev["mismatched_bytes"] == 0, ev
            assert finished(p0, r["request_id"])["state"] == "done"
        moved |= {p for r in dst for p in r["pages"]}
        assert untouched_bytes(d0, sorted(set(range(NUM_PAGES)) - moved)) == 0  # nothing written elsewhere


def carried_plan(prefill: InstanceSpec, hello: dict[str, Any], mode: str) -> list[list[Any]]:
    """What a fake source daemon's handshake answer carries: the pair's plan, made as a real source
    daemon makes it (``mode`` direct or staged, the answer's)."""
    assert mode in ("direct", "staged"), mode
    return plan_to_wire(make_plan(prefill, InstanceSpec.from_dict(hello["decode_spec"]), mode=mode))

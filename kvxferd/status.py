"""What the daemon reports about itself: the ``status`` answer and gauges counted on demand."""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, Any

from . import PROTOCOL_VERSION, __version__, runcopy
from .lifecycle import states

if TYPE_CHECKING:
    from .daemon import Daemon


class StateCounts:
    """Requests per (side, state), counted when Prometheus asks (from its thread) and reused for
    the other label values of the same scrape. Counting on every state change instead made
    the control loop's work grow with the number of requests in flight."""

    def __init__(self, app: "Daemon") -> None:
        self.app = app
        self._cache: tuple[float, dict[tuple[str, str], int]] | None = None

    def __call__(self) -> dict[tuple[str, str], int]:
        now = time.monotonic()
        cached = self._cache
        if cached is not None and now - cached[0] < 0.05:
            return cached[1]
        counts = {("decode", s): 0 for s in states.ACTIVE} | {("prefill", s): 0 for s in states.ACTIVE}
        for entry in self.app.inbox.all():
            if entry.state in states.ACTIVE:
                counts[("decode", entry.state)] += 1
        for src in list(self.app.life.sources.values()):  # one C-level copy: safe against the loop's changes
            if src.state in states.ACTIVE:
                counts[("prefill", src.state)] += 1
        self._cache = (now, counts)
        return counts


def count_peers(app: "Daemon") -> None:
    counts = {"up": 0, "down": 0, "connecting": 0}
    for link in app.upstream.links.values():
        counts[link.state] = counts.get(link.state, 0) + 1
    counts["up"] += len(app.downstream.peers)
    for state, n in counts.items():
        app.metrics.peers.labels(state).set(n)


def status(app: "Daemon") -> dict[str, Any]:
    cfg = app.cfg
    by_state: dict[str, int] = {}
    for entry in app.inbox.all():
        by_state[f"decode:{entry.state}"] = by_state.get(f"decode:{entry.state}", 0) + 1
    for src in app.life.sources.values():
        by_state[f"prefill:{src.state}"] = by_state.get(f"prefill:{src.state}", 0) + 1
    metrics_url = ""
    if app.ops is not None:
        host = cfg.metrics.bind.rpartition(":")[0] or "127.0.0.1"
        metrics_url = f"http://{host}:{app.ops.port}/metrics"
    now = time.monotonic()
    return {
        "version": __version__, "protocol": PROTOCOL_VERSION, "pid": os.getpid(), "incarnation": app.incarnation,
        "name": cfg.daemon.instance_name or socket.gethostname(),
        "uptime_s": round(time.time() - app.started, 3), "ready": app.ready, "draining": app.draining,
        "engine_endpoint": f"ipc://{cfg.socket_path}", "peer_endpoint": f"tcp://{app.address}",
        "data_endpoint": app.data_address, "metrics_url": metrics_url,
        "ranks": [r.describe() for r in app.registry],
        "peers": [{"address": l.address, "state": l.state, "side": "prefill",
                   "last_seen_s": round(now - l.last_seen, 3), "auth_error": l.auth_error,
                   "incarnation": l.peer_incarnation, "batch": l.outgoing.max_parts,
                   "plans": sorted(f"{hs.key[1]}->{hs.key[2]}" for hs in app.life.handshakes.at(l.address)
                                   if hs.state == "agreed"),
                   "handshaking": [h for h in app.life.handshakes.describe() if h["source"] == l.address]}
                  for l in app.upstream.links.values()]
                 + [{"address": p.daemon, "state": "up", "side": "decode", "incarnation": p.incarnation,
                     "last_seen_s": round(now - p.last_seen, 3)} for p in app.downstream.peers.values()],
        "requests": by_state,
        # multipart messages between daemons and the peer messages they carried (parts > messages: batched)
        "peer_messages": {"to_sources": app.upstream.sent.describe(), "from_sources": app.upstream.received.describe(),
                          "to_decode": app.downstream.sent.describe(),
                          "from_decode": app.downstream.received.describe()},
        "recent_failures": list(app.life.recent_failures),
        "auth": {"refused_here": app.auth_refusals.describe(), "refused_by_peers": app.auth_refused_by.describe()},
        "transports": app.transports.describe(),
        "copy_path": runcopy.copy_path(),  # native, or torch and why
        "rendezvous": app.rendezvous.status(),  # instances over several daemons: who holds which rank
    }

"""When a request passed each hop inside this daemon: the timeline that says where a small
request's latency goes.

Off unless ``daemon.hop_trace`` names how many requests to keep (0: off, and every mark is one
attribute test). On, the daemon stamps each request at the hops below with
``time.monotonic_ns`` (on Linux one clock for every process of the host, so the stamps of two
daemons on one machine line up), keeps the last ``hop_trace`` requests, and ``status`` lists
them. ``kvxferd bench`` turns it on and reads the stamps beside its latency rows.

Hops, in the order one chunk of a remote request passes them:

- ``send_in`` / ``expect_in``: the engine's call, decoded on the event loop;
- ``peer_expect_out`` (decode) / ``peer_expect_in`` (source): the expect between the daemons;
- ``job_queued``: the lifecycle handed the chunk to the data plane;
- ``data_start`` / ``data_end``: a data thread took it / its transport returned (sent and
  acknowledged, or copied);
- ``chunk_in`` / ``landed``: the receiving side admitted the chunk's header / its bytes are in;
- ``loop_job`` / ``loop_dest``: the event loop took the data thread's report / the receiver's
  once bytes had landed;
- ``told_prefill`` / ``told_decode``: an event for the request left for that side's engine.

A hop is stamped once per request and daemon (the first time): a request of one chunk reads
straight off; for more, the first chunk's hops.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

MAX_KEEP = 100_000  # the most requests daemon.hop_trace may keep


class HopTrace:
    """The last ``keep`` requests' first stamp at each hop; thread-safe (data threads mark too)."""

    def __init__(self, keep: int = 0) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._stamps: OrderedDict[str, dict[str, int]] = OrderedDict()

    def configure(self, keep: int) -> None:
        with self._lock:
            self.keep = keep
            while len(self._stamps) > keep:
                self._stamps.popitem(last=False)

    def mark(self, request_id: str, hop: str) -> None:
        if not self.keep:
            return
        now = time.monotonic_ns()
        with self._lock:
            stamps = self._stamps.get(request_id)
            if stamps is None:
                stamps = self._stamps[request_id] = {}
                if len(self._stamps) > self.keep:
                    self._stamps.popitem(last=False)
            stamps.setdefault(hop, now)

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Each kept request's stamps (hop -> monotonic ns), oldest request first."""
        with self._lock:
            return {rid: dict(stamps) for rid, stamps in self._stamps.items()}


#: the one trace of this process (a daemon is one process; its loop and data threads share it)
TRACE = HopTrace()

"""The daemon's transports behind one object: both directions, asked by what a route recorded."""

from __future__ import annotations

import numpy as np

from kvxferd.geometry import RankGeometry
from kvxferd.inbox import DestEntry, Inbox
from kvxferd.registry import Rank
from kvxferd.staging import StagingPool
from kvxferd.transport.hub import Transports

from lifecycle_util import spec


def _hub(preference=("tcp",)):
    received = []
    hub = Transports(Inbox(lambda entry: None), StagingPool(1 << 20, 1 << 16), daemon_name="unit",
                     preference=list(preference), timeout_s=1.0, max_header_bytes=1 << 16, max_pages=64,
                     data_connections=1, landing_slots=0, landing_bytes=0,
                     on_received=lambda kind, sink, moved: received.append(kind),
                     on_refused=lambda entry, code, message: None, on_invalid=lambda code: None)
    return hub, received


def _entry(transport: str, source: str) -> DestEntry:
    rank = Rank("d", "decode", RankGeometry(spec(), num_pages=4), {}, b"e")
    entry = DestEntry("r", rank, "p", np.arange(2), 8, created=0.0, phase_since=0.0)
    entry.transport, entry.source_address = transport, source
    return entry


def test_both_directions_are_found_by_the_name_a_route_recorded():
    hub, _ = _hub()
    try:
        assert hub.get("local").name == "local" and hub.get("tcp").name == "tcp"
        assert hub.find("nixl") is None  # not configured: no agent, nothing to find
        assert not any(hub.get(k).one_sided for k in ("local", "tcp"))
        assert hub.offered() == ["tcp"]
    finally:
        hub.close()


def test_only_one_sided_writes_from_a_remote_source_need_a_fence():
    hub, _ = _hub()
    try:
        assert not hub.needs_fence(_entry("tcp", "h:1"))
        assert not hub.needs_fence(_entry("local", ""))
        assert not hub.needs_fence(_entry("nixl", "h:1"))  # no NIXL agent here: no WRITE can land
    finally:
        hub.close()


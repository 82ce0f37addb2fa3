"""The daemon's transports behind one object: both directions, asked by what a route recorded."""

from __future__ import annotations

from kvxferd.datapath.staging import StagingPool
from kvxferd.lifecycle.inbox import Inbox
from kvxferd.transport.hub import Transports


def _hub(preference=("tcp",)):
    received = []
    hub = Transports(Inbox(lambda entry: None), StagingPool(1 << 20, 1 << 16), daemon_name="unit",
                     preference=list(preference), timeout_s=1.0, max_header_bytes=1 << 16, max_pages=64,
                     data_connections=1, landing_slots=0, landing_bytes=0,
                     on_received=lambda kind, sink, moved: received.append(kind),
                     on_refused=lambda entry, code, message: None, on_invalid=lambda code: None)
    return hub, received


def test_both_directions_are_found_by_the_name_a_route_recorded():
    hub, _ = _hub()
    try:
        assert hub.get("local").name == "local" and hub.get("tcp").name == "tcp"
        assert hub.find("nixl") is None  # not configured: no agent, nothing to find
        assert not any(hub.get(k).one_sided for k in ("local", "tcp"))
        assert hub.offered() == ["tcp"]
    finally:
        hub.close()

"""Per-peer quotas on the prefill side: what one decode daemon's link may hold of the daemon's
shared limits, so that one peer's flood of expects or handshakes leaves the others the rest.

A decode daemon's link may hold at most ``limits.peer_share`` of ``limits.max_inflight_requests``
requests in flight (those its expects bound here) and of ``limits.max_peer_pairs`` instance pairs
(its handshakes) while another decode daemon is linked here (alone, it may use all of each: the
quota leaves room for others, and there are none). Past its share it is told ``busy``, naming the
quota; with the default share of one half, every other peer keeps at least half of each. Pure:
counts only, no socket, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


def share_of(total: int, share: float) -> int:
    """One peer's part of a limit (at least one)."""
    return max(1, int(total * share))


@dataclass(frozen=True)
class Quota:
    """A limit one peer passed: what it counts, its size and the settings it comes from."""

    what: str  # "requests in flight" or "instance pairs"
    limit: int
    setting: str  # e.g. "limits.peer_share x limits.max_inflight_requests"

    def message(self, daemon: str, held: int) -> str:
        return (f"decode daemon {daemon} holds {held} {self.what} here, its quota of {self.limit} "
                f"({self.setting}); the rest is kept for other peers")

    def fix(self) -> str:
        return f"finish or abort requests of this peer first, or raise {self.setting.split(' x ')[-1]} or limits.peer_share"


class PeerRequests:
    """The requests each decode daemon's link bound here by its expects, counted as still in
    flight while ``held(request_id)`` says so. Finished requests are pruned lazily, when a link's
    count reaches its quota, so an expect costs a set insert, not a scan."""

    def __init__(self) -> None:
        self._by_peer: dict[bytes, set[str]] = {}

    def add(self, identity: bytes, request_id: str) -> None:
        self._by_peer.setdefault(identity, set()).add(request_id)

    def count(self, identity: bytes, limit: int, held: Callable[[str], bool]) -> int:
        """The link's requests in flight, exact once it reaches ``limit`` (below it, an upper bound)."""
        mine = self._by_peer.get(identity)
        if mine is None:
            return 0
        if len(mine) >= limit:
            mine.intersection_update([r for r in mine if held(r)])
        return len(mine)

    def forget(self, identity: bytes) -> None:
        self._by_peer.pop(identity, None)

"""Which transport each instance pair runs on, and why not the first one preferred.

A pair that ends up on a slower transport than its daemon's first choice (NIXL unusable
here, not offered by the peer, no landing ring for a staged plan) still moves its bytes,
so nothing fails and nobody would notice. The book below is what makes such a fallback
visible: the handshake records each pair's outcome here; ``status`` lists them, the daemon
logs a pair's fallback once and counts it by reason code. Pure bookkeeping: no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

#: pairs remembered; the oldest is forgotten first (a daemon sees a bounded set of pairs in practice)
MAX_PAIRS = 4096

#: reason codes (metric label values): short and bounded
UNAVAILABLE_HERE = "unavailable_here"  # the library is missing or would not start on this daemon
NOT_OFFERED = "not_offered"  # the decode daemon did not offer it
NO_LANDING_RING = "no_landing_ring"  # a staged plan needs a landing ring the decode daemon did not give
#: the decode daemon keeps its engines' memory private (every chunk lands in a ring) and gave no ring
PRIVATE_NO_RING = "private_no_ring"
NO_AGENT = "no_agent"  # the offer carried no agent metadata
PEER_FAILED = "peer_failed"  # loading the peer's agent failed
REGISTER_FAILED = "register_failed"  # a rank of the pair's instances could not be registered with it
PEER_CHOSE = "peer_chose"  # decode side: the source daemon chose another (its reason, if it sent one)


@dataclass(frozen=True)
class Fallback:
    """Why a pair does not run on the preferred transport: a code for metrics, words for people."""

    code: str
    detail: str


@dataclass(frozen=True)
class PairTransport:
    """The outcome of one pair's handshake as one side saw it."""

    side: str  # "prefill" or "decode": whose view this is
    peer: str  # the other daemon's control address
    prefill: str
    decode: str
    transport: str
    preferred: str
    reason: str = ""  # empty when the preferred transport was taken
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        # every field is a string: a flat copy (``asdict`` deep-copies, and status lists one per
        # pair: at 300 pairs it took 60% of a status call)
        return dict(self.__dict__)


class TransportChoices:
    """The last transport outcome of every pair, bounded; says when an outcome is new."""

    def __init__(self, max_pairs: int = MAX_PAIRS) -> None:
        self.max_pairs = max_pairs
        self._pairs: OrderedDict[tuple[str, str, str, str], PairTransport] = OrderedDict()

    def record(self, choice: PairTransport) -> bool:
        """Keep a pair's outcome; True when it differs from what was recorded before (log it then)."""
        key = (choice.side, choice.peer, choice.prefill, choice.decode)
        before = self._pairs.pop(key, None)
        self._pairs[key] = choice
        while len(self._pairs) > self.max_pairs:
            self._pairs.popitem(last=False)
        return before != choice

    def describe(self) -> list[dict[str, Any]]:
        return [c.to_dict() for c in self._pairs.values()]

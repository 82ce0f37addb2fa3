"""The one place for plans and routes.

Prefill side: a handshake binds an instance pair to a plan and a route to the decode daemon
that sent it. A decode instance whose ranks sit at several daemons handshakes once from each,
so a pair holds one plan and one route per decode daemon (they must agree on the plan). An
expect binds a request to the pair's plan, the decode instance and, per destination rank, the
route of the link the expect came on. Sources refer to the request's :class:`Binding` (shared,
never copied), so a route that goes with its peer goes for every request at once.

What a decode side says about a request before (or instead of) binding it lives here too: a
handshake this daemon refused is remembered per link, so the link that was refused may still
end the requests it was refused for, and such an end (:class:`DecodeEnd`) is kept per request,
so a send or poll of it that comes later finds the request failed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from ..directory.holders import spec_difference
from ..errors import PlanRefusal
from ..model.plan import Plan
from ..model.sampling import describe_period
from .outbox import Binding, Route


@dataclass(frozen=True)
class DecodeEnd:
    """A decode side ended a request before its expect bound it here: who said so and why.
    ``identity`` is the decode daemon's link (None: the decode rank is on this daemon)."""

    decode: str
    identity: bytes | None
    code: str
    message: str


@dataclass
class PairRoutes:
    """An instance pair: its plan and each decode daemon's route (by advertised address)."""

    plan: Plan
    routes: dict[str, Route] = field(default_factory=dict)
    #: the integrity period agreed at the pair's handshake (the shorter of both sides'; None: off)
    integrity: int | None = None
    #: decode daemon -> the decode ranks it holds of the instance: those its handshake named (all of
    #: them where it named none), and those its expects named since
    claimed: dict[str, set[Coords]] = field(default_factory=dict)


Coords = tuple[int, int]


@dataclass(frozen=True)
class Holder:
    """Another live decode daemon that holds ranks of a pair a handshake or expect claims."""

    daemon: str
    ranks: list[Coords]

    def describe(self, decode: str) -> str:
        shown = ", ".join(f"{tp}.{pp}" for tp, pp in self.ranks[:8])
        more = f" and {len(self.ranks) - 8} more" if len(self.ranks) > 8 else ""
        return f"decode daemon {self.daemon} holds ranks {shown}{more} of decode instance {decode!r}"


class RouteBook:
    def __init__(self, max_requests: int) -> None:
        self._pairs: dict[tuple[str, str], PairRoutes] = {}
        # (request, prefill instance) -> binding; bounded, oldest dropped
        self._requests: OrderedDict[tuple[str, str], Binding] = OrderedDict()
        self._max_requests = max_requests
        #: (prefill, decode, link) of handshakes this daemon refused; bounded, oldest dropped
        self._refused: OrderedDict[tuple[str, str, bytes], None] = OrderedDict()
        #: (request, prefill instance) -> what a decode side said ended it before binding it; bounded
        self._ends: OrderedDict[tuple[str, str], DecodeEnd] = OrderedDict()

    # -- instance pairs (handshakes) ---------------------------------------------------------
    def plan(self, prefill: str, decode: str) -> Plan | None:
        found = self._pairs.get((prefill, decode))
        return found.plan if found is not None else None

    def route_of(self, prefill: str, decode: str, identity: bytes) -> Route | None:
        """The route of the decode daemon whose link has this routing id (None: no handshake on it)."""
        found = self._pairs.get((prefill, decode))
        if found is None:
            return None
        return next((r for r in found.routes.values() if r.identity == identity), None)

    def route_at(self, prefill: str, decode: str, daemon: str) -> Route | None:
        found = self._pairs.get((prefill, decode))
        return found.routes.get(daemon) if found is not None else None

    def local(self, prefill: str, decode: str) -> tuple[Plan, Route] | None:
        """The pair's plan and route when decode ranks are on this daemon."""
        found = self._pairs.get((prefill, decode))
        route = next((r for r in found.routes.values() if r.local), None) if found is not None else None
        return (found.plan, route) if found is not None and route is not None else None

    def daemons(self, prefill: str, decode: str) -> list[str]:
        found = self._pairs.get((prefill, decode))
        return sorted(found.routes) if found is not None else []

    def check_pair(self, prefill: str, decode: str, plan: Plan, daemon: str) -> None:
        """A decode daemon's handshake must find the plan the pair's other decode daemons found:
        every daemon of a decode instance computes it from the same two specs, so a difference is
        a misconfigured rank (another geometry) or daemon (another ``peer.mode``)."""
        found = self._pairs.get((prefill, decode))
        others = [d for d in (found.routes if found is not None else {}) if d != daemon]
        if found is None or not others or found.plan == plan:
            return
        fix = "register every rank of a decode instance with the same geometry, and give its daemons the same peer.mode"
        if found.plan.decode != plan.decode:
            name, theirs, ours = spec_difference(found.plan.decode, plan.decode)
            raise PlanRefusal(f"decode daemon {daemon} has ranks of {decode!r} with {name} = {ours!r}, but decode "
                              f"daemon {others[0]} has ranks of it with {name} = {theirs!r}",
                              field=name, prefill=theirs, decode=ours, fix=fix)
        raise PlanRefusal(f"decode daemon {daemon} plans {prefill!r} -> {decode!r} in mode {plan.mode!r}, but decode "
                          f"daemon {others[0]} in mode {found.plan.mode!r}", field="mode",
                          prefill=found.plan.mode, decode=plan.mode, fix=fix)

    def set_pair(self, prefill: str, decode: str, plan: Plan, route: Route, integrity: int | None = None,
                 ranks: set[Coords] | None = None) -> None:
        """Record a handshake (call :meth:`check_pair` first): a new plan replaces the pair's, and
        its last handshake's agreed integrity period the one before; ``ranks``: the decode ranks
        the handshake claims (None: every rank of the plan's decode instance)."""
        found = self._pairs.get((prefill, decode))
        if found is None or found.plan != plan:
            keep = {d: r for d, r in found.routes.items() if d != route.daemon} if found is not None else {}
            claimed = {d: c for d, c in found.claimed.items() if d in keep} if found is not None else {}
            found = self._pairs[(prefill, decode)] = PairRoutes(plan, keep, claimed=claimed)
        found.routes[route.daemon] = route
        found.claimed[route.daemon] = set(ranks) if ranks is not None else all_ranks(plan)
        found.integrity = integrity

    def held_elsewhere(self, prefill: str, decode: str, daemon: str, ranks: set[Coords],
                       live: Callable[[bytes], bool]) -> Holder | None:
        """Another decode daemon whose live link holds one of ``ranks`` of the pair (None: none does).
        A decode instance over several daemons holds disjoint ranks at each; two instances given one
        name, or a stranger naming a live instance, claim the same ranks. A holder whose link is gone
        (a restarted or dead decode daemon) holds nothing."""
        found = self._pairs.get((prefill, decode))
        if found is None:
            return None
        for other, route in found.routes.items():
            if other == daemon or route.identity is None or not live(route.identity):
                continue
            both = sorted(found.claimed.get(other, set()) & ranks)
            if both:
                return Holder(other, both)
        return None

    def claim(self, prefill: str, decode: str, daemon: str, dst: Coords) -> None:
        """An expect of ``daemon`` for rank ``dst`` (registered there after its handshake): it holds it now."""
        found = self._pairs.get((prefill, decode))
        if found is not None and daemon in found.routes:
            found.claimed.setdefault(daemon, set()).add(dst)

    def pairs_of(self, identity: bytes) -> int:
        """Instance pairs a decode daemon's link handshook (its share of ``limits.max_peer_pairs``)."""
        return sum(1 for found in self._pairs.values() for r in found.routes.values() if r.identity == identity)

    def pair_count(self) -> int:
        """Instance pairs with a route to a decode daemon's link (local pairs cost no peer anything)."""
        return sum(1 for found in self._pairs.values() if any(r.identity is not None for r in found.routes.values()))

    def integrity(self, prefill: str, decode: str) -> int | None:
        """The pair's agreed integrity period (None: off, or no handshake)."""
        found = self._pairs.get((prefill, decode))
        return found.integrity if found is not None else None

    def integrity_pairs(self) -> list[dict[str, Any]]:
        """For ``status``: each pair and decode daemon this daemon is the source for, and the agreed mode."""
        return [{"side": "prefill", "prefill": prefill, "decode": decode, "peer": daemon,
                 "integrity": describe_period(found.integrity)}
                for (prefill, decode), found in self._pairs.items() for daemon in found.routes]

    def refused(self, prefill: str, decode: str, identity: bytes) -> None:
        """This daemon refused the pair's handshake over that link."""
        _remember(self._refused, (prefill, decode, identity), None, self._max_requests)

    def linked(self, prefill: str, decode: str, identity: bytes) -> bool:
        """Whether that link handshook the pair here, accepted or refused: only such a link may tell
        of requests of the pair that no expect bound (a stranger's word fails nothing it names)."""
        return self.route_of(prefill, decode, identity) is not None or (prefill, decode, identity) in self._refused

    # -- requests (expects) ------------------------------------------------------------------
    def request(self, request_id: str, prefill: str) -> Binding | None:
        """The binding learnt for this request from any expect, also after other ranks finished:
        a rank the plan gives nothing to write may send after the writers completed."""
        return self._requests.get((request_id, prefill))

    def bind(self, request_id: str, prefill: str, binding: Binding) -> None:
        key = (request_id, prefill)
        self._requests[key] = binding
        self._requests.move_to_end(key)
        while len(self._requests) > self._max_requests:
            self._requests.popitem(last=False)

    def end(self, request_id: str, prefill: str, end: DecodeEnd) -> None:
        _remember(self._ends, (request_id, prefill), end, self._max_requests)

    def ended(self, request_id: str, prefill: str) -> DecodeEnd | None:
        """What a decode side said ended the request, if it did (whether it applies is the core's call)."""
        return self._ends.get((request_id, prefill))

    # -- peers -------------------------------------------------------------------------------
    def drop_peer(self, identity: bytes) -> list[Route]:
        """Forget every pair's route and every request routed to a decode daemon; return its routes.
        Bindings held by sources keep their routes: the other decode daemons still hear a failure."""
        gone = []
        for key, found in list(self._pairs.items()):
            for daemon, route in list(found.routes.items()):
                if route.identity == identity:
                    del found.routes[daemon]
                    found.claimed.pop(daemon, None)
                    gone.append(route)
            if not found.routes:
                del self._pairs[key]
        for key, binding in list(self._requests.items()):
            if binding.routed_to(identity):
                del self._requests[key]
        for refusal in [k for k in self._refused if k[2] == identity]:
            del self._refused[refusal]
        return gone


def all_ranks(plan: Plan) -> set[Coords]:
    """Every rank of a plan's decode instance: what a handshake that names no ranks claims."""
    return {(tp, pp) for tp in range(plan.decode.tp_size) for pp in range(plan.decode.pp_size)}


def _remember(book: OrderedDict[Any, Any], key: Any, value: Any, bound: int) -> None:
    """Keep ``key`` as the newest entry of a bounded book, dropping the oldest past ``bound``."""
    book[key] = value
    book.move_to_end(key)
    while len(book) > bound:
        book.popitem(last=False)

"""The one place for plans and routes.

Prefill side: a handshake binds an instance pair to a plan and a route (how to reach the
decode daemon); an expect binds a request to the pair's plan, the decode instance and the
route. Sources refer to the request's :class:`Binding` (shared, never copied), so a route
that goes with its peer goes for every request at once.
"""

from __future__ import annotations

from collections import OrderedDict

from ..outbox import Binding, Route
from ..planner import Plan


class RouteBook:
    def __init__(self, max_requests: int) -> None:
        self._pairs: dict[tuple[str, str], tuple[Plan, Route]] = {}
        # (request, prefill instance) -> binding; bounded, oldest dropped
        self._requests: OrderedDict[tuple[str, str], Binding] = OrderedDict()
        self._max_requests = max_requests

    # -- instance pairs (handshakes) ---------------------------------------------------------
    def pair(self, prefill: str, decode: str) -> tuple[Plan, Route] | None:
        return self._pairs.get((prefill, decode))

    def set_pair(self, prefill: str, decode: str, plan: Plan, route: Route) -> None:
        self._pairs[(prefill, decode)] = (plan, route)

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

    # -- peers -------------------------------------------------------------------------------
    def drop_peer(self, identity: bytes) -> list[Route]:
        """Forget every pair and request routed to a decode daemon; return the pairs' routes."""
        gone = []
        for key, (_plan, route) in list(self._pairs.items()):
            if route.identity == identity:
                del self._pairs[key]
                gone.append(route)
        for key, binding in list(self._requests.items()):
            if binding.route.identity == identity:
                del self._requests[key]
        return gone

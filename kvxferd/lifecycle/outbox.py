"""Prefill side: what each source rank has handed over and where it must go.

Pure bookkeeping, touched only on the daemon's event loop. A :class:`SrcEntry` is one
request at one prefill rank: the chunks the engine sent, the destinations the plan gives
this rank (known as decode daemons' ``expect`` messages arrive), and which chunk has been
confirmed by which destination. Source pages are free only when every chunk has been
confirmed by every destination (over a one-sided transport: by the decode rank's word that the
whole request landed and checked), or, after a failure, when no copy reads them any more.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import RequestError
from ..model.plan import Plan, Writer, group_key
from ..model.qos import Qos
from ..model.sampling import Sample
from . import states


@dataclass(frozen=True)
class Route:
    """How to reach one decode daemon of a (prefill, decode) instance pair (a decode instance over
    several daemons has one route per daemon)."""

    kind: str  # "local", "tcp" or "nixl"
    data_address: tuple[str, int] | None = None
    identity: bytes | None = None  # routing id of the decode daemon's peer link
    daemon: str = ""
    token: bytes | None = None  # the decode daemon's per-link data token
    nixl: Any = None  # kind "nixl": the decode daemon's agent and regions (transport.nixl.NixlPeer)
    #: the pair asked its mode outright (``peer.mode`` direct or staged), not ``auto``: chunks
    #: keep it on host memory (:func:`kvxferd.transport.chunk_modes.pick`)
    pinned: bool = False

    @property
    def local(self) -> bool:
        """The decode ranks are on this daemon (no peer link, no data connection)."""
        return self.kind == "local"


@dataclass(frozen=True)
class Binding:
    """What expects taught the prefill side about one request: shared by every source of it
    (kept by :class:`~kvxferd.lifecycle.routes.RouteBook`), never copied. ``routes`` grows as the
    expects of the decode ranks arrive: each names its destination rank, and the link it came
    on is the route to that rank's daemon (a decode instance may span several daemons)."""

    plan: Plan
    decode_instance: str
    routes: dict[tuple[int, int], Route] = field(default_factory=dict)  # destination rank -> its daemon

    def daemons(self) -> list[Route]:
        """One route per decode daemon of the request (in the order their expects came)."""
        seen: dict[str, Route] = {}
        for route in self.routes.values():
            seen.setdefault(route.daemon if route.identity is None else repr(route.identity), route)
        return list(seen.values())

    def routed_to(self, identity: bytes) -> bool:
        return any(route.identity == identity for route in self.routes.values())


@dataclass
class Chunk:
    start: int
    end: int
    last: bool
    slots: np.ndarray
    aux: bytes | None
    groups: dict[str, np.ndarray] | None = None  # cache groups: the chunk's pages per KV group, state slots


@dataclass
class Target:
    dst: tuple[int, int]
    writer: Writer
    scheduled: set[int] = field(default_factory=set)
    acked: set[int] = field(default_factory=set)
    route: Route | None = None  # the daemon of the destination rank (the link its expect came on)
    dst_pages: np.ndarray | None = None  # route "nixl": the decode rank's pages, from its expect
    start: int = 0  # the decode side holds tokens before it already: chunks are clipped to >= start
    inflight: int = 0  # jobs towards it not returned yet (a fence waits for those of its daemon)
    #: a one-sided route: the source's WRITEs complete before the decode daemon checks them, so the
    #: target is done only once its decode rank says it landed the request whole (``landed``)
    confirm: bool = False
    landed: bool = False
    #: which granules of its chunks carry their digests (integrity: what its expect asked, or this
    #: daemon or the source's instance where stricter; None: none), and the granule's tokens
    digests: Sample | None = None
    granule: int = 0


_serials = itertools.count(1)


@dataclass
class SrcEntry:
    """One request at one prefill rank."""

    request_id: str
    rank_id: str  # the prefill rank's id (the rank may register after a peer's expect)
    coords: tuple[int, int]
    created: float = 0.0
    state: str = states.BOOTSTRAPPING
    phase_since: float = 0.0
    chunks: list[Chunk] = field(default_factory=list)
    last_end: int | None = None
    binding: Binding | None = None
    targets: dict[tuple[int, int], Target] = field(default_factory=dict)
    inflight: int = 0
    closed: bool = False
    failure: tuple[str, str] | None = None
    #: the decode daemon hung up on a chunk: until then its reason, if it sends one, replaces ``failure``
    reason_due: float | None = None
    bytes_sent: int = 0
    #: what its chunk jobs ask of the data plane: class and weight (its first chunk's ask, held to
    #: qos.instances), instance, and the lifecycle time by which it must be done (None: no deadline)
    qos: Qos = Qos()
    #: this entry's own number among every source of the daemon's life: what its chunk jobs carry,
    #: so that stopping its sends never reaches a later request that reuses its id at the rank
    serial: int = field(default_factory=lambda: next(_serials))

    def add_chunk(self, chunk: Chunk) -> None:
        if self.last_end is not None:
            raise RequestError(f"request {self.request_id!r} already got its last chunk (ending at "
                               f"{self.last_end})", field="last", fix="send nothing after last=true")
        for other in self.chunks:
            if other.start < chunk.end and chunk.start < other.end:
                raise RequestError(f"chunk [{chunk.start}, {chunk.end}) overlaps chunk "
                                   f"[{other.start}, {other.end}) already sent", field="start",
                                   fix="send each token range once")
        if chunk.last:
            reach = max([c.end for c in self.chunks] + [chunk.end])
            covered = sorted((c.start, c.end) for c in [*self.chunks, chunk])
            pos = 0
            for s, e in covered:
                if s != pos:
                    raise RequestError(f"last chunk leaves tokens [{pos}, {s}) unsent", field="start",
                                       fix="send every token range of the request before the last chunk")
                pos = e
            if reach != chunk.end:
                raise RequestError(f"last chunk ends at {chunk.end} but an earlier chunk reaches {reach}",
                                   field="end", fix="end the request with the chunk holding its last token")
            self.last_end = chunk.end
        self.chunks.append(chunk)

    @property
    def plan(self) -> Plan | None:
        return self.binding.plan if self.binding is not None else None

    def routes(self) -> list[Route]:
        """The decode daemons of the request known so far (each told of a failure once)."""
        return self.binding.daemons() if self.binding is not None else []

    def routed_to(self, identity: bytes) -> bool:
        return self.binding is not None and self.binding.routed_to(identity)

    @property
    def transport(self) -> str:
        """The metric label: the routes' transport (several only for a decode instance spread over
        daemons reached differently, e.g. ``local+tcp``)."""
        kinds = sorted({route.kind for route in self.routes()})
        return "+".join(kinds) if kinds else "none"

    @property
    def decode_instance(self) -> str | None:
        return self.binding.decode_instance if self.binding is not None else None

    def bind(self, binding: Binding, now: float) -> None:
        """The first binding wins (a second decode side may not take over a request's bytes)."""
        if self.binding is None:
            self.binding = binding
            if states.may(self, states.SRC, "bound"):
                states.advance(self, states.SRC, "bound", now)

    def expected_targets(self) -> set[tuple[int, int]]:
        assert self.plan is not None
        return {group_key(d.rank, w.group, w.part) for d, w in self.plan.all_targets_of(*self.coords)}

    def complete(self) -> bool:
        if self.plan is None or self.last_end is None or self.inflight:
            return False
        if set(self.targets) != self.expected_targets():
            return False
        n = len(self.chunks)
        return all(len(t.acked) == n and (t.landed or not t.confirm) for t in self.targets.values())

    def awaiting_landed(self) -> list[Target]:
        """Targets whose every chunk went, still waiting for their decode rank's ``landed``."""
        n = len(self.chunks)
        return [t for t in self.targets.values() if t.confirm and not t.landed and len(t.acked) == n]

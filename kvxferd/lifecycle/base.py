"""What both sides of the lifecycle core share: the books of requests, the effects queue, the
records of finished and failed requests, and the hooks one side calls on the other.

The sides (:mod:`.decode`, :mod:`.prefill`) build on :class:`LifecycleBase`;
:class:`~.core.Lifecycle` joins them and runs the failure worklist, so the core imports its
sides and neither side imports the core.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from typing import Any, Callable, Union

from ..errors import RequestError
from ..model.qos import QosPolicy
from ..model.sampling import MODES, PageLedger, Policy
from ..ops.logutil import q
from ..ops.metrics import Metrics
from . import effects, events, states
from .handshakes import Handshakes
from .inbox import DestEntry, Inbox
from .links import Link, Links
from .outbox import SrcEntry
from .registry import Registry
from .routes import RouteBook

log = logging.getLogger("kvxferd.lifecycle")

Entry = Union[DestEntry, SrcEntry]


class LifecycleBase:
    """The books both sides keep (destinations in the inbox, sources here, the route book) and
    what they share; :class:`~.core.Lifecycle` is the one instance of it."""

    def __init__(self, limits: Any, timeouts: Any, registry: Registry, inbox: Inbox, metrics: Metrics, *,
                 one_sided: Callable[[str], bool], source_up: Callable[[str], bool] | None = None,
                 wall_clock: Callable[[], float], peer: Any = None, address: str = "",
                 remote_ranks: Callable[[str], dict[Any, str]] = lambda instance: {},
                 integrity: Policy | None = None, qos: QosPolicy | None = None) -> None:
        self.limits = limits  # config.Limits: max_inflight_requests, max_pending_chunks, recent_failures
        self.timeouts = timeouts  # config.Timeouts: phase limits, fence_s
        self.registry = registry
        self.inbox = inbox
        self.metrics = metrics
        self.one_sided = one_sided  # a transport name -> whether its writes land without this daemon
        #: links to peer daemons: source daemons this daemon pulls from (by address), decode
        #: daemons that pull from it (by routing id)
        self.source_daemons = Links("prefill", backoff_s=peer.heartbeat_interval_s if peer is not None else 1.0,
                                    backoff_max_s=peer.unreachable_backoff_max_s if peer is not None else 60.0)
        self.decode_daemons = Links("decode")
        #: a source daemon address -> whether its link is up (a fence can be answered); the link
        #: book's unless a caller models links itself
        self.source_up = source_up or self.source_daemons.is_up
        self.wall_clock = wall_clock  # for the times in ``recent_failures`` (shown, never compared)
        self.address = address  # this daemon's control address (a local route names it)
        self.peer = peer  # config.Peer: require_same_page_size (plans refuse others), heartbeat_interval_s
        #: a prefill instance -> its ranks the rank directory lists at other daemons (coords -> daemon)
        self.remote_ranks = remote_ranks
        #: integrity.mode: what share of each request this daemon's decode ranks check against
        #: digests, and its prefill ranks send them for (a peer or an instance that asks for more
        #: gets more: the stricter side wins)
        self.integrity = integrity or Policy()
        #: qos.instances: each instance's transfer class (the highest its requests may ask) and weight
        self.qos = qos or QosPolicy()
        #: decode side: the writes into each page of each rank since it was last checked (sampled)
        self.ledger = PageLedger()
        #: decode side: handshakes with source daemons (an unanswered hello goes again after a
        #: heartbeat interval, at least a second), and destinations waiting for a local source
        self.handshakes = Handshakes(max(1.0, peer.heartbeat_interval_s if peer is not None else 1.0),
                                     timeouts.handshake_retry_s)
        self.local_waiting: list[DestEntry] = []
        self.routes = RouteBook(2 * limits.max_inflight_requests)
        self.sources: dict[tuple[str, str], SrcEntry] = {}
        self._by_request: dict[str, dict[str, SrcEntry]] = {}
        self.held_chunks = 0  # chunks of the sources above, counted as they come and go (a bounded total)
        self.finished: OrderedDict[tuple[str, str], dict[str, Any]] = OrderedDict()
        #: request -> decode daemons (peer identities) waiting for "fenced" once its jobs return
        self.fence_waiters: dict[str, set[bytes]] = {}
        self.recent_failures: list[dict[str, Any]] = []
        self.now = 0.0
        self._effects: list[effects.Effect] = []
        self._failures: deque[tuple[Entry, str, str, bool]] = deque()
        self._failing = False

    def emit(self, effect: effects.Effect) -> None:
        self._effects.append(effect)

    def _moved(self, book: Links, link: Link, happened: str, why: str = "", **detail: Any) -> None:
        """Apply one happening to a link and tell the shell when its state changed (or why matters)."""
        before = link.state
        after = book.move(link, happened, self.now)
        if before != after or why:
            self.emit(effects.LinkChanged(book.side, link.key, link.daemon, before, after, why or happened, **detail))

    # -- hooks: the core and the other side answer these ------------------------------------------
    def _fail(self, entry: Entry, code: str, message: str, propagate: bool = True) -> None:
        """Fail ``entry`` through the core's worklist (:meth:`~.core.Lifecycle._fail`)."""
        raise NotImplementedError

    def _on_expect(self, ev: events.PeerExpected) -> None:
        """A destination announced to the prefill side (:meth:`~.prefill.PrefillSide._on_expect`)."""
        raise NotImplementedError

    def _downstream_ended(self, ev: events.DownstreamEnded) -> None:
        """The decode side ended a request (:meth:`~.prefill.PrefillSide._downstream_ended`)."""
        raise NotImplementedError

    def _plan_found(self, ev: events.PlanFound) -> None:
        """A destination's plan is found (:meth:`~.decode.DecodeSide._plan_found`)."""
        raise NotImplementedError

    def _bootstrap_failed(self, ev: events.BootstrapFailed) -> None:
        """A destination's plan cannot be found (:meth:`~.core.Lifecycle._bootstrap_failed`)."""
        raise NotImplementedError

    @property
    def require_same_page_size(self) -> bool:
        return bool(self.peer is not None and self.peer.require_same_page_size)

    # -- checks, counts and records --------------------------------------------------------------
    def standing(self, instance: str) -> int | None:
        """The standing integrity period of an instance on this daemon at its handshakes: this
        daemon's mode, or the strictest its ranks asked for at register where stricter."""
        asks = [rank.integrity or "off" for rank in self.registry if rank.instance == instance]
        return self.integrity.standing(max(asks, key=MODES.index) if asks else None)

    def refuse_finished(self, request_id: str, rank_id: str) -> None:
        record = self.finished.get((request_id, rank_id))
        if record is not None:
            why = f" ({record.get('code')}: {record.get('reason')})" if record["state"] == states.FAILED else ""
            raise RequestError(f"request {request_id!r} already {record['state']} at {rank_id}{why}",
                               field="request_id", code="request_finished",
                               fix="use a new request id per request")

    def check_capacity(self) -> None:
        if self.active_count() >= self.limits.max_inflight_requests:
            raise RequestError(f"{self.limits.max_inflight_requests} requests are in flight",
                               field="request_id", code="busy",
                               fix="retry later, or raise limits.max_inflight_requests")

    def active_count(self) -> int:
        return len(self.inbox) + sum(1 for e in self.sources.values() if e.state not in states.TERMINAL)

    def inflight_jobs(self) -> int:
        return sum(e.inflight for e in self.inbox.all()) + sum(e.inflight for e in self.sources.values())

    def remember(self, request_id: str, rank_id: str, record: dict[str, Any]) -> None:
        self.finished[(request_id, rank_id)] = record
        while len(self.finished) > self.limits.max_inflight_requests:
            self.finished.popitem(last=False)

    def record_failure(self, side: str, request_id: str, rank_id: str, code: str, message: str) -> None:
        self.metrics.failures.labels(side, code[:48]).inc()
        log.info("event=request_failed side=%s request=%s rank=%s code=%s reason=%s", side, q(request_id),
                 rank_id, code, q(message[:300]))
        self.recent_failures.append({"time": self.wall_clock(), "side": side, "request_id": request_id,
                                     "rank_id": rank_id, "code": code, "reason": message[:500]})
        del self.recent_failures[:-self.limits.recent_failures]

    def phase_limits(self) -> dict[str, float]:
        t = self.timeouts
        return {states.BOOTSTRAPPING: t.bootstrap_s, states.WAITING: t.waiting_for_input_s,
                states.TRANSFERRING: t.transfer_s}

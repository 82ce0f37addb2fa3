"""In-process daemons for lifecycle tests: the real lifecycle core, inbox, registry and planner,
with the shells replaced by a deterministic loop that delivers effects as the next events.

Each :class:`Node` is one daemon's core. :class:`Cluster` carries peer messages between
nodes, runs chunk jobs through the destination's real :class:`~kvxferd.lifecycle.inbox.Inbox` (the
checks and accounting a data thread does, with no bytes to copy), and advances a fake clock.
Jobs can be held in flight, hellos held (a handshake that has not left yet), and peers cut, so
every order can be driven. A source node answers a hello as the peer endpoint does: it plans
under its own config and answers ok, refused, or "retry later".
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from kvxferd.errors import KvxferError, PlanRefusal
from kvxferd.lifecycle import effects, events
from kvxferd.lifecycle.core import Lifecycle
from kvxferd.lifecycle.inbox import DestEntry, Inbox
from kvxferd.lifecycle.jobs import Moved
from kvxferd.lifecycle.outbox import Chunk, Route
from kvxferd.lifecycle.registry import Rank, Registry
from kvxferd.model.geometry import InstanceSpec, RankGeometry, rank_id
from kvxferd.model.plan_wire import plan_to_wire
from kvxferd.model.segments import as_pages, unit_slots
from kvxferd.model.sampling import Sample
from kvxferd.ops.config import Config
from kvxferd.ops.metrics import Metrics
from kvxferd.wire import messages


def spec(tp: int = 1, layers: int = 2, heads: int = 2, page: int = 4) -> InstanceSpec:
    return InstanceSpec(attention="mha", num_layers=layers, head_dim=8, dtype="bfloat16", page_size=page,
                        tp_size=tp, total_kv_heads=heads)


@dataclass
class Node:
    """One daemon's lifecycle core and what its shells would have done."""

    name: str
    cluster: "Cluster"
    cfg: Config = field(default_factory=Config)
    told: list[messages.Event] = field(default_factory=list)  # events sent to engines, in order
    jobs: list[effects.StartJob] = field(default_factory=list)  # jobs posted, not yet run
    stopped: list[DestEntry] = field(default_factory=list)  # StopReceiving
    gone: list[effects.PeerGone] = field(default_factory=list)
    hellos: list[effects.SendHandshake] = field(default_factory=list)  # sent, not answered yet
    links: list[effects.LinkChanged] = field(default_factory=list)  # peer links' changes, in order

    def __post_init__(self) -> None:
        self.address = f"{self.name}:1"
        self.identity = self.name.encode()
        self.incarnation = f"{self.name}-{id(self):x}"
        self.registry = Registry(64)
        self.metrics = Metrics()
        self.inbox = Inbox(lambda entry: self.cluster.later(self, events.DestChanged(entry)))
        self.life = Lifecycle(self.cfg.limits, self.cfg.timeouts, self.registry, self.inbox, self.metrics,
                              one_sided=lambda kind: kind == "nixl",
                              source_up=lambda address: address not in self.cluster.cut_links,
                              wall_clock=lambda: 0.0, peer=self.cfg.peer, address=self.address)

    def rank(self, instance: str, role: str, spec_: InstanceSpec, tp: int = 0, pages: int = 64) -> Rank:
        rank = Rank(instance, role, RankGeometry(spec_, tp_rank=tp, num_pages=pages), {}, self.identity)
        self.registry.add(rank)
        return rank

    def handle(self, event: Any) -> Any:
        try:
            return self.life.handle(event, self.cluster.now)
        finally:
            for effect in self.life.take_effects():
                self.cluster.carry(self, effect)

    # -- engine calls ------------------------------------------------------------------------
    def expect(self, rank: Rank, request_id: str, pages: list[int], source: str, num_tokens: int | None = None,
               start: int = 0, source_node: "Node | None" = None, groups: dict[str, list[int]] | None = None) -> str:
        address = source_node.address if source_node is not None and source_node is not self else ""
        tables = {k: np.asarray(v, dtype=np.int64) for k, v in (groups or {}).items()} or None
        return self.handle(events.ExpectCalled(rank, request_id, source, as_pages(pages, rank.geometry.num_pages, "pages"),
                                               num_tokens, start, address, tables))

    def send(self, rank: Rank, request_id: str, pages: list[int], start: int, end: int, last: bool,
             aux: bytes | None = None, groups: dict[str, list[int]] | None = None,
             qos_class: str | None = None, budget_s: float | None = None) -> str:
        spec_ = rank.geometry.spec
        slots = unit_slots(spec_, as_pages(pages, rank.geometry.num_pages, "pages"), start, end, start, None)
        tables = {k: np.asarray(v, dtype=np.int64) for k, v in (groups or {}).items()} or None
        return self.handle(events.SendCalled(rank, request_id, Chunk(start, end, last, slots, aux, tables),
                                             qos_class, budget_s))

    def events_for(self, request_id: str, rank: Rank) -> list[messages.Event]:
        return [e for e in self.told if e.request_id == request_id and e.rank_id == rank.id]

    def outcome(self, request_id: str, rank: Rank) -> messages.Event | None:
        found = self.events_for(request_id, rank)
        assert len(found) <= 1, f"{rank.id} told {len(found)} times: {found}"
        return found[0] if found else None


class Cluster:
    """Nodes, a fake clock and a queue of deliveries between them."""

    def __init__(self, *names: str) -> None:
        self.now = 1000.0
        self.nodes = {n: Node(n, self) for n in names}
        self.queue: deque[tuple[Node, Any]] = deque()
        self.hold_jobs = False
        self.hold_hellos = False
        self.cut_links: set[str] = set()  # source addresses whose link is down
        self.kinds: dict[tuple[str, str], str] = {}  # (prefill, decode) -> transport of a remote pair
        #: a prefill instance over several nodes: instance -> rank coords -> the node that holds it
        #: (what the rendezvous's directory answers in the handshake)
        self.spread: dict[str, dict[tuple[int, int], str]] = {}
        self.sent_upstream: list[messages.Message] = []  # every message a decode node sent a source node
        #: a prefill instance -> what its source node answers a hello while set ("retry later")
        self.retry_reason: dict[str, str] = {}
        #: while set, changes the plan rows a source node's handshake answer carries (a faulty source)
        self.tamper_plan: Callable[[list[list[Any]]], list[list[Any]]] | None = None
        #: a prefill instance -> (code, message) a source node's peer endpoint answers every expect
        #: with while set (busy, draining, a NIXL page table it cannot use): refused, nothing bound
        self.refuse_expects: dict[str, tuple[str, str]] = {}

    def node(self, name: str) -> Node:
        return self.nodes[name]

    def by_address(self, address: str) -> Node:
        return next(n for n in self.nodes.values() if n.address == address)

    def by_identity(self, identity: bytes) -> Node:
        return next(n for n in self.nodes.values() if n.identity == identity)

    def later(self, node: Node, event: Any) -> None:
        self.queue.append((node, event))

    def tick(self, seconds: float) -> None:
        self.now += seconds
        for node in self.nodes.values():
            node.handle(events.Tick())
        self.run()

    # -- effects ------------------------------------------------------------------------------
    def carry(self, node: Node, effect: Any) -> None:
        if isinstance(effect, effects.TellEngine):
            node.told.append(effect.event)
        elif isinstance(effect, effects.StartJob):
            node.jobs.append(effect)
        elif isinstance(effect, effects.SendHandshake):
            node.hellos.append(effect)
        elif isinstance(effect, effects.StopReceiving):
            node.stopped.append(effect.entry)
        elif isinstance(effect, effects.PeerGone):
            node.gone.append(effect)
        elif isinstance(effect, effects.LinkChanged):
            node.links.append(effect)
        elif isinstance(effect, effects.ExpectUpstream):
            self._expect_upstream(node, effect.address, effect.entry, effect.writers)
        elif isinstance(effect, effects.SendUpstream):
            if effect.address not in self.cut_links:
                self._to_source(node, self.by_address(effect.address), effect.message)
        elif isinstance(effect, effects.SendDownstream):
            self._to_decode(node, self.by_identity(effect.identity), effect.message)

    def _expect_upstream(self, node: Node, address: str, entry: DestEntry,
                         writers: tuple[tuple[int, int], ...] | None = None) -> None:
        source = self.by_address(address)
        if entry.source_instance in self.refuse_expects:  # the endpoint's error answer, as the shell reads it
            code, message = self.refuse_expects[entry.source_instance]
            self.later(node, events.UpstreamAbort(address, entry.request_id, code,
                                                  f"source daemon {address}: {message}", started_only=True))
            return
        plan = source.life.routes.plan(entry.source_instance, entry.rank.instance)
        route = source.life.routes.route_of(entry.source_instance, entry.rank.instance, node.identity)
        self.later(source, events.PeerExpected(entry.request_id, entry.source_instance, entry.rank.instance,
                                               entry.rank.coords, plan, route, start=entry.start, writers=writers,
                                               integrity=Sample.from_wire(entry.integrity.to_wire())
                                               if entry.integrity is not None else None))  # as the wire carries it

    def _to_source(self, decode: Node, source: Node, message: messages.Message) -> None:
        self.sent_upstream.append(message)
        if isinstance(message, messages.PeerAbort):
            self.later(source, events.DownstreamAbort(decode.identity, message.request_id,
                                                      message.code or "peer_aborted", message.reason))
        elif isinstance(message, messages.PeerEnded):
            self.later(source, events.DownstreamEnded(decode.identity, message.request_id, message.prefill_instance,
                                                      message.decode_instance, message.code, message.reason))
        elif isinstance(message, messages.Fence):
            self.later(source, _Fence(decode, message.request_id))
        elif isinstance(message, messages.Landed):
            self.later(source, events.DownstreamLanded(decode.identity, message.request_id, message.decode_instance,
                                                       (message.dst[0], message.dst[1])))

    def _to_decode(self, source: Node, decode: Node, message: messages.Message) -> None:
        if isinstance(message, messages.PeerAbort):
            self.later(decode, events.UpstreamAbort(source.address, message.request_id, message.code or "",
                                                    message.reason))
        elif isinstance(message, messages.Fenced):
            self.later(decode, events.UpstreamFenced(source.address, message.request_id))

    # -- the shells' work ---------------------------------------------------------------------
    def answer_hello(self, node: Node, hello: effects.SendHandshake) -> None:
        """A hello reaches its source node, which answers as the peer endpoint does (it plans under
        its own config, binds the pair to the link or remembers the refusal, names the ranks of an
        instance over several nodes); the answer reaches the decode node's core. A hello to a cut
        link is lost."""
        if hello.address in self.cut_links:
            return
        source = self.by_address(hello.address)
        prefill, decode = hello.prefill, hello.decode
        kind = self.kinds.get((prefill, decode), "tcp")
        token = b"token-" + source.identity
        holders = self.spread.get(prefill, {})
        prefill_spec = source.registry.spec(prefill, "prefill") or next(
            (self.node(name).registry.spec(prefill, "prefill") for name in holders.values()), None)
        answer: messages.Message
        if prefill in self.retry_reason:
            answer = messages.HandshakeRetry(self.retry_reason[prefill])
        elif prefill_spec is None:
            answer = messages.HandshakeRetry(f"instance {prefill!r} has no registered prefill rank")
        else:
            route = Route(kind, ("127.0.0.1", 9), node.identity, node.address, token)
            try:
                held = tuple(r.coords for r in node.registry if r.instance == decode and r.role == "decode")
                plan = source.handle(events.HandshakeAsked(node.identity, prefill, decode, prefill_spec, hello.spec,
                                                           "direct", True, route, hello.integrity, held or None))
            except PlanRefusal as refusal:
                source.handle(events.HandshakeRefusedHere(node.identity, prefill, decode))
                answer = messages.HandshakeRefused(refusal.to_wire())
            else:
                ranks = [[tp, pp, self.node(name).address] for (tp, pp), name in sorted(holders.items())] or None
                rows = plan_to_wire(plan) if self.tamper_plan is None else self.tamper_plan(plan_to_wire(plan))
                answer = messages.HandshakeOk(prefill_spec.to_dict(), plan.mode, rows, source.incarnation,
                                              {"transport": kind}, ranks, None, source.life.standing(prefill))
        node.handle(events.HandshakeAnswered(source.address, prefill, decode, answer, token, kind))

    def run_job(self, node: Node, job: effects.StartJob, ok: bool = True) -> None:
        """What a data thread does: admit the chunk at the destination, account it, report back."""
        dest = node if job.job.data_address is None else self.by_address_of_route(job)
        error: BaseException | None = None
        try:
            sink = dest.inbox.begin(job.job.header(), rank_id(job.job.decode_instance, *job.job.dst))
            dest.inbox.finish(sink, ok)
            if not ok:
                error = KvxferError("simulated transport failure", field="transport", code="transfer")
        except KvxferError as exc:
            error = exc
        moved = Moved(job.job.nbytes, 1, "direct") if error is None else None
        self.later(node, events.JobFinished(job.entry, job.target, job.index, job.kind, moved, 0.001, error))

    def by_address_of_route(self, job: effects.StartJob) -> Node:
        route = job.target.route
        assert route is not None
        return self.by_address(route.daemon)

    def run(self, limit: int = 10_000) -> None:
        """Deliver everything pending (held jobs and hellos stay held)."""
        for _ in range(limit):
            if self.queue:
                node, event = self.queue.popleft()
                if isinstance(event, _Fence):
                    answer = node.handle(events.FenceAsked(event.decode.identity, event.request_id))
                    if answer is not None:
                        self._to_decode(node, event.decode, answer)
                    continue
                node.handle(event)
                continue
            work = False
            for node in self.nodes.values():
                if node.hellos and not self.hold_hellos:
                    self.answer_hello(node, node.hellos.pop(0))
                    work = True
                    break
                if node.jobs and not self.hold_jobs:
                    self.run_job(node, node.jobs.pop(0))
                    work = True
                    break
            if not work:
                return
        raise AssertionError("the cluster did not settle")


@dataclass(frozen=True)
class _Fence:
    decode: Node
    request_id: str


def pages(n: int, first: int = 0) -> list[int]:
    return list(range(first, first + n))


def nbytes_of(spec_: InstanceSpec, tokens: int) -> int:
    """Bytes a whole request of ``tokens`` tokens moves into one decode rank (K and V, every layer)."""
    return tokens * spec_.num_layers * len(spec_.region_kinds) * spec_.local_heads * spec_.head_dim * 2

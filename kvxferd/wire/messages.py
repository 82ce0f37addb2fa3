"""Typed messages between engines and the daemon, and between daemons.

One dataclass per wire op, and the one definition of it: each field names the checker its
incoming value must pass (:func:`wire`), a field with a default is optional (left out on the
wire when ``None``), one without is required. The schemas the validator
(:class:`kvxferd.wire.protocol.Schema`) uses, :data:`ENGINE_SCHEMAS`, :data:`PEER_SCHEMAS` and
:data:`HANDSHAKE_ANSWERS`, are derived from the classes (:func:`schema_of`), so a field and its
check cannot drift apart. Incoming messages are checked and then typed with
:func:`parse_engine` / :func:`parse_peer` / :func:`parse_handshake_answer`; outgoing ones are
built as these types and put on the wire with :meth:`Message.to_wire`: msgpack maps with an
``op`` field.

``extra`` holds fields a message carries for a transport (NIXL's offer in a handshake, its
page table in an expect): the transport builds and reads them, the lifecycle passes them on.
Their checkers live in :mod:`kvxferd.wire.protocol` with the transport's other fields; the
``extra`` field names which of them the message takes (:func:`extras`).

Messages this daemon only sends and never checks (:class:`Event`, :class:`AnnounceOk`,
:class:`Ranks`, :class:`PeerError`) are read by the other side as plain maps; their fields
declare no checker.
"""

from __future__ import annotations

import functools
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Mapping

from ..errors import ProtocolError
from ..model.qos import CLASSES, MAX_BUDGET_MS, MAX_DEADLINE_AT
from ..model.sampling import MAX_PERIOD, MODES
from .protocol import (ADDRESS, BATCH_PARTS, EXPECT_TARGETS, INCARNATION, MAX_DP, MAX_INSTANCE_RANKS,
                       MAX_PLAN_ROWS, NAME, NIXL_OFFER, REQUEST_ID, TRANSPORT_CHOICE, Checker, Schema, asked_sample,
                       blob, boolean, check_op, group_tables, int_list, integer, list_of, mapping, number, pair,
                       plan_row, rank_at, region, text)

#: cut lengths the schemas allow for free text sent to a peer
MAX_REASON = 500
MAX_CODE = 64

#: where a field keeps its checker, and ``extra`` the transport fields it takes (dataclass metadata)
CHECK = "check"
EXTRAS = "extras"


def wire(check: Checker, default: Any = MISSING) -> Any:
    """A message field and the checker its incoming value must pass, declared together so the
    validator's schema is read off the class. With a ``default`` the field is optional."""
    return field(default=default, metadata={CHECK: check})


def extras(checks: Mapping[str, Checker]) -> Any:
    """The ``extra`` field: the transport fields a message may carry, with their checkers (kept in
    :mod:`kvxferd.wire.protocol`, where each transport's fields are defined once)."""
    return field(default_factory=dict, metadata={EXTRAS: dict(checks)})


ROLE = text(16, ("prefill", "decode"))
MODE = text(16, ("auto", "direct", "staged"))
POSITION = integer(0, 1 << 40)  # a token position in a request
REASON = text(512)
CODE = text(64)


@dataclass(frozen=True)
class Message:
    """Base of every typed message: ``op`` is the class's wire name."""

    op: ClassVar[str] = ""

    def to_wire(self) -> dict[str, Any]:
        # the instance dict holds the fields in declaration order (no slots): one pass, no
        # dataclasses.fields() per message on the control path
        out: dict[str, Any] = {"op": self.op}
        for name, value in self.__dict__.items():
            if name == "extra":
                out.update(value)
            elif value is not None:
                out[name] = value
        return out

    @classmethod
    def from_checked(cls, checked: Mapping[str, Any]) -> "Message":
        """Build from a map the protocol schemas already validated."""
        names = _field_names(cls)
        known = {k: v for k, v in checked.items() if k in names and k != "extra"}
        if "extra" in names:
            known["extra"] = {k: v for k, v in checked.items() if k not in names and k not in ("op", "seq")}
        return cls(**known)


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls))


# -- engine -> daemon ---------------------------------------------------------------------

@dataclass(frozen=True)
class Register(Message):
    op: ClassVar[str] = "register"
    instance: str = wire(NAME)
    role: str = wire(ROLE)
    geometry: dict[str, Any] = wire(mapping)
    regions: list[dict[str, Any]] = wire(list_of(region, 1 << 16))
    pid: int | None = wire(integer(1, 1 << 31), None)
    #: the instance's rendezvous daemon (its ranks span several daemons)
    rendezvous: str | None = wire(ADDRESS, None)
    #: a data-parallel rank of the instance (DP attention), with dp_size: filed as <instance>@dp<dp_rank>
    dp_rank: int | None = wire(integer(0, MAX_DP - 1), None)
    dp_size: int | None = wire(integer(1, MAX_DP), None)
    #: the integrity mode the instance asks for (off, sampled, full); this daemon's applies where stricter
    integrity: str | None = wire(text(8, MODES), None)


@dataclass(frozen=True)
class Unregister(Message):
    op: ClassVar[str] = "unregister"
    rank_id: str = wire(NAME)


@dataclass(frozen=True)
class Expect(Message):
    """A decode rank will receive ``request_id`` into ``pages`` from ``source_instance``."""

    op: ClassVar[str] = "expect"
    rank_id: str = wire(NAME)
    request_id: str = wire(REQUEST_ID)
    source_instance: str = wire(NAME)
    pages: list[int] = wire(int_list())
    source_address: str | None = wire(ADDRESS, None)
    num_tokens: int | None = wire(integer(1, 1 << 40), None)
    start: int | None = wire(POSITION, None)
    timeout_s: float | None = wire(number(0.001, 86400), None)
    #: the source instance's DP rank that holds the request
    source_dp_rank: int | None = wire(integer(0, MAX_DP - 1), None)
    #: cache groups: page table per KV group, [slot] per state group
    groups: dict[str, list[int]] | None = wire(group_tables, None)


@dataclass(frozen=True)
class Send(Message):
    """A prefill rank hands over tokens ``[start, end)`` of a request (one chunk)."""

    op: ClassVar[str] = "send"
    rank_id: str = wire(NAME)
    request_id: str = wire(REQUEST_ID)
    pages: list[int] = wire(int_list())
    start: int = wire(POSITION)
    end: int = wire(POSITION)
    last: bool = wire(boolean)
    aux: bytes | None = wire(blob(), None)
    #: cache groups: the chunk's pages per KV group, state slots
    groups: dict[str, list[int]] | None = wire(group_tables, None)
    #: the request's transfer class ("latency" or "bulk"; None: its instance's, qos.instances). The
    #: first chunk's class and budget hold for the whole request
    qos_class: str | None = wire(text(16, CLASSES), None)
    #: ms from this call by which the request's KV must have landed; one that cannot, or did not,
    #: fails with code "deadline" (None: no deadline)
    budget_ms: float | None = wire(number(0.001, MAX_BUDGET_MS), None)
    #: the wall-clock time (Unix seconds, the node's clock, which engine and daemon share) by which
    #: the request's KV must have landed; with ``budget_ms`` too, the earlier holds. One already
    #: past fails ``deadline`` before a byte moves
    deadline_at: float | None = wire(number(0.0, MAX_DEADLINE_AT), None)


@dataclass(frozen=True)
class Poll(Message):
    op: ClassVar[str] = "poll"
    rank_id: str = wire(NAME)
    request_id: str = wire(REQUEST_ID)


@dataclass(frozen=True)
class Abort(Message):
    op: ClassVar[str] = "abort"
    rank_id: str = wire(NAME)
    request_id: str = wire(REQUEST_ID)
    reason: str | None = wire(REASON, None)


@dataclass(frozen=True)
class Status(Message):
    op: ClassVar[str] = "status"


@dataclass(frozen=True)
class Ping(Message):
    op: ClassVar[str] = "ping"


# -- daemon -> engine ---------------------------------------------------------------------

@dataclass(frozen=True)
class Event(Message):
    """A request reached a terminal state at a rank (``done`` or ``failed``)."""

    op: ClassVar[str] = "event"
    rank_id: str
    request_id: str
    state: str
    bytes: int
    code: str | None = None
    reason: str | None = None
    aux: bytes | None = None

    @classmethod
    def of(cls, rank_id: str, request_id: str, record: Mapping[str, Any]) -> "Event":
        return cls(rank_id, request_id, record["state"], record["bytes"], record.get("code"),
                   record.get("reason"), record.get("aux"))


def reply(**fields_: Any) -> dict[str, Any]:
    """An engine call's answer: ``ok`` true and what the call returns."""
    return {"op": "reply", "ok": True, **fields_}


def error_reply(error: Mapping[str, Any]) -> dict[str, Any]:
    return {"op": "reply", "ok": False, "error": dict(error)}


# -- daemon <-> daemon --------------------------------------------------------------------

@dataclass(frozen=True)
class Handshake(Message):
    """Decode daemon -> prefill daemon, once per (prefill instance, decode instance) pair."""

    op: ClassVar[str] = "handshake"
    v: int = wire(integer(0, 1 << 16))
    daemon: str = wire(ADDRESS)
    data_address: str = wire(ADDRESS)
    prefill_instance: str = wire(NAME)
    decode_instance: str = wire(NAME)
    decode_spec: dict[str, Any] = wire(mapping)
    mode: str = wire(MODE)
    transports: list[str] = wire(list_of(text(32), 16))
    data_token: bytes | None = wire(blob(64), None)
    incarnation: str | None = wire(INCARNATION, None)
    decode_tensors: bool | None = wire(boolean, None)
    #: the decode instance's standing integrity period for every request of the pair (1: full;
    #: left out: off); the pair agrees the shorter of both sides' (kvxferd.model.sampling)
    integrity: int | None = wire(integer(1, MAX_PERIOD), None)
    extra: dict[str, Any] = extras(NIXL_OFFER)  # the transports' offer (NIXL agent, regions)
    #: the decode instance's ranks registered at the sending daemon ([tp, pp] each; left out: all of
    #: them): another live decode daemon holding one of them is refused (two instances, one name)
    ranks: list[list[int]] | None = wire(list_of(pair, MAX_INSTANCE_RANKS), None)


@dataclass(frozen=True)
class HandshakeOk(Message):
    op: ClassVar[str] = "handshake_ok"
    prefill_spec: dict[str, Any] = wire(mapping)
    mode: str = wire(MODE)
    #: the pair's plan, made here once, one row per writer (:mod:`kvxferd.model.plan_wire`)
    plan: list[list[Any]] = wire(list_of(plan_row, MAX_PLAN_ROWS))
    incarnation: str | None = wire(INCARNATION, None)  # every daemon sends it; a restart shows in it
    extra: dict[str, Any] = extras(TRANSPORT_CHOICE)  # the transport chosen and what it needs
    #: the instance's ranks over several daemons, ``[[tp, pp, daemon], ...]`` (left out: all here)
    ranks: list[list[Any]] | None = wire(list_of(rank_at, MAX_INSTANCE_RANKS), None)
    #: peer control messages this daemon reads from one multipart message (left out: one per message)
    batch: int | None = wire(BATCH_PARTS, None)
    #: the prefill instance's standing integrity period (as the hello's ``integrity``)
    integrity: int | None = wire(integer(1, MAX_PERIOD), None)


@dataclass(frozen=True)
class HandshakeRefused(Message):
    op: ClassVar[str] = "handshake_refused"
    error: dict[str, Any] = wire(mapping)


@dataclass(frozen=True)
class HandshakeRetry(Message):
    op: ClassVar[str] = "handshake_retry"
    reason: str = wire(text(8192))


@dataclass(frozen=True)
class PeerExpect(Message):
    """Decode daemon -> prefill daemon: the decode rank ``dst`` expects the request."""

    op: ClassVar[str] = "expect"
    request_id: str = wire(REQUEST_ID)
    prefill_instance: str = wire(NAME)
    decode_instance: str = wire(NAME)
    dst: list[int] = wire(pair)
    num_tokens: int = wire(POSITION)
    start: int | None = wire(POSITION, None)  # left out when 0 (nothing cached on the decode side)
    extra: dict[str, Any] = extras(EXPECT_TARGETS)  # dst_pages and regions for one-sided writes
    #: the writers the receiving daemon holds (left out: every writer)
    writers: list[list[int]] | None = wire(list_of(pair, MAX_INSTANCE_RANKS), None)
    #: the granules of the request the decode side checks against digests, [period, offset] and
    #: its picks by cache group where it chose them page by page ([1, 0]: every chunk whole;
    #: kvxferd.model.sampling): the source sends digests covering them whatever its own mode
    #: (left out: nothing asked)
    integrity: list[Any] | None = wire(asked_sample, None)


@dataclass(frozen=True)
class PeerAbort(Message):
    op: ClassVar[str] = "abort"
    request_id: str = wire(REQUEST_ID)
    reason: str = wire(REASON)
    code: str | None = wire(CODE, None)

    @classmethod
    def of(cls, request_id: str, code: str, message: str) -> "PeerAbort":
        return cls(request_id, message[:MAX_REASON], code[:MAX_CODE])


@dataclass(frozen=True)
class PeerEnded(Message):
    """Decode -> prefill: the request a decode rank expected from ``prefill_instance`` ended on the
    decode side before its expect reached the prefill daemon (the pair was refused at the handshake,
    by either daemon; the decode engine aborted; a phase timeout; the decode rank went). The prefill
    daemon fails the request's sources there with ``code`` and ``reason``, and a send or poll that
    comes later finds it failed. An expect that reached the prefill daemon is ended by :class:`PeerAbort`."""

    op: ClassVar[str] = "ended"
    request_id: str = wire(REQUEST_ID)
    prefill_instance: str = wire(NAME)
    decode_instance: str = wire(NAME)
    code: str = wire(CODE)
    reason: str = wire(REASON)

    @classmethod
    def of(cls, request_id: str, prefill: str, decode: str, code: str, message: str) -> "PeerEnded":
        return cls(request_id, prefill, decode, code[:MAX_CODE] or "failed",
                   message[:MAX_REASON] or "the request ended on the decode side")


@dataclass(frozen=True)
class Fence(Message):
    """Decode -> prefill: the request failed here; answer :class:`Fenced` once no WRITE is in flight."""

    op: ClassVar[str] = "fence"
    request_id: str = wire(REQUEST_ID)


@dataclass(frozen=True)
class Fenced(Message):
    op: ClassVar[str] = "fenced"
    request_id: str = wire(REQUEST_ID)


@dataclass(frozen=True)
class Landed(Message):
    """Decode -> prefill, over a one-sided transport: decode rank ``dst`` of ``decode_instance``
    holds the whole request, every chunk's bytes and header checked. A source's WRITEs complete
    before the decode daemon has read their headers, so a source rank is done only once each
    of its one-sided destinations said this; a header refused here fails the request instead."""

    op: ClassVar[str] = "landed"
    request_id: str = wire(REQUEST_ID)
    decode_instance: str = wire(NAME)
    dst: list[int] = wire(pair)


@dataclass(frozen=True)
class Announce(Message):
    """A daemon -> an instance's rendezvous: the ranks of the instance registered here (all of
    them: a rank left out is withdrawn). Renewed with every heartbeat: a lease."""

    op: ClassVar[str] = "announce"
    daemon: str = wire(ADDRESS)
    incarnation: str = wire(INCARNATION)
    instance: str = wire(NAME)
    role: str = wire(ROLE)
    spec: dict[str, Any] = wire(mapping)
    ranks: list[list[int]] = wire(list_of(pair, MAX_INSTANCE_RANKS))
    #: the instance is one DP rank of a data-parallel instance
    dp_size: int | None = wire(integer(1, MAX_DP), None)


@dataclass(frozen=True)
class AnnounceOk(Message):
    op: ClassVar[str] = "announce_ok"
    instance: str


@dataclass(frozen=True)
class Lookup(Message):
    """Which daemon holds which rank of an instance (answered by its rendezvous with :class:`Ranks`)."""

    op: ClassVar[str] = "lookup"
    instance: str = wire(NAME)
    role: str = wire(ROLE)


@dataclass(frozen=True)
class Ranks(Message):
    op: ClassVar[str] = "ranks"
    instance: str
    ranks: list[list[Any]]  # [[tp, pp, daemon], ...], every rank of the instance
    #: a data-parallel instance: its dp_size, each complete DP rank's rank map
    #: ``[[dp_rank, [[tp, pp, daemon], ...]], ...]``, and what keeps the others incomplete
    dp_size: int | None = None
    dp_ranks: list[list[Any]] | None = None
    missing: list[str] | None = None
    spec: dict[str, Any] | None = None  # the instance's spec (of a DP instance: each DP rank's)


@dataclass(frozen=True)
class PeerPing(Message):
    op: ClassVar[str] = "ping"
    daemon: str = wire(ADDRESS)
    incarnation: str | None = wire(INCARNATION, None)
    #: a source daemon asks whether this daemon sent a handshake: the digest of the data token it
    #: carried (:func:`kvxferd.wire.auth.token_digest`); the pong says ``confirmed``
    confirm: bytes | None = wire(blob(64), None)


@dataclass(frozen=True)
class Pong(Message):
    op: ClassVar[str] = "pong"
    daemon: str = wire(ADDRESS)
    incarnation: str | None = wire(INCARNATION, None)
    batch: int | None = wire(BATCH_PARTS, None)  # as in HandshakeOk
    confirmed: bool | None = wire(boolean, None)  # the answer to a ping's ``confirm``


@dataclass(frozen=True)
class PeerError(Message):
    """An error answer; ``request_id`` names the request it is about (unsolicited errors)."""

    op: ClassVar[str] = "error"
    error: dict[str, Any]
    request_id: str | None = None
    incarnation: str | None = None

    @classmethod
    def about(cls, request_id: str, code: str, message: str, field_: str | None = None,
              incarnation: str | None = None) -> "PeerError":
        err: dict[str, Any] = {"code": code}
        if field_ is not None:
            err["field"] = field_
        err["message"] = message
        return cls(err, request_id, incarnation)


def schema_of(cls: type[Message]) -> Schema:
    """The schema the validator checks ``cls``'s op against, read off its fields: required are
    those without a default, optional those with one, and ``extra`` adds its transport fields.
    A field that declares no checker, or a transport field named like a field, is a TypeError
    when this module loads: no message is checked against a schema that misses a field."""
    required: dict[str, Checker] = {}
    optional: dict[str, Checker] = {}
    extra: dict[str, Checker] = {}
    for f in fields(cls):
        if f.name == "extra":
            if EXTRAS not in f.metadata:
                raise TypeError(f"{cls.__name__}.extra names no transport fields: declare it with extras()")
            extra = dict(f.metadata[EXTRAS])
        elif CHECK not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} has no checker: declare it with wire(checker)")
        elif f.default is MISSING and f.default_factory is MISSING:
            required[f.name] = f.metadata[CHECK]
        else:
            optional[f.name] = f.metadata[CHECK]
    clash = sorted(set(extra) & (set(required) | set(optional)))
    if clash:
        raise TypeError(f"{cls.__name__}.extra takes {clash}, which are fields of the class")
    return Schema(required, optional, extra)


ENGINE_TYPES: dict[str, type[Message]] = {
    t.op: t for t in (Register, Unregister, Expect, Send, Poll, Abort, Status, Ping)}
PEER_TYPES: dict[str, type[Message]] = {
    t.op: t for t in (Handshake, PeerExpect, PeerAbort, PeerEnded, Fence, Fenced, Landed, Announce, Lookup, PeerPing, Pong)}
#: a source daemon's answers to a handshake, as the decode daemon reads them
HANDSHAKE_ANSWER_TYPES: dict[str, type[Message]] = {t.op: t for t in (HandshakeOk, HandshakeRefused, HandshakeRetry)}

ENGINE_SCHEMAS: dict[str, Schema] = {op: schema_of(t) for op, t in ENGINE_TYPES.items()}
PEER_SCHEMAS: dict[str, Schema] = {op: schema_of(t) for op, t in PEER_TYPES.items()}
HANDSHAKE_ANSWERS: dict[str, Schema] = {op: schema_of(t) for op, t in HANDSHAKE_ANSWER_TYPES.items()}


def check_engine(message: Mapping[str, Any]) -> dict[str, Any]:
    """Validate one decoded engine message (a map with a string ``op``); the checked map."""
    return check_op(ENGINE_SCHEMAS, message, "engine")


def check_peer(message: Mapping[str, Any]) -> dict[str, Any]:
    """Validate one decoded peer message (a map with a string ``op``); the checked map."""
    return check_op(PEER_SCHEMAS, message, "peer")


def parse_engine(raw: Mapping[str, Any]) -> Message:
    """Validate and type one decoded engine message."""
    checked = check_engine(raw)
    return ENGINE_TYPES[checked["op"]].from_checked(checked)


def parse_handshake_answer(raw: Mapping[str, Any]) -> Message:
    """Validate and type a source daemon's answer to a handshake (ProtocolError if it is none)."""
    op = raw.get("op")
    schema = HANDSHAKE_ANSWERS.get(op) if isinstance(op, str) else None
    if schema is None:
        raise ProtocolError(f"a handshake answered with op {str(op)[:32]!r}", field="op",
                            fix=f"answer with one of {sorted(HANDSHAKE_ANSWERS)}")
    return HANDSHAKE_ANSWER_TYPES[op].from_checked(schema.check(raw))


def parse_peer(raw: Mapping[str, Any]) -> Message:
    """Validate and type one decoded peer message."""
    checked = check_peer(raw)
    return PEER_TYPES[checked["op"]].from_checked(checked)

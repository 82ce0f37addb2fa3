"""Typed messages between engines and the daemon, and between daemons.

One dataclass per wire op. Incoming messages are validated by the schemas of
:mod:`kvxferd.wire.protocol` (the one validator) and then turned into these types with
:func:`parse_engine` / :func:`parse_peer`; outgoing ones are built as these types and put
on the wire with :meth:`Message.to_wire`. The wire format is the one the schemas describe:
msgpack maps with an ``op`` field, optional fields left out when unset.

``extra`` holds fields a message carries for a transport (NIXL's offer in a handshake, its
page table in an expect): the transport builds and reads them, the lifecycle passes them on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Mapping

from . import protocol
from ..errors import ProtocolError

#: cut lengths the schemas allow for free text sent to a peer
MAX_REASON = 500
MAX_CODE = 64


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
    instance: str
    role: str
    geometry: dict[str, Any]
    regions: list[dict[str, Any]]
    pid: int | None = None
    rendezvous: str | None = None  # the instance's rendezvous daemon (its ranks span several daemons)
    dp_rank: int | None = None  # a data-parallel rank of the instance (with dp_size)
    dp_size: int | None = None


@dataclass(frozen=True)
class Unregister(Message):
    op: ClassVar[str] = "unregister"
    rank_id: str


@dataclass(frozen=True)
class Expect(Message):
    """A decode rank will receive ``request_id`` into ``pages`` from ``source_instance``."""

    op: ClassVar[str] = "expect"
    rank_id: str
    request_id: str
    source_instance: str
    pages: list[int]
    source_address: str | None = None
    num_tokens: int | None = None
    start: int | None = None
    timeout_s: float | None = None
    source_dp_rank: int | None = None  # the source instance's DP rank that holds the request
    groups: dict[str, list[int]] | None = None  # cache groups: page table per KV group, [slot] per state group


@dataclass(frozen=True)
class Send(Message):
    """A prefill rank hands over tokens ``[start, end)`` of a request (one chunk)."""

    op: ClassVar[str] = "send"
    rank_id: str
    request_id: str
    pages: list[int]
    start: int
    end: int
    last: bool
    aux: bytes | None = None
    groups: dict[str, list[int]] | None = None  # cache groups: the chunk's pages per KV group, state slots


@dataclass(frozen=True)
class Poll(Message):
    op: ClassVar[str] = "poll"
    rank_id: str
    request_id: str


@dataclass(frozen=True)
class Abort(Message):
    op: ClassVar[str] = "abort"
    rank_id: str
    request_id: str
    reason: str | None = None


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
    v: int
    daemon: str
    data_address: str
    prefill_instance: str
    decode_instance: str
    decode_spec: dict[str, Any]
    mode: str
    transports: list[str]
    data_token: bytes | None = None
    incarnation: str | None = None
    decode_tensors: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # the transports' offer (NIXL agent, regions)


@dataclass(frozen=True)
class HandshakeOk(Message):
    op: ClassVar[str] = "handshake_ok"
    prefill_spec: dict[str, Any]
    mode: str
    incarnation: str | None = None  # every daemon sends it; a restart shows in it
    extra: dict[str, Any] = field(default_factory=dict)  # the transport chosen and what it needs
    #: the instance's ranks over several daemons, ``[[tp, pp, daemon], ...]`` (left out: all here)
    ranks: list[list[Any]] | None = None
    #: peer control messages this daemon reads from one multipart message (left out: one per message)
    batch: int | None = None


@dataclass(frozen=True)
class HandshakeRefused(Message):
    op: ClassVar[str] = "handshake_refused"
    error: dict[str, Any]


@dataclass(frozen=True)
class HandshakeRetry(Message):
    op: ClassVar[str] = "handshake_retry"
    reason: str


@dataclass(frozen=True)
class PeerExpect(Message):
    """Decode daemon -> prefill daemon: the decode rank ``dst`` expects the request."""

    op: ClassVar[str] = "expect"
    request_id: str
    prefill_instance: str
    decode_instance: str
    dst: list[int]
    num_tokens: int
    start: int | None = None  # left out when 0 (nothing cached on the decode side)
    extra: dict[str, Any] = field(default_factory=dict)  # dst_pages and regions for one-sided writes
    writers: list[list[int]] | None = None  # the writers the receiving daemon holds (left out: every writer)


@dataclass(frozen=True)
class PeerAbort(Message):
    op: ClassVar[str] = "abort"
    request_id: str
    reason: str
    code: str | None = None

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
    request_id: str
    prefill_instance: str
    decode_instance: str
    code: str
    reason: str

    @classmethod
    def of(cls, request_id: str, prefill: str, decode: str, code: str, message: str) -> "PeerEnded":
        return cls(request_id, prefill, decode, code[:MAX_CODE] or "failed",
                   message[:MAX_REASON] or "the request ended on the decode side")


@dataclass(frozen=True)
class Fence(Message):
    """Decode -> prefill: the request failed here; answer :class:`Fenced` once no WRITE is in flight."""

    op: ClassVar[str] = "fence"
    request_id: str


@dataclass(frozen=True)
class Fenced(Message):
    op: ClassVar[str] = "fenced"
    request_id: str


@dataclass(frozen=True)
class Announce(Message):
    """A daemon -> an instance's rendezvous: the ranks of the instance registered here (all of
    them: a rank left out is withdrawn). Renewed with every heartbeat: a lease."""

    op: ClassVar[str] = "announce"
    daemon: str
    incarnation: str
    instance: str
    role: str
    spec: dict[str, Any]
    ranks: list[list[int]]
    dp_size: int | None = None  # the instance is one DP rank of a data-parallel instance


@dataclass(frozen=True)
class AnnounceOk(Message):
    op: ClassVar[str] = "announce_ok"
    instance: str


@dataclass(frozen=True)
class Lookup(Message):
    """Which daemon holds which rank of an instance (answered by its rendezvous with :class:`Ranks`)."""

    op: ClassVar[str] = "lookup"
    instance: str
    role: str


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
    daemon: str
    incarnation: str | None = None


@dataclass(frozen=True)
class Pong(Message):
    op: ClassVar[str] = "pong"
    daemon: str
    incarnation: str | None = None
    batch: int | None = None  # as in HandshakeOk


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


ENGINE_TYPES: dict[str, type[Message]] = {
    t.op: t for t in (Register, Unregister, Expect, Send, Poll, Abort, Status, Ping)}
PEER_TYPES: dict[str, type[Message]] = {
    t.op: t for t in (Handshake, PeerExpect, PeerAbort, PeerEnded, Fence, Fenced, Announce, Lookup, PeerPing, Pong)}
assert set(ENGINE_TYPES) == set(protocol.ENGINE_SCHEMAS) and set(PEER_TYPES) == set(protocol.PEER_SCHEMAS)


def parse_engine(raw: Mapping[str, Any]) -> Message:
    """Validate (protocol's schemas) and type one decoded engine message."""
    checked = protocol.check_engine(raw)
    return ENGINE_TYPES[checked["op"]].from_checked(checked)


HANDSHAKE_ANSWER_TYPES: dict[str, type[Message]] = {t.op: t for t in (HandshakeOk, HandshakeRefused, HandshakeRetry)}
assert set(HANDSHAKE_ANSWER_TYPES) == set(protocol.HANDSHAKE_ANSWERS)


def parse_handshake_answer(raw: Mapping[str, Any]) -> Message:
    """Validate and type a source daemon's answer to a handshake (ProtocolError if it is none)."""
    op = raw.get("op")
    schema = protocol.HANDSHAKE_ANSWERS.get(op) if isinstance(op, str) else None
    if schema is None:
        raise ProtocolError(f"a handshake answered with op {str(op)[:32]!r}", field="op",
                                     fix=f"answer with one of {sorted(protocol.HANDSHAKE_ANSWERS)}")
    return HANDSHAKE_ANSWER_TYPES[op].from_checked(schema.check(raw))


def parse_peer(raw: Mapping[str, Any]) -> Message:
    """Validate (protocol's schemas) and type one decoded peer message."""
    checked = protocol.check_peer(raw)
    return PEER_TYPES[checked["op"]].from_checked(checked)

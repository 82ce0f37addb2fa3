"""What happens to requests, as the lifecycle core hears it. Shells build these from engine
calls, peer messages, data threads and timers; every event carries no clock: the core is
handed ``now`` with each one (see :meth:`Lifecycle.handle`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..model.geometry import InstanceSpec
from ..model.plan import Plan
from ..model.sampling import Sample
from ..wire.messages import Message
from .inbox import DestEntry
from .jobs import Moved
from .outbox import Chunk, Route, SrcEntry, Target
from .registry import Rank


# -- engine calls ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpectCalled:
    """A decode rank expects a request (already validated by the engine endpoint)."""

    rank: Rank
    request_id: str
    source_instance: str
    pages: np.ndarray
    num_tokens: int | None
    start: int
    source_address: str  # empty: the source instance is on this daemon
    groups: Any = None  # cache groups: page table per KV group, [slot] per state group (numpy)


@dataclass(frozen=True)
class SendCalled:
    """A prefill rank hands over one chunk (already validated by the engine endpoint)."""

    rank: Rank
    request_id: str
    chunk: Chunk
    qos_class: str | None = None  # what the engine asked (None: its instance's class)
    budget_s: float | None = None  # from this call to the deadline (None: none)


@dataclass(frozen=True)
class AbortCalled:
    rank: Rank
    request_id: str
    reason: str


@dataclass(frozen=True)
class RankGone:
    """A rank unregistered, re-registered or its process exited: its requests fail."""

    rank: Rank
    reason: str


# -- decode side: the plan and the source daemon --------------------------------------------
@dataclass(frozen=True)
class PlanFound:
    """Bootstrap found the plan; ``token`` and ``transport`` are the source link's (remote sources)."""

    entry: DestEntry
    plan: Plan
    token: bytes | None = None
    transport: str = "local"
    #: a source instance over several daemons: every rank -> the daemon holding it, and each
    #: daemon's link token (empty: the whole instance is at the source address, as before)
    rank_daemons: dict[tuple[int, int], str] = field(default_factory=dict)
    tokens: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class HandshakeAnswered:
    """A source daemon answered a hello (:class:`~.effects.SendHandshake`): ok, refused or retry
    later. ``token`` and ``kind``: the link's data token and the transport the shell accepted."""

    address: str
    prefill: str
    decode: str
    answer: Message  # HandshakeOk | HandshakeRefused | HandshakeRetry
    token: bytes | None = None
    kind: str = "tcp"


@dataclass(frozen=True)
class BootstrapFailed:
    entry: DestEntry
    code: str
    message: str


@dataclass(frozen=True)
class DestChanged:
    """A data thread admitted or finished a chunk of this destination."""

    entry: DestEntry


@dataclass(frozen=True)
class ChunkRefused:
    """A receiving transport refused a chunk of this destination (it fails)."""

    entry: DestEntry
    code: str
    message: str


@dataclass(frozen=True)
class UpstreamAbort:
    """The source daemon at ``address`` aborted (or errored) a request."""

    address: str
    request_id: str
    code: str
    message: str
    started_only: bool = False  # an error answer: only destinations past bootstrapping fail


@dataclass(frozen=True)
class UpstreamFenced:
    address: str
    request_id: str


@dataclass(frozen=True)
class NoHandshake:
    """The source daemon forgot the instance pair (it restarted): handshake again, once."""

    address: str
    request_id: str


@dataclass(frozen=True)
class SourceLost:
    """The source daemon stopped answering (``code`` peer_dead), restarted or refused this one's key."""

    address: str
    code: str
    message: str
    #: peer_restarted: when the message left that the new process answered (None: unknown). Messages
    #: to a source go over one connection in order, so an expect sent after it reached the new
    #: process too, and only expects sent by then can have reached the old one.
    sent_before: float | None = None


# -- prefill side: decode daemons -----------------------------------------------------------
@dataclass(frozen=True)
class HandshakeAsked:
    """A decode daemon's hello, checked by the peer endpoint (its rank set, specs and transport):
    the core plans the pair under this daemon's config and binds it to the link's route. The
    plan is the answer; a :class:`~kvxferd.errors.PlanRefusal` is raised to the endpoint."""

    identity: bytes
    prefill: str
    decode: str
    spec: InstanceSpec  # the prefill instance's
    decode_spec: InstanceSpec
    mode: str  # direct or staged, as the transport allows
    decode_tensors: bool
    route: Route
    integrity: int | None = None  # the decode instance's standing integrity period (None: off)
    #: the decode ranks the hello claims its daemon holds (None: every rank of the instance)
    ranks: tuple[tuple[int, int], ...] | None = None


@dataclass(frozen=True)
class HandshakeRefusedHere:
    """This daemon refused a pair's hello over a link: that link may still end the pair's requests."""

    identity: bytes
    prefill: str
    decode: str


@dataclass(frozen=True)
class PeerExpected:
    """A decode daemon's expect, checked against the pair's handshake by the peer endpoint."""

    request_id: str
    prefill: str
    decode: str
    dst: tuple[int, int]
    plan: Plan
    route: Any
    dst_pages: Any = None
    start: int = 0
    writers: tuple[tuple[int, int], ...] | None = None  # the writers held here (None: every writer)
    num_tokens: int = 0  # the request's length (0: not given); a sliding-window group's window ends there
    dst_groups: Any = None  # route "nixl": each cache group's destination table (pages, or [state slot])
    #: what the destination checks against digests (None: nothing asked): its chunks carry them
    integrity: Sample | None = None


@dataclass(frozen=True)
class DownstreamAbort:
    identity: bytes
    request_id: str
    code: str
    message: str


@dataclass(frozen=True)
class DownstreamEnded:
    """A decode rank's request ended before its expect bound it here (the pair refused at the
    handshake, an abort, a timeout, a rank gone while bootstrapping). ``identity``: the decode
    daemon's link, None when the decode rank is on this daemon."""

    identity: bytes | None
    request_id: str
    prefill: str
    decode: str
    code: str
    message: str


@dataclass(frozen=True)
class DownstreamLanded:
    """A decode daemon says its rank ``dst`` of ``decode`` landed the request whole (one-sided
    transports): the sources routed there over that link may be done."""

    identity: bytes
    request_id: str
    decode: str
    dst: tuple[int, int]


@dataclass(frozen=True)
class FenceAsked:
    identity: bytes
    request_id: str


@dataclass(frozen=True)
class DownstreamLost:
    """A decode daemon stopped answering or restarted: its routes go, its requests fail."""

    identity: bytes
    code: str
    message: str


@dataclass(frozen=True)
class JobFinished:
    """A chunk job returned: ``moved`` and ``seconds`` when every byte landed, else ``error``."""

    entry: SrcEntry
    target: Target
    index: int
    kind: str
    moved: Moved | None = None
    seconds: float = 0.0
    error: BaseException | None = None


# -- timers and shutdown --------------------------------------------------------------------
# -- links to peer daemons, both sides -------------------------------------------------------
@dataclass(frozen=True)
class LinkOpened:
    """Decode side: a link (socket) to the source daemon at ``address`` was opened."""

    address: str


@dataclass(frozen=True)
class SourceHeard:
    """Decode side: a message came from the source daemon at ``address``. Answers True when it
    shows a restart (another incarnation than the link knew): what it answers then is the new
    process's, and the shell drops it."""

    address: str
    incarnation: Any = None  # the one the message named, if any
    sent_before: float | None = None  # when the message it answers left (None: unknown)


@dataclass(frozen=True)
class DecodeHeard:
    """Prefill side: a message came on a decode daemon's connection; ``daemon`` and
    ``incarnation`` where the message named them (ping, handshake)."""

    identity: bytes
    daemon: str | None = None
    incarnation: Any = None


@dataclass(frozen=True)
class DecodeGone:
    """Prefill side: the connection ``identity`` of decode daemon ``daemon`` (incarnation
    ``old``) is gone, and a connection of incarnation ``new`` speaks for that daemon now."""

    identity: bytes
    daemon: str
    old: str
    new: str


@dataclass(frozen=True)
class Heartbeat:
    """Peer liveness: links silent past ``timeout_s`` go down (their requests fail), down links
    nothing waits on are closed."""

    timeout_s: float


@dataclass(frozen=True)
class Tick:
    """Phase timeouts and fence deadlines (``now`` is the handle's)."""


@dataclass(frozen=True)
class ShutDown:
    """Drain's end: fail every request still here (``final``: tell them now, jobs or not)."""

    final: bool = False

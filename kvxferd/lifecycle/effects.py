"""What the lifecycle core asks its shells to do. The core never does I/O itself: it returns
these, in order, and the app hands each to the shell that owns the socket, thread or timer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from ..model.geometry import InstanceSpec
from ..wire.messages import Event, Message
from .inbox import DestEntry
from .jobs import ChunkJob
from .outbox import SrcEntry, Target


@dataclass(frozen=True)
class TellEngine:
    """An event for the engine connection that registered a rank."""

    identity: bytes
    event: Event


@dataclass(frozen=True)
class SendUpstream:
    """A message to the source (prefill) daemon at ``address``, over this daemon's link to it."""

    address: str
    message: Message


@dataclass(frozen=True)
class SendDownstream:
    """A message to a decode daemon, over the peer socket (by its routing id)."""

    identity: bytes
    message: Message


@dataclass(frozen=True)
class ExpectUpstream:
    """Tell the source daemon that this destination expects the request (the shell adds what
    the destination's transport needs, e.g. NIXL's page table)."""

    address: str
    entry: DestEntry
    writers: tuple[tuple[int, int], ...] | None = None  # those the daemon holds (None: every writer)


@dataclass(frozen=True)
class SendHandshake:
    """A hello to the source daemon at ``address`` for one instance pair: the shell numbers it,
    adds what it offers (its addresses, token, transports) and hands the answer back as
    :class:`~.events.HandshakeAnswered`."""

    address: str
    prefill: str
    decode: str
    spec: InstanceSpec  # the decode instance's
    integrity: int | None = None  # the decode instance's standing integrity period (None: off)


@dataclass(frozen=True)
class StartJob:
    """Run one chunk job on a data thread; report :class:`~.events.JobFinished` when it returns."""

    job: ChunkJob
    kind: str  # the route's transport
    entry: SrcEntry
    target: Target
    index: int


@dataclass(frozen=True)
class StopSending:
    """End a failed source's chunk sends now (cut their data connections): a send blocked on a
    receiver that hung up or stalled would otherwise hold the failure back until its socket
    timeout."""

    source: int  # the entry's serial (:attr:`~.outbox.SrcEntry.serial`), which its chunk jobs carry


@dataclass(frozen=True)
class StopReceiving:
    """End writes into a failed destination's pages now (cut connections, drop assemblies)."""

    entry: DestEntry


@dataclass(frozen=True)
class PeerGone:
    """Prefill side: forget a decode daemon's transports state (writes to it stop waiting)."""

    kind: str
    remote: Any
    data_address: tuple[str, int] | None
    why: str


@dataclass(frozen=True)
class LinkChanged:
    """A link to a peer daemon changed (:mod:`.links`): the shell counts and logs it and does what
    the change means for its socket and transports (``why``: heard, silent, idle, restarted, closed)."""

    side: str  # which side the peer serves: "prefill" (a source daemon) or "decode"
    key: Any  # the source's address, or the decode daemon connection's routing id
    daemon: str
    before: str | None
    after: str | None  # None: the link is forgotten
    why: str
    silent_for: float = 0.0  # silent: how long
    old_incarnation: str = ""  # restarted: the process that went
    new_incarnation: str = ""


Effect = Union[TellEngine, SendUpstream, SendDownstream, ExpectUpstream, SendHandshake, StartJob, StopSending,
               StopReceiving, PeerGone, LinkChanged]

"""Decode side of pairing with source daemons: one handshake per (source daemon, prefill
instance, decode instance), every change of its state in one table.

A destination whose source instance lives at another daemon needs the plan of its instance
pair before it can tell the source anything: the handshake. The destinations of one pair
share it, and it holds until the link goes down, the source restarts or forgets the pair.
Nothing here sends or waits: :class:`Handshakes` says which hellos to send (the shell sends
them, numbered, and hands the answers back as events) and which destinations may go on.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from ..model.geometry import InstanceSpec
from ..model.plan import Plan
from ..model.sampling import describe_period
from .inbox import DestEntry

ASKING = "asking"  # a hello is out and unanswered
PAUSED = "paused"  # the source said "retry later": the next hello leaves at ``due``
AGREED = "agreed"  # the plan holds

#: (state, what happened) -> the next state; None: the handshake is forgotten (the next
#: destination of the pair asks again). A pair absent from the book is in state None.
TRANSITIONS: dict[tuple[str | None, str], str | None] = {
    (None, "needed"): ASKING,        # a destination of a pair not agreed yet: hello
    (ASKING, "agreed"): AGREED,      # handshake_ok, and this daemon can plan the answer
    (ASKING, "refused"): None,       # handshake_refused, or an answer this daemon cannot use
    (ASKING, "retry"): PAUSED,       # handshake_retry: missing ranks, a pair bound elsewhere
    (ASKING, "silent"): ASKING,      # no answer within the answer time: hello again
    (PAUSED, "due"): ASKING,         # the pause is over: hello again
    (ASKING, "restarted"): ASKING,   # the source restarted meanwhile: what it offered went with it
    (PAUSED, "restarted"): ASKING,
    (AGREED, "restarted"): None,
    (AGREED, "forgotten"): None,     # link down, or the source answered an expect "no_handshake"
    (ASKING, "forgotten"): ASKING,   # still asking: the answer will be the new process's
    (PAUSED, "forgotten"): PAUSED,
    (ASKING, "auth_failed"): None,   # the source refused this daemon's key: its destinations fail
    (PAUSED, "auth_failed"): None,
    (AGREED, "auth_failed"): None,
    (ASKING, "abandoned"): None,     # no destination waits for it any more
    (PAUSED, "abandoned"): None,
}

Key = tuple[str, str, str]  # (source daemon address, prefill instance, decode instance)

#: pairs remembered as having lost a member daemon (bounded: the oldest go first)
MAX_LOST = 4096


@dataclass
class Handshake:
    """One pair's handshake with one source daemon."""

    key: Key
    spec: InstanceSpec  # the decode instance's, as the hello offers it
    state: str | None = None
    due: float = 0.0  # ASKING: when an unanswered hello goes again; PAUSED: when the next one leaves
    said: str = ""  # the source's last "retry later"
    plan: Plan | None = None
    #: every rank of the source instance -> the daemon holding it, when the rendezvous named them
    rank_map: dict[tuple[int, int], str] = field(default_factory=dict)
    token: bytes | None = None  # the link's data token (data headers of its writers carry it)
    kind: str = "tcp"  # the transport its data arrives over
    waiting: list[DestEntry] = field(default_factory=list)  # destinations that wait for it
    #: integrity: the standing period this side asks for the pair in its hello, and the one agreed
    #: (the shorter of both sides'; None: off) that every request of the pair is checked at least at
    ask: int | None = None
    integrity: int | None = None

    @property
    def address(self) -> str:
        return self.key[0]


class HandshakeError(Exception):
    """A transition the table does not have: a bug in the caller, never a peer's doing."""


class Handshakes:
    """Every handshake of this daemon as the decode side, by key.

    ``move`` is the only writer of a handshake's state; it follows :data:`TRANSITIONS`.
    """

    def __init__(self, answer_s: float, retry_s: float) -> None:
        self.answer_s = answer_s  # an unanswered hello goes again after this
        self.retry_s = retry_s  # a "retry later" is asked again after this
        self.book: dict[Key, Handshake] = {}
        #: pairs whose rendezvous's rank map named a member daemon that went down -> (that daemon,
        #: the ranks it held): until the pair agrees again, the rendezvous's "retry later" means
        #: those ranks are gone, not on their way
        self.lost: OrderedDict[Key, tuple[str, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.book)

    def get(self, key: Key) -> Handshake | None:
        return self.book.get(key)

    def at(self, address: str) -> list[Handshake]:
        return [hs for hs in self.book.values() if hs.address == address]

    def move(self, hs: Handshake, happened: str, now: float) -> str | None:
        """Apply one happening; returns the new state (None: forgotten)."""
        try:
            state = TRANSITIONS[(hs.state, happened)]
        except KeyError:
            raise HandshakeError(f"handshake {hs.key} in state {hs.state}: no transition for {happened!r}") from None
        hs.state = state
        if state == AGREED:
            self.lost.pop(hs.key, None)
        if state is None:
            self.book.pop(hs.key, None)
            hs.plan, hs.rank_map = None, {}
        elif state == ASKING:
            hs.due = now + self.answer_s
        elif state == PAUSED:
            hs.due = now + self.retry_s
        return state

    def member_lost(self, hs: Handshake, member: str, ranks: str) -> None:
        """``hs``'s rank map named ``member``, which went down: remembered past the handshake."""
        self.lost[hs.key] = (member, ranks)
        self.lost.move_to_end(hs.key)
        while len(self.lost) > MAX_LOST:
            self.lost.popitem(last=False)

    def need(self, key: Key, spec: InstanceSpec, entry: DestEntry, now: float) -> tuple[Handshake, bool]:
        """The handshake ``entry`` waits for; True when a hello must leave now (it was not asked)."""
        hs = self.book.get(key)
        fresh = hs is None
        if hs is None:
            hs = self.book[key] = Handshake(key, spec)
            self.move(hs, "needed", now)
        if hs.state != AGREED and not any(e is entry for e in hs.waiting):  # by identity: entries are not values
            hs.waiting.append(entry)
        return hs, fresh

    def due(self, now: float, wanted: Callable[[DestEntry], bool] | None = None) -> list[tuple[Handshake, str]]:
        """Handshakes whose time came: (handshake, what happened) for each, not applied yet.

        ``wanted``: whether a destination still waits for its handshake (default: it has not
        failed); a handshake that no one wants any more is abandoned."""
        out = []
        for hs in list(self.book.values()):
            if hs.state == AGREED:
                continue
            hs.waiting = [e for e in hs.waiting if (wanted(e) if wanted is not None else e.failure is None)]
            if not hs.waiting:
                out.append((hs, "abandoned"))
            elif now >= hs.due:
                out.append((hs, "silent" if hs.state == ASKING else "due"))
        return out

    def integrity_pairs(self) -> list[dict[str, Any]]:
        """For ``status``: each agreed pair this daemon is the destination of, and its agreed mode."""
        return [{"side": "decode", "prefill": hs.key[1], "decode": hs.key[2], "peer": hs.address,
                 "integrity": describe_period(hs.integrity)}
                for hs in self.book.values() if hs.state == AGREED]

    def describe(self) -> list[dict[str, Any]]:
        """For ``status``: every handshake not agreed, and what it waits for."""
        return [{"source": hs.address, "prefill": hs.key[1], "decode": hs.key[2], "state": hs.state,
                 "waiting": len(hs.waiting), **({"said": hs.said} if hs.said else {})}
                for hs in self.book.values() if hs.state != AGREED]

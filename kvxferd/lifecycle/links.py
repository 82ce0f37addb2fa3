"""Links to peer daemons, both directions: whether each is up, when it was last heard, which
process (incarnation) answers on it; every change of a link's state in one table.

A decode daemon opens a link to each source daemon it pulls from (keyed by the source's
address); a prefill daemon learns of each decode daemon when it first hears from it (keyed by
the routing id of its connection). A link that stays silent past the peer timeout is down,
and what waits on it fails; a message that names another incarnation than the link knew shows
a restart. Nothing here sends, pings or closes: :class:`Links` says what happened, and the core
turns that into failures and effects.

A down link costs nothing: its socket is closed, and it is tried again only after a backoff
that doubles with every try that found the peer silent (with jitter, up to a cap), and only if
a request needs it then. Until then requests that name it fail at once (``peer_unreachable``)
instead of waiting out their bootstrap. A link nothing needed for a whole backoff cap after
its backoff ran out is forgotten; the next request that names the peer tries it afresh.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Hashable

CONNECTING = "connecting"  # opened; nothing heard from the peer yet
UP = "up"  # heard within the peer timeout
DOWN = "down"  # silent past the peer timeout: what waited on it failed; tried again after a backoff

#: (state, what happened) -> the next state; None: the link is forgotten. A link absent from
#: the book is in state None.
TRANSITIONS: dict[tuple[str | None, str], str | None] = {
    (None, "opened"): CONNECTING,       # decode side: a socket to a source daemon
    (CONNECTING, "opened"): CONNECTING,  # opened again (a refused key: libzmq does not retry it)
    (UP, "opened"): CONNECTING,
    (DOWN, "opened"): CONNECTING,
    (None, "heard"): UP,                # prefill side: a decode daemon's first message
    (CONNECTING, "heard"): UP,
    (UP, "heard"): UP,
    (DOWN, "heard"): UP,                # back: its requests failed when it went down
    (CONNECTING, "silent"): DOWN,       # never answered within the peer timeout
    (UP, "silent"): DOWN,               # went silent: its requests fail (peer_dead)
    (DOWN, "retry"): CONNECTING,        # its backoff ran out and a request needs it: try again
    (DOWN, "idle"): None,               # nothing needed it for a whole backoff cap after that: forgotten
    (CONNECTING, "closed"): None,       # the peer's process is gone (a restart seen on another link)
    (UP, "closed"): None,
    (DOWN, "closed"): None,
}

#: incarnations longer than this are not taken (the wire allows 64 characters)
MAX_INCARNATION = 64


class LinkError(Exception):
    """A transition the table does not have: a bug in the caller, never a peer's doing."""


@dataclass
class Link:
    """One link to one peer daemon."""

    key: Hashable  # decode side: the source daemon's address; prefill side: the connection's routing id
    daemon: str  # the peer daemon's control address
    state: str | None = None
    last_seen: float = 0.0  # when it was opened or last heard
    incarnation: str = ""  # the peer process's, once a message named it
    tries: int = 0  # tries in a row that found the peer silent (0 once it is heard)
    retry_at: float = 0.0  # DOWN: when it may be tried again
    #: the peer's last refusal of this daemon's key, until it is heard: a request that finds the
    #: link down fails with it (``auth_failed``), not as if the peer were merely unreachable
    refused: str = ""


class Links:
    """Every link of one direction, by key; :meth:`move` is the only writer of a link's state."""

    def __init__(self, side: str, backoff_s: float = 1.0, backoff_max_s: float = 60.0,
                 rng: random.Random | None = None) -> None:
        self.side = side  # which side the peers serve: "prefill" (source daemons) or "decode"
        self.backoff_s = backoff_s  # the first wait after a silent try; doubles with each silent try
        self.backoff_max_s = backoff_max_s
        self.rng = rng or random.Random()  # jitter: links that went down together are not tried together
        self.book: dict[Hashable, Link] = {}
        #: the keys of each daemon address's links: what :meth:`others` reads on every ping, which a
        #: scan of the book made cost O(links) each (a thousand links: O(n^2) a heartbeat)
        self._by_daemon: dict[str, set[Hashable]] = {}

    def __len__(self) -> int:
        return len(self.book)

    def __iter__(self) -> Any:
        return iter(list(self.book.values()))

    def get(self, key: Hashable) -> Link | None:
        return self.book.get(key)

    def is_up(self, key: Hashable) -> bool:
        link = self.book.get(key)
        return link is not None and link.state == UP

    def count(self) -> dict[str, int]:
        """Links by state (every state present, for the peer gauges)."""
        out = {CONNECTING: 0, UP: 0, DOWN: 0}
        for link in self.book.values():
            out[str(link.state)] += 1
        return out

    def move(self, link: Link, happened: str, now: float) -> str | None:
        """Apply one happening; returns the new state (None: forgotten)."""
        try:
            state = TRANSITIONS[(link.state, happened)]
        except KeyError:
            raise LinkError(f"{self.side} link {link.daemon} in state {link.state}: no transition for "
                            f"{happened!r}") from None
        link.state = state
        if state is None:
            if self.book.pop(link.key, None) is not None:
                keys = self._by_daemon.get(link.daemon)
                if keys is not None:
                    keys.discard(link.key)
                    if not keys:
                        del self._by_daemon[link.daemon]
        else:
            self.book[link.key] = link
            self._by_daemon.setdefault(link.daemon, set()).add(link.key)
        if happened in ("opened", "heard", "retry"):
            link.last_seen = now
        if happened == "heard":
            link.tries, link.refused = 0, ""
        elif state == DOWN:
            link.tries += 1
            wait = min(self.backoff_max_s, self.backoff_s * 2 ** (link.tries - 1))
            link.retry_at = now + wait * self.rng.uniform(0.5, 1.0)
        return state

    def backed_off(self, key: Hashable, now: float) -> Link | None:
        """The link if it is down and not to be tried yet (requests that need it fail at once)."""
        link = self.book.get(key)
        return link if link is not None and link.state == DOWN and now < link.retry_at else None

    def open(self, key: Hashable, daemon: str, now: float) -> Link:
        link = self.book.get(key) or Link(key, daemon)
        self.move(link, "opened", now)
        return link

    def heard(self, key: Hashable, daemon: str, now: float) -> tuple[Link, str | None]:
        """A message came on the link; returns it and the state it was in before."""
        link = self.book.get(key) or Link(key, daemon)
        before = link.state
        self.move(link, "heard", now)
        return link, before

    @staticmethod
    def incarnation(link: Link, incarnation: Any) -> str:
        """The peer named its incarnation; returns the one it replaces when it differs (a restart),
        else "". The first one named is learnt; one that is not a short string is ignored."""
        if not isinstance(incarnation, str) or not incarnation or len(incarnation) > MAX_INCARNATION:
            return ""
        old, link.incarnation = link.incarnation, incarnation
        return old if old and old != incarnation else ""

    def others(self, key: Hashable, daemon: str, incarnation: str) -> list[Link]:
        """Other links to the same daemon address that know another incarnation of it: each may
        belong to a process that is gone (the shell asks the socket whether it is)."""
        links = (self.book[k] for k in self._by_daemon.get(daemon, ()) if k != key)
        return [link for link in links if link.incarnation and link.incarnation != incarnation]

    def due(self, now: float, timeout_s: float, waited_on: Callable[[Link], bool]) -> list[tuple[Link, str]]:
        """Links whose time came: (link, what happened) for each, not applied yet.

        Up or connecting links silent past ``timeout_s`` are ``silent``; down ones whose backoff
        ran out are tried again (``retry``) if a request waits on them (``waited_on``), and
        forgotten (``idle``) once nothing did for a backoff cap more. A request that comes for
        a down link after its backoff tries it then (:meth:`backed_off` is None)."""
        out = []
        for link in self.book.values():
            if link.state in (UP, CONNECTING) and now - link.last_seen > timeout_s:
                out.append((link, "silent"))
            elif link.state == DOWN and now >= link.retry_at:
                if waited_on(link):
                    out.append((link, "retry"))
                elif now >= link.retry_at + self.backoff_max_s:
                    out.append((link, "idle"))
        return out

    def describe(self, now: float) -> list[dict[str, Any]]:
        return [{"address": link.daemon, "state": link.state, "side": self.side,
                 "last_seen_s": round(now - link.last_seen, 3), "incarnation": link.incarnation,
                 **({"silent_tries": link.tries, "retry_in_s": round(max(0.0, link.retry_at - now), 3)}
                    if link.state == DOWN else {})}
                for link in self.book.values()]

"""Confirming a decode daemon's claimed address by a call back to it (peer links without auth).

A handshake names the decode daemon's control address (``daemon``), its incarnation and the
data token of its link. Anyone can write those words: a stranger that names a live decode
daemon's address would take its instance pairs. So before a handshake is accepted, this daemon
asks the claimed address itself, on a DEALER socket of its own: a ``ping`` carrying the digest
of the handshake's token (:func:`kvxferd.wire.auth.token_digest`). The daemon there answers
``confirmed`` only if one of its own links holds that token, and names its incarnation, which
must be the one the handshake named. A stranger not listening there gets no answer; something
else listening there does not know the token.

A confirmation is kept per (address, incarnation, token): each decode daemon's link costs one
round trip, whatever number of instance pairs it handshakes. A refusal is kept for a peer
timeout, so a peer repeating a false claim costs no call per handshake; calls in flight are
capped, so a flood of claims naming many addresses cannot open sockets without bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

import zmq
import zmq.asyncio

from ..errors import KvxferError
from ..ops.logutil import q
from ..wire import auth, messages, protocol
from .advertised import Advertised

log = logging.getLogger("kvxferd.claims")

#: confirmed (address, incarnation, token digest) kept at once (oldest dropped past it)
MAX_CONFIRMED = 4096
#: refused claims kept at once, each for a peer timeout
MAX_REFUSED = 1024
#: calls back in flight at once; past it a handshake is told to retry
MAX_PENDING = 64

Key = tuple[str, str, bytes]


class ClaimConfirmer:
    """Calls back the daemon address a handshake claims; keeps what it learnt."""

    def __init__(self, ctx: zmq.asyncio.Context, me: Advertised, timeout_s: float, max_message_bytes: int) -> None:
        self.ctx = ctx
        self.me = me
        self.timeout_s = timeout_s  # peer.peer_timeout_s: a daemon silent that long is not there
        self.max_message_bytes = max_message_bytes
        self._confirmed: OrderedDict[Key, None] = OrderedDict()
        self._refused: OrderedDict[Key, tuple[float, str]] = OrderedDict()
        self._pending: dict[Key, asyncio.Future[str | None]] = {}
        self._sockets: set[Any] = set()
        self.calls = 0  # round trips made (status)

    @staticmethod
    def key(daemon: str, incarnation: str | None, token: bytes | None) -> Key | None:
        """The cache key of a claim; None: the handshake names no token, so nothing can be confirmed."""
        if not token:
            return None
        return daemon, incarnation or "", auth.token_digest(token)

    def known(self, key: Key, now: float) -> str | None | bool:
        """True: confirmed; a string: refused (why); None: not known yet (call :meth:`confirm`)."""
        if key in self._confirmed:
            self._confirmed.move_to_end(key)
            return True
        refused = self._refused.get(key)
        if refused is not None:
            if now < refused[0]:
                return refused[1]
            del self._refused[key]
        return None

    def busy(self, key: Key) -> bool:
        """Too many calls in flight for one more (a call already in flight for ``key`` is shared)."""
        return key not in self._pending and len(self._pending) >= MAX_PENDING

    async def confirm(self, key: Key) -> str | None:
        """Call the claimed address back; None when it confirmed the claim, else why not."""
        fut = self._pending.get(key)
        if fut is None:
            fut = self._pending[key] = asyncio.ensure_future(self._call(key))
            fut.add_done_callback(lambda _f, k=key: self._pending.pop(k, None))
        return await asyncio.shield(fut)

    async def _call(self, key: Key) -> str | None:
        daemon, incarnation, digest = key
        try:
            why = await self._ask(daemon, incarnation, digest)
        except Exception as exc:  # noqa: BLE001 - a failed call is a claim not confirmed
            why = f"the call back to {daemon} failed: {exc}"
        if why is None:
            self._confirmed[key] = None
            while len(self._confirmed) > MAX_CONFIRMED:
                self._confirmed.popitem(last=False)
        else:
            self._refused[key] = (time.monotonic() + self.timeout_s, why)
            while len(self._refused) > MAX_REFUSED:
                self._refused.popitem(last=False)
            log.info("event=claim_unconfirmed daemon=%s msg=%s", daemon, q(why[:300]))
        return why

    async def _ask(self, daemon: str, incarnation: str, digest: bytes) -> str | None:
        try:
            host, port = protocol.split_address(daemon)
        except KvxferError as exc:
            return f"the claimed daemon address {daemon!r} cannot be called: {exc}"
        sock = self.ctx.socket(zmq.DEALER)
        self._sockets.add(sock)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            sock.connect(f"tcp://{host}:{port}")
            self.calls += 1
            ping = messages.PeerPing(self.me.address, self.me.incarnation, confirm=digest)
            await sock.send(protocol.encode({**ping.to_wire(), "seq": 1}))
            deadline = time.monotonic() + self.timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await sock.poll(int(left * 1000) + 1):
                    return (f"nothing answered at the claimed daemon address {daemon} within {self.timeout_s:g}s "
                            "(peer.peer_timeout_s): no decode daemon listens there")
                for part in await sock.recv_multipart():
                    answer = protocol.decode(part, self.max_message_bytes)
                    if answer.get("op") == "pong" and answer.get("seq") == 1:
                        return self._judge(daemon, incarnation, answer)
        finally:
            self._sockets.discard(sock)
            sock.close(0)

    @staticmethod
    def _judge(daemon: str, incarnation: str, pong: dict[str, Any]) -> str | None:
        theirs = pong.get("incarnation")
        if pong.get("confirmed") is not True:
            return (f"the daemon at {daemon} (incarnation {theirs}) did not send this handshake: none of its "
                    "links holds the handshake's data token")
        if incarnation and theirs != incarnation:
            return (f"the daemon at {daemon} answers as incarnation {theirs}, the handshake named {incarnation}")
        return None

    def close(self) -> None:
        for fut in list(self._pending.values()):
            fut.cancel()
        for sock in list(self._sockets):
            sock.close(0)
        self._sockets.clear()

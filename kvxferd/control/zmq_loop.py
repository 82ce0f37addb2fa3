"""ZeroMQ sockets on the daemon's event loop: a ROUTER socket served part by part within its
bounds, and sends whose outcome nobody waits for."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import zmq
from zmq import RCVMORE

from ..ops.metrics import Metrics
from .message_bounds import DroppedSenders, MessageBounds, Oversize

log = logging.getLogger("kvxferd.messages")


def ignore_result(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


async def serve_router(sock: Any, answer: Callable[[bytes, bytes, int], None], bounds: MessageBounds, *,
                       refuse: Callable[[bytes, Oversize], None], metrics: Metrics,
                       received: Callable[[int], None] | None = None, turn_parts: int | None = None,
                       head: Callable[[Any], None] | None = None) -> None:
    """Answer every part of every message a ROUTER socket receives, by routing id, in order.

    A client that batches sends the calls of one loop turn as the parts of one multipart
    message; each part is a message of its own, answered on its own (its own ``seq``). The
    parts are read one at a time (ZeroMQ delivers a message whole, so after its first frame
    every part is there) and each is answered as it is read, so no part is kept longer than
    its answer takes. Parts past ``bounds.parts`` are refused, not run: ``answer`` gets the
    part's number as its third argument for them (0 for the others). A message past the hard
    bounds (:class:`~.message_bounds.MessageBounds`) is dropped unread from there on, its sender
    gets ``refuse``, and that sender's messages are dropped unread for ``bounds.drop_s``.

    A ready socket hands over its next message without a turn of the loop; after about
    ``turn_parts`` parts (default ``bounds.parts``) the loop gets one anyway (other work, and
    the flush of the answers). A turn per message instead cost a third of the CPU of a message
    sent on its own.

    ``head``, where given, sees each message's routing-id frame before its parts are answered (a
    ``zmq.Frame``: its connection's properties, such as a unix socket peer's credentials).
    """
    raw = zmq.Socket.shadow(sock.underlying)  # read without a future; awaited only when idle
    getopt, recv = raw.getsockopt, raw.recv
    soft, hard, budget = bounds.parts, bounds.hard_parts, bounds.total_bytes
    turn = bounds.parts if turn_parts is None else turn_parts
    dropped = DroppedSenders()
    ignored = metrics.dropped_sender_messages.labels(bounds.endpoint)
    log_gate = LogGate()
    taken = 0
    while True:
        try:  # a ready socket hands over its next message at once: no future, no turn of the loop
            if head is None:
                identity = recv(zmq.NOBLOCK, copy=True)
            else:
                frame = recv(zmq.NOBLOCK, copy=False)
                identity = frame.bytes
                head(frame)
        except zmq.Again:
            await sock.poll(flags=zmq.POLLIN)  # idle: wait for the next message on the loop
            continue
        ignoring = len(dropped) > 0 and dropped.dropped(identity, time.monotonic())
        parts = nbytes = 0
        over: Oversize | None = None
        while getopt(RCVMORE):
            if ignoring or over is not None:
                recv(zmq.NOBLOCK, copy=False)  # dropped unread: never copied into the daemon
                parts += 1
                continue
            payload = recv(zmq.NOBLOCK, copy=True)
            parts += 1
            nbytes += len(payload)
            if nbytes > budget:
                over = Oversize("bytes", parts, nbytes, bounds)
            elif parts <= soft:
                answer(identity, payload, 0)
            elif parts <= hard:
                answer(identity, payload, parts)
            else:
                over = Oversize("parts", parts, nbytes, bounds)
        if received is not None:
            received(parts)
        if ignoring:
            ignored.inc()
        elif over is not None:
            dropped.drop(identity, time.monotonic() + bounds.drop_s)
            metrics.oversized_messages.labels(bounds.endpoint, over.reason).inc()
            if log_gate.open(time.monotonic()):
                log.warning("event=sender_dropped endpoint=%s reason=%s parts=%d bytes=%d drop_s=%g sender=%s "
                            "dropped_senders=%d suppressed=%d", bounds.endpoint, over.reason, over.parts, over.nbytes,
                            bounds.drop_s, identity[:16].hex(), len(dropped), log_gate.take_suppressed())
            refuse(identity, over)
        taken += parts
        if taken >= turn:
            taken = 0
            await asyncio.sleep(0)


class LogGate:
    """At most one line a second for an event a flood may repeat; the lines held back are counted."""

    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s = every_s
        self.last = float("-inf")
        self.suppressed = 0

    def open(self, now: float) -> bool:
        if now - self.last >= self.every_s:
            self.last = now
            return True
        self.suppressed += 1
        return False

    def take_suppressed(self) -> int:
        n, self.suppressed = self.suppressed, 0
        return n

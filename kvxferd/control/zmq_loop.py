"""ZeroMQ sockets on the daemon's event loop: a ROUTER socket served part by part, and sends
whose outcome nobody waits for."""

from __future__ import annotations

import asyncio
from typing import Any, Callable


def ignore_result(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


async def serve_router(sock: Any, answer: Callable[[bytes, bytes, int], None], limit: int,
                       received: Callable[[int], None] | None = None) -> None:
    """Answer every part of every message a ROUTER socket receives, by routing id, in order.

    A peer that batches sends the control messages of one loop turn as the parts of one
    multipart message; each part is a message of its own, answered on its own (its own
    ``seq``). Parts past ``limit`` are refused, not run: ``answer`` gets the batch's size as
    its third argument for them (0 for the others).

    A ready socket hands over its next message without a turn of the loop; after about
    ``limit`` parts the loop gets one anyway (other work, and the flush of the answers). A turn
    per message instead cost a third of the CPU of a message sent on its own.
    """
    taken = 0
    while True:
        frames = await sock.recv_multipart(copy=True)
        parts = len(frames) - 1
        if received is not None:
            received(parts)
        identity = frames[0]
        for i in range(1, len(frames)):
            answer(identity, frames[i], parts if i > limit else 0)
        taken += parts
        if taken >= limit:
            taken = 0
            await asyncio.sleep(0)

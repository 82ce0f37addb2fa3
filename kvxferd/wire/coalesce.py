"""Messages to engines, coalesced: one ZeroMQ multipart message per engine per loop iteration.

Replies and events for one engine that arise in the same turn of the event loop (a batch of
calls answered, a burst of transfers finishing) leave as the parts of one multipart message:
one socket send instead of one per message, and the same bytes and order an engine would
have read one by one. A DEALER reading with ``recv()`` gets the parts one at a time, so an
engine that knows nothing of coalescing reads them as separate messages.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable

#: parts in one multipart message at most; the rest leave in the next one, in order
MAX_PARTS = 256


@dataclass
class PartCounts:
    """Multipart messages and the parts they carried: parts / messages is the batching achieved."""

    messages: int = 0
    parts: int = 0

    def add(self, parts: int) -> None:
        self.messages += 1
        self.parts += parts

    def describe(self) -> dict[str, int]:
        return {"messages": self.messages, "parts": self.parts}


class Coalescer:
    """Frames queued per routing id, flushed once per loop turn through ``send``.

    ``send(parts)`` gets ``[routing id, frame, frame, ...]``. Only the loop thread may call
    :meth:`put`: order per engine is the order of the calls. ``max_parts`` may change between
    turns (a peer that said how many parts it reads); 1 sends every frame on its own.
    """

    def __init__(self, send: Callable[[list[bytes]], Any], max_parts: int = MAX_PARTS) -> None:
        self._send = send
        self.max_parts = max_parts
        self._queued: dict[bytes, list[bytes]] = {}
        self._scheduled = False

    def put(self, identity: bytes, frame: bytes) -> None:
        queued = self._queued.get(identity)
        if queued is None:
            self._queued[identity] = [frame]
        else:
            queued.append(frame)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        queued, self._queued = self._queued, {}
        step = max(1, self.max_parts)
        for identity, frames in queued.items():
            for i in range(0, len(frames), step):
                self._send([identity, *frames[i:i + step]])

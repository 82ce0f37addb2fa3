"""How much one ZeroMQ multipart message may cost the daemon, and the senders dropped for passing it.

ZeroMQ's own size limit (``limits.max_message_bytes``, ``MAXMSGSIZE``) holds per part, not per
message: without a bound of its own, one message of thousands of parts made the daemon copy
every part before any limit was looked at. The reader (:func:`~.zmq_loop.serve_router`) takes
the parts one at a time and weighs each against these bounds as it comes, so nothing past a
bound is ever kept:

- parts up to ``parts`` run, each as a message of its own (as always);
- parts past ``parts`` are refused one by one (``batch_too_large``, by their ``seq``), not run:
  a client that sent a batch slightly too large learns which of its calls did not run;
- a message past twice ``parts``, or whose parts together pass ``total_bytes``, is not a
  batch a working client sends: the rest of it is received and dropped unread, its sender gets
  one error, and every message from that sender (its ZeroMQ routing id) is dropped unread for
  ``drop_s`` seconds. libzmq cannot close one peer of a bound ROUTER socket; ignoring it costs
  the reading of its bytes and nothing more.

Pure: no socket, no clock (``now`` is handed in).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

#: senders held dropped at once; past it the one dropped longest ago is let back first
MAX_DROPPED = 4096


@dataclass(frozen=True)
class MessageBounds:
    """The bounds of one endpoint's messages (``endpoint`` names it in metrics and logs)."""

    endpoint: str  # "engine" or "peer"
    parts: int  # parts of one message that run; limits.max_batch_calls or limits.max_peer_batch_parts
    parts_setting: str  # the setting ``parts`` comes from, for the words of a refusal
    total_bytes: int  # limits.max_batch_bytes: every part of one message together
    drop_s: float  # limits.drop_sender_s: how long a sender past the hard bound is ignored

    @property
    def hard_parts(self) -> int:
        """Parts past which a message is dropped with its sender (refusing each one by one costs a
        decode per part: twice the bound is as far as a client that overshot can need)."""
        return 2 * self.parts


@dataclass(frozen=True)
class Oversize:
    """Why a message was dropped: ``reason`` is ``parts`` or ``bytes`` (a bounded metric label);
    ``parts`` and ``nbytes`` are what had been read when it passed its bound."""

    reason: str
    parts: int
    nbytes: int
    bounds: MessageBounds

    def describe(self) -> str:
        b = self.bounds
        if self.reason == "bytes":
            what = (f"a message of more than {b.total_bytes} bytes (limits.max_batch_bytes; {self.nbytes} bytes "
                    f"in its first {self.parts} parts)")
        else:
            what = (f"a message of more than {b.hard_parts} parts (twice {b.parts_setting} {b.parts}, past which "
                    "parts are no longer refused one by one)")
        return (f"{what} was dropped unread from its part {self.parts} on, and its sender's messages are ignored "
                f"for {b.drop_s:g}s (limits.drop_sender_s)")

    def fix(self) -> str:
        return (f"send at most {self.bounds.parts} calls and {self.bounds.total_bytes} bytes in one multipart "
                f"message, then reconnect or wait {self.bounds.drop_s:g}s")


class DroppedSenders:
    """Routing ids whose messages are dropped unread until a time; bounded (``MAX_DROPPED``)."""

    def __init__(self, limit: int = MAX_DROPPED) -> None:
        self.limit = limit
        self._until: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._until)

    def drop(self, identity: bytes, until: float) -> None:
        self._until.pop(identity, None)
        self._until[identity] = until
        while len(self._until) > self.limit:
            self._until.popitem(last=False)

    def dropped(self, identity: bytes, now: float) -> bool:
        """Whether ``identity``'s messages are dropped at ``now`` (an ended drop is forgotten)."""
        until = self._until.get(identity)
        if until is None:
            return False
        if until <= now:
            del self._until[identity]
            return False
        return True

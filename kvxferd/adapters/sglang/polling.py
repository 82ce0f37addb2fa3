"""kvxferd request states as SGLang's ``KVPoll`` values (pure).

SGLang's queues move a request on only in this order: the prefill bootstrap queue waits
for ``WaitingForInput`` (polling before it calls ``init``), then runs the forward and
sends; the decode transfer queue waits for ``Success``. kvxferd's daemon answers the
prefill rank ``waiting_for_input`` once the decode side's ``expect`` reached it, which is
exactly the moment SGLang may start sending.
"""

from __future__ import annotations

# sglang.srt.disaggregation.base.conn.KVPoll (0.5.23); plain ints so this module imports nothing
FAILED, BOOTSTRAPPING, WAITING_FOR_INPUT, TRANSFERRING, SUCCESS = 0, 1, 2, 3, 4


def sender_poll(state: str | None, *, sent: bool) -> int:
    """A prefill rank's poll; ``state`` None: the daemon does not know the request yet."""
    if state is None or state == "bootstrapping":
        return BOOTSTRAPPING
    if state == "waiting_for_input":
        return TRANSFERRING if sent else WAITING_FOR_INPUT
    if state == "transferring":
        return TRANSFERRING
    if state == "done":
        return SUCCESS
    return FAILED


def receiver_poll(state: str | None, *, inited: bool, metadata_sent: bool, aux_landed: bool) -> int:
    """A decode rank's poll. ``Success`` only once the aux row landed in MetadataBuffers."""
    if not inited:
        return BOOTSTRAPPING
    if not metadata_sent:
        return WAITING_FOR_INPUT
    if state in (None, "bootstrapping", "waiting_for_input"):
        return WAITING_FOR_INPUT
    if state == "transferring":
        return TRANSFERRING
    if state == "done":
        return SUCCESS if aux_landed else TRANSFERRING
    return FAILED

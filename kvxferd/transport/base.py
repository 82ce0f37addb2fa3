"""The transport interface: both directions of one way to move chunk jobs
(:class:`~kvxferd.lifecycle.jobs.ChunkJob`) between daemons.

Transports are blocking and run on data-plane threads; they raise
:class:`~kvxferd.errors.TransferError` (or a subclass of KvxferError) when bytes did not
all land, and return only once the destination has confirmed them.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Protocol

from ..lifecycle.jobs import ChunkJob, Moved

log = logging.getLogger("kvxferd.transport")

#: a chunk up to this size may travel with others in one hand-off (:mod:`kvxferd.transport.dataplane`):
#: small enough that the connection it shares is never held long by one
SMALL_CHUNK = 256 * 1024


class Transport(Protocol):
    """Both directions of one way to move bytes between daemons.

    Sending runs on the prefill daemon's data threads (:meth:`send`). Receiving runs on the
    transport's own threads, which admit every chunk through the inbox and report what landed
    with their ``on_received`` callback; the daemon only ever asks a receiving side to stop
    writing into a request that failed (:meth:`stop_receiving`).
    """

    name: str
    #: writes land without the receiving daemon's help (one-sided): before a failed request's
    #: pages are handed back, the sender must confirm nothing of it is in flight (the fence)
    one_sided: bool

    def send(self, job: ChunkJob) -> Moved: ...

    # optional, for transports that move several small chunks in one go:
    # ``batch_key(job)`` -> a hashable shared by jobs that may go together (None: alone), and
    # ``send_many(jobs)`` -> one ``Moved`` or exception per job, in order
    # optional, for transports whose small jobs never block (a local copy of host memory):
    # ``runs_inline(job)`` -> True where the data plane may run the job on the event loop

    def stop_receiving(self, entry: Any) -> None: ...

    def close(self) -> None: ...


def nice_this_thread(nice: int) -> None:
    """Run the calling thread (only it: on Linux a thread id names one thread) at ``nice``, so the
    kernel gives a core to latency work over this thread's bulk work beside it. Raising one's own
    nice needs no privilege; lowering it again would, so a thread once niced stays so."""
    if nice <= 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError) as exc:
        log.warning("event=bulk_nice_failed nice=%d error=%s", nice, exc)

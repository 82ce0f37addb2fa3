"""Tools that start daemons and engines clean up after themselves when they are stopped.

``kvxferd demo`` and ``kvxferd bench`` start daemon processes (in their own sessions, so a
terminal's Ctrl-C does not reach them) and engine processes that hold shared-memory KV
caches. Python's default SIGTERM action ends the process without running ``finally``
blocks, which left the daemons running and the caches in ``/dev/shm``. Inside
:func:`cleanup_on_signals`, SIGTERM, SIGINT and SIGHUP raise ``SystemExit(128 + signal)``
instead, so the tool's ``finally`` blocks stop what it started; further signals are ignored
while that cleanup runs.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@contextmanager
def cleanup_on_signals() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; an embedding caller owns its signals
        return
    previous: dict[int, Any] = {}

    def stop(signum: int, _frame: Any) -> None:
        for sig in SIGNALS:  # one cleanup: a second Ctrl-C must not cut it short
            signal.signal(sig, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    for sig in SIGNALS:
        previous[sig] = signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

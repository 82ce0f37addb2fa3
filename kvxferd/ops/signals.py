"""Tools that start daemons and engines clean up after themselves when they are stopped.

``kvxferd demo`` and ``kvxferd bench`` start daemon processes (in their own sessions, so a
terminal's Ctrl-C does not reach them) and engine processes that hold shared-memory KV
caches. Python's default SIGTERM action ends the process without running ``finally``
blocks, which left the daemons running and the caches in ``/dev/shm``. Inside
:func:`cleanup_on_signals`, SIGTERM, SIGINT and SIGHUP raise ``SystemExit(128 + signal)``
instead, so the tool's ``finally`` blocks stop what it started; further signals are ignored
while that cleanup runs. A cleanup that runs on the normal way out is wrapped in
:func:`deferred`, so a signal that comes meanwhile does not cut it short either: it takes
effect once the cleanup is done.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: signals that came while a :func:`deferred` block ran (None: none runs)
_held: list[int] | None = None


def _ignore_all() -> None:
    for sig in SIGNALS:  # one cleanup: a second Ctrl-C must not cut it short
        signal.signal(sig, signal.SIG_IGN)


@contextmanager
def cleanup_on_signals() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; an embedding caller owns its signals
        return
    previous: dict[int, Any] = {}

    def stop(signum: int, _frame: Any) -> None:
        if _held is not None:
            _held.append(signum)
            return
        _ignore_all()
        raise SystemExit(128 + signum)

    for sig in SIGNALS:
        previous[sig] = signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def deferred() -> Iterator[None]:
    """A cleanup no signal may cut short: a SIGTERM/SIGINT/SIGHUP that comes while it runs (inside
    :func:`cleanup_on_signals`) ends the tool once the block is done, not in its middle."""
    global _held
    if threading.current_thread() is not threading.main_thread() or _held is not None:
        yield
        return
    _held = []
    try:
        yield
    finally:
        held, _held = _held, None
    if held:
        _ignore_all()
        raise SystemExit(128 + held[0])

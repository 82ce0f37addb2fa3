"""Child processes of the tools (daemons, engine ranks) die with the tool that started them.

A tool stopped by SIGTERM or SIGINT stops its children in ``finally`` blocks
(:mod:`kvxferd.signals`), but one that is SIGKILLed (a test's timeout, the OOM killer,
``kill -9``) runs no code at all: its daemons, started in sessions of their own
(``start_new_session=True``, so a terminal's Ctrl-C does not reach them), went on running
as orphans. So every child is started with Linux's ``PR_SET_PDEATHSIG``: the kernel sends it
SIGTERM when its parent dies, and it stops as it would under ``kill`` (a daemon shuts down
and removes its socket; an engine rank unlinks its cache file).

The kernel's "parent" here is the *thread* that forked the child, not the process: a child
started from a short-lived thread (the soak starts daemons and engines from worker threads)
would be signalled when that thread ends. So every child is forked by one long-lived thread of
this module, which ends only with the process.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future
from typing import Any

PR_SET_PDEATHSIG = 1
#: what a child gets when the tool that started it dies: the same as ``kill``, so it cleans up
DEATH_SIGNAL = signal.SIGTERM

_libc: Any = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # no libc to call: children are stopped by the tools' finally blocks only
        _libc = None

_requests: queue.Queue[tuple[list[str], dict[str, Any], Future[subprocess.Popen[Any]]]] = queue.Queue()
_thread: threading.Thread | None = None
_thread_lock = threading.Lock()


def _die_with(parent: int) -> None:
    """Runs in the child between fork and exec: die with ``parent``, and at once if it is gone already."""
    _libc.prctl(PR_SET_PDEATHSIG, int(DEATH_SIGNAL), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def _serve() -> None:
    while True:
        args, kwargs, result = _requests.get()
        try:
            result.set_result(_popen(args, kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            result.set_exception(exc)


def _popen(args: list[str], kwargs: dict[str, Any]) -> subprocess.Popen[Any]:
    parent = os.getpid()
    return subprocess.Popen(args, preexec_fn=lambda: _die_with(parent), **kwargs)


def popen(args: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(args, **kwargs)``, for a child that must not outlive this process."""
    if _libc is None:
        return subprocess.Popen(args, **kwargs)
    global _thread
    with _thread_lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_serve, name="kvxferd-launcher", daemon=True)
            _thread.start()
    result: Future[subprocess.Popen[Any]] = Future()
    _requests.put((args, kwargs, result))
    return result.result()

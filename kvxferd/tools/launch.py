"""Child processes of the tools (daemons, engine ranks) die with the tool that started them.

A tool stopped by SIGTERM or SIGINT stops its children in ``finally`` blocks
(:mod:`kvxferd.ops.signals`), but one that is SIGKILLed (a test's timeout, the OOM killer,
``kill -9``) runs no code at all: its daemons, started in sessions of their own
(``start_new_session=True``, so a terminal's Ctrl-C does not reach them), went on running
as orphans. So every child is started with Linux's ``PR_SET_PDEATHSIG``: the kernel sends it
SIGTERM when its parent dies, and it stops as it would under ``kill`` (a daemon shuts down
and removes its socket; an engine rank unlinks its cache file).

The kernel's "parent" here is the *thread* that forked the child, not the process: a child
started from a short-lived thread (the soak starts daemons and engines from worker threads)
would be signalled when that thread ends. So every child is forked by one long-lived thread of
this module, which ends only with the process.

A tool that starts many children (the test suite) may call :func:`fork_from_preloaded`: from
then on, children that run one of this package's modules fork from a preloaded interpreter
(:mod:`kvxferd.tools.forkserver`) instead of importing torch each.
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
_server: Any = None  # a ForkServer once fork_from_preloaded() was called and it could start
_FORKABLE = {"stdin", "stdout", "stderr", "text", "bufsize", "env", "start_new_session"}


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


def fork_from_preloaded() -> bool:
    """Start this package's children from a fork server from now on; False if it cannot run here
    (they start the usual way then)."""
    global _server
    if _server is None and _libc is not None:
        from .forkserver import ForkServer, Unusable
        try:
            _server = ForkServer(_start)
        except (Unusable, OSError) as exc:
            print(f"kvxferd: children start without a fork server: {exc}", file=sys.stderr)
            return False
    return _server is not None


def stop_forking() -> None:
    """Close the fork server (its children still running are told SIGTERM)."""
    global _server
    server, _server = _server, None
    if server is not None:
        server.close()


#: environment variables read only after start-up (kvxferd's settings, UCX's when NIXL loads) or
#: by nothing a child imports (pytest's note of the running test): a child whose environment
#: differs from the fork server's in these alone still forks from it
_RUNTIME_ENV = ("KVXFERD_", "UCX_", "PYTEST_")


def _forkable(args: list[str], kwargs: dict[str, Any]) -> bool:
    if not (_server is not None and _server.alive and len(args) >= 3 and args[0] == sys.executable
            and args[1] == "-m" and args[2].split(".")[0] == "kvxferd" and set(kwargs) <= _FORKABLE):
        return False
    env = kwargs.get("env")
    if env is None:
        env = dict(os.environ)
    differ = {k for k in set(env) | set(_server.env) if env.get(k) != _server.env.get(k)}
    return all(k.startswith(_RUNTIME_ENV) for k in differ)


def popen(args: list[str], *, preloaded: bool = True, **kwargs: Any) -> Any:
    """``subprocess.Popen(args, **kwargs)``, for a child that must not outlive this process.
    ``preloaded=False``: never forked from the fork server, always its own interpreter (vLLM's
    engines: forked from it, their generate calls ran over ten times slower)."""
    if preloaded and _forkable(args, kwargs):
        return _server.spawn(args, **kwargs)
    return _start(args, **kwargs)


def _start(args: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
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

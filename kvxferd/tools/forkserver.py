"""Children forked from one preloaded interpreter, for tools that start many of them.

A daemon or an engine rank spends about 3 s of CPU importing torch and the daemon's modules
before it does anything. The test suite starts hundreds of them on two cores, so those imports
were most of its CPU. A fork server imports the heavy modules once; each child is forked from
it and runs what ``python -m MODULE ARGS`` runs (:func:`runpy.run_module` as ``__main__``),
with its own stdin, stdout, stderr, environment and session, and ends as an interpreter ends
(non-daemon threads joined, ``atexit`` run, streams flushed). The code under test is the same;
only the imports are shared.

Only modules that start no Python thread at import are preloaded (fork copies the calling
thread only); the server refuses to serve otherwise, and :func:`kvxferd.tools.launch.popen`
starts children the usual way. A child whose environment differs from the server's in more
than settings read after start-up (``KVXFERD_*``, ``UCX_*``: an import-time setting, a
``PYTHONPATH`` that hides a package) is started the usual way too.

Lifetimes: the server is started through :func:`kvxferd.tools.launch.popen`, so it dies with
the tool; it exits when its control socket closes; each child gets ``PR_SET_PDEATHSIG`` on
the server, so it is told SIGTERM when the server goes. The server reaps its children and
reports each exit status, which :class:`Forked` (a ``subprocess.Popen`` look-alike) returns.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from concurrent.futures import Future
from typing import Any, IO

#: imported once by the server: what daemons and engine ranks spend their start-up on
PRELOAD = ("torch", "numpy", "zmq", "msgpack", "prometheus_client", "uvloop", "kvxferd.control.daemon",
           "kvxferd.sdk.client", "kvxferd.cli", "kvxferd.tools.oracle")
MAX_MESSAGE = 1 << 20
PR_SET_PDEATHSIG = 1


class Unusable(RuntimeError):
    """The server could not start or cannot fork safely here; start children the usual way."""


# -- the server (its own process) -------------------------------------------------------------
def _send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def serve(fd: int) -> int:
    sock = socket.socket(fileno=fd)
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass  # not installed here (an engine's environment): its children import it themselves
    if threading.active_count() != 1:
        _send(sock, {"unusable": f"{threading.active_count()} Python threads after the preload"})
        return 1
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears it
    _send(sock, {"ready": os.getpid()})
    try:
        while True:
            readable, _, _ = select.select([sock, wake_r], [], [])
            if wake_r in readable:
                while True:
                    try:
                        if not os.read(wake_r, 512):
                            break
                    except BlockingIOError:
                        break
                _reap(sock)
            if sock in readable:
                try:
                    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 3)
                except OSError:
                    return 0
                if not data:
                    return 0  # the tool closed the socket: children hear SIGTERM as the server exits
                _spawn(sock, json.loads(data), fds, (wake_r, wake_w))
                _reap(sock)
    finally:
        _reap(sock)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        try:
            _send(sock, {"exit": pid, "status": os.waitstatus_to_exitcode(status)})
        except OSError:
            pass


def _spawn(sock: socket.socket, request: dict[str, Any], fds: list[int], wake: tuple[int, int]) -> None:
    server = os.getpid()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        pid = os.fork()
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        _send(sock, {"id": request["id"], "error": str(exc)})
        return
    if pid == 0:  # pragma: no cover - runs in the child, which never returns here
        _become_child(sock, request, fds, wake, server)
    for fd in fds:
        os.close(fd)
    _send(sock, {"id": request["id"], "pid": pid})


def _become_child(sock: socket.socket, request: dict[str, Any], fds: list[int], wake: tuple[int, int],
                  server: int) -> None:  # pragma: no cover - the forked child
    code: Any = 1
    try:
        sock.close()
        signal.set_wakeup_fd(-1)
        for fd in wake:
            os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != server:
            os._exit(1)
        if request.get("session"):
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.stdin = open(0, "r", encoding="utf-8", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
        sys.argv = ["-m", *request["argv"]]
        sys.modules.pop(request["module"], None)  # run afresh as __main__, as -m does
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code
        except KeyboardInterrupt:
            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:  # noqa: BLE001 - printed as an uncaught exception is
            traceback.print_exc()
            code = 1
        _finish_interpreter()
    finally:
        _exit(code)


def _finish_interpreter() -> None:  # pragma: no cover - the forked child
    """What the interpreter does at exit: join non-daemon threads, run ``atexit``."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - best effort, as at interpreter exit
        traceback.print_exc()
    atexit._run_exitfuncs()


def _exit(code: Any) -> None:  # pragma: no cover - the forked child
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe, as at interpreter exit
            pass
    if code < 0:  # ended by a signal, as an uncaught KeyboardInterrupt ends python
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


# -- the tool's side ---------------------------------------------------------------------------
class Forked:
    """A child of the fork server, with the parts of ``subprocess.Popen`` the tools use."""

    def __init__(self, server: "ForkServer", args: list[str], pid: int, stdin: IO[Any] | None,
                 stdout: IO[Any] | None) -> None:
        self.args = args
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = None
        self.returncode: int | None = None
        self._ended = threading.Event()
        self._server = server

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        out = self.stdout.read() if self.stdout is not None else None
        self.wait(timeout)
        return out, None


class ForkServer:
    """One server process and the reader of its reports."""

    def __init__(self, start: Any) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = dict(os.environ)
        try:
            self.proc = start([sys.executable, "-m", "kvxferd.tools.forkserver", str(theirs.fileno())],
                              pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.sock = ours
        first = json.loads(ours.recv(MAX_MESSAGE) or b"{}")
        if "ready" not in first:
            ours.close()
            self.proc.wait()
            raise Unusable(first.get("unusable") or "the fork server exited at start")
        self._lock = threading.Lock()
        self._next = 0
        self._spawning: dict[int, Future[int]] = {}
        self._children: dict[int, Forked] = {}
        self._exits: dict[int, int] = {}  # exits heard before the spawn was answered
        self.alive = True
        threading.Thread(target=self._read, name="kvxferd-forkserver", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            with self._lock:
                if "exit" in message:
                    child = self._children.pop(message["exit"], None)
                    if child is None:
                        self._exits[message["exit"]] = message["status"]
                    else:
                        child._exited(message["status"])
                    continue
                future = self._spawning.pop(message["id"])
            if "error" in message:
                future.set_exception(OSError(message["error"]))
            else:
                future.set_result(message["pid"])
        with self._lock:  # the server is gone, and its children were told SIGTERM with it
            self.alive = False
            for child in self._children.values():
                child._exited(-signal.SIGTERM)
            self._children.clear()
            for future in self._spawning.values():
                future.set_exception(OSError("the fork server exited"))
            self._spawning.clear()

    def spawn(self, args: list[str], *, stdin: Any = None, stdout: Any = None, stderr: Any = None,
              text: bool = False, bufsize: int = -1, env: dict[str, str] | None = None,
              start_new_session: bool = False) -> Forked:
        module, argv = args[2], args[3:]
        ends: list[int] = []  # the child's ends this side opened, closed once sent
        mine: list[IO[Any] | None] = [None, None]

        def child_fd(spec: Any, index: int) -> int:
            if spec is None:
                return index
            if spec == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                ends.append(fd)
                return fd
            if spec == subprocess.PIPE:
                r, w = os.pipe()
                theirs, keep = (r, w) if index == 0 else (w, r)
                ends.append(theirs)
                mode = ("w" if index == 0 else "r") + ("" if text else "b")
                buffering = bufsize if text or bufsize != 1 else -1  # line buffering is for text only, as in Popen
                mine[min(index, 1)] = open(keep, mode, buffering=buffering, **({"encoding": "utf-8"} if text else {}))
                return theirs
            return spec if isinstance(spec, int) else spec.fileno()

        try:
            fds = [child_fd(stdin, 0), child_fd(stdout, 1)]
            fds.append(fds[1] if stderr == subprocess.STDOUT else child_fd(stderr, 2))
            future: Future[int] = Future()
            with self._lock:
                if not self.alive:
                    raise OSError("the fork server exited")
                self._next += 1
                self._spawning[self._next] = future
                request = {"id": self._next, "module": module, "argv": argv, "env": env or dict(os.environ),
                           "session": start_new_session}
                _send(self.sock, request, fds)
            pid = future.result()
        except BaseException:
            for f in mine:
                if f is not None:
                    f.close()
            raise
        finally:
            for fd in ends:
                os.close(fd)
        child = Forked(self, args, pid, mine[0], mine[1])
        with self._lock:
            if pid in self._exits:
                child._exited(self._exits.pop(pid))
            else:
                self._children[pid] = child
        return child

    def close(self) -> None:
        try:  # shutdown first: a close() alone leaves the reader's recv() holding the socket open
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1])))

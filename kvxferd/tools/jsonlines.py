"""Child processes spoken to in JSON lines: the events a child prints, one object a line."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterable

#: put on the queue once the child's stdout ends, so a reader waiting for an event wakes up
EXIT_EVENT = {"event": "exit"}


def pump(lines: Iterable[str], events: queue.Queue[dict[str, Any]]) -> None:
    """Every JSON line of ``lines`` onto ``events`` (other lines, e.g. a library's print, are
    skipped), then :data:`EXIT_EVENT`."""
    for line in lines:
        try:
            events.put(json.loads(line))
        except json.JSONDecodeError:
            pass
    events.put(dict(EXIT_EVENT))


def read_events(proc: subprocess.Popen[str]) -> queue.Queue[dict[str, Any]]:
    """A queue fed by a background thread with the events ``proc`` prints on its stdout."""
    assert proc.stdout is not None, "start the child with stdout=subprocess.PIPE, text=True"
    events: queue.Queue[dict[str, Any]] = queue.Queue()
    threading.Thread(target=pump, args=(proc.stdout, events), daemon=True).start()
    return events


def send_command(proc: subprocess.Popen[str], cmd: dict[str, Any]) -> None:
    """One JSON command on the child's stdin."""
    assert proc.stdin is not None, "start the child with stdin=subprocess.PIPE, text=True"
    proc.stdin.write(json.dumps(cmd) + "\n")
    proc.stdin.flush()


def close(proc: subprocess.Popen[str], timeout: float) -> None:
    """End of input (the child finishes what it has and exits), then wait; killed if it does not."""
    if proc.poll() is not None:
        return
    try:
        assert proc.stdin is not None
        proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class ChildFailed(RuntimeError):
    """A :class:`JsonProc` reported an error, exited, or did not answer in time (its log's tail is in
    the message)."""


class JsonProc:
    """A python child that reads JSON commands on stdin and writes JSON events on stdout; its stderr
    goes to ``log_path``. ``args`` follow the interpreter: ``["-m", module, ...]`` or a script and its
    arguments. It dies with this process (:func:`kvxferd.tools.launch.popen`, which ``preloaded``
    goes to); ``start_new_session`` keeps a terminal's Ctrl-C from it (the tool that started it
    stops it)."""

    def __init__(self, args: list[str], log_path: Path, *, start_new_session: bool = False,
                 preloaded: bool = True) -> None:
        from . import launch

        self.log_path = log_path
        self._log = open(log_path, "ab")
        try:
            self.proc = launch.popen([sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, bufsize=1, start_new_session=start_new_session,
                                     preloaded=preloaded)
        except BaseException:
            self._log.close()
            raise
        self.events = read_events(self.proc)

    def next(self, timeout: float = 120.0) -> dict[str, Any]:
        """The child's next event; :class:`ChildFailed` for an ``error`` event, its exit, or none in time."""
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            raise ChildFailed(f"no answer within {timeout}s; log tail:\n{self.log_tail()}") from None
        if event.get("event") in ("exit", "error"):
            raise ChildFailed(f"child failed: {event}; log tail:\n{self.log_tail()}")
        return event

    def call(self, timeout: float = 120.0, **cmd: Any) -> dict[str, Any]:
        """Send ``cmd``, return the child's answer (its next event)."""
        send_command(self.proc, cmd)
        return self.next(timeout)

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def close(self, timeout: float = 30) -> None:
        """End of input, then wait for the child to finish (killed if it does not within ``timeout``)."""
        try:
            close(self.proc, timeout)
        finally:
            self._log.close()

"""Child processes spoken to in JSON lines: the events a child prints, one object a line."""

from __future__ import annotations

import json
import queue
import subprocess
import threading
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

"""systemd's notify protocol (``Type=notify``), without libsystemd."""

from __future__ import annotations

import os
import socket


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``READY=1``) to ``$NOTIFY_SOCKET``; False when not under systemd."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(path)
            sock.sendall(state.encode())
        except OSError:
            return False
    return True


def watchdog_interval() -> float | None:
    """Half of ``WatchdogSec`` in seconds when systemd asked this process for pings."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None

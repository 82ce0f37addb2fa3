"""Who is at the other end of an engine connection, as the kernel says, not as the engine says.

An engine's ``register`` claims a ``pid`` and names memory (descriptors of that pid, files by
path). A claim is only worth what can be checked: the engine socket is a unix socket, whose
kernel-given peer credentials (``SO_PEERCRED``: pid, uid, gid at connect time) libzmq attaches
to every message as the property ``Peer-Address`` (``"<host>:<uid>:<gid>:<pid>"``). The daemon
takes those as the truth: the claimed pid must be the peer's, descriptors are opened only in
the peer's process, named files must belong to the peer's uid, and a rank is bound to the
connection that registered it.

A pid seen through another pid namespace differs from the one the engine reads with
``getpid()``: the kernel reports the peer's pid as the daemon's namespace numbers it (0 when
the engine's process is not visible there at all), while the engine claims the number of its
own namespace. Both name the same process where ``/proc/<peer pid>/status`` lists the claimed
pid as the innermost of its ``NSpid`` numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import RegistrationError

#: the ZeroMQ message property that carries a unix-socket peer's credentials
PEER_PROPERTY = "Peer-Address"


class TrustRefusal(RegistrationError):
    """A registration refused because the engine named memory, or a rank, that it cannot show to
    be its own. ``reason`` is the bounded label it is counted under (the wire code stays
    ``registration``, as for every registration refusal)."""

    def __init__(self, reason: str, message: str, *, field: str, fix: str) -> None:
        super().__init__(message, field=field, fix=fix)
        self.reason = reason


@dataclass(frozen=True)
class Caller:
    """The engine process of one connection: its credentials when it connected."""

    pid: int  # as the daemon's pid namespace numbers it; 0: not visible from the daemon
    uid: int
    gid: int
    peer: str  # the property as libzmq gave it: equal strings, the same connection's credentials

    @property
    def visible(self) -> bool:
        """Whether the daemon can see the engine's process (its /proc entry, its descriptors)."""
        return self.pid > 0


def parse_peer(value: str | None) -> Caller | None:
    """The credentials in a ``Peer-Address`` property; None where it carries none (not a unix
    socket, or a libzmq without ``SO_PEERCRED``)."""
    if not value:
        return None
    parts = value.rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        uid, gid, pid = int(parts[1]), int(parts[2]), int(parts[3])
    except ValueError:
        return None
    if min(uid, gid, pid) < 0:
        return None
    return Caller(pid, uid, gid, value)


def namespace_pids(pid: int) -> list[int]:
    """The ``NSpid`` numbers of process ``pid`` (outermost first); [] where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


def engine_pid(claimed: int | None, caller: Caller) -> int | None:
    """The pid whose descriptors this registration may open: the peer's own.

    ``claimed`` (the message's ``pid``) must name the peer's process, in the daemon's numbering
    or in the engine's own pid namespace; anything else is refused, naming both. None where the
    engine's process is not visible from the daemon (its descriptors cannot be opened then).
    """
    if not caller.visible:
        return None
    if claimed is None or claimed == caller.pid:
        return caller.pid
    inner = namespace_pids(caller.pid)
    if inner and inner[-1] == claimed:
        return caller.pid  # the same process, numbered by the engine's own pid namespace
    raise TrustRefusal(
        "pid_mismatch",
        f"register claims pid {claimed}, but the process on this connection is pid {caller.pid} "
        f"(uid {caller.uid}, from the socket's peer credentials)", field="pid",
        fix="register from the process that holds the memory (the client sends its own pid); "
            "one process cannot register another's descriptors")

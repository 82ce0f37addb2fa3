"""Engine ranks registered with this daemon and their mapped regions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from ..datapath.engine_caller import Caller, TrustRefusal
from ..datapath.regions import MappedRegion
from ..errors import RegistrationError
from ..model.geometry import InstanceSpec, RankGeometry, rank_id


@dataclass(frozen=True)
class ProcessRef:
    """A local process identified by pid and start time, so a reused pid is not mistaken for it."""

    pid: int
    start: str

    @classmethod
    def find(cls, pid: int) -> "ProcessRef | None":
        start = _start_time(pid)
        return cls(pid, start) if start is not None else None

    def alive(self) -> bool:
        return _start_time(self.pid) == self.start


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat; None when the pid is not visible (gone, other namespace) or
    the process has exited and waits to be reaped (a zombie holds no memory and makes no call)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    return fields[19] if len(fields) > 19 else None


@dataclass
class Rank:
    instance: str
    role: str
    geometry: RankGeometry
    regions: dict[tuple[int, str], MappedRegion]
    identity: bytes  # routing id of the engine connection that registered it
    process: "ProcessRef | None" = None  # the engine process, when this daemon can see it
    dp_size: int | None = None  # a DP rank of a data-parallel instance (``instance`` is <name>@dp<k>)
    #: the integrity mode its instance asked for at register (the daemon's own applies when stricter)
    integrity: str | None = None
    #: the registering connection's peer credentials (:mod:`kvxferd.datapath.engine_caller`): the
    #: rank is bound to them, and calls for it from any other connection are refused
    caller: Caller | None = None
    id: str = field(init=False)

    def __post_init__(self) -> None:
        self.id = rank_id(self.instance, self.geometry.tp_rank, self.geometry.pp_rank)

    @property
    def coords(self) -> tuple[int, int]:
        return (self.geometry.tp_rank, self.geometry.pp_rank)

    def region(self, layer: int, kind: str) -> MappedRegion:
        return self.regions[(layer, kind)]

    def describe(self) -> dict:
        out = {"rank_id": self.id, "instance": self.instance, "role": self.role,
               "geometry": self.geometry.to_dict(), "regions": len(self.regions)}
        if self.dp_size is not None:
            out["dp_size"] = self.dp_size
        if self.integrity:
            out["integrity"] = self.integrity
        return out


class Registry:
    def __init__(self, max_ranks: int) -> None:
        self.max_ranks = max_ranks
        self._ranks: dict[str, Rank] = {}

    def __iter__(self) -> Iterator[Rank]:
        return iter(list(self._ranks.values()))

    def __len__(self) -> int:
        return len(self._ranks)

    def get(self, rank_key: str) -> Rank | None:
        return self._ranks.get(rank_key)

    def spec(self, instance: str, role: str | None = None) -> InstanceSpec | None:
        for rank in self._ranks.values():
            if rank.instance == instance and (role is None or rank.role == role):
                return rank.geometry.spec
        return None

    def check_new(self, instance: str, role: str, geometry: RankGeometry) -> None:
        """Refuse a rank that contradicts ranks of its instance already here."""
        if len(self._ranks) >= self.max_ranks:
            raise RegistrationError(f"this daemon already holds {self.max_ranks} ranks", field="rank",
                                    fix="raise limits.max_ranks or unregister stale ranks")
        for other in self._ranks.values():
            if other.instance != instance:
                continue
            if other.role != role:
                raise RegistrationError(f"instance {instance!r} is registered as {other.role}, not {role}",
                                        field="role", fix="use one instance name per role")
            if other.geometry.spec != geometry.spec:
                diff = [k for k, v in geometry.spec.to_dict().items()
                        if other.geometry.spec.to_dict().get(k) != v]
                raise RegistrationError(
                    f"instance {instance!r} geometry differs from rank {other.id} in {diff}",
                    field=diff[0] if diff else "geometry",
                    fix="register every rank of an instance with the same instance geometry")

    @staticmethod
    def check_takeover(held: Rank, identity: bytes, caller: Caller | None, process: ProcessRef | None) -> None:
        """Refuse a register of ``held``'s rank id from a stranger: another live process's connection.

        Allowed: the holder's own connection again; another connection of the holder's process (a
        new client); anyone once the holder's process has exited (an engine restarted before the
        sweeper noticed). Where the holder's process cannot be seen from here, another connection
        of the holder's uid may take the rank (the daemon cannot tell whether the holder lives).
        """
        if identity == held.identity and (held.caller is None or caller is None or caller.peer == held.caller.peer):
            return
        if held.process is not None:
            if not held.process.alive() or (process is not None and process == held.process):
                return
        elif held.caller is not None and caller is not None and caller.uid == held.caller.uid:
            return
        who = (f"engine process {held.process.pid}" if held.process is not None else "an engine process the daemon "
               "cannot see") + (f" (uid {held.caller.uid})" if held.caller is not None else "")
        mine = f"process {caller.pid} (uid {caller.uid})" if caller is not None else "a process of unknown credentials"
        raise TrustRefusal(
            "rank_held", f"rank {held.id} is held by {who} on another connection; {mine} may not take it over",
            field="rank_id", fix=f"unregister {held.id} from its holder first, or stop the holder (the daemon frees "
                                 "its ranks once its process exits); give each engine rank its own instance "
                                 "name and coordinates")

    def add(self, rank: Rank) -> Rank | None:
        """Add a rank; return the one it replaces (an engine that restarted)."""
        old = self._ranks.get(rank.id)
        self._ranks[rank.id] = rank
        return old

    def remove(self, rank_key: str) -> Rank | None:
        return self._ranks.pop(rank_key, None)

    def count_by_role(self) -> dict[str, int]:
        counts = {"prefill": 0, "decode": 0}
        for r in self._ranks.values():
            counts[r.role] += 1
        return counts

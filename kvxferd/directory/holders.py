"""The embedded directory of an instance's rendezvous daemon: which daemon holds which rank.

A rank that registers at a daemon other than its instance's rendezvous is *announced* there
by its daemon, and the announcement is renewed with every heartbeat: an entry is a lease that
ends ``lease_s`` after its last renewal, so the ranks of a daemon that died drop out on their
own. The rendezvous's own ranks come from its registry (passed in as ``local``). Pure: no
socket and no clock (``now`` is handed in), so every rule is tested without processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Iterable

from ..errors import PlanRefusal, RegistrationError
from ..model import dp
from ..model.geometry import InstanceSpec, rank_id

Coords = tuple[int, int]

#: missing ranks an answer names at most (the rest are counted): no answer grows with tp_size x pp_size
MAX_NAMED = 16


@dataclass
class Holder:
    """One rank announced by a remote daemon (its advertised address), valid until ``expires``."""

    daemon: str
    incarnation: str
    spec: InstanceSpec
    expires: float
    dp_size: int | None = None  # the instance is a DP rank (<name>@dp<k>) of a data-parallel instance
    #: the peer link that announced it (a routing id): only that link renews or withdraws it while it lives
    owner: Hashable = None


def spec_difference(a: InstanceSpec, b: InstanceSpec) -> tuple[str, object, object]:
    """The first field in which two instance specs differ, and both values."""
    da, db = a.to_dict(), b.to_dict()
    for key in sorted(set(da) | set(db)):
        if da.get(key) != db.get(key):
            return key, da.get(key), db.get(key)
    return "geometry", da, db


class Directory:
    """Ranks of instances this daemon is the rendezvous of, announced by other daemons."""

    def __init__(self, own_address: str, lease_s: float, max_ranks: int = 4096) -> None:
        self.own_address = own_address
        self.lease_s = lease_s
        self.max_ranks = max_ranks  # announced ranks held at once (a peer cannot grow it without bound)
        self._held: dict[tuple[str, str], dict[Coords, Holder]] = {}
        #: (instance, role) -> rank -> (why its announcement was refused, field); kept for the handshake
        self.refused: dict[tuple[str, str], dict[Coords, tuple[str, str]]] = {}
        #: instances whose ranks registered naming this daemon as their rendezvous: a handshake
        #: for them waits for the whole rank set (other instances answer as they always did)
        self._managed: set[tuple[str, str]] = set()

    def manage(self, instance: str, role: str) -> None:
        self._managed.add((instance, role))

    def managed_keys(self) -> set[tuple[str, str]]:
        return set(self._managed)

    def managed(self, instance: str, role: str) -> bool:
        key = (instance, role)
        return key in self._managed or bool(self._held.get(key)) or bool(self.refused.get(key))

    def announce(self, instance: str, role: str, spec: InstanceSpec, ranks: Iterable[Coords], daemon: str,
                 incarnation: str, now: float, local: dict[Coords, InstanceSpec], dp_size: int | None = None,
                 local_dp: dp.DpSize | None = None, owner: Hashable = None) -> None:
        """Record (or renew) the ranks held by ``daemon`` (all of them: those it no longer names are
        withdrawn); refuse ranks that contradict the instance (also a DP rank whose ``dp_size``
        differs from another DP rank's: ``local_dp`` is what ranks registered here said)."""
        key = (instance, role)
        self._expire(key, now)
        held = self._held.setdefault(key, {})
        ranks = list(ranks)
        for coords in [c for c, h in held.items() if h.daemon == daemon and c not in ranks]:
            del held[coords]
        if sum(len(h) for h in self._held.values()) + len([c for c in ranks if c not in held]) > self.max_ranks:
            raise RegistrationError(f"the directory holds {self.max_ranks} announced ranks", field="ranks",
                                    fix="raise limits.max_ranks at the rendezvous daemon")
        if len(self.refused) > self.max_ranks:
            self.refused.clear()  # kept for handshakes only; a flood of refusals must not grow without bound
        for coords in ranks:
            rid = rank_id(instance, *coords)
            self._check_coords(spec, coords, rid)
            other = self._spec_of_others(key, coords, local)
            if other is not None and other[1] != spec:
                field, theirs, ours = spec_difference(other[1], spec)
                self._refuse(key, coords, f"rank {rid} announced by {daemon} has {field} = {ours!r}, but rank "
                             f"{other[0]} of the instance has {field} = {theirs!r}", field,
                             "register every rank of an instance with the same instance geometry")
            self._check_dp(key, coords, daemon, dp_size, local_dp, now)
            holder = held.get(coords)
            # a rank held here, or announced by another daemon whose lease runs, is not taken over
            claim = self.own_address if coords in local else (
                holder.daemon if holder is not None and holder.daemon != daemon else None)
            if claim is not None and claim != daemon:
                self._refuse(key, coords, f"rank {rid} is announced by {daemon} but held by {claim}", "daemon",
                             "register each rank of an instance at one daemon only")
            held[coords] = Holder(daemon, incarnation, spec, now + self.lease_s, dp_size, owner)
            self.refused.get(key, {}).pop(coords, None)

    def owner_refusal(self, instance: str, role: str, daemon: str, owner: Hashable,
                      live: Callable[[Hashable], bool], now: float) -> str | None:
        """Why ``owner`` (a peer link) may not announce or withdraw ``daemon``'s ranks of the instance:
        another link of that name announced them and still lives (None: it may). A daemon that
        restarted or reconnected announces over a new link once its old one is gone."""
        for holder in self.remote(instance, role, now).values():
            if holder.daemon == daemon and holder.owner is not None and holder.owner != owner:
                if live(holder.owner):
                    return (f"ranks of {instance!r} ({role}) of daemon {daemon} were announced over another peer "
                            "link that is still live")
                return None  # the old link is gone: the new one takes them over
        return None

    def withdraw(self, instance: str, role: str, daemon: str, ranks: Iterable[Coords]) -> None:
        held = self._held.get((instance, role), {})
        for coords in ranks:
            if coords in held and held[coords].daemon == daemon:
                del held[coords]

    def forget_daemon(self, daemon: str) -> None:
        """A daemon restarted or went: its leases end now."""
        for held in self._held.values():
            for coords in [c for c, h in held.items() if h.daemon == daemon]:
                del held[coords]

    def keys(self) -> list[tuple[str, str]]:
        return list(self._held)

    def remote(self, instance: str, role: str, now: float) -> dict[Coords, Holder]:
        key = (instance, role)
        self._expire(key, now)
        return dict(self._held.get(key, {}))

    def spec(self, instance: str, role: str, now: float) -> InstanceSpec | None:
        for holder in self.remote(instance, role, now).values():
            return holder.spec
        return None

    def ranks(self, instance: str, role: str, now: float, local: dict[Coords, InstanceSpec]) -> dict[Coords, str]:
        """Every known rank -> the daemon that holds it, or raise (refusal, or ranks still missing).

        Raises :class:`PlanRefusal` for a refused announcement (naming rank, field and both values)
        and :class:`RankSetIncomplete` naming the ranks nobody registered yet."""
        key = (instance, role)
        refused = self.refused.get(key)
        if refused:
            message, field = next(iter(refused.values()))
            raise PlanRefusal(message, field=field)
        remote = self.remote(instance, role, now)
        spec = next(iter(local.values()), None) or self.spec(instance, role, now)
        for coords, holder in remote.items():  # a rank registered here after the others announced
            if spec is not None and holder.spec != spec and coords not in local:
                field, ours, theirs = spec_difference(spec, holder.spec)
                mine = next(iter(local), None)
                raise PlanRefusal(f"rank {rank_id(instance, *coords)} at {holder.daemon} has {field} = {theirs!r}, "
                                  f"but rank {rank_id(instance, *(mine or coords))} has {field} = {ours!r}",
                                  field=field)
        out = {coords: holder.daemon for coords, holder in remote.items()}
        out.update({coords: self.own_address for coords in local})
        if spec is None:
            raise RankSetIncomplete(f"instance {instance!r} has no registered {role} rank", [])
        absent = spec.tp_size * spec.pp_size - sum(1 for tp, pp in out if tp < spec.tp_size and pp < spec.pp_size)
        if absent > 0:
            missing = first_missing(spec, out, MAX_NAMED)
            names = ", ".join(rank_id(instance, *c) for c in missing)
            more = f" and {absent - len(missing)} more" if absent > len(missing) else ""
            raise RankSetIncomplete(f"instance {instance!r} is missing ranks {names}{more} ({absent} of its "
                                    f"{spec.tp_size * spec.pp_size}; registered at no daemon this rendezvous "
                                    "knows of)", missing, absent)
        return out

    def dp_seen(self, base: str, role: str, now: float) -> dp.DpSize | None:
        """The ``dp_size`` a DP rank of the data-parallel instance ``base`` was announced with."""
        for (instance, r), held in self._held.items():  # read only: announce() calls it mid-update
            if r == role and dp.split(instance)[0] == base and dp.split(instance)[1] is not None:
                for coords, holder in sorted(held.items()):
                    if holder.dp_size is not None and holder.expires >= now:
                        return dp.DpSize(holder.dp_size, rank_id(instance, *coords), holder.daemon)
        return None

    def plain(self, instance: str, role: str) -> bool:
        """Whether ranks of ``instance`` were announced without DP ranks."""
        return bool(self._held.get((instance, role)))

    # -- internals ---------------------------------------------------------------------------
    def _check_dp(self, key: tuple[str, str], coords: Coords, daemon: str, dp_size: int | None,
                  local_dp: dp.DpSize | None, now: float) -> None:
        base, dp_rank = dp.split(key[0])
        if dp_rank is None or dp_size is None:
            return
        rid = rank_id(key[0], *coords)
        if dp_rank >= dp_size:
            self._refuse(key, coords, f"rank {rid} announced by {daemon} is DP rank {dp_rank}, not below its "
                         f"dp_size = {dp_size}", "dp_rank", f"register DP ranks 0..{dp_size - 1}")
        why = dp.size_mismatch(base, rid, dp_size, daemon, local_dp or self.dp_seen(base, key[1], now))
        if why is not None:
            self._refuse(key, coords, why, "dp_size", dp.SAME_SIZE_FIX)


    def _expire(self, key: tuple[str, str], now: float) -> None:
        held = self._held.get(key)
        if held:
            for coords in [c for c, h in held.items() if h.expires < now]:
                del held[coords]
        if held is not None and not held:
            del self._held[key]

    def _spec_of_others(self, key: tuple[str, str], coords: Coords,
                        local: dict[Coords, InstanceSpec]) -> tuple[str, InstanceSpec] | None:
        for c, spec in local.items():
            if c != coords:
                return rank_id(key[0], *c), spec
        for c, holder in self._held.get(key, {}).items():
            if c != coords:
                return rank_id(key[0], *c), holder.spec
        return None

    def _check_coords(self, spec: InstanceSpec, coords: Coords, rid: str) -> None:
        if not (0 <= coords[0] < spec.tp_size and 0 <= coords[1] < spec.pp_size):
            raise RegistrationError(f"rank {rid} is outside the instance's tp_size {spec.tp_size} x pp_size "
                                    f"{spec.pp_size}", field="ranks", fix="announce ranks of the instance's spec")

    def _refuse(self, key: tuple[str, str], coords: Coords, message: str, field: str, fix: str) -> None:
        self.refused.setdefault(key, {})[coords] = (message, field)
        raise RegistrationError(message, field=field, fix=fix)


def first_missing(spec: InstanceSpec, held: dict[Coords, str], limit: int) -> list[Coords]:
    """The first ``limit`` ranks of ``spec`` (in PP, then TP order) that ``held`` lacks. The walk
    stops there: it visits at most ``len(held) + limit`` ranks, however large tp_size x pp_size is."""
    out: list[Coords] = []
    for pp in range(spec.pp_size):
        for tp in range(spec.tp_size):
            if (tp, pp) not in held:
                out.append((tp, pp))
                if len(out) >= limit:
                    return out
    return out


class RankSetIncomplete(Exception):
    """The rank set of an instance is not complete yet: the decode side retries, then names them.

    ``missing`` names at most :data:`MAX_NAMED` ranks; ``count`` is how many are missing in all."""

    def __init__(self, message: str, missing: list[Coords], count: int | None = None) -> None:
        super().__init__(message)
        self.missing = missing
        self.count = len(missing) if count is None else count

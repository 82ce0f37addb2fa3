"""The rank directory kept in etcd, the pure part: key layout, values, and feeding what a range
read returned into :class:`~.holders.Directory`, so the rules (same spec on every rank, one
daemon per rank, DP sizes, complete rank sets) stay in one place.

Each daemon writes one key per rank it holds, ``/kvxferd/<cluster>/ranks/<role>/<instance>/<tp>.<pp>``,
attached to its lease; the value is JSON naming the daemon (its advertised peer address), its
incarnation, the instance spec and the DP size. A rendezvous reads the keys of an instance (and
of its DP ranks ``<instance>@dp<k>``) with one range over ``.../<role>/<instance>`` and announces
what each other daemon holds, as if that daemon had announced it over the peer protocol.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..errors import KvxferError, RegistrationError
from ..model import dp
from ..model.geometry import InstanceSpec
from ..wire import protocol
from .holders import Coords, Directory

#: the largest value one rank's key may hold (a spec is a few hundred bytes)
MAX_VALUE = 64 * 1024


def ranks_prefix(cluster: str, role: str) -> bytes:
    return f"/kvxferd/{cluster}/ranks/{role}/".encode()


def rank_key(cluster: str, role: str, instance: str, coords: Coords) -> bytes:
    return ranks_prefix(cluster, role) + f"{instance}/{coords[0]}.{coords[1]}".encode()


def instance_prefix(cluster: str, role: str, instance: str) -> bytes:
    """Covers the instance's keys and those of its DP ranks (``<instance>@dp<k>``); a range read
    over it may also return other instances whose name starts alike (:func:`parse` drops them)."""
    return ranks_prefix(cluster, role) + instance.encode()


def encode_value(daemon: str, incarnation: str, spec: InstanceSpec, dp_size: int | None) -> bytes:
    return json.dumps({"daemon": daemon, "incarnation": incarnation, "spec": spec.to_dict(), "dp_size": dp_size},
                      sort_keys=True, separators=(",", ":")).encode()


@dataclass
class Held:
    """What one daemon wrote for one instance: its ranks and the spec it registered them with."""

    daemon: str
    incarnation: str
    spec: InstanceSpec
    dp_size: int | None
    ranks: list[Coords] = field(default_factory=list)


@dataclass
class Parsed:
    """A range read, by instance then daemon. ``bad`` says why keys were skipped (key, reason), for
    values refused by this read; ``known_bad`` counts those refused before and unchanged since.
    ``parsed`` counts values parsed by this read (the others were known, :class:`ValueCache`)."""

    held: dict[str, dict[str, Held]] = field(default_factory=dict)
    bad: list[tuple[str, str]] = field(default_factory=list)
    known_bad: int = 0
    parsed: int = 0
    refused: int = 0  # of those parsed, refused


#: one value as parsed: (daemon, incarnation, spec, dp_size), or why it was refused
Outcome = tuple[str, str, InstanceSpec, int | None] | str


class ValueCache:
    """Values already parsed, by a digest of their bytes: a value read again unchanged (every
    heartbeat) is not parsed again, whether it was good or refused. Bounded: past ``limit``
    entries the oldest are forgotten (and parsed again if they come back)."""

    def __init__(self, limit: int = 8192) -> None:
        self.limit = limit
        self._known: OrderedDict[bytes, Outcome] = OrderedDict()

    def __len__(self) -> int:
        return len(self._known)

    def get(self, value: bytes) -> tuple[bytes, Outcome | None]:
        digest = hashlib.blake2b(value, digest_size=16).digest()
        return digest, self._known.get(digest)

    def put(self, digest: bytes, outcome: Outcome) -> None:
        self._known[digest] = outcome
        while len(self._known) > self.limit:
            self._known.popitem(last=False)


def parse(cluster: str, role: str, instance: str, kvs: Iterable[tuple[bytes, bytes, int]],
          cache: ValueCache | None = None) -> Parsed:
    """The keys of ``instance`` and its DP ranks; a key another daemon wrote wrongly is skipped
    (and named in ``bad`` the first time it is read), it never stops the rest from being read."""
    out = Parsed()
    prefix = ranks_prefix(cluster, role)
    for key, value, _lease in kvs:
        name = key.decode("utf-8", "replace")
        try:
            if not key.startswith(prefix):
                continue
            inst, _, coords_text = key[len(prefix):].decode().rpartition("/")
            if inst != instance and not (dp.split(inst)[0] == instance and dp.split(inst)[1] is not None):
                continue  # another instance whose name starts alike
            tp, _, pp = coords_text.partition(".")
            coords = (int(tp), int(pp))
        except (ValueError, KeyError, TypeError, KvxferError) as exc:
            out.bad.append((name, f"{type(exc).__name__}: {exc}"[:200]))
            continue
        digest, outcome = cache.get(value) if cache is not None else (b"", None)
        if outcome is None:
            outcome = _outcome(value)
            out.parsed += 1
            if cache is not None:
                cache.put(digest, outcome)
            if isinstance(outcome, str):
                out.bad.append((name, outcome))
                out.refused += 1
        elif isinstance(outcome, str):
            out.known_bad += 1
        if isinstance(outcome, str):
            continue
        by_daemon = out.held.setdefault(inst, {})
        daemon = outcome[0]
        if daemon in by_daemon:
            by_daemon[daemon].ranks.append(coords)
        else:
            by_daemon[daemon] = Held(*outcome, [coords])
    return out


def _outcome(value: bytes) -> Outcome:
    try:
        return _held(value)
    except (ValueError, KeyError, TypeError, RecursionError, KvxferError) as exc:
        return f"{type(exc).__name__}: {exc}"[:200]


def _held(value: bytes) -> tuple[str, str, InstanceSpec, int | None]:
    """One value parsed, checked against the bounds every geometry gets before anything is built
    from it (a spec of a million layers or PP ranks is refused here, not expanded)."""
    if len(value) > MAX_VALUE:
        raise ValueError(f"value of {len(value)} bytes exceeds {MAX_VALUE}")
    data = json.loads(value)
    if not isinstance(data, dict) or not isinstance(data.get("daemon"), str) or not data["daemon"]:
        raise ValueError("value names no daemon")
    protocol.ADDRESS("daemon", data["daemon"])
    dp_size = data.get("dp_size")
    if dp_size is not None and (not isinstance(dp_size, int) or isinstance(dp_size, bool)
                                or not 1 <= dp_size <= protocol.MAX_DP):
        raise ValueError(f"dp_size {dp_size!r} is not an integer in 1..{protocol.MAX_DP}")
    spec = InstanceSpec.from_dict(protocol.bounded_geometry(data["spec"], "spec"))
    return data["daemon"], str(data.get("incarnation", ""))[:protocol.MAX_ID_LEN], spec, dp_size


def feed(directory: Directory, instance: str, role: str, held: dict[str, Held], own_address: str, now: float,
         local: dict[Coords, InstanceSpec], local_dp: dp.DpSize | None) -> list[str]:
    """Make the directory hold what etcd holds for one instance: every other daemon's ranks are
    announced (renewing their leases here), a daemon whose keys are gone is withdrawn, and the
    refusals are derived afresh (etcd is the whole truth). Returns the refusals, for the log."""
    key = (instance, role)
    directory.refused.pop(key, None)
    others = {d: h for d, h in held.items() if d != own_address}  # own ranks come from the registry
    for daemon in {h.daemon for h in directory.remote(instance, role, now).values()} - set(others):
        directory.withdraw(instance, role, daemon, list(directory.remote(instance, role, now)))
    refusals: list[str] = []
    for daemon, h in sorted(others.items()):
        try:
            directory.announce(instance, role, h.spec, sorted(h.ranks), daemon, h.incarnation, now, local,
                               h.dp_size, local_dp)
        except RegistrationError as exc:
            refusals.append(str(exc))
    return refusals


def desired(cluster: str, own_address: str, incarnation: str,
            ranks: Iterable[tuple[str, str, Coords, InstanceSpec, int | None]]) -> dict[bytes, bytes]:
    """The keys this daemon should hold in etcd for its registered ranks (instance, role, coords, spec, dp_size)."""
    return {rank_key(cluster, role, instance, coords): encode_value(own_address, incarnation, spec, dp_size)
            for instance, role, coords, spec, dp_size in ranks}


def diff(want: dict[bytes, bytes], written: dict[bytes, bytes]) -> tuple[dict[bytes, bytes], list[bytes]]:
    """Keys to put (new or changed) and keys to delete (ranks that went) to make ``written`` ``want``."""
    puts = {k: v for k, v in want.items() if written.get(k) != v}
    return puts, sorted(k for k in written if k not in want)


def describe(held: dict[str, Held]) -> dict[str, Any]:
    """For status: daemon -> its ranks as ``tp.pp``."""
    return {d: sorted(f"{tp}.{pp}" for tp, pp in h.ranks) for d, h in sorted(held.items())}

"""Instances over several daemons, the I/O side: announcing this daemon's ranks to their
instance's rendezvous, and serving announcements, lookups and handshake rank maps for the
instances this daemon is the rendezvous of (the rules are in :mod:`kvxferd.directory.holders`).

A rank names its rendezvous when it registers (``rendezvous``, host:port of a daemon's peer
endpoint). Naming this daemon makes it the rendezvous; naming another makes this daemon
announce the rank there now and with every heartbeat (a lease), and withdraw it when the
rank goes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from ..directory.holders import MAX_NAMED, Coords, Directory, RankSetIncomplete
from ..errors import KvxferError, RequestError
from ..lifecycle.registry import Rank, Registry
from ..model import dp
from ..model.geometry import InstanceSpec
from ..ops.config import Config
from ..ops.logutil import q
from ..ops.metrics import Metrics
from ..wire import messages, protocol
from .advertised import Advertised
from .rendezvous_etcd import EtcdDirectory

log = logging.getLogger("kvxferd.rendezvous")


def check_rendezvous(address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RequestError(f"rendezvous {address!r} is not host:port", field="rendezvous",
                           fix="name the peer endpoint (host:peer.control_port) of the instance's rendezvous daemon")


class Rendezvous:
    def __init__(self, cfg: Config, me: Advertised, registry: Registry, directory: Directory,
                 ask: Callable[[str, messages.Message, float], Awaitable[dict[str, Any]]], metrics: Metrics) -> None:
        self.cfg = cfg
        self.me = me
        self.registry = registry  # the ranks here
        self.directory = directory  # the ranks announced to this daemon, or read from etcd
        self.ask = ask  # a message to another daemon and its answer (an announcement)
        #: (instance, role) of ranks here -> the rendezvous daemon they announce to
        self.remote: dict[tuple[str, str], str] = {}
        #: the last refusal a rendezvous answered, per (instance, role) (shown by status)
        self.refusals: dict[tuple[str, str], str] = {}
        self._pending: set[tuple[str, str]] = set()  # announcements waiting for their answer
        self.metrics = metrics
        self._values_ok = metrics.directory_values.labels("announce", "ok")
        #: the last refusal of an announcement per (daemon, instance, role): logged when it changes
        self._refused_here: dict[tuple[str, str, str], str] = {}
        #: directory.backend = "etcd": ranks are written to and read from etcd instead of announced
        self.etcd = (EtcdDirectory(self, cfg, me, registry, metrics.directory_errors.inc, metrics.directory_values)
                     if cfg.directory.backend == "etcd" else None)

    async def close(self) -> None:
        if self.etcd is not None:
            await self.etcd.close()

    # -- ranks here ------------------------------------------------------------------------------
    def local(self, instance: str, role: str) -> dict[Coords, InstanceSpec]:
        return {r.coords: r.geometry.spec for r in self.registry if r.instance == instance and r.role == role}

    def local_dp(self, base: str, role: str) -> dp.DpSize | None:
        for r in self.registry:
            if r.role == role and r.dp_size is not None and dp.split(r.instance)[0] == base:
                return dp.DpSize(r.dp_size, r.id, self.me.address)
        return None

    def dp_seen(self, base: str, role: str) -> dp.DpSize | None:
        """The ``dp_size`` of the data-parallel instance ``base`` as a rank here or an announcement said."""
        return self.local_dp(base, role) or self.directory.dp_seen(base, role, time.monotonic())

    def check_dp_request(self, instance: str) -> None:
        """A handshake for a DP rank (``<name>@dp<k>``) the instance does not have is refused now."""
        base, dp_rank = dp.split(instance)
        if self.etcd is not None:
            self.etcd.ask(base, "prefill")
        if dp_rank is not None:
            plain = self.registry.spec(base, "prefill") is not None or self.directory.plain(base, "prefill")
            dp.check_request(base, dp_rank, self.dp_seen(base, "prefill"), plain)

    def registered(self, rank: Rank, rendezvous: str | None) -> None:
        if self.etcd is not None:
            self.etcd.kick()  # every rank here goes to etcd, whichever daemon is its rendezvous
        if not rendezvous:
            return
        key = (rank.instance, rank.role)
        if rendezvous == self.me.address:
            self.directory.manage(*key)
            return
        self.remote[key] = rendezvous
        self.announce(*key)

    def unregistered(self, rank: Rank) -> None:
        if self.etcd is not None:
            self.etcd.kick()  # its key is deleted now
        key = (rank.instance, rank.role)
        if key in self.remote:
            self.announce(*key)  # the set without it: the rendezvous withdraws the rank now
            if not self.local(*key):
                del self.remote[key]

    def heartbeat(self) -> None:
        if self.etcd is not None:
            self.etcd.kick()  # renews the lease, writes what changed, reads the instances asked about
            return
        for key in list(self.remote):
            self.announce(*key)

    def announce(self, instance: str, role: str) -> None:
        key = (instance, role)
        if self.etcd is not None:
            return  # the rendezvous reads this daemon's ranks from etcd
        if key in self._pending:
            return  # the last one is still on its way; the next heartbeat renews
        local = self.local(instance, role)
        spec = next(iter(local.values()), None)
        dp_size = next((r.dp_size for r in self.registry if r.instance == instance and r.role == role), None)
        msg = messages.Announce(self.me.address, self.me.incarnation, instance, role,
                                spec.to_dict() if spec is not None else {}, [list(c) for c in sorted(local)],
                                dp_size)
        self._pending.add(key)
        asyncio.ensure_future(self._announce(self.remote[key], key, msg))

    async def _announce(self, address: str, key: tuple[str, str], msg: messages.Announce) -> None:
        try:
            reply = await self.ask(address, msg, max(1.0, self.cfg.peer.heartbeat_interval_s))
        except (asyncio.TimeoutError, TimeoutError, asyncio.CancelledError):
            return  # unanswered: the next heartbeat tries again
        except KvxferError as exc:
            reply = {"op": "error", "error": exc.to_wire()}
        finally:
            self._pending.discard(key)
        if reply.get("op") == "announce_ok":
            if self.refusals.pop(key, None) is not None:
                log.info("event=announce_ok rendezvous=%s instance=%s", address, key[0])
            return
        err = reply.get("error") if isinstance(reply.get("error"), dict) else {}
        message = str(err.get("message", reply))[:500]
        if self.refusals.get(key) != message:
            log.warning("event=announce_refused rendezvous=%s instance=%s field=%s msg=%s", address, key[0],
                        err.get("field"), q(message))
        self.refusals[key] = message

    # -- this daemon as the rendezvous -------------------------------------------------------------
    def on_announce(self, msg: messages.Announce, owner: Any = None,
                    live: Callable[[Any], bool] = lambda _owner: True) -> messages.Message:
        """Record (or withdraw: no ranks) a daemon's ranks announced over the peer link ``owner``;
        ``live`` says whether another link that announced them first still lives (then refused)."""
        now = time.monotonic()
        local = self.local(msg.instance, msg.role)
        taken = self.directory.owner_refusal(msg.instance, msg.role, msg.daemon, owner, live, now)
        if taken is not None:
            op = "announce" if msg.ranks else "withdraw"
            self.metrics.peer_claims_refused.labels(op, "not_owner").inc()
            log.warning("event=claim_refused op=%s reason=not_owner daemon=%s instance=%s", op, msg.daemon,
                        msg.instance)
            raise RequestError(f"this peer link may not {op} ranks of daemon {msg.daemon}: {taken}",
                               field="daemon", code="claim_refused",
                               fix=f"{op} ranks only over the daemon's own link; a restarted daemon's announcements "
                               "are taken once its old link is gone")
        if not msg.ranks:
            self.directory.withdraw(msg.instance, msg.role, msg.daemon,
                                    list(self.directory.remote(msg.instance, msg.role, now)))
            return messages.AnnounceOk(msg.instance)
        known = set(self.directory.remote(msg.instance, msg.role, now))
        try:  # the geometry bounds every input gets, before anything sized by the spec is built
            spec = InstanceSpec.from_dict(protocol.bounded_geometry(msg.spec, "spec"))
            self.directory.announce(msg.instance, msg.role, spec, [tuple(c) for c in msg.ranks], msg.daemon,
                                    msg.incarnation, now, local, msg.dp_size,
                                    self.local_dp(dp.split(msg.instance)[0], msg.role), owner)
        except KvxferError as exc:
            self._announce_refused(msg, exc)
            raise
        self._values_ok.inc()
        if known != set(self.directory.remote(msg.instance, msg.role, now)):
            log.info("event=ranks_announced instance=%s daemon=%s ranks=%s", msg.instance, msg.daemon,
                     ",".join(f"{tp}.{pp}" for tp, pp in msg.ranks))
        return messages.AnnounceOk(msg.instance)

    def _announce_refused(self, msg: messages.Announce, exc: KvxferError) -> None:
        """Count a refused announcement; log it when it differs from the last one of its sender and instance."""
        self.metrics.directory_values.labels("announce", "refused").inc()
        key = (msg.daemon, msg.instance, msg.role)
        text = str(exc)[:300]
        if self._refused_here.get(key) == text:
            return  # renewed every heartbeat: logged once
        if len(self._refused_here) >= self.cfg.limits.max_ranks:
            self._refused_here.clear()
        self._refused_here[key] = text
        log.warning("event=announce_refused_here daemon=%s instance=%s field=%s msg=%s", msg.daemon, msg.instance,
                    exc.field, q(text))

    def rank_map(self, instance: str, role: str) -> dict[Coords, str]:
        """Every rank -> its daemon; raises PlanRefusal, or RequestError naming missing ranks."""
        try:
            return self.directory.ranks(instance, role, time.monotonic(), self.local(instance, role))
        except RankSetIncomplete as missing:
            where = f" (the etcd directory: {self.etcd.error})" if self.etcd is not None and self.etcd.error else ""
            raise RequestError(str(missing) + where, field="ranks", code="ranks_missing",
                               fix="start every rank of the instance, each naming this daemon as its rendezvous")

    def on_lookup(self, msg: messages.Lookup) -> Any:
        """The rank map; with an etcd directory, read from etcd first (an awaitable answer)."""
        if self.etcd is not None:
            return self._lookup_etcd(msg)
        return self._lookup(msg)

    async def _lookup_etcd(self, msg: messages.Lookup) -> messages.Message:
        assert self.etcd is not None
        await self.etcd.read(dp.split(msg.instance)[0], msg.role)
        return self._lookup(msg)

    def _lookup(self, msg: messages.Lookup) -> messages.Message:
        seen = self.dp_seen(msg.instance, msg.role) if dp.split(msg.instance)[1] is None else None
        if seen is not None:  # a data-parallel instance: which DP ranks it has, and where their ranks are
            return self._dp_ranks(msg.instance, msg.role, seen.dp_size)
        held = self.rank_map(msg.instance, msg.role)
        return messages.Ranks(msg.instance, [[tp, pp, a] for (tp, pp), a in sorted(held.items())],
                              spec=self._spec(msg.instance, msg.role))

    def _spec(self, instance: str, role: str) -> dict[str, Any] | None:
        spec = self.registry.spec(instance, role) or self.directory.spec(instance, role, time.monotonic())
        return spec.to_dict() if spec is not None else None

    def _dp_ranks(self, base: str, role: str, dp_size: int) -> messages.Ranks:
        complete: list[list[Any]] = []
        missing: list[str] = []
        incomplete = 0
        for k in range(dp_size):
            try:
                held = self.directory.ranks(dp.dp_instance(base, k), role, time.monotonic(),
                                            self.local(dp.dp_instance(base, k), role))
            except (RankSetIncomplete, KvxferError) as exc:
                incomplete += 1
                if len(missing) < MAX_NAMED:  # the answer names a few and counts the rest
                    missing.append(f"DP rank {k}: {exc}"[:300])
                continue
            complete.append([k, [[tp, pp, a] for (tp, pp), a in sorted(held.items())]])
        if incomplete > len(missing):
            missing.append(f"and {incomplete - len(missing)} more DP ranks incomplete")
        spec = next((self._spec(dp.dp_instance(base, k), role) for k, _ in complete), None)
        return messages.Ranks(base, [], dp_size, complete, missing or None, spec)

    def handshake_ranks(self, instance: str) -> list[list[Any]] | None:
        """What a handshake for the instance answers: None for an instance wholly on this daemon (as
        always), the rank map when ranks are elsewhere; RankSetIncomplete while ranks are missing."""
        if self.etcd is not None:
            self.etcd.ask(dp.split(instance)[0], "prefill")
        if not self.directory.managed(instance, "prefill"):
            return None
        held = self.directory.ranks(instance, "prefill", time.monotonic(), self.local(instance, "prefill"))
        if all(address == self.me.address for address in held.values()):
            return None
        return [[tp, pp, a] for (tp, pp), a in sorted(held.items())]

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        out: dict[str, Any] = {"announcing": {f"{i}/{r}": a for (i, r), a in self.remote.items()}}
        if self.refusals:
            out["refused"] = {f"{i}/{r}": m for (i, r), m in self.refusals.items()}
        held, maps = {}, {}
        for instance, role in sorted(set(self.directory.keys()) | self.directory.managed_keys()):
            remote = self.directory.remote(instance, role, now)
            if remote:
                held[f"{instance}/{role}"] = {f"{tp}.{pp}": h.daemon for (tp, pp), h in sorted(remote.items())}
            # the whole map this rendezvous answers: its own ranks too (which daemon holds which rank)
            where = {(tp, pp): h.daemon for (tp, pp), h in remote.items()}
            where.update({c: self.me.address for c in self.local(instance, role)})
            if where:
                maps[f"{instance}/{role}"] = {f"{tp}.{pp}": a for (tp, pp), a in sorted(where.items())}
        if held:
            out["remote_ranks"] = held
        if maps:
            out["rank_map"] = maps
        if self.etcd is not None:
            out["directory"] = self.etcd.status()
        return out

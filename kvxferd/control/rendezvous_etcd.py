"""The rank directory in etcd, the I/O side (``directory.backend = "etcd"``).

Every heartbeat, and when a rank registers or goes, one round runs in a thread of its own (etcd
calls block; the event loop never waits on them): keep this daemon's lease alive (a new one if
etcd forgot it), put the keys of ranks that are new or changed, delete those of ranks that went,
and read the ranks of every instance this daemon is asked about or is the rendezvous of. What was
read is fed to the embedded :class:`~kvxferd.directory.holders.Directory` on the loop
(:mod:`kvxferd.directory.etcd_keys`), so handshakes, ``status`` and lookups answer from it with
the same rules as announcements.

etcd unreachable: one ``event=directory_unreachable`` line (and one ``directory_reachable`` when
it answers again), ``kvxferd_directory_errors_total``, and the error in ``status``; local work
goes on, and ranks read before expire from the directory after ``peer.peer_timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol

from ..directory import etcd_keys
from ..directory.etcd_client import EtcdClient, EtcdError
from ..directory.holders import Coords, Directory
from ..lifecycle.registry import Registry
from ..model import dp
from ..model.geometry import InstanceSpec
from ..ops.config import Config, lease_ttl
from ..ops.logutil import q
from .advertised import Advertised

log = logging.getLogger("kvxferd.directory")

#: instances asked about (handshake, lookup) are read for this many heartbeats after the last ask
ASKED_ROUNDS = 120


class Fed(Protocol):
    """What the rounds feed: the rendezvous's directory, its book of refusals, and the ranks here
    (:class:`~kvxferd.control.rendezvous.Rendezvous`)."""

    directory: Directory
    refusals: dict[tuple[str, str], str]

    def local(self, instance: str, role: str) -> dict[Coords, InstanceSpec]: ...

    def local_dp(self, base: str, role: str) -> dp.DpSize | None: ...


class EtcdDirectory:
    def __init__(self, rendezvous: Fed, cfg: Config, me: Advertised, registry: Registry,
                 count_error: Callable[[], None], values: Any = None) -> None:
        self.rv = rendezvous
        self.cfg = cfg
        self.me = me
        self.registry = registry  # the ranks here, whose keys this daemon writes
        self.count_error = count_error  # a round or read etcd did not answer (kvxferd_directory_errors_total)
        self.cluster = cfg.directory.cluster
        self.client = EtcdClient.from_config(cfg.directory)
        #: values read before, good or refused, by their bytes: an unchanged value is not parsed again
        self.values = etcd_keys.ValueCache(max(1024, 4 * cfg.limits.max_ranks))
        #: kvxferd_directory_values{source="etcd"} by outcome (None: not counted)
        self._parsed_ok = values.labels("etcd", "ok") if values is not None else None
        self._parsed_refused = values.labels("etcd", "refused") if values is not None else None
        self.ttl = lease_ttl(cfg)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvxferd-etcd")
        self.lease = 0
        self._written: dict[bytes, bytes] = {}  # what etcd holds of ours (touched by the etcd thread only)
        self._asked: dict[tuple[str, str], float] = {}  # (instance, role) -> when last asked
        self._busy = False
        self._again = False
        self._closed = False
        self.error: str | None = None  # the last etcd failure, until a round succeeds
        self.rounds = 0

    # -- called on the loop ------------------------------------------------------------------------
    def kick(self) -> None:
        """Run a round now (or right after the one in flight)."""
        if self._closed:
            return
        if self._busy:
            self._again = True
            return
        self._busy = True
        asyncio.ensure_future(self._rounds())

    def ask(self, instance: str, role: str) -> None:
        """Read this instance from etcd from now on (a handshake or lookup named it)."""
        key = (instance, role)
        new = key not in self._asked
        self._asked[key] = time.monotonic()
        if len(self._asked) > self.cfg.limits.max_ranks:  # bounded: forget the longest unasked
            del self._asked[min(self._asked, key=self._asked.__getitem__)]
        if new:
            self.kick()

    async def read(self, instance: str, role: str) -> None:
        """Read one instance now (a lookup answers from etcd as it is)."""
        self.ask(instance, role)
        loop = asyncio.get_running_loop()
        prefix = etcd_keys.instance_prefix(self.cluster, role, instance)
        try:
            kvs = await loop.run_in_executor(self._pool, self.client.get_prefix, prefix)
        except EtcdError as exc:
            self._failed(exc)
            return
        self._feed(instance, role, kvs)

    async def close(self) -> None:
        """A clean stop revokes the lease: this daemon's ranks leave etcd now, not a TTL later."""
        self._closed = True
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._pool, self._revoke)  # after a round in flight: its lease too
        except EtcdError as exc:
            log.warning("event=directory_unreachable endpoint=%s op=revoke error=%s", exc.endpoint, q(str(exc)[:300]))
        finally:
            self._pool.submit(self.client.close)
            self._pool.shutdown(wait=False)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": "etcd", "endpoint": self.client.last_endpoint, "cluster": self.cluster,
                               "lease": f"{self.lease:x}" if self.lease else None, "lease_ttl_s": self.ttl,
                               "keys": len(self._written), "reading": sorted(f"{i}/{r}" for i, r in self._watched()),
                               "rounds": self.rounds, "values_known": len(self.values)}
        if self.error:
            out["error"] = self.error
        return out

    def _revoke(self) -> None:
        if self.lease:
            self.client.revoke(self.lease)
            log.info("event=directory_lease_revoked lease=%x keys=%d", self.lease, len(self._written))
            self.lease = 0
            self._written.clear()

    # -- one round ---------------------------------------------------------------------------------
    async def _rounds(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self._closed:
                self._again = False
                want = self._want()
                watched = self._watched()
                try:
                    kvs = await loop.run_in_executor(self._pool, self._io, want, watched)
                except EtcdError as exc:
                    self._failed(exc)
                else:
                    if kvs is not None:  # a round with nothing to say proves nothing about etcd
                        self._ok()
                    for (instance, role), got in (kvs or {}).items():
                        self._feed(instance, role, got)
                if not self._again:
                    break
        except RuntimeError:  # the pool shut down under a round at stop
            pass
        finally:
            self._busy = False

    def _want(self) -> dict[bytes, bytes]:
        return etcd_keys.desired(self.cluster, self.me.address, self.me.incarnation,
                                 ((r.instance, r.role, r.coords, r.geometry.spec, r.dp_size) for r in self.registry))

    def _watched(self) -> list[tuple[str, str]]:
        horizon = time.monotonic() - ASKED_ROUNDS * self.cfg.peer.heartbeat_interval_s
        for key in [k for k, t in self._asked.items() if t < horizon]:
            del self._asked[key]
        managed = {(dp.split(i)[0], r) for i, r in self.rv.directory.managed_keys()}
        return sorted(managed | set(self._asked))

    def _io(self, want: dict[bytes, bytes],
            watched: list[tuple[str, str]]) -> dict[tuple[str, str], list[tuple[bytes, bytes, int]]] | None:
        """In the etcd thread: lease, writes, reads. Raises EtcdError; what got written stays known.

        None when there was nothing to keep alive, write or read: no request went out, so the round
        says nothing about whether etcd answers (an unreachable directory stays named as such)."""
        client = self.client
        if not (self.lease or want or self._written or watched):
            return None
        if self.lease and client.keepalive(self.lease) <= 0:
            log.warning("event=directory_lease_lost lease=%x keys=%d", self.lease, len(self._written))
            self.lease = 0
        if not self.lease:
            self._written.clear()  # the keys went with the old lease: write them all again
            if want:
                self.lease = client.grant(self.ttl)
                log.info("event=directory_lease lease=%x ttl_s=%d", self.lease, self.ttl)
        puts, deletes = etcd_keys.diff(want, self._written)
        for key in deletes:
            client.delete(key)
            del self._written[key]
        for key, value in puts.items():
            client.put(key, value, self.lease)
            self._written[key] = value
        return {(i, r): client.get_prefix(etcd_keys.instance_prefix(self.cluster, r, i)) for i, r in watched}

    def _feed(self, base: str, role: str, kvs: list[tuple[bytes, bytes, int]]) -> None:
        rv = self.rv
        parsed = etcd_keys.parse(self.cluster, role, base, kvs, self.values)
        if self._parsed_ok is not None and parsed.parsed:
            self._parsed_refused.inc(parsed.refused)
            self._parsed_ok.inc(parsed.parsed - parsed.refused)
        for key, why in parsed.bad[:3]:  # a refused value is parsed, and logged, once while unchanged
            log.warning("event=directory_bad_key key=%s reason=%s", q(key[:200]), q(why))
        now = time.monotonic()
        known = {i for i, r in rv.directory.keys() if r == role and (i == base or dp.split(i)[0] == base)}
        for instance in sorted(known | set(parsed.held)):
            local = rv.local(instance, role)
            refusals = etcd_keys.feed(rv.directory, instance, role, parsed.held.get(instance, {}), self.me.address,
                                      now, local, rv.local_dp(dp.split(instance)[0], role))
            for why in refusals:
                if rv.refusals.get((instance, role)) != why:
                    log.warning("event=directory_refused instance=%s msg=%s", instance, q(why[:300]))
                rv.refusals[(instance, role)] = why
            if not refusals:
                rv.refusals.pop((instance, role), None)

    def _failed(self, exc: EtcdError) -> None:
        self.count_error()
        message = str(exc)[:500]
        if self.error is None:
            log.warning("event=directory_unreachable endpoint=%s error=%s", exc.endpoint, q(message))
        self.error = message

    def _ok(self) -> None:
        self.rounds += 1
        if self.error is not None:
            log.info("event=directory_reachable endpoint=%s", self.client.last_endpoint)
        self.error = None

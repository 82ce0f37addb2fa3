"""The daemon's side of NIXL: the lazily started agent, transport negotiation in the
handshake, and the NIXL fields that handshakes and peer ``expect`` messages carry.

Everything here runs on the daemon's event loop; the transport's own threads live in
:mod:`.transport`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np

from ...wire import protocol
from ...errors import KvxferError, PlanRefusal, ProtocolError, RequestError, TransferError
from ...lifecycle.inbox import DestEntry, Inbox, Sink
from ...ops.logutil import q
from ...lifecycle.registry import Rank
from ...model.segments import as_pages
from ...datapath.staging import StagingPool
from .. import choices
from ...lifecycle.jobs import Moved
from ..choices import Fallback
from .api import PRIVATE
from .transport import NixlPeer, NixlTransport, _why

log = logging.getLogger("kvxferd.nixl")


class NixlSupport:
    """The daemon's view of NIXL: the lazy agent, transport negotiation, and what the
    handshake and peer ``expect`` messages carry for it.

    Everything here runs on the daemon's event loop except the transport's own threads.
    """

    def __init__(self, daemon_name: str, preference: list[str], inbox: Inbox, *, timeout_s: float,
                 max_header_bytes: int, max_pages: int, staging: StagingPool | None = None,
                 landing_slots: int = 0, landing_bytes: int = 0, in_place_bytes: int = 256 * 1024,
                 engine_memory: str = PRIVATE, bulk_block_bytes: int = 0,
                 on_received: Callable[[Sink, Moved], None] | None = None,
                 on_refused: Callable[[DestEntry, str, str], None] | None = None,
                 on_invalid: Callable[[str], None] | None = None,
                 on_registered: Callable[[str, int], None] | None = None,
                 on_nixl_refused: Callable[[str], None] | None = None) -> None:
        self.daemon_name = daemon_name
        self.engine_memory = engine_memory
        self.preference = list(preference)
        self.max_pages = max_pages
        self._args = dict(timeout_s=timeout_s, max_header_bytes=max_header_bytes, staging=staging,
                          landing_slots=landing_slots, landing_bytes=landing_bytes, in_place_bytes=in_place_bytes,
                          engine_memory=engine_memory, bulk_block_bytes=bulk_block_bytes, on_received=on_received,
                          on_refused=on_refused, on_invalid=on_invalid, on_registered=on_registered,
                          on_nixl_refused=on_nixl_refused)
        self.inbox = inbox
        self.transport: NixlTransport | None = None
        self.unavailable = "" if "nixl" in preference else "not enabled (peer.transport / peer.transports)"
        #: decode side: transport chosen per (source daemon, prefill instance, decode instance)
        self._chosen: dict[tuple[str, str, str], str] = {}
        #: decode side: registration generation of each rank last described per (source daemon, prefill instance)
        self._sent: dict[tuple[str, str, str], int] = {}
        #: ranks NIXL would not register, by rank id: (instance, why); their instances' pairs take
        #: another transport, saying so, rather than failing each request
        self.unregistered: dict[str, tuple[str, str]] = {}

    def get(self) -> NixlTransport | None:
        """The agent, created on first use; None where NIXL is off or unusable here."""
        if self.transport is None and not self.unavailable:
            try:
                self.transport = NixlTransport(self.daemon_name, self.inbox, **self._args)
            except Exception as exc:  # noqa: BLE001 - ImportError, no UCX plugin, UCX init failure
                self.unavailable = _why(exc)
                log.warning("event=nixl_unavailable reason=%s fix=%s", q(self.unavailable),
                            q("install nixl-cu12 (make venv does) and check UCX can start; peers fall back to tcp"))
        return self.transport

    def describe(self) -> dict[str, Any]:
        """For ``status``: the configured preference and the state of NIXL here (starts nothing)."""
        if self.transport is None:
            return {"preference": list(self.preference), "nixl_engine_memory": self.engine_memory,
                    "nixl": self.unavailable or "not started (starts with the first rank or handshake)"}
        t = self.transport
        return {"preference": list(self.preference), "nixl_engine_memory": self.engine_memory,
                "nixl": f"ready (agent {t.agent_name}, {len(t.source_agents)} sources)",
                # decode side: landing rings offered to source links (live and quarantined memory);
                # prefill side: landing slots of each destination agent written and not yet handed back
                "landing": {"rings": t.landing.ring_count, "bytes_held": t.landing.bytes_held,
                            "budget_bytes": t.landing.budget_bytes},
                "credits_out": t.credits_out(), "registrations": t.registrations(),
                # prefill side: direct chunks and the WRITEs they took (more WRITEs: bulk cut by qos.bulk_block_bytes)
                "direct": {"chunks": t.direct_chunks, "writes": t.direct_writes}}

    def offered(self) -> list[str]:
        """This daemon's transports in preference order, NIXL only where the agent works."""
        return [t for t in self.preference if t != "nixl" or self.get() is not None]

    def register(self, rank: Rank) -> None:
        transport = self.get()
        if transport is None:
            return
        try:
            transport.register_rank(rank)
        except Exception as exc:  # noqa: BLE001 - the rank still works over tcp: its pairs fall back
            self.unregistered[rank.id] = (rank.instance, _why(exc)[:300])
            log.warning("event=nixl_register_failed rank=%s reason=%s fix=%s", rank.id, q(_why(exc)),
                        q("the instance's pairs take the next transport; see the NIXL/UCX error above"))

    def deregister(self, rank: Rank) -> None:
        self.unregistered.pop(rank.id, None)
        if self.transport is not None:
            self.transport.deregister_rank(rank)

    def unusable_for(self, instance: str) -> str:
        """Why NIXL cannot carry ``instance`` here (a rank it would not register), else empty."""
        for rank_id, (owner, why) in sorted(self.unregistered.items()):
            if owner == instance:
                return f"rank {rank_id} could not be registered with NIXL ({why})"
        return ""

    # -- decode side -----------------------------------------------------------------
    def handshake_fields(self, source: str, prefill: str, decode: str) -> dict[str, Any]:
        transport = self.get() if "nixl" in self.offered() else None
        if transport is None:
            return {}
        unusable = self.unusable_for(decode)
        if unusable:  # offered, with the reason it cannot be taken for this instance
            return {"nixl_unusable": unusable[:500]}
        fields, sent = transport.offer(decode, source)
        for dest_rank, generation in sent.items():
            self._sent[(source, prefill, dest_rank)] = generation
        return fields

    def accepted(self, source: str, prefill: str, decode: str, reply: dict[str, Any]) -> str:
        """Record the transport a source daemon chose in its handshake answer."""
        chosen = reply.get("transport")
        agent = reply.get("nixl_agent")
        if chosen == "nixl" and self.transport is not None and isinstance(agent, str) and agent:
            previous = self.transport.source_agents.get(source)
            if previous and previous != agent:  # the source daemon restarted: its old agent is gone
                self.transport.forget(previous)
            self.transport.source_agents[source] = agent
            self.transport.landing.bind(source, agent)
            try:  # the source's connection info, so landing slots can be handed back to it
                md = protocol.NIXL_OFFER["nixl_md"]("nixl_md", reply.get("nixl_md") or [])
                self.transport.load(agent, md)
            except KvxferError as exc:
                log.warning("event=nixl_peer_failed peer=%s reason=%s", q(source), q(str(exc)[:300]))
        else:
            chosen = "tcp"
        self._chosen[(source, prefill, decode)] = chosen
        if self.transport is not None and not any(
                t == "nixl" for (src, _p, _d), t in self._chosen.items() if src == source):
            self.transport.landing.retire(source)  # offered, not taken by any pair of that link
        return chosen

    def abandon(self, entry: DestEntry) -> None:
        if self.transport is not None:
            self.transport.stop_receiving(entry)

    def forget_peer(self, agent: str) -> None:
        """Prefill side: a decode daemon stopped answering; its agent goes once nothing can write to it."""
        if self.transport is not None and agent:
            self.transport.forget(agent)

    def forget_source(self, source: str) -> None:
        """Decode side: the link to a source daemon is gone for good (no request waits on it)."""
        if self.transport is not None:
            agent = self.transport.source_agents.pop(source, None)
            if agent:
                self.transport.forget(agent)

    def source_down(self, source: str) -> None:
        """A source daemon link went down: its landing ring is retired (quarantined, then freed)."""
        if self.transport is not None:
            self.transport.landing.retire(source)

    def route_kind(self, source: str, prefill: str, decode: str) -> str:
        return self._chosen.get((source, prefill, decode), "tcp")

    def expect_fields(self, source: str, entry: DestEntry) -> dict[str, Any]:
        """What a peer expect adds over NIXL: the page table, and the rank if the peer lacks it;
        nothing where engine memory is private (the source never addresses decode pages)."""
        if entry.transport != "nixl" or self.transport is None or self.transport.private:
            return {}
        key = (source, entry.source_instance, entry.rank.id)
        extra, generation = self.transport.describe_rank(entry.rank, self._sent.get(key))
        if generation is not None:
            self._sent[key] = generation
        fields: dict[str, Any] = {"dst_pages": entry.pages.tolist(), **extra}
        if entry.groups:  # each cache group's own table: its pages from token 0, or [state slot]
            fields["dst_groups"] = {name: table.tolist() for name, table in entry.groups.items()}
        return fields

    # -- prefill side ----------------------------------------------------------------
    def choose(self, msg: dict[str, Any], decode_spec: Any,
               mode: str) -> tuple[str, NixlPeer | None, Fallback | None]:
        """Pick the transport for a handshake: the first of ours the peer offers too; and why the
        first we prefer was passed over, if it was."""
        theirs = list(msg.get("transports") or [])
        mine = self.offered()
        skipped: dict[str, Fallback] = {}
        for name in self.preference:
            if name not in mine:
                skipped[name] = Fallback(choices.UNAVAILABLE_HERE, f"{name} is unusable here: {self.unavailable}")
                continue
            if name not in theirs:
                skipped[name] = Fallback(choices.NOT_OFFERED, f"the decode daemon offers {theirs}")
                continue
            if name != "nixl":
                return name, None, self._passed_over(name, skipped)
            unusable = msg.get("nixl_unusable")
            here = self.unusable_for(str(msg.get("prefill_instance", "")))
            if unusable or here:
                where = f"on the decode daemon: {unusable}" if unusable else f"here: {here}"
                skipped[name] = Fallback(choices.REGISTER_FAILED, f"NIXL cannot carry this pair {where}")
                continue
            if msg.get("nixl_private") and not msg.get("nixl_landing"):
                skipped[name] = Fallback(choices.PRIVATE_NO_RING, "the decode daemon keeps its engines' memory "
                                         "private (peer.nixl_engine_memory) and gave this link no landing ring "
                                         "(its limits.nixl_landing_bytes or _slots)")
                continue
            if mode == "staged" and not msg.get("nixl_landing"):
                skipped[name] = Fallback(choices.NO_LANDING_RING, "staged mode needs a landing ring the decode "
                                         "daemon did not offer (its limits.nixl_landing_bytes or _slots)")
                continue
            if not msg.get("nixl_agent") or not msg.get("nixl_md"):
                skipped[name] = Fallback(choices.NO_AGENT, "the decode daemon's offer carried no NIXL agent")
                continue
            transport = self.get()
            assert transport is not None
            try:
                peer = transport.add_peer(msg["nixl_agent"], msg["nixl_md"], msg.get("nixl_regions") or [],
                                          decode_spec, msg.get("nixl_landing"), bool(msg.get("nixl_private")))
            except KvxferError as exc:
                skipped[name] = Fallback(choices.PEER_FAILED, f"loading the decode daemon's agent failed: "
                                         f"{str(exc)[:300]}")
                continue
            return "nixl", peer, self._passed_over(name, skipped)
        why = "; ".join(f"{name}: {f.detail}" for name, f in skipped.items())
        raise PlanRefusal(f"no transport in common: the prefill daemon accepts {self.preference}, the "
                          f"decode daemon offers {theirs} ({why})", field="peer.transports", prefill=mine,
                          decode=theirs,
                          fix="list a common transport in both daemons' peer.transports (tcp works everywhere)")

    def _passed_over(self, chosen: str, skipped: dict[str, Fallback]) -> Fallback | None:
        preferred = self.preference[0]
        return None if chosen == preferred else skipped.get(preferred)

    def answer(self, transport: str) -> dict[str, Any]:
        if transport == "nixl" and self.transport is not None:
            return {"transport": "nixl", "nixl_agent": self.transport.agent_name,
                    "nixl_md": [self.transport.connection_metadata()]}
        return {"transport": transport}

    def expect_pages(self, peer: NixlPeer, dst: tuple[int, int], msg: dict[str, Any]) -> np.ndarray | None:
        """Check a peer expect for a NIXL route; return the destination page table (None for a
        private peer: its chunks land in its ring, addressed by the decode side alone)."""
        if self.transport is None:
            raise TransferError("NIXL route without an agent", field="transport", fix="handshake again")
        if peer.private:
            if msg.get("nixl_md") or msg.get("nixl_regions"):
                raise ProtocolError("an expect of a decode daemon whose engine memory is private describes "
                                    "NIXL memory", field="nixl_regions",
                                    fix="describe engine memory only with peer.nixl_engine_memory = exposed")
            return None
        if msg.get("nixl_md"):
            self.transport.load(peer.agent, msg["nixl_md"], msg.get("nixl_regions") or [])
        if msg.get("nixl_regions"):
            if any((r[0], r[1]) != tuple(dst) for r in msg["nixl_regions"]):
                raise ProtocolError("nixl_regions of an expect may only describe its dst rank",
                                    field="nixl_regions", fix="describe the dst rank only")
            peer.update(msg["nixl_regions"])
        pages = msg.get("dst_pages")
        if pages is None:
            raise ProtocolError("expect over NIXL without dst_pages", field="dst_pages",
                                fix="send the destination page table (one-sided writes need it)")
        if len(pages) > self.max_pages:
            raise RequestError(f"{len(pages)} dst_pages exceed limits.max_pages_per_request", field="dst_pages",
                               fix="split the request or raise the limit")
        num_pages = peer.num_pages(dst)
        if num_pages is None:
            raise RequestError(f"decode rank {list(dst)} has no NIXL regions described", field="nixl_regions",
                               fix="register the decode rank before it expects requests")
        return as_pages(pages, num_pages, "dst_pages")

    def expect_groups(self, peer: NixlPeer, dst: tuple[int, int], msg: dict[str, Any]) -> dict[str, np.ndarray]:
        """Check a peer expect's cache-group tables for a NIXL route (after :meth:`expect_pages`):
        one per group of the decode instance, every page (state slot) inside the regions the decode
        rank described for that group. None at all for a private peer (see :meth:`expect_pages`)."""
        if peer.private:
            return {}
        raw = msg.get("dst_groups") or {}
        unknown = sorted(set(raw) - set(peer.groups))
        if unknown:
            raise ProtocolError(f"dst_groups names {unknown[0]!r}, not a cache group of the decode instance "
                                f"({peer.groups})", field=f"dst_groups.{unknown[0]}",
                                fix="send tables only for the decode instance's groups")
        out: dict[str, np.ndarray] = {}
        for group in peer.groups:
            if group not in raw:
                raise ProtocolError(f"expect over NIXL without the table of cache group {group!r}",
                                    field=f"dst_groups.{group}",
                                    fix="send every group's destination table (one-sided writes need it)")
            table = raw[group]
            if len(table) > self.max_pages:
                raise RequestError(f"{len(table)} pages of group {group!r} exceed limits.max_pages_per_request",
                                   field=f"dst_groups.{group}", fix="split the request or raise the limit")
            num_pages = peer.num_pages(dst, group)
            if num_pages is None:
                raise RequestError(f"decode rank {list(dst)} described no NIXL regions of cache group {group!r}",
                                   field="nixl_regions", fix="register the decode rank's group regions "
                                                             "before it expects requests")
            out[group] = as_pages(table, num_pages, f"dst_groups.{group}")
        return out

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


"""Every transport of one daemon behind one object, so the daemon never asks which one it holds.

The daemon names a transport only by what a route or destination recorded (``route.kind``,
``entry.transport``); what differs between transports (NIXL's offer in the handshake, its
page table in an expect, the fence for one-sided writes, the connections to forget when a
peer goes) is answered here.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..datapath.staging import StagingPool
from ..lifecycle.inbox import DestEntry, Inbox, Sink
from ..lifecycle.jobs import Moved
from ..lifecycle.registry import Rank
from . import choices
from .base import Transport
from .choices import PairTransport, TransportChoices
from .local import LocalTransport
from .nixl.support import NixlSupport
from .tcp import TcpDataServer, TcpTransport
from .tcp_guard import Deadlines
from .tcp_proof import LinkKeys


class Transports:
    """local, tcp and (where configured and usable) NIXL, both directions."""

    def __init__(self, inbox: Inbox, staging: StagingPool, *, daemon_name: str, preference: list[str],
                 timeout_s: float, max_header_bytes: int, max_pages: int, data_connections: int,
                 landing_slots: int, landing_bytes: int, in_place_bytes: int = 256 * 1024,
                 nixl_block_bytes: int | None = None, nixl_engine_memory: str = "private",
                 bulk_block_bytes: int = 0, qos_lanes: bool = False, bulk_nice: int = 0,
                 on_received: Callable[[str, Sink, Moved], None],
                 on_refused: Callable[[DestEntry, str, str], None],
                 on_invalid: Callable[[str], None],
                 on_fallback: Callable[[PairTransport], None] = lambda choice: None,
                 on_nixl_registered: Callable[[str, int], None] | None = None,
                 on_nixl_refused: Callable[[str], None] | None = None) -> None:
        self.inbox = inbox
        #: each instance pair's transport as its handshake chose it, for ``status``
        self.choices = TransportChoices()
        self.on_fallback = on_fallback
        self.timeout_s = timeout_s
        self.max_header_bytes = max_header_bytes
        self.on_received = on_received
        self.on_invalid = on_invalid
        self.local = LocalTransport(inbox, lambda sink, moved: on_received("local", sink, moved))
        #: the data token of each link to a source daemon (the control side adds them as it makes
        #: links): what a tcp data connection proves before its first chunk (:mod:`.tcp_proof`)
        self.link_keys = LinkKeys()
        self.tcp = TcpTransport(timeout_s=timeout_s, max_reply_bytes=1 << 16, staging=staging,
                                connections_per_peer=data_connections, lanes=qos_lanes)
        self.bulk_nice = bulk_nice
        self.nixl = NixlSupport(  # the agent itself starts on first use, only where nixl is configured
            daemon_name, preference, inbox, timeout_s=timeout_s, max_header_bytes=max_header_bytes,
            max_pages=max_pages, landing_slots=landing_slots, landing_bytes=landing_bytes,
            staging=staging if nixl_block_bytes is None else staging.sibling(nixl_block_bytes),
            in_place_bytes=in_place_bytes, engine_memory=nixl_engine_memory, bulk_block_bytes=bulk_block_bytes,
            on_received=lambda sink, moved: on_received("nixl", sink, moved),
            on_refused=on_refused, on_invalid=on_invalid, on_registered=on_nixl_registered,
            on_nixl_refused=on_nixl_refused)

    def listen(self, host: str, port: int, *, deadlines: Deadlines = Deadlines(), max_connections: int = 64,
               on_conn_refused: Callable[[str], None] | None = None,
               on_accept_error: Callable[[], None] | None = None) -> TcpDataServer:
        """Start receiving over tcp (the data port): connections prove a link in :attr:`link_keys`."""
        return self.tcp.listen(host, port, self.inbox, max_header_bytes=self.max_header_bytes,
                               timeout_s=self.timeout_s, max_connections=max_connections,
                               on_received=lambda sink, moved: self.on_received("tcp", sink, moved),
                               on_invalid=self.on_invalid, keys=self.link_keys, deadlines=deadlines,
                               on_conn_refused=on_conn_refused, on_accept_error=on_accept_error,
                               bulk_nice=self.bulk_nice)

    def find(self, kind: str) -> Transport | None:
        """The transport a route or destination recorded by name; NIXL once its agent started."""
        found: dict[str, Transport | None] = {"local": self.local, "tcp": self.tcp, "nixl": self.nixl.transport}
        return found.get(kind)

    def get(self, kind: str) -> Transport:
        found = self.find(kind)
        assert found is not None, f"no {kind} transport here (a route names it only once it started)"
        return found

    # -- a failed request: its transfers end now ---------------------------------------
    def stop_sending(self, source: int) -> None:
        """End a failed source's tcp sends now (cut their connections). A local copy ends by itself;
        a NIXL WRITE cannot be recalled (the decode side's fence waits for it)."""
        self.tcp.stop_sending(source)

    def stop_receiving(self, entry: DestEntry) -> None:
        """End writes into a failed destination's pages now (cut its data connections, drop
        staged chunks still assembling), so its failure can be told soon."""
        self.tcp.stop_receiving(entry)
        own = self.find(entry.transport)
        if own is not None and own is not self.tcp:
            own.stop_receiving(entry)

    # -- negotiation (decode side) ---------------------------------------------------------
    def offered(self) -> list[str]:
        """What a decode instance can be written by, in this daemon's preference order."""
        return self.nixl.offered()

    def handshake_fields(self, source: str, prefill: str, decode: str) -> dict[str, Any]:
        return self.nixl.handshake_fields(source, prefill, decode)

    def accepted(self, source: str, prefill: str, decode: str, reply: dict[str, Any]) -> str:
        """The transport the source chose in its handshake answer (recorded for ``status``; a
        pair passed over this daemon's first preference is reported once)."""
        chosen = self.nixl.accepted(source, prefill, decode, reply)
        first = self.nixl.preference[0]
        reason = detail = ""
        if chosen != first and first not in self.nixl.offered():  # never offered: unusable here
            reason, detail = choices.UNAVAILABLE_HERE, f"{first} is unusable here: {self.nixl.unavailable}"
        elif chosen != first:
            said = reply.get("transport_reason")
            reason = choices.PEER_CHOSE
            detail = f"the source daemon chose {chosen}" + (f" ({said})" if isinstance(said, str) else "")
        self._record(PairTransport("decode", source, prefill, decode, chosen, first, reason, detail))
        return chosen

    def receive_kind(self, source: str, prefill: str, decode: str) -> str:
        """How a destination fed by a remote source receives: the pair's negotiated transport."""
        return self.nixl.route_kind(source, prefill, decode)

    def expect_fields(self, source: str, entry: DestEntry) -> dict[str, Any]:
        """What a peer expect carries for the destination's transport (NIXL: its page table)."""
        return self.nixl.expect_fields(source, entry)

    # -- negotiation (prefill side) --------------------------------------------------------
    def choose(self, offer: dict[str, Any], decode_spec: Any, mode: str) -> tuple[str, Any, str, PairTransport]:
        """The transport for a handshake, its remote agent (NIXL), the mode it moves in, and the
        pair's outcome (recorded for ``status``; a new fallback is reported once)."""
        transport, remote, fallback = self.nixl.choose(offer, decode_spec, mode)
        if remote is not None and remote.credits is None and mode == "auto":
            mode = "direct"  # no landing ring to stage into: NIXL writes the head slices one by one
        choice = PairTransport("prefill", str(offer.get("daemon")), str(offer.get("prefill_instance")),
                               str(offer.get("decode_instance")), transport, self.nixl.preference[0],
                               fallback.code if fallback else "", fallback.detail if fallback else "")
        self._record(choice)
        return transport, remote, mode, choice

    def answer(self, choice: PairTransport) -> dict[str, Any]:
        """The handshake answer's transport fields; a fallback's reason goes along so the decode
        daemon can show it too."""
        fields = self.nixl.answer(choice.transport)
        if choice.reason:
            fields["transport_reason"] = f"{choice.reason}: {choice.detail}"[:500]
        return fields

    def _record(self, choice: PairTransport) -> None:
        if self.choices.record(choice) and choice.reason:
            self.on_fallback(choice)

    def prepare(self, kind: str, remote: Any, dst: tuple[int, int],
                fields: dict[str, Any]) -> tuple[np.ndarray | None, dict[str, np.ndarray]]:
        """Check what a peer expect carries for a route; one-sided routes get the destination's page
        table and each cache group's (pages, or the state slot)."""
        if kind != "nixl":
            return None, {}
        return self.nixl.expect_pages(remote, dst, fields), self.nixl.expect_groups(remote, dst, fields)

    # -- peers and ranks ---------------------------------------------------------------------
    def peer_lost(self, kind: str, remote: Any, data_address: tuple[str, int] | None, why: str) -> None:
        """Prefill side: a decode daemon is gone; writes to it stop waiting, its connections go."""
        if remote is not None:
            remote.dead = why
            self.nixl.forget_peer(remote.agent)
        if data_address is not None:
            self.tcp.forget(data_address)

    def source_down(self, source: str) -> None:
        self.nixl.source_down(source)

    def source_gone(self, source: str) -> None:
        self.nixl.forget_source(source)

    def register(self, rank: Rank) -> None:
        self.nixl.register(rank)

    def deregister(self, rank: Rank) -> None:
        self.nixl.deregister(rank)

    def describe(self) -> dict[str, Any]:
        return {**self.nixl.describe(), "pairs": self.choices.describe()}

    def close(self) -> None:
        self.tcp.close()
        self.nixl.close()

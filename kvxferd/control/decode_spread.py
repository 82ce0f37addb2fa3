"""Decode side of a source instance over several daemons: after the rendezvous answered its rank
map, handshake with every other daemon it names and check they agree on the plan.

Every daemon computes the plan from the same two specs, so each must answer the rendezvous's
spec and plan mode, and the data of all of them must reach this daemon the same way (tcp, or
NIXL: the NIXL receive path then admits each writer's chunks from its own daemon's agent only).
"""

from __future__ import annotations

import asyncio
from typing import Callable, Protocol

from ..directory.holders import spec_difference
from ..errors import PlanRefusal, TransferError
from ..lifecycle.inbox import DestEntry
from ..model.geometry import InstanceSpec, rank_id
from ..model.plan import Plan


class Link(Protocol):
    """A link to one source daemon: its address, and the token its data connections carry."""

    address: str
    token: bytes


class Links(Protocol):
    """What the handshakes with a spread instance's daemons ask of the decode side's links
    (:class:`~kvxferd.control.decode_links.DecodeLinks`)."""

    def link(self, address: str) -> Link: ...

    async def remote_plan(self, link: Link, prefill: str, decode: str, spec: InstanceSpec,
                          deadline: float) -> Plan: ...


def _ranks_at(instance: str, rank_map: dict[tuple[int, int], str], address: str) -> str:
    return ", ".join(rank_id(instance, *c) for c, a in sorted(rank_map.items()) if a == address)


async def other_daemons(links: Links, own_address: str, receive_kind: Callable[[str, str, str], str],
                        entry: DestEntry, rendezvous: Link, plan: Plan, rank_map: dict[tuple[int, int], str],
                        deadline: float) -> tuple[dict[str, bytes], str]:
    """Handshake with each daemon of the instance; return each one's link token (data headers of the
    writers it holds carry it) and the transport they all send over (``receive_kind(daemon, prefill,
    decode)``). Raises PlanRefusal or TransferError naming the daemon."""
    prefill, decode = entry.source_instance, entry.rank.instance
    spec = entry.rank.geometry.spec
    tokens: dict[str, bytes] = {}
    kinds: dict[str, str] = {}
    for address in sorted(set(rank_map.values())):
        held = _ranks_at(prefill, rank_map, address)
        if address == own_address:
            raise PlanRefusal(f"ranks {held} of {prefill!r} are registered at this decode daemon {address} and the "
                              "rest at other daemons: a source instance partly on its decode daemon is not "
                              "supported", field="ranks")
        link = rendezvous if address == rendezvous.address else links.link(address)
        entry.waiting_for = (f"a handshake with daemon {address}, holding {held} by the directory of rendezvous "
                             f"{rendezvous.address}: is that address reachable from here (peer.advertise_host of "
                             "that daemon)?")
        try:
            theirs = plan if link is rendezvous else await links.remote_plan(link, prefill, decode, spec, deadline)
        except (asyncio.TimeoutError, TimeoutError):
            raise TransferError(f"daemon {address} (holding {held} by the directory of rendezvous "
                                f"{rendezvous.address}) gave no handshake for {prefill!r} in time: is that address "
                                "reachable from here (peer.advertise_host of that daemon)?", field="ranks",
                                code="bootstrap_timeout")
        if theirs.prefill != plan.prefill:
            field, ours, other = spec_difference(plan.prefill, theirs.prefill)
            raise PlanRefusal(f"daemon {address} holding {held} answers {field} = {other!r}, the rendezvous "
                              f"{rendezvous.address} answers {field} = {ours!r}", field=field)
        if theirs.mode != plan.mode:
            raise PlanRefusal(f"daemon {address} plans mode {theirs.mode!r}, the rendezvous {rendezvous.address} "
                              f"{plan.mode!r}", field="mode", prefill=theirs.mode, decode=plan.mode)
        kinds[address] = receive_kind(address, prefill, decode)
        tokens[address] = link.token
    entry.waiting_for = ""
    distinct = sorted(set(kinds.values()))
    if len(distinct) > 1:  # one destination, one way in: a fence and a receive path per request
        one, other = (next(a for a, k in sorted(kinds.items()) if k == kind) for kind in distinct[:2])
        raise PlanRefusal(f"daemon {one} sends {prefill!r} over {distinct[0]!r} and daemon {other} over "
                          f"{distinct[1]!r}; every daemon of a source instance must reach this decode daemon "
                          "the same way", field="transport",
                          fix="give every daemon of the instance the same peer.transport and NIXL install")
    return tokens, next(iter(kinds.values()))

"""Asking a rendezvous daemon which daemon holds which rank of an instance (``kvxferd plan
--rendezvous``), over the peer protocol's ``lookup``; and the words for its answer."""

from __future__ import annotations

from typing import Any

import zmq

from ..errors import KvxferError, TransferError
from ..wire import protocol

MAX_ANSWER = 1 << 22


def lookup(address: str, instance: str, role: str, timeout: float) -> dict[str, Any]:
    """The rendezvous's ``ranks`` answer; raises KvxferError (its refusal, or no answer in time)."""
    host, port = protocol.split_address(address)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(protocol.encode({"op": "lookup", "instance": instance, "role": role, "seq": 1}))
        if not sock.poll(int(timeout * 1000)):
            raise TransferError(f"rendezvous {address} did not answer a lookup within {timeout}s", field="rendezvous",
                                fix="name the peer endpoint (host:peer.control_port) of the instance's rendezvous "
                                    "daemon; a daemon with auth enabled answers only peers it knows")
        answer = protocol.decode(sock.recv(), MAX_ANSWER)
    finally:
        sock.close(0)
    if answer.get("op") != "ranks":
        err = answer.get("error") if isinstance(answer.get("error"), dict) else {}
        raise KvxferError(str(err.get("message") or answer), field=str(err.get("field") or "instance"),
                          code=str(err.get("code") or "lookup"))
    return answer


def daemons_of(answer: dict[str, Any]) -> dict[tuple[int, int], str]:
    return {(tp, pp): address for tp, pp, address in answer.get("ranks") or []}


def format_ranks(answer: dict[str, Any]) -> list[str]:
    """Which daemon holds which rank; for a data-parallel instance, per DP rank."""
    def rows(ranks: list[list[Any]], indent: str) -> list[str]:
        return [f"{indent}tp{tp} pp{pp}  {address}" for tp, pp, address in ranks]

    name = answer.get("instance", "")
    if answer.get("dp_size"):
        out = [f"instance {name}: {answer['dp_size']} DP ranks (filed as {name}@dp<k>)"]
        for dp_rank, ranks in answer.get("dp_ranks") or []:
            out.append(f"  DP rank {dp_rank}")
            out += rows(ranks, "    ")
        for why in answer.get("missing") or []:
            out.append(f"  incomplete: {why}")
        return out
    return [f"instance {name}: rank -> daemon"] + rows(answer.get("ranks") or [], "  ")

"""Handshake outcomes of an authenticated peer link, from its ZeroMQ socket monitor.

A CURVE handshake that fails leaves the link silent: no message ever says so, and a request
would wait for its bootstrap deadline as if the peer were down. The socket's monitor events
do say it, at once: ``HANDSHAKE_FAILED_AUTH`` when the peer's ZAP handler refused our key,
``HANDSHAKE_FAILED_NO_DETAIL``/``_PROTOCOL`` when the peer could not be authenticated (the
server key we hold for it is not its key). libzmq does not retry a connection whose key
was refused, so the link has to be replaced to try again.
"""

from __future__ import annotations

import asyncio
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
          | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_SUCCEEDED)


def failure_message(event: int, value: int, address: str, our_key: str) -> str | None:
    """What an operator must know about a failed handshake with ``address``; None for success."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"authentication failed at {address}: the peer refused this daemon's CURVE key {our_key} "
                f"(ZAP status {value}); add it to that daemon's auth.allowed_keys")
    if event in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
        return (f"authentication failed at {address}: the CURVE handshake failed (the server key in "
                f"auth.peer_keys for {address} is not that daemon's public key, or it does not use CURVE)")
    return None


async def watch(monitor: zmq.Socket, address: str, our_key: str, on_failed: Callable[[str], None],
                on_ok: Callable[[], None]) -> None:
    """Report each handshake outcome of the monitored socket until it is closed."""
    while True:
        try:
            event = await recv_monitor_message(monitor)
        except (zmq.ZMQError, asyncio.CancelledError):
            return
        if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            on_ok()
            continue
        message = failure_message(event["event"], event["value"], address, our_key)
        if message is not None:
            on_failed(message)

"""A tcp data connection proves which peer link it belongs to, once, before its first chunk.

The decode daemon hands each source daemon a random per-link token inside the handshake, over
the control link (CURVE-encrypted where ``auth.enabled``). The token itself never travels on a
data connection: on accept the receiver sends a fresh random nonce (``challenge``), and the
sender's first frame (``hello``) names the link by a one-way id of its token and carries
HMAC-SHA256(token, nonce). A stranger without the token cannot answer, and a captured hello
is worth nothing on another connection (another nonce). Once proven, every chunk on the
connection is taken as coming from that link (its data headers need not carry the token).

With auth off the handshake, and so the token, crosses the network in the clear: the proof
then keeps out port scanners and misdirected clients, not an on-path attacker (the network
is trusted). One exchange per connection, never per chunk: connections are pooled.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import threading
from collections import OrderedDict
from typing import Any

from ..errors import ProtocolError, RequestError, TransferError
from ..wire import protocol
from .framing import read_frame

NONCE_BYTES = 16
LINK_ID_BYTES = 8
MAX_HELLO_BYTES = 512  # a challenge or a hello; anything longer is not one
MAX_LINKS = 4096  # link tokens remembered (one per source daemon link; the oldest go first)
_CONTEXT = b"kvxferd data hello v1\x00"

#: why a connection's proof failed (a bounded metric label each)
NO_HELLO = "no_hello"
UNKNOWN_LINK = "unknown_link"
BAD_PROOF = "bad_proof"


def link_id(token: bytes) -> bytes:
    """A public name of a link's token: one-way, so naming it gives nothing away."""
    return hashlib.blake2b(token, digest_size=LINK_ID_BYTES, person=b"kvxferd-link").digest()


def proof(token: bytes, nonce: bytes) -> bytes:
    return hmac.new(token, _CONTEXT + nonce, hashlib.sha256).digest()


class LinkKeys:
    """The data tokens this daemon handed its source daemons' links, by link id (thread-safe:
    the event loop adds, data threads look up)."""

    def __init__(self, limit: int = MAX_LINKS) -> None:
        self.limit = limit
        self._tokens: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, token: bytes) -> None:
        with self._lock:
            self._tokens[link_id(token)] = token
            while len(self._tokens) > self.limit:
                self._tokens.popitem(last=False)

    def find(self, ident: bytes) -> bytes | None:
        with self._lock:
            return self._tokens.get(ident)


class ProofRefused(RequestError):
    """A data connection that did not prove its link: ``reason`` is the metric label."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message, field="token", code="unproven_connection",
                         fix="open data connections only from a daemon this one handshook with "
                             "(answer the challenge with the link's token)")
        self.reason = reason


def challenge() -> tuple[bytes, bytes]:
    """A fresh nonce and the frame that carries it (the receiver's first bytes on a connection)."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce, protocol.frame({"op": "challenge", "nonce": nonce})


def check_hello(frame: dict[str, Any], nonce: bytes, keys: LinkKeys) -> bytes:
    """The link token a connection's first frame proves; raises :class:`ProofRefused`."""
    if frame.get("op") != "hello":
        raise ProofRefused(f"a data connection's first frame must be a hello answering the challenge, got op "
                           f"{str(frame.get('op'))[:32]!r}", NO_HELLO)
    ident, mac = frame.get("link"), frame.get("proof")
    if not (isinstance(ident, bytes) and len(ident) == LINK_ID_BYTES and isinstance(mac, bytes)):
        raise ProofRefused(f"hello must carry link ({LINK_ID_BYTES} bytes) and proof (bytes)", NO_HELLO)
    token = keys.find(ident)
    if token is None:
        raise ProofRefused(f"hello names link {ident.hex()}, which this daemon never handed a token to "
                           "(or forgot)", UNKNOWN_LINK)
    if not hmac.compare_digest(mac, proof(token, nonce)):
        raise ProofRefused(f"hello's proof for link {ident.hex()} does not match this connection's challenge "
                           "(a wrong token, or a hello replayed from another connection)", BAD_PROOF)
    return token


def prove(sock: socket.socket, token: bytes | None, address: tuple[str, int]) -> None:
    """Sender side, on a new connection: read the receiver's challenge, send the hello (the first
    chunk follows at once; a refused proof comes back as that chunk's reply)."""
    try:
        msg = read_frame(sock, MAX_HELLO_BYTES)
    except ProtocolError as exc:
        raise TransferError(f"data endpoint {address[0]}:{address[1]} sent no valid challenge: {exc}",
                            field="data_address", fix="check the address is a kvxferd data port of "
                            "the same protocol version") from None
    nonce = msg.get("nonce")
    if msg.get("op") != "challenge" or not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise TransferError(f"data endpoint {address[0]}:{address[1]} sent op {str(msg.get('op'))[:32]!r}, "
                            "not a challenge", field="data_address",
                            fix="check the address is a kvxferd data port of the same protocol version")
    if token is None:  # nothing to prove with: the receiver refuses, and says so in the first reply
        sock.sendall(protocol.frame({"op": "hello", "link": b"", "proof": b""}))
        return
    sock.sendall(protocol.frame({"op": "hello", "link": link_id(token), "proof": proof(token, nonce)}))


def chunk_header(job: Any, trailer: bool = False, lane: str = "") -> dict[str, Any]:
    """A chunk job's data header as it crosses a proven connection: without the link's token (the
    connection proved it once, and the receiver takes every chunk on it as that link's). ``lane``:
    the QoS class of the connection it travels on (``""``: the sender keeps no lanes)."""
    head: dict[str, Any] = job.header(trailer)
    head.pop("token", None)
    if lane:
        head["lane"] = lane
    return head

"""Peer authentication: CURVE key pairs, the allow-list, and which key each peer has.

Control links between daemons use ZeroMQ CURVE (encrypted, server authenticated by its
public key, clients admitted by an allow-list of public keys). The data connections are
plain TCP; they are tied to an authenticated control link by a random per-link token the
decode daemon hands over inside the (encrypted) handshake, and which every data header
must carry.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import zmq
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85

from ..errors import ConfigError


@dataclass(frozen=True)
class KeyPair:
    public: str  # Z85, 40 characters
    secret: str


def generate() -> KeyPair:
    public, secret = zmq.curve_keypair()
    return KeyPair(public.decode(), secret.decode())


def write_keypair(path: str | os.PathLike[str], pair: KeyPair) -> Path:
    """Write the secret key file (0600) and ``<path>.pub``; return the secret file path."""
    secret_path = Path(path)
    fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(f"# kvxferd CURVE key pair: keep this file private\npublic = \"{pair.public}\"\n"
                 f"secret = \"{pair.secret}\"\n")
    Path(f"{secret_path}.pub").write_text(f"{pair.public}\n")
    return secret_path


def read_keypair(path: str | os.PathLike[str]) -> KeyPair:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read auth.secret_key_file {path}: {exc.strerror}",
                          field="auth.secret_key_file", fix="generate one with `kvxferd keygen`") from None
    values = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip().strip('"')
    pair = KeyPair(values.get("public", ""), values.get("secret", ""))
    for name in ("public", "secret"):
        check_key(f"auth.secret_key_file ({name})", getattr(pair, name))
    return pair


def check_key(field: str, key: str) -> str:
    if len(key) != 40:
        raise ConfigError(f"{field} is not a 40-character Z85 CURVE key: {key[:12]!r}...", field=field,
                          fix="use keys printed by `kvxferd keygen`")
    try:
        z85.decode(key.encode())
    except Exception:  # noqa: BLE001 - any decoding failure means the same thing
        raise ConfigError(f"{field} is not valid Z85", field=field, fix="use keys printed by `kvxferd keygen`") from None
    return key


def parse_peer_keys(entries: list[str]) -> dict[str, str]:
    """``["host:port=KEY", ...]`` -> {"host:port": KEY}: the server key of each peer daemon."""
    out = {}
    for entry in entries:
        address, sep, key = entry.partition("=")  # Z85 keys may contain "="
        if not sep or ":" not in address:
            raise ConfigError(f"auth.peer_keys entry {entry[:60]!r} is not host:port=KEY", field="auth.peer_keys",
                              fix="write entries like \"10.0.0.2:5557=<public key>\"")
        out[address.strip()] = check_key("auth.peer_keys", key.strip())
    return out


def token_digest(token: bytes) -> bytes:
    """What a source daemon sends to the address a handshake claimed, to ask whether that
    daemon sent it: a digest of the handshake's data token, so the question never carries the
    token itself to whatever listens there."""
    return hashlib.blake2b(token, digest_size=16, person=b"kvxferd-claim").digest()


#: what a key may speak for: ``"KEY=ADDRESS[,ADDRESS...];INSTANCE[,INSTANCE...]"`` (globs allowed)
CLAIMS_FORMAT = '"<40-character key>=host:port[,host:port...];instance[,instance...]"'


@dataclass(frozen=True)
class KeyClaims:
    """The daemon addresses and instance names one allowed key may speak for (``auth.key_claims``).

    A peer's key is proven by CURVE, but a key says nothing of which daemon and instances it is:
    without claims, any admitted key may name any decode daemon and instance in a handshake,
    expect, announce or withdrawal. Patterns are shell globs (``fnmatch``, case-sensitive)."""

    key: str
    addresses: tuple[str, ...]
    instances: tuple[str, ...]

    def covers_daemon(self, address: str) -> bool:
        return any(fnmatch.fnmatchcase(address, p) for p in self.addresses)

    def covers_instance(self, instance: str) -> bool:
        return any(fnmatch.fnmatchcase(instance, p) for p in self.instances)

    def describe(self) -> str:
        return f"{','.join(self.addresses)};{','.join(self.instances)}"

    def refusal(self, daemon: str, instance: str | None) -> tuple[str, str] | None:
        """Why this key may not speak for ``daemon`` (and ``instance``): (what, message), or None."""
        if not self.covers_daemon(daemon):
            return "daemon", f"daemon address {daemon!r} is not among {list(self.addresses)}"
        if instance is not None and not self.covers_instance(instance):
            return "instance", f"instance {instance!r} is not among {list(self.instances)}"
        return None


def parse_key_claims(entries: list[str], allowed: list[str] | None = None) -> dict[str, KeyClaims]:
    """``auth.key_claims`` entries -> {key: its claims}. Each key appears once and, where
    ``allowed`` is given, is one of ``auth.allowed_keys`` (a claim for a key never admitted
    is a typo that would leave the real key unscoped)."""
    out: dict[str, KeyClaims] = {}
    for entry in entries:
        entry = entry.strip()
        key, sep, rest = entry[:40], entry[40:41], entry[41:]  # Z85 keys may contain "=": cut by length
        addresses, semi, instances = rest.partition(";")
        addr = tuple(a.strip() for a in addresses.split(",") if a.strip())
        inst = tuple(i.strip() for i in instances.split(",") if i.strip())
        if sep != "=" or not semi or not addr or not inst:
            raise ConfigError(f"auth.key_claims entry {entry[:60]!r} is not KEY=ADDRESSES;INSTANCES",
                              field="auth.key_claims", fix=f"write entries like {CLAIMS_FORMAT}")
        check_key("auth.key_claims", key)
        bad = [a for a in addr if ":" not in a]
        if bad:
            raise ConfigError(f"auth.key_claims address {bad[0]!r} of key {key[:12]}... is not host:port (a glob "
                              "may stand for either part)", field="auth.key_claims",
                              fix="write addresses like 10.0.0.2:5557 or 10.0.0.*:5557")
        if key in out:
            raise ConfigError(f"auth.key_claims names key {key[:12]}... twice", field="auth.key_claims",
                              fix="give each key one entry, listing all its addresses and instances")
        if allowed is not None and key not in allowed:
            raise ConfigError(f"auth.key_claims names key {key[:12]}..., which is not in auth.allowed_keys",
                              field="auth.key_claims", fix="add the key to auth.allowed_keys, or fix the claim's key")
        out[key] = KeyClaims(key, addr, inst)
    return out


class AllowList:
    """ZAP credentials provider: admits clients whose public key is listed."""

    def __init__(self, keys: list[str], on_deny: "callable[[], None] | None" = None) -> None:
        self.keys = {check_key("auth.allowed_keys", k) for k in keys}
        self.on_deny = on_deny

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key.decode("ascii", "replace") in self.keys
        if not allowed and self.on_deny:
            self.on_deny()
        return allowed


class RefusalBook:
    """Authentication refusals seen, by who was refused: a bounded record for logs and status.

    A refused ZeroMQ peer may try again every few hundred milliseconds; the first refusal of
    each (address, key) is logged at once, repeats at most every ``log_every_s`` with their
    count, so an operator sees every distinct problem without a log flood.
    """

    def __init__(self, limit: int = 32, log_every_s: float = 60.0) -> None:
        self.limit = limit
        self.log_every_s = log_every_s
        self._seen: "OrderedDict[tuple[tuple[str, str], ...], dict[str, object]]" = OrderedDict()

    def note(self, reason: str, **who: str) -> tuple[dict[str, object], bool]:
        """Record one refusal; return its record and whether to log it now."""
        now = time.time()
        key = tuple(sorted(who.items()))
        record = self._seen.pop(key, None)
        if record is None:
            record = {**who, "reason": reason, "count": 0, "first": now, "last": now, "logged": 0.0}
        self._seen[key] = record
        while len(self._seen) > self.limit:
            self._seen.popitem(last=False)
        record["count"] = int(record["count"]) + 1  # type: ignore[call-overload]
        record["last"] = now
        record["reason"] = reason
        log_now = now - float(record["logged"]) >= self.log_every_s  # type: ignore[arg-type]
        if log_now:
            record["logged"] = now
        return record, log_now

    def describe(self) -> list[dict[str, object]]:
        return [{k: v for k, v in r.items() if k != "logged"} for r in self._seen.values()]


class ZapAuthenticator(AsyncioAuthenticator):
    """pyzmq's ZAP handler, telling ``on_refused(address, key, reason)`` whom it refused.

    pyzmq hands credentials providers only the domain and the key; the client's address
    is in the ZAP request, which this class remembers while that request is checked (the
    handler takes one request at a time on the loop).
    """

    def __init__(self, ctx: zmq.Context, on_refused: Callable[[str, str, str], None]) -> None:
        super().__init__(ctx)
        self.on_refused = on_refused
        self._address = ""

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else ""
        await super().handle_zap_message(msg)

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        allowed, reason = await super()._authenticate_curve(domain, client_key)
        if not allowed:
            self.on_refused(self._address, z85.encode(client_key).decode("ascii", "replace"),
                            reason.decode("utf-8", "replace"))
        return allowed, reason

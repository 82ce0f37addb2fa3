"""Peer authentication: CURVE key pairs, the allow-list, and which key each peer has.

Control links between daemons use ZeroMQ CURVE (encrypted, server authenticated by its
public key, clients admitted by an allow-list of public keys). The data connections are
plain TCP; they are tied to an authenticated control link by a random per-link token the
decode daemon hands over inside the (encrypted) handshake, and which every data header
must carry.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

from .errors import ConfigError


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

"""Typed errors.

Every refusal names the field, the values on each side and the fix, because the person
reading it is an operator looking at a log line, not at our source.
"""

from __future__ import annotations

from typing import Any


class KvxferError(Exception):
    """Base of every error kvxferd raises on purpose.

    ``code`` is a short stable token (used as a bounded metric label and on the wire),
    ``field`` names the offending field when there is one.
    """

    code = "error"

    def __init__(self, message: str, *, field: str | None = None, fix: str | None = None,
                 code: str | None = None) -> None:
        self.message = message
        self.field = field
        self.fix = fix
        if code is not None:
            self.code = code
        super().__init__(self.__str__())

    def __str__(self) -> str:
        text = self.message
        if self.fix:
            text = f"{text}; fix: {self.fix}"
        return text

    def to_wire(self) -> dict[str, Any]:
        return {"code": self.code, "field": self.field, "message": str(self)}


class GeometryError(KvxferError, ValueError):
    """A single rank or instance geometry is invalid on its own."""

    code = "geometry"


class PlanRefusal(KvxferError):
    """Two geometries cannot be paired; carries both sides' values."""

    code = "incompatible"

    def __init__(self, message: str, *, field: str, prefill: Any = None, decode: Any = None,
                 fix: str | None = None) -> None:
        self.prefill_value = prefill
        self.decode_value = decode
        super().__init__(message, field=field, fix=fix)

    def to_wire(self) -> dict[str, Any]:
        wire = super().to_wire()
        wire["prefill"] = _plain(self.prefill_value)
        wire["decode"] = _plain(self.decode_value)
        return wire


class ClaimRefused(PlanRefusal):
    """A peer claimed a daemon address, instance or ranks that it cannot show to be its own (or that
    another live daemon holds): its handshake is refused like an incompatible plan, with this code."""

    code = "claim_refused"


class ProtocolError(KvxferError):
    """A message did not match its schema (wrong type, missing field, out of bounds)."""

    code = "bad_message"


class RegistrationError(KvxferError):
    """A rank's registration (regions, memory) does not match what it claims."""

    code = "registration"


class RequestError(KvxferError):
    """A request-level problem: unknown id, duplicate, bad page table, wrong state."""

    code = "request"


class TransferError(KvxferError):
    """Bytes could not be moved (peer gone, socket error, timeout)."""

    code = "transfer"


class IntegrityError(TransferError):
    """Bytes landed that differ from what the source read (integrity.mode): the request fails
    rather than let an engine decode from them."""

    code = "integrity"


class PeerHungUp(TransferError):
    """The receiving daemon ended a chunk on purpose or died: it hung up mid-chunk, or refused
    the chunk as no longer expected. A daemon that fails a request says why on the control
    plane, which races the data connection; the source waits ``timeouts.cut_reason_s`` for
    that reason before it reports this error instead."""


class ConfigError(KvxferError, ValueError):
    code = "config"


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


class BindError(KvxferError):
    """An endpoint could not be bound at start-up; names the setting and the address."""

    code = "bind_failed"

"""Binding the daemon's endpoints at start-up, with errors an operator can act on.

A bind that fails (a port in use, a directory without permission) surfaces from the OS or
ZeroMQ as ``Address already in use`` with no address: which of four endpoints, and which
setting chose it, is what the operator needs to fix it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import zmq

from ..errors import BindError


@contextmanager
def binding(setting: str, address: str) -> Iterator[None]:
    """Turn a failed bind of ``address`` (chosen by ``setting``) into a :class:`BindError`."""
    try:
        yield
    except (OSError, zmq.ZMQError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise BindError(f"cannot bind {address} ({setting}): {reason}", field=setting,
                        fix=f"free {address} (another process holds it?) or change {setting}") from None

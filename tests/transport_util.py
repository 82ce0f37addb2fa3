"""The engine adapters' transfer tests over each transport (tests/engines/*).

A test parametrized over ``TRANSPORTS`` runs its real daemons on tcp (the default config) or
on NIXL alone (``peer.transports = ["nixl"]`` on both daemons, UCX pinned to loopback tcp), so
a pair that fell back to tcp would be refused and its request fail. ``Carried`` reads the
daemons' own Prometheus counters around a transfer, and ``assert_only`` checks that the one
transport carried exactly the bytes the test computed, and the other none.

The daemons run from the engine venv's python, so the NIXL variant needs nixl-cu12 in that
venv (``make test-sglang`` / ``make test-vllm`` install it); where NIXL cannot start there,
the variant skips, saying why.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from kvxferd.tools.sim import ONLY_NIXL  # noqa: F401 - a daemon that accepts NIXL alone, named for the tests
from nixl_util import NIXL_MISSING, metric

TRANSPORTS = ("tcp", "nixl")


def require(transport: str) -> None:
    """Skip the NIXL variant where NIXL cannot start in this venv, with the reason."""
    if transport == "nixl" and NIXL_MISSING:
        pytest.skip(f"NIXL unusable in this venv: {NIXL_MISSING} (make test-sglang / make test-vllm install "
                    f"nixl-cu12 when they build their venv, and only warn if that fails; into a venv built "
                    f"before: {sys.executable} -m pip install --no-deps nixl-cu12==1.5.1)")


def daemon_env(transport: str) -> dict[str, str] | None:
    """The environment of a daemon for ``transport``: None (the default config, tcp) or NIXL alone."""
    return dict(ONLY_NIXL) if transport == "nixl" else None


class Carried:
    """Bytes sent (prefill daemons) and received (decode daemons) per transport since it was made."""

    def __init__(self, prefill: list[Any], decode: list[Any]) -> None:
        self.prefill, self.decode = prefill, decode
        self.before = self._read()

    def _read(self) -> dict[str, float]:
        out = {}
        for t in TRANSPORTS:
            out[f"sent-{t}"] = sum(metric(d, "kvxferd_sent_bytes_total", transport=t) for d in self.prefill)
            out[f"received-{t}"] = sum(metric(d, "kvxferd_received_bytes_total", transport=t) for d in self.decode)
        return out

    def delta(self) -> dict[str, float]:
        now = self._read()
        return {k: now[k] - self.before[k] for k in now}

    def assert_only(self, transport: str, nbytes: int) -> None:
        """``transport`` carried exactly ``nbytes`` each way, every other transport nothing."""
        assert nbytes > 0, nbytes
        want = {f"{side}-{t}": (nbytes if t == transport else 0) for side in ("sent", "received") for t in TRANSPORTS}
        got = self.delta()
        assert got == want, f"bytes carried per transport: {got}, wanted {want}"


# -- fixtures an engine module imports to run its byte-exact tests on each transport -------------
# The module defines ``cluster`` (its tcp daemons) and ``nixl_cluster`` (the same daemons
# accepting NIXL alone); a test that takes ``daemons`` runs once per transport.

@pytest.fixture(params=TRANSPORTS)
def transport(request):
    require(request.param)
    return request.param


@pytest.fixture
def daemons(request, transport):
    """The module's daemons of the test's transport."""
    return request.getfixturevalue("cluster" if transport == "tcp" else "nixl_cluster")

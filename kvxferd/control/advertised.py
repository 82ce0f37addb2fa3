"""This daemon as its peers name it: the host and ports it advertises, and its incarnation.

The ports are the bound ones (a port of 0 in the config is chosen when the daemon binds);
the incarnation is new with every process start, so a peer tells a restart by it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass
class Advertised:
    host: str
    control_port: int
    data_port: int
    incarnation: str = field(default_factory=lambda: os.urandom(8).hex())

    @property
    def address(self) -> str:
        """The peer endpoint (host:control port), as peers dial it and name this daemon."""
        return f"{self.host}:{self.control_port}"

    @property
    def data_address(self) -> str:
        return f"{self.host}:{self.data_port}"

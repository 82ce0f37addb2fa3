"""vLLM on kvxferd: ``kv_connector_module_path = "kvxferd.adapters.vllm"``, ``kv_connector = "KvxferdConnector"``.

The connector (which imports vLLM) loads on first use of its name, so the pure parts in
:mod:`.logic` import without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvxferdConnector", "KvxferdMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

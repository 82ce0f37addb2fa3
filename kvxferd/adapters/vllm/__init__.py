"""vLLM on kvxferd: ``kv_connector_module_path = "kvxferd.adapters.vllm"``, ``kv_connector = "KvxferdConnector"``.

Importing this package imports vLLM; the pure parts live in :mod:`.logic`.
"""

from .connector import KvxferdConnector, KvxferdMetadata

__all__ = ["KvxferdConnector", "KvxferdMetadata"]

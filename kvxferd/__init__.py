"""kvxferd: a standalone KV-cache transfer daemon for prefill/decode disaggregated serving."""

__version__ = "0.1.0"
PROTOCOL_VERSION = 13

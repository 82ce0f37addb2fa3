"""Transports move one chunk (one writer to one destination) between ranks."""

from .base import ChunkJob, Transport

__all__ = ["ChunkJob", "Transport"]

"""Same-daemon transport: source and destination regions are both mapped here.

The destination goes through the same :class:`~kvxferd.lifecycle.inbox.Inbox` checks as a remote
chunk, then the bytes move region to region with no socket and no staging.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

from ..datapath.copier import copy_regions, settle
from ..errors import KvxferError, TransferError
from ..lifecycle.inbox import Inbox, Sink
from ..lifecycle.jobs import ChunkJob, Moved
from ..model.geometry import rank_id
from .base import SMALL_CHUNK


class LocalTransport:
    name = "local"
    one_sided = False

    def __init__(self, inbox: Inbox, on_received: Callable[[Sink, Moved], None] | None = None) -> None:
        self.inbox = inbox
        self.on_received = on_received

    def send(self, job: ChunkJob) -> Moved:
        sink = self.inbox.begin(job.header(), rank_id(job.decode_instance, *job.dst))
        ok = False
        try:
            fragments = copy_regions([r.flat for r in job.regions()], [r.flat for r in sink.regions()],
                                     job.src_slots, sink.dst_slots, job.writer, job.head_offset,
                                     sink.head_offset)
            settle(r.flat for r in sink.regions())
            ok = True
        except KvxferError:
            raise
        except Exception as exc:  # a torch or memory error must fail the request, not the thread
            raise TransferError(f"local copy failed: {exc}", field="transport") from exc
        finally:
            failed = self.inbox.finish(sink, ok, self.name)
        if failed is not None:
            raise failed
        moved = Moved(job.nbytes, fragments, "direct")
        if self.on_received is not None:
            self.on_received(sink, moved)
        return moved

    @staticmethod
    def runs_inline(job: ChunkJob) -> bool:
        """A copy out of host memory never blocks: small ones may run on the loop (the data plane
        decides how small). From a GPU, a copy waits for the device: always on a data thread."""
        return all(r.is_cpu for r in job.regions())

    @staticmethod
    def batch_key(job: ChunkJob) -> Hashable | None:
        """Small copies go several to a data thread: one hand-off and one post back for all."""
        return "local" if job.nbytes <= SMALL_CHUNK else None

    def send_many(self, jobs: list[ChunkJob]) -> list[Moved | BaseException]:
        outcomes: list[Moved | BaseException] = []
        for job in jobs:
            try:
                outcomes.append(self.send(job))
            except Exception as exc:  # noqa: BLE001 - each job reports its own failure
                outcomes.append(exc)
        return outcomes

    def stop_receiving(self, entry: Any) -> None:
        """Copies run on the sending thread, which the lifecycle already waits for."""

    def close(self) -> None:
        pass

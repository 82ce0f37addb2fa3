"""Same-daemon transport: source and destination regions are both mapped here.

The destination goes through the same :class:`~kvxferd.lifecycle.inbox.Inbox` checks as a remote
chunk, then the bytes move region to region with no socket and no staging.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

from ..datapath.copier import copy_hashed, copy_regions, settle
from ..datapath.digest import COPY_HASH_BYTES, XXH3
from ..errors import KvxferError, TransferError
from ..lifecycle.inbox import Inbox, Sink
from ..lifecycle.jobs import ChunkJob, Moved
from ..model.geometry import rank_id
from ..model.sampling import checked_slots
from .base import SMALL_CHUNK


class LocalTransport:
    name = "local"
    one_sided = False

    def __init__(self, inbox: Inbox, on_received: Callable[[Sink, Moved], None] | None = None) -> None:
        self.inbox = inbox
        self.on_received = on_received

    def send(self, job: ChunkJob) -> Moved:
        # with digests, the source's follow the copy: both sides are hashed as the bytes move
        sink = self.inbox.begin(job.header(trailer=job.digests is not None), rank_id(job.decode_instance, *job.dst),
                                self.name)
        ok = False
        try:
            srcs, dsts = [r.flat for r in job.regions()], [r.flat for r in sink.regions()]
            hashed = self._copy_hashed(job, sink, srcs, dsts) if job.digests is not None else None
            if hashed is None:
                fragments = copy_regions(srcs, dsts, job.src_slots, sink.dst_slots, job.writer, job.head_offset,
                                         sink.head_offset)
                if job.digests is not None:  # the check hashes the landed pages in a pass of its own
                    sink.digests = job.region_digests
            else:
                sink.digests, sink.landed, fragments = hashed
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

    def _copy_hashed(self, job: ChunkJob, sink: Sink, srcs: list[Any],
                     dsts: list[Any]) -> tuple[list[int], list[int], int] | None:
        """The copy, hashing the checked slots of both sides piece by piece as they move (each
        piece read from memory once, and hashed from cache); None, having copied nothing, where
        the two sides' slots do not pair one to one, the digest is the device's (word sums, taken
        where the pages lie) or this build cannot hash in C."""
        if job.src_slots.size != sink.dst_slots.size or job.slot_tokens != sink.slot_tokens or job.hash != XXH3:
            return None
        checked = checked_slots(job.src_slots.size, job.slot_tokens, job.start, job.granule, job.sample, job.group)
        return copy_hashed(srcs, dsts, job.src_slots, sink.dst_slots, job.writer, job.head_offset, sink.head_offset,
                           checked, COPY_HASH_BYTES, flip=bool(checked.any()) and self.inbox.flip_due(sink))

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

"""Two staging slots in flight: copy one block while the socket moves the other.

A staged chunk is a sequence of slot-sized blocks, each copied (gather or scatter) and
moved over the socket. Done one after the other in one thread, the copy and the socket
take turns; with two slots, a helper thread copies block k+1 while the data thread sends
block k (sender), or scatters block k while the data thread receives block k+1
(receiver). Both the native copy and socket I/O release the GIL, so the two overlap.

A second slot is taken only if the pool has one free right away and more than half of it
stays available (:meth:`~kvxferd.datapath.staging.StagingPool.try_acquire_spare`): under
back-pressure a chunk falls back to one slot and strict alternation rather than wait for a
second, or take the slots that receivers need.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

import torch

from .staging import StagingPool

B = TypeVar("B")
Step = Callable[[B, torch.Tensor], None]

HELPERS = 4  # copies in flight across all data threads; more would only queue for the 2 cores' worth of CPU

_executor: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _helpers() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=HELPERS, thread_name_prefix="kvxferd-copy")
        return _executor


def _wait_all(futures: Sequence[Future[None] | None]) -> None:
    """Every outstanding copy finished before its slot is released; the first error is raised."""
    error: BaseException | None = None
    for f in futures:
        if f is None:
            continue
        try:
            f.result()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after every copy stopped
            error = error or exc
    if error is not None:
        raise error


def send_blocks(blocks: Sequence[B], fill: Step, send: Step, pool: StagingPool, timeout: float) -> int:
    """``fill(block, slot)`` then ``send(block, slot)`` for every block in order; fills run one
    block ahead on a helper thread. Returns how many slots were used (1 or 2)."""
    first = pool.acquire(timeout)
    second = pool.try_acquire_spare() if len(blocks) > 1 else None
    if second is None:
        try:
            for b in blocks:
                fill(b, first)
                send(b, first)
        finally:
            pool.release(first)
        return 1
    slots = (first, second)
    ahead: Future[None] | None = None
    try:
        ahead = _helpers().submit(fill, blocks[0], slots[0])
        for k, b in enumerate(blocks):
            ahead.result()
            ahead = None
            if k + 1 < len(blocks):  # the other slot was sent in the previous step: free to refill
                ahead = _helpers().submit(fill, blocks[k + 1], slots[(k + 1) % 2])
            send(b, slots[k % 2])
    finally:
        try:
            _wait_all([ahead])
        finally:
            pool.release(first)
            pool.release(second)
    return 2


def receive_blocks(blocks: Sequence[B], receive: Step, drain: Step, pool: StagingPool, timeout: float) -> int:
    """``receive(block, slot)`` then ``drain(block, slot)`` for every block in order; drains run
    on a helper thread while the next block is received. Returns only when every drain has
    finished (their bytes are in place) and raises the first error of any step."""
    first = pool.acquire(timeout)
    second = pool.try_acquire_spare() if len(blocks) > 1 else None
    if second is None:
        try:
            for b in blocks:
                receive(b, first)
                drain(b, first)
        finally:
            pool.release(first)
        return 1
    slots = (first, second)
    pending: list[Future[None] | None] = [None, None]
    try:
        for k, b in enumerate(blocks):
            slot = k % 2
            if pending[slot] is not None:  # the drain of block k - 2 still reads this slot
                f, pending[slot] = pending[slot], None
                f.result()
            receive(b, slots[slot])
            pending[slot] = _helpers().submit(drain, b, slots[slot])
        _wait_all(pending)
        pending = [None, None]
    finally:
        try:
            _wait_all(pending)
        finally:
            pool.release(first)
            pool.release(second)
    return 2

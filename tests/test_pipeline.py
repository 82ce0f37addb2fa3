"""Two-slot staging pipelines: order, bytes, errors and slot accounting.

Each block's content is a function of its index, so a block filled into the wrong slot,
sent out of order, or overwritten before it was drained shows up as wrong bytes.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvxferd.datapath.pipeline import receive_blocks, send_blocks
from kvxferd.datapath.staging import StagingPool

SLOT = 4096


def pattern(k: int) -> torch.Tensor:
    return (torch.arange(SLOT, dtype=torch.int64) * 7 + k * 131).remainder(251).to(torch.uint8)


@pytest.mark.parametrize("slots", [1, 2, 3, 4])
@pytest.mark.parametrize("n_blocks", [1, 2, 3, 9])
def test_send_blocks_sends_every_block_in_order(slots: int, n_blocks: int) -> None:
    pool = StagingPool(slots * SLOT, SLOT)
    sent: list[bytes] = []
    used = send_blocks(list(range(n_blocks)), lambda k, slot: slot.copy_(pattern(k)),
                       lambda k, slot: sent.append(bytes(slot.numpy())), pool, timeout=5.0)
    assert sent == [bytes(pattern(k).numpy()) for k in range(n_blocks)]
    # a second slot only while more than half the pool stays available
    assert used == (2 if slots >= 4 and n_blocks > 1 else 1)
    assert pool.in_use == 0


@pytest.mark.parametrize("slots", [1, 4])
@pytest.mark.parametrize("n_blocks", [1, 2, 5])
def test_receive_blocks_drains_every_block_before_returning(slots: int, n_blocks: int) -> None:
    pool = StagingPool(slots * SLOT, SLOT)
    landed: dict[int, bytes] = {}
    lock = threading.Lock()

    def drain(k: int, slot: torch.Tensor) -> None:
        data = bytes(slot.numpy())
        with lock:
            landed[k] = data

    receive_blocks(list(range(n_blocks)), lambda k, slot: slot.copy_(pattern(k)), drain, pool, timeout=5.0)
    assert landed == {k: bytes(pattern(k).numpy()) for k in range(n_blocks)}
    assert pool.in_use == 0


def test_a_failing_fill_stops_the_send_and_releases_both_slots() -> None:
    pool = StagingPool(4 * SLOT, SLOT)
    sent: list[int] = []

    def fill(k: int, slot: torch.Tensor) -> None:
        if k == 2:
            raise RuntimeError("gather failed at block 2")

    with pytest.raises(RuntimeError, match="block 2"):
        send_blocks(list(range(5)), fill, lambda k, slot: sent.append(k), pool, timeout=5.0)
    assert sent == [0, 1] and pool.in_use == 0


def test_a_failing_send_waits_for_the_fill_in_flight() -> None:
    pool = StagingPool(4 * SLOT, SLOT)
    filling = threading.Event()
    finished: list[int] = []

    def fill(k: int, slot: torch.Tensor) -> None:
        if k == 1:
            filling.set()
            threading.Event().wait(0.2)  # still writing the slot when the send fails
        finished.append(k)

    def send(k: int, slot: torch.Tensor) -> None:
        filling.wait(5.0)
        raise ConnectionError("peer went away")

    with pytest.raises(ConnectionError):
        send_blocks(list(range(3)), fill, send, pool, timeout=5.0)
    assert finished == [0, 1] and pool.in_use == 0  # the slot went back only after its fill ended


def test_a_failing_drain_is_raised_after_every_drain_ended() -> None:
    pool = StagingPool(4 * SLOT, SLOT)
    drained: list[int] = []

    def drain(k: int, slot: torch.Tensor) -> None:
        if k == 1:
            raise ValueError("scatter failed at block 1")
        drained.append(k)

    with pytest.raises(ValueError, match="block 1"):
        receive_blocks(list(range(4)), lambda k, slot: None, drain, pool, timeout=5.0)
    assert pool.in_use == 0 and 1 not in drained

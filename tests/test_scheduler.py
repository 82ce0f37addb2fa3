"""The QoS scheduler of the data plane (kvxferd/transport/scheduler.py): pure rules, checked
against the orders and shares they promise, with hypothesis over job sizes, weights and arrivals."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.model.qos import BULK, LATENCY, Qos
from kvxferd.transport.scheduler import Scheduler

jobs_st = st.lists(st.tuples(st.sampled_from(CLASSES := (LATENCY, BULK)), st.sampled_from("abc"),
                             st.integers(1, 1 << 20), st.one_of(st.none(), st.floats(0, 100)),
                             st.one_of(st.none(), st.sampled_from("xy"))), max_size=60)


def _drain(s: Scheduler, allowed=CLASSES, max_jobs: int = 1, max_bytes: int = 0) -> list:
    out = []
    while (pick := s.pop(allowed, max_jobs, max_bytes)) is not None:
        out.append(pick)
    return out


@given(jobs_st, st.booleans(), st.integers(1, 8))
@settings(max_examples=200, deadline=None)
def test_every_job_pushed_comes_out_exactly_once(jobs, fifo, max_jobs):
    s: Scheduler[int] = Scheduler(0.1, fifo=fifo)
    for i, (cls, inst, nbytes, deadline, batch) in enumerate(jobs):
        s.push(i, Qos(cls, inst, 1.0, deadline), nbytes, batch)
    assert len(s) == len(jobs)
    out = [i for pick in _drain(s, max_jobs=max_jobs, max_bytes=4 << 20) for i in pick.items]
    assert sorted(out) == list(range(len(jobs))) and len(s) == 0
    assert s.queued(LATENCY) == (0, 0) and s.queued(BULK) == (0, 0)


@given(jobs_st)
@settings(max_examples=200, deadline=None)
def test_fifo_keeps_the_order_jobs_came_in_whatever_their_class_and_deadline(jobs):
    s: Scheduler[int] = Scheduler(0.1, fifo=True)
    for i, (cls, inst, nbytes, deadline, _) in enumerate(jobs):
        s.push(i, Qos(cls, inst, 5.0 if inst == "a" else 1.0, deadline), nbytes)
    assert [i for pick in _drain(s) for i in pick.items] == list(range(len(jobs)))


@given(st.lists(st.tuples(st.one_of(st.none(), st.floats(0, 100)), st.integers(1, 1000)), min_size=1, max_size=40))
@settings(max_examples=200, deadline=None)
def test_inside_an_instance_the_earliest_deadline_goes_first_then_arrival_order(jobs):
    s: Scheduler[int] = Scheduler(0.1)
    for i, (deadline, nbytes) in enumerate(jobs):
        s.push(i, Qos(LATENCY, "a", 1.0, deadline), nbytes)
    got = [i for pick in _drain(s) for i in pick.items]
    key = [(math.inf if jobs[i][0] is None else jobs[i][0], i) for i in got]
    assert key == sorted(key)


@given(st.integers(1, 5), st.integers(1, 5), st.lists(st.integers(1, 64), min_size=1, max_size=4))
@settings(max_examples=40, deadline=None)
def test_two_backlogged_instances_share_bytes_by_weight(wa, wb, sizes_kib):
    """Both kept backlogged (each pop is replaced by a job of the same size): over many pops the
    bytes served come out in the ratio of the weights, to within one largest job per flow."""
    s: Scheduler[str] = Scheduler(0.1)
    sizes = [k << 10 for k in sizes_kib]
    nxt = {"a": 0, "b": 0}

    def refill(inst: str) -> None:
        size = sizes[nxt[inst] % len(sizes)]
        nxt[inst] += 1
        s.push(inst, Qos(BULK, inst, float(wa if inst == "a" else wb)), size)

    for inst in "ab":
        for _ in range(3):
            refill(inst)
    served = {"a": 0, "b": 0}
    for _ in range(400):
        pick = s.pop()
        assert pick is not None and pick.cls == BULK
        inst = pick.items[0]
        size = sizes[(nxt[inst] - 3) % len(sizes)]
        served[inst] += size
        refill(inst)
    biggest = max(sizes)
    # start-time fair queueing: the normalised bytes of two backlogged flows differ by at most one
    # job of each
    assert abs(served["a"] / wa - served["b"] / wb) <= biggest / wa + biggest / wb


def test_weights_three_to_one_give_three_to_one_of_the_bytes_within_ten_percent():
    s: Scheduler[str] = Scheduler(0.1)
    for _ in range(4):
        s.push("heavy", Qos(BULK, "heavy", 3.0), 4 << 20)
        s.push("light", Qos(BULK, "light", 1.0), 4 << 20)
    served = {"heavy": 0, "light": 0}
    for _ in range(200):
        inst = s.pop().items[0]
        served[inst] += 4 << 20
        s.push(inst, Qos(BULK, inst, 3.0 if inst == "heavy" else 1.0), 4 << 20)
    assert abs(served["heavy"] / served["light"] - 3.0) <= 0.3, served


def test_an_instance_back_from_idle_starts_level_with_no_credit_banked():
    s: Scheduler[str] = Scheduler(0.1)
    for _ in range(50):  # "a" alone for a while
        s.push("a", Qos(BULK, "a"), 1000)
        s.pop()
    s.push("a", Qos(BULK, "a"), 1000)
    s.push("a", Qos(BULK, "a"), 1000)
    for _ in range(3):
        s.push("b", Qos(BULK, "b"), 1000)
    order = [s.pop().items[0] for _ in range(5)]
    assert order[:4].count("b") <= 2, order  # b does not take the next 50 turns for a's past


@given(st.floats(0.05, 0.5), st.integers(1, 8), st.integers(64, 4096))
@settings(max_examples=30, deadline=None)
def test_bulk_keeps_its_floor_of_thread_time_under_a_latency_flood(floor, latency_kib, bulk_kib):
    """Both classes always waiting; each job runs for its bytes at one rate: bulk's share of the
    thread time is at least its floor, less one bulk job's time over the whole run."""
    s: Scheduler[str] = Scheduler(floor)
    rate = 1e9
    s.push("bulk", Qos(BULK, "b"), bulk_kib << 10)
    s.push("lat", Qos(LATENCY, "l"), latency_kib << 10)
    time = {LATENCY: 0.0, BULK: 0.0}
    for _ in range(3000):
        pick = s.pop()
        cls = pick.cls
        seconds = ((bulk_kib if cls == BULK else latency_kib) << 10) / rate
        s.ran(pick, seconds)
        time[cls] += seconds
        s.push(pick.items[0], Qos(cls, "b" if cls == BULK else "l"), (bulk_kib if cls == BULK else latency_kib) << 10)
    total = time[LATENCY] + time[BULK]
    one_bulk = (bulk_kib << 10) / rate
    assert time[BULK] >= floor * total - one_bulk, (time, floor)
    # and latency is never starved either: bulk takes no more than its floor plus one job
    assert time[BULK] <= floor * total + 2 * one_bulk, (time, floor)


def test_latency_goes_first_and_a_latency_only_lane_never_takes_bulk():
    s: Scheduler[str] = Scheduler(0.1)
    s.push("b1", Qos(BULK, "x"), 1 << 20)
    s.push("l1", Qos(LATENCY, "y"), 4096)
    assert s.pop((LATENCY,)).items == ["l1"]
    assert s.pop((LATENCY,)) is None  # bulk waits for a thread that may take it
    s.push("l2", Qos(LATENCY, "y"), 4096)
    pick = s.pop()
    assert pick.items == ["l2"] and pick.contested
    assert s.pop().items == ["b1"]


def test_idle_classes_bank_nothing_for_the_floor():
    s: Scheduler[str] = Scheduler(0.5)
    s.push("l", Qos(LATENCY, "y"), 10)
    s.push("b", Qos(BULK, "x"), 10)
    s.ran(s.pop(), 10.0)  # latency ran 10 s while bulk waited: bulk is owed 10 s
    assert s.bulk_credit == pytest.approx(10.0)
    assert s.pop().items == ["b"]  # latency is empty: bulk runs, and the debt is forgotten
    assert s.next_class() is None and s.bulk_credit == 0.0


def test_batching_takes_the_same_key_right_behind_within_the_limits():
    s: Scheduler[int] = Scheduler(0.1)
    for i, key in enumerate(["k", "k", "k", "j", "k"]):
        s.push(i, Qos(BULK, "a"), 100, key)
    s.push(5, Qos(BULK, "a"), 100, None)
    assert s.pop(max_jobs=8, max_bytes=250).items == [0, 1]  # 250 bytes in all
    assert s.pop(max_jobs=8, max_bytes=10_000).items == [2]  # the key changes behind it
    assert s.pop(max_jobs=8, max_bytes=10_000).items == [3]
    assert s.pop(max_jobs=8, max_bytes=10_000).items == [4]  # a job with no key is never joined
    assert s.pop(max_jobs=8, max_bytes=10_000).items == [5]


def test_ahead_of_counts_what_a_new_job_waits_behind():
    s: Scheduler[int] = Scheduler(0.1)
    s.push(0, Qos(BULK, "a"), 1000)
    s.push(1, Qos(LATENCY, "b"), 10)
    assert s.ahead_of(LATENCY) == 10 and s.ahead_of(BULK) == 1010
    assert Scheduler(0.1, fifo=True).ahead_of(LATENCY) == 0


def test_a_floor_outside_zero_to_one_and_an_unknown_class_are_refused():
    with pytest.raises(ValueError, match="bulk_floor"):
        Scheduler(1.0)
    with pytest.raises(ValueError, match="qos class"):
        Scheduler(0.1).push(0, Qos("urgent", "a"), 1)

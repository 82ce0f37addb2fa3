"""QoS over tcp, through real daemons: latency and bulk chunks travel on connections of their own,
and the decode daemon receives the bulk ones on threads at ``qos.bulk_nice``, so the kernel gives
a latency chunk's receive the core over the bulk stream beside it. Every byte checked against the
oracle. The daemons are this module's own: which connections exist depends on every chunk sent."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from e2e_util import NUM_PAGES, Node, assert_verified, close, finished, module_cluster, spec
from test_e2e_qos import QOS, ONE_THREAD, Pages, _send

BULK_NICE = 10  # qos.bulk_nice's default


@pytest.fixture(scope="module")
def cluster(request):
    yield from module_cluster(request, Node("la", QOS, ONE_THREAD), Node("lb", QOS, ONE_THREAD))


def _pair(cluster, prefill_name: str, decode_name: str):
    la, lb = cluster.daemons["la"], cluster.daemons["lb"]
    return cluster.instances((la, prefill_name, "prefill", spec(), NUM_PAGES),
                             (lb, decode_name, "decode", spec(), NUM_PAGES))


def _nices(pid: int) -> list[int]:
    """The nice value of each of the process's threads (/proc/PID/task/TID/stat, field 19)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out.append(int((task / "stat").read_text().rsplit(")", 1)[1].split()[16]))
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended while we looked
    return out


def _run(p, d, rids, n, pages, source_address, qos_class=None):
    for rid in rids:
        _send(p, d, rid, n, pages, qos_class=qos_class, source_address=source_address)
    for rid in rids:
        assert_verified([finished(w, rid) for w in d], [finished(w, rid) for w in p])


def test_bulk_chunks_are_received_at_bulk_nice_and_latency_chunks_are_not(cluster):
    la, lb = cluster.daemons["la"], cluster.daemons["lb"]
    pid = lb.proc.pid
    if os.getpriority(os.PRIO_PROCESS, pid) >= BULK_NICE:
        pytest.skip("the daemon already runs at qos.bulk_nice or lower: no thread can be told apart")
    pages = Pages(random.Random(3))
    chat_p, chat_d = _pair(cluster, "chat-lane-p", "chat-lane-d")
    bulk_p, bulk_d = _pair(cluster, "bulk-lane-p", "bulk-lane-d")
    try:
        # a decode daemon that never sent starts no data-plane thread: nothing of it runs niced yet
        shared = _nices(pid).count(BULK_NICE)
        _run(chat_p, chat_d, [f"chat-{i}" for i in range(4)], 16, pages, la.address, qos_class="latency")
        assert _nices(pid).count(BULK_NICE) == shared  # latency chunks: received at the process's nice
        _run(bulk_p, bulk_d, [f"bulk-{i}" for i in range(3)], 64, pages, la.address)
        niced = _nices(pid).count(BULK_NICE)
        assert niced > shared  # each bulk connection's receiving thread now runs at qos.bulk_nice
        # latency requests after the bulk stream still go on connections of their own
        _run(chat_p, chat_d, [f"chat-again-{i}" for i in range(4)], 16, pages, la.address, qos_class="latency")
        assert _nices(pid).count(BULK_NICE) == niced
    finally:
        close(chat_p + chat_d + bulk_p + bulk_d)

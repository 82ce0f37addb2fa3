"""Transfer QoS through real daemons: classes asked by engines and held to qos.instances, counted
per class on the metrics endpoint, every byte checked against the oracle; deadlines that cannot be
met fail ``deadline`` on both sides with no byte landed, and the daemons go on serving."""

from __future__ import annotations

import random
import time
import urllib.request

import pytest

from kvxferd.sdk.client import EngineClient
from e2e_util import (NUM_PAGES, Node, assert_verified, close, finished, module_cluster, spec,
                      transfer, untouched_bytes)

QOS = '[qos]\ninstances = ["chat*=latency", "bulk*=bulk:2"]\nlatency_threads = 1\n'
ONE_THREAD = {"KVXFERD_DAEMON_DATA_THREADS": "1"}


@pytest.fixture(scope="module")
def cluster(request):
    yield from module_cluster(request, Node("qa", QOS, ONE_THREAD), Node("qb", QOS, ONE_THREAD))


def _class_bytes(daemon) -> dict[str, float]:
    with urllib.request.urlopen(daemon.metrics_url, timeout=10) as answer:
        text = answer.read().decode()
    out = {"latency": 0.0, "bulk": 0.0}
    for line in text.splitlines():
        if line.startswith("kvxferd_transfer_class_bytes_total{"):
            cls = line.split('class="', 1)[1].split('"', 1)[0]
            out[cls] = float(line.rsplit(" ", 1)[1])
    return out


def _pair(cluster, prefill_name: str, decode_name: str):
    qa, qb = cluster.daemons["qa"], cluster.daemons["qb"]
    return cluster.instances((qa, prefill_name, "prefill", spec(), NUM_PAGES),
                             (qb, decode_name, "decode", spec(), NUM_PAGES))


class Pages:
    """Pages no two requests of one instance share (requests in flight together must not)."""

    def __init__(self, rng: random.Random) -> None:
        self.free = {}
        self.rng = rng

    def take(self, instance: str, n: int) -> list[int]:
        free = self.free.setdefault(instance, self.rng.sample(range(NUM_PAGES), NUM_PAGES))
        need = -(-n // spec().page_size)
        taken, self.free[instance] = free[:need], free[need:]
        assert len(taken) == need, "the test ran out of pages"
        return taken


def _send(p, d, rid, n, pages: Pages, *, qos_class=None, budget_ms=None, source_address, deadline_at=None):
    src = pages.take(p[0].instance, n)
    dst = pages.take(d[0].instance, n)
    for w in d:
        w.command(cmd="expect", request_id=rid, pages=dst, n=n, source_instance=p[0].instance,
                  source_address=source_address)
    for w in p:
        w.command(cmd="send", request_id=rid, pages=src, n=n, qos_class=qos_class, budget_ms=budget_ms,
                  deadline_at=deadline_at)
    return dst


def test_classes_asked_are_held_to_the_instances_class_and_counted_on_the_metrics_endpoint(cluster):
    qa = cluster.daemons["qa"]
    pages = Pages(random.Random(1))
    chat_p, chat_d = _pair(cluster, "chat-p", "chat-d")
    bulk_p, bulk_d = _pair(cluster, "bulk-p", "bulk-d")
    try:
        before = _class_bytes(qa)
        # the chat instance's requests, and the bulk instance's, at once on the same daemons
        rids = []
        for i in range(3):
            _send(chat_p, chat_d, f"chat-{i}", 16, pages, qos_class="latency", source_address=qa.address)
            _send(bulk_p, bulk_d, f"bulk-{i}", 64, pages, source_address=qa.address)
            rids += [(chat_p, chat_d, f"chat-{i}"), (bulk_p, bulk_d, f"bulk-{i}")]
        for p, d, rid in rids:
            assert_verified([finished(w, rid) for w in d], [finished(w, rid) for w in p])
        after = _class_bytes(qa)
        assert after["latency"] > before["latency"] and after["bulk"] > before["bulk"]
        # the bulk instance asking latency is held to bulk: not a byte counts as latency
        latency_before = after["latency"]
        _send(bulk_p, bulk_d, "bulk-asks-latency", 64, pages, qos_class="latency", source_address=qa.address)
        assert_verified([finished(w, "bulk-asks-latency") for w in bulk_d],
                        [finished(w, "bulk-asks-latency") for w in bulk_p])
        final = _class_bytes(qa)
        assert final["latency"] == latency_before and final["bulk"] > after["bulk"]
        with EngineClient(qa.socket_path, timeout=10) as client:
            status = client.status()["qos"]
        assert status["policy"] == "qos" and status["latency_threads"] == 1 and status["bulk_floor"] == 0.1
    finally:
        close(chat_p + chat_d + bulk_p + bulk_d)


def test_a_deadline_that_cannot_be_met_fails_deadline_on_both_sides_and_nothing_lands(cluster):
    qa = cluster.daemons["qa"]
    pages = Pages(random.Random(2))
    p, d = _pair(cluster, "chat-dl-p", "chat-dl-d")
    try:
        # a budget of one microsecond: gone before the chunk reaches the data plane
        dst = _send(p, d, "too-late", 16, pages, qos_class="latency", budget_ms=0.001, source_address=qa.address)
        pre = finished(p[0], "too-late")
        dec = finished(d[0], "too-late")
        assert (pre["state"], pre["code"]) == ("failed", "deadline"), pre
        assert "deadline" in pre["reason"], pre
        assert (dec["state"], dec["code"]) == ("failed", "deadline"), dec
        assert untouched_bytes(d[0], dst) == 0  # not a byte of it landed
        # the pair goes on: a request with room in its budget is done, byte-exact
        src, dst2 = pages.take(p[0].instance, 16), pages.take(d[0].instance, 16)
        dec2, pre2 = transfer(p, d, "in-time", 16, src_pages=src, dst_pages=dst2, source_address=qa.address)
        assert_verified(dec2, pre2)
    finally:
        close(p + d)


def test_a_wall_clock_deadline_already_past_fails_deadline_and_one_ahead_is_done(cluster):
    """``deadline_at`` (the node's clock, Unix seconds): one already past fails ``deadline`` on both
    sides with no byte landed; one an hour ahead holds nothing back (done, byte-exact)."""
    qa = cluster.daemons["qa"]
    pages = Pages(random.Random(4))
    p, d = _pair(cluster, "chat-at-p", "chat-at-d")
    try:
        src, dst = pages.take(p[0].instance, 16), pages.take(d[0].instance, 16)
        for w in d:
            w.command(cmd="expect", request_id="past", pages=dst, n=16, source_instance=p[0].instance,
                      source_address=qa.address)
        for w in p:
            w.command(cmd="send", request_id="past", pages=src, n=16, deadline_at=time.time() - 1.0)
        pre, dec = finished(p[0], "past"), finished(d[0], "past")
        assert (pre["state"], pre["code"]) == ("failed", "deadline"), pre
        assert (dec["state"], dec["code"]) == ("failed", "deadline"), dec
        assert untouched_bytes(d[0], dst) == 0
        dst2 = _send(p, d, "ahead", 16, pages, source_address=qa.address, deadline_at=time.time() + 3600)
        assert_verified([finished(w, "ahead") for w in d], [finished(w, "ahead") for w in p])
        assert dst2
    finally:
        close(p + d)

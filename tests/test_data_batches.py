"""Small chunks travel together: a data thread takes the queued chunks for one peer in one
hand-off, and tcp sends them back to back on one connection before reading their replies.

- Through a real daemon pair: many small requests arrive byte-exact, the prefill daemon's
  ``kvxferd_data_handoff_chunks`` histogram shows several chunks per hand-off, and with
  ``daemon.data_batch_chunks = 1`` every chunk goes alone.
- Against a real decode daemon's data port (the test plays the prefill daemon): frames sent
  back to back are answered in order, and a refused small chunk among them (its payload read
  past) leaves the chunks behind it on the same connection untouched.
"""

from __future__ import annotations

import random
import time

import msgpack
import pytest

from e2e_util import NUM_PAGES, Node, cluster_run, finished, module_cluster, move_batched_rounds, spec
from kvxferd.sdk.client import EngineClient
from kvxferd.tools.procstats import scrape
from test_fuzz_data import N_TOKENS, FakePrefillDaemon, _recv, data_connection, frame, oracle_payload
from test_fuzz_engine import canary

TIMEOUTS = "[timeouts]\nwaiting_for_input_s = 30.0\nbootstrap_s = 30.0\n"


@pytest.fixture(scope="module")
def cluster(request):
    yield from module_cluster(request, Node("prefill-node", TIMEOUTS),
                              Node("prefill-alone-node", TIMEOUTS, env={"KVXFERD_DAEMON_DATA_BATCH_CHUNKS": "1"}),
                              Node("decode-node", TIMEOUTS))


def handoffs(daemon) -> tuple[float, float]:
    """(hand-offs, chunks they carried) so far."""
    seen = scrape(daemon.metrics_url)
    return seen.get("kvxferd_data_handoff_chunks_count", 0.0), seen.get("kvxferd_data_handoff_chunks_sum", 0.0)


def move_rounds(cluster, pd, tag: str, seed: int) -> None:
    dd = cluster.daemons["decode-node"]
    (p0,), (d0,) = cluster.instances((pd, f"{tag}p", "prefill", spec(), NUM_PAGES),
                                     (dd, f"{tag}d", "decode", spec(), NUM_PAGES))
    move_batched_rounds(d0, p0, f"{tag}p", pd.address, random.Random(seed), tag)


def test_small_chunks_for_one_peer_go_several_to_a_handoff_and_arrive_byte_exact(cluster):
    pd = cluster.daemons["prefill-node"]
    before = handoffs(pd)
    move_rounds(cluster, pd, "many", 11)
    count, chunks = (a - b for a, b in zip(handoffs(pd), before))
    assert chunks >= 60, (count, chunks)  # every chunk went through a hand-off
    assert count < chunks, (count, chunks)  # and some hand-offs carried several


def test_with_data_batch_chunks_1_every_chunk_goes_alone(cluster):
    pd = cluster.daemons["prefill-alone-node"]
    before = handoffs(pd)
    move_rounds(cluster, pd, "alone", 12)
    count, chunks = (a - b for a, b in zip(handoffs(pd), before))
    assert chunks >= 60 and count == chunks, (count, chunks)


# -- frames back to back at a decode daemon's data port --------------------------------------------------
DST = {"pipe-a": [9, 2, 14, 5], "pipe-b": [1, 7, 3, 12]}


def test_frames_back_to_back_are_answered_in_order_and_a_refused_one_spares_the_rest(request):
    fake = FakePrefillDaemon(spec(tp_size=2))
    try:
        with cluster_run(request) as c:
            dd = c.daemon("pipe-decode-node", extra_toml=TIMEOUTS)
            (d0,) = c.instance(dd, "pd", "decode", spec(), NUM_PAGES)
            for rid, pages in DST.items():
                d0.command(cmd="expect", request_id=rid, pages=pages, n=N_TOKENS, source_instance="pp",
                           source_address=fake.address)
            deadline = time.monotonic() + 60
            with EngineClient(dd.socket_path, timeout=10) as client:
                while client.status()["requests"] != {"decode:waiting_for_input": 2}:
                    assert time.monotonic() < deadline, client.status()["requests"]
                    time.sleep(0.05)
            token = fake.tokens["pd"]
            writers = [[0, 0], [1, 0]]
            per_token = 2 * spec().num_layers * spec().row_bytes // 2  # K and V, every layer, half the heads

            def chunk(rid: str, w: int) -> bytes:
                head = {"op": "data", "request_id": rid, "decode_instance": "pd", "dst": [0, 0], "token": token,
                        "src": writers[w], "start": 0, "end": N_TOKENS, "last": True,
                        "nbytes": N_TOKENS * per_token}
                return frame(head) + oracle_payload(rid if rid in DST else "pipe-a", w, 0, N_TOKENS)

            # a request nobody expects sits between the two writers of pipe-a: it is refused, its payload
            # read past, and the four good chunks on the same connection all land
            order = [("pipe-a", 0), ("ghost", 0), ("pipe-a", 1), ("pipe-b", 0), ("pipe-b", 1)]
            invalid_before = scrape(dd.metrics_url).get('kvxferd_invalid_messages_total{endpoint="data"}', 0.0)
            with data_connection(dd.data_port, token) as s:
                s.settimeout(30)
                s.sendall(b"".join(chunk(rid, w) for rid, w in order))
                replies = []
                for _ in order:
                    head = _recv(s, 4)
                    assert head is not None, replies
                    body = _recv(s, int.from_bytes(head, "big"))
                    assert body is not None, replies
                    replies.append(msgpack.unpackb(body, raw=False))
            assert [r["ok"] for r in replies] == [True, False, True, True, True], replies
            assert replies[1]["error"]["field"] == "request_id", replies[1]
            invalid_after = scrape(dd.metrics_url).get('kvxferd_invalid_messages_total{endpoint="data"}', 0.0)
            assert invalid_after - invalid_before == 1
            for rid in DST:
                ev = finished(d0, rid)
                assert ev["state"] == "done" and ev["mismatched_bytes"] == 0, ev
            seen = canary(d0, [[pages, N_TOKENS] for pages in DST.values()])
            assert seen["outside_bytes"] == 0, seen
            assert set(seen["changed_pages"]) <= {p for pages in DST.values() for p in pages}, seen
    finally:
        fake.close()

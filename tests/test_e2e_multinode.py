"""A prefill instance over two daemons (ranks 0-1 at A, 2-3 at B, A the rendezvous) -> a decode
instance at D, over tcp: real daemons and engine processes, byte-exact against the oracle."""

from __future__ import annotations

import random

import pytest

from e2e_util import assert_verified, close, module_cluster, pages_for, spec, transfer, untouched_bytes
from kvxferd.client import EngineClient

NUM_PAGES = 64


@pytest.fixture(scope="module")
def cluster(request):
    yield from module_cluster(request, "node-a", "node-b", "node-d")


def _instances(cluster, tag: str, d_tp: int = 2):
    a, b, d = (cluster.daemons[n] for n in ("node-a", "node-b", "node-d"))
    pspec, dspec = spec(tp_size=4, total_kv_heads=4), spec(tp_size=d_tp, total_kv_heads=4)
    prefill = cluster.spread_instance([a, a, b, b], f"{tag}p", "prefill", pspec, NUM_PAGES)
    (decode,) = cluster.instances((d, f"{tag}d", "decode", dspec, NUM_PAGES))
    return a, b, d, prefill, decode, pspec, dspec


@pytest.mark.parametrize("d_tp", [2, 1], ids=["tp4_to_tp2", "tp4_to_tp1"])
def test_tp4_over_two_daemons_to_one_decode_daemon_byte_exact(cluster, d_tp):
    a, b, d, prefill, decode, pspec, dspec = _instances(cluster, f"m{d_tp}", d_tp)
    rng = random.Random(d_tp)
    try:
        used: set[int] = set()
        for i, (order, chunks) in enumerate([("expect_first", None), ("send_first", [[0, 12], [12, 40]])]):
            src = pages_for(rng, NUM_PAGES, 40, pspec.page_size)
            dst = rng.sample([p for p in range(NUM_PAGES) if p not in used], 10)
            used.update(dst)
            dec, pre = transfer(prefill, decode, f"m{d_tp}-r{i}", 40, src_pages=src, dst_pages=dst,
                                source_address=a.address, chunks=chunks, order=order)
            assert_verified(dec, pre)
        never = [p for p in range(NUM_PAGES) if p not in used]
        for w in decode:
            assert untouched_bytes(w, never) == 0
        # the rendezvous knows B's ranks; the decode daemon handshook with both source daemons
        assert _status(a)["rendezvous"]["remote_ranks"][f"m{d_tp}p/prefill"] == {"2.0": b.address, "3.0": b.address}
        assert _status(b)["rendezvous"]["announcing"] == {f"m{d_tp}p/prefill": a.address}
        plans = {p["address"]: p["plans"] for p in _status(d)["peers"] if p["side"] == "prefill"}
        assert f"m{d_tp}p->m{d_tp}d" in plans[a.address] and f"m{d_tp}p->m{d_tp}d" in plans[b.address]
    finally:
        close(prefill + decode)


def _status(daemon):
    with EngineClient(daemon.socket_path, timeout=10) as client:
        return client.status()

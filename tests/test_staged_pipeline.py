"""Staged tcp transfers whose chunks span many slots, with room for two slots per thread.

With 256-byte slots and a 16-slot pool, every chunk here is dozens of blocks, so the
sender gathers block k+1 on a helper thread while it sends block k, and the receiver
scatters block k while it receives block k+1. The decode pages are compared with the
prefill oracle byte for byte (``assert_verified``), in both directions of TP mismatch and
with several requests in flight.
"""

from __future__ import annotations

import random

import pytest

from e2e_util import Cluster, assert_verified, close, finished, spec

ROOMY_POOL = "[limits]\nstaging_bytes = 4096\nstaging_slot_bytes = 256\n"


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    env = {"KVXFERD_PEER_MODE": "staged"}
    c.daemon("prefill-node", extra_toml=ROOMY_POOL, env=env)
    c.daemon("decode-node", extra_toml=ROOMY_POOL, env=env)
    yield c
    c.close()


@pytest.mark.parametrize("pspec, dspec, chunks", [
    (spec(tp_size=2), spec(), [[0, 24], [24, 61]]),
    (spec(), spec(tp_size=2), None),
], ids=["tp2-to-tp1-chunked", "tp1-to-tp2"])
def test_many_block_staged_transfers_land_every_byte(cluster, pspec, dspec, chunks):
    pd, dd = cluster.daemons["prefill-node"], cluster.daemons["decode-node"]
    tag = f"{pspec.tp_size}-{dspec.tp_size}"
    prefill = cluster.instance(pd, f"pp-{tag}", "prefill", pspec, 64)
    decode = cluster.instance(dd, f"pd-{tag}", "decode", dspec, 64)
    rng = random.Random(tag)
    try:
        ids = [f"pl-{tag}-{i}" for i in range(3)]
        plans = {rid: (rng.sample(range(i * 16, i * 16 + 16), 16), rng.sample(range(i * 16, i * 16 + 16), 16))
                 for i, rid in enumerate(ids)}
        for rid, (src, dst) in plans.items():
            for w in decode:
                w.command(cmd="expect", request_id=rid, pages=dst, n=61, source_instance=prefill[0].instance,
                          source_address=pd.address)
        for rid, (src, dst) in plans.items():
            for w in prefill:
                w.command(cmd="send", request_id=rid, pages=src, n=61, chunks=chunks)
        for rid in ids:
            assert_verified([finished(w, rid) for w in decode], [finished(w, rid) for w in prefill])
    finally:
        close(prefill + decode)

"""The asyncio engine client against a real daemon (local transport, one process per side)."""

from __future__ import annotations

import asyncio

import torch

from e2e_util import cluster_run, spec
from kvxferd.model.geometry import RankGeometry
from kvxferd.sdk.client import AsyncEngineClient, DaemonError
from kvxferd.sdk.kv_cache import allocate_cpu


def test_async_client_moves_bytes_and_reports_events():
    with cluster_run() as c:
        d = c.daemon("node")
        s = spec(num_layers=2, page_size=4)

        async def main() -> None:
            p_geo, d_geo = RankGeometry(s, 0, 0, 8), RankGeometry(s, 0, 0, 8)
            with allocate_cpu(p_geo, name="async-p") as src, allocate_cpu(d_geo, name="async-d", fill=0) as dst:
                for t in src.tensors.values():
                    t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
                prefill, decode = AsyncEngineClient(d.socket_path), AsyncEngineClient(d.socket_path)
                try:
                    p_rank = await prefill.register("ap", "prefill", p_geo, src.descriptors())
                    d_rank = await decode.register("ad", "decode", d_geo, dst.descriptors())
                    assert await decode.expect(d_rank, "a-1", source_instance="ap", pages=[5, 1], num_tokens=7) \
                        in ("bootstrapping", "waiting_for_input")
                    await prefill.send(p_rank, "a-1", pages=[2, 6], start=0, end=7, last=True, aux=b"\x07")
                    done_d, done_p = await asyncio.gather(decode.wait(d_rank, "a-1", timeout=30),
                                                          prefill.wait(p_rank, "a-1", timeout=30))
                    assert done_d["state"] == "done" and done_d["aux"] == b"\x07"
                    assert done_p["state"] == "done"
                    for key, t in src.tensors.items():
                        got = dst.tensors[key].view(torch.uint8)
                        want = t.view(torch.uint8)
                        # tokens 0..3 of page 2 -> page 5; tokens 4..6 of page 6 -> page 1
                        assert torch.equal(got[5], want[2])
                        assert torch.equal(got[1][:3], want[6][:3])
                        assert int(got[1][3:].count_nonzero()) == 0  # the slot past the request is untouched
                    status = await decode.status()
                    assert status["requests"] == {}
                    try:
                        await decode.poll(d_rank, "no-such-request")
                        raise AssertionError("poll of an unknown request must fail")
                    except DaemonError as err:
                        assert err.field == "request_id"
                finally:
                    prefill.close()
                    decode.close()

        asyncio.run(main())

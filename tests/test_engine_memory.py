"""Registering tensors an engine already owns: share_in_place, describe_tensors, expect start,
prefill readiness.

The engines here are the test process itself holding its KV the way SGLang and vLLM do
(per-layer tensors that are views of one storage, allocated with plain torch), talking
to real daemon processes over their real sockets. The byte oracle is a per-token loop
over the page tables, independent of the planner and segment code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from e2e_util import module_cluster, spec
from kvxferd.errors import RegistrationError
from kvxferd.model.geometry import InstanceSpec, RankGeometry
from kvxferd.sdk.client import DaemonError, EngineClient
from kvxferd.sdk.engine_memory import SharedPool, describe_tensors, share_in_place

MARK = 0x5A


def _file_bytes(pool: SharedPool) -> np.ndarray:
    """The pool's memory read through its descriptor, not through the tensors."""
    return np.fromfile(pool.path or f"/proc/self/fd/{pool.fd}", dtype=np.uint8)


def _holders(name: str) -> list[str]:
    """This process's descriptors that still name the memfd ``name`` (Python's mmap keeps one of its own)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{name} "):
                out.append(fd)
        except OSError:
            pass
    return out


# -- share_in_place ------------------------------------------------------------------------

def test_share_in_place_keeps_values_views_and_rebinds_the_objects():
    raw = torch.arange(3 * 2 * 5, dtype=torch.float32)
    layers = [raw[i * 10:(i + 1) * 10].view(2, 5) for i in range(3)]  # views of one storage
    other = torch.full((7,), 3, dtype=torch.int16)  # a storage of its own
    holder = {"layer1": layers[1]}  # an attention layer holding the very object
    before = [t.clone() for t in layers] + [other.clone()]
    gap = layers[2].data_ptr() - layers[0].data_ptr()
    pool = share_in_place(layers + [other], name="t-share")
    try:
        assert isinstance(pool, SharedPool) and pool.path is None  # a memfd: no name in /dev/shm
        assert pool.name.startswith("kvxferd-t-share-") and str(pool.fd) in _holders(pool.name)
        for got, want in zip(layers + [other], before):
            assert torch.equal(got, want)
        # still one storage with the same relative offsets, and not the old one any more
        assert len({t.untyped_storage().data_ptr() for t in layers}) == 1
        assert layers[2].data_ptr() - layers[0].data_ptr() == gap
        assert layers[0].untyped_storage().data_ptr() != raw.untyped_storage().data_ptr()
        assert other.untyped_storage().data_ptr() == layers[0].untyped_storage().data_ptr()  # same file
        # a write through the holder's reference lands in the file, and is seen through the views
        holder["layer1"][1, 4] = 123.0
        assert float(layers[1][1, 4]) == 123.0
        assert float(raw[19]) == 19.0  # the old storage is no longer written
        file = _file_bytes(pool)
        offset = holder["layer1"].data_ptr() - layers[0].untyped_storage().data_ptr()
        assert file[offset + 9 * 4:offset + 10 * 4].view(np.float32)[0] == 123.0
        other[6] = -2
        o = other.data_ptr() - other.untyped_storage().data_ptr()
        assert _file_bytes(pool)[o + 12:o + 14].view(np.int16)[0] == -2
        name, fd = pool.name, pool.fd
    finally:
        pool.close()
    assert str(fd) not in _holders(name)  # the pool's descriptor is closed
    pool.close()  # idempotent
    assert pool.path is None and pool.fd is None
    layers[0][0, 0] = 1.0  # the mapping outlives the file name while tensors use it
    assert float(layers[0][0, 0]) == 1.0


def test_share_in_place_refuses_non_cpu_tensors_naming_index_and_device():
    with pytest.raises(RegistrationError) as err:
        share_in_place([torch.zeros(4), torch.empty(4, device="meta")], name="t-meta")
    assert "tensors[1]" in str(err.value) and "meta" in str(err.value) and err.value.field == "tensors"


def test_named_shared_file_is_removed_at_normal_exit_without_close():
    code = ("import torch\nfrom kvxferd.sdk.engine_memory import share_in_place\n"
            "t = torch.ones(1000)\np = share_in_place([t], name='t-exit', shm_dir='/dev/shm')\n"
            "print(p.path, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ})
    assert out.returncode == 0, out.stderr
    path = out.stdout.strip()
    assert path.startswith("/dev/shm/kvxferd-t-exit-")
    assert not os.path.exists(path)


# -- describe_tensors -----------------------------------------------------------------------

def test_describe_refuses_private_memory_naming_the_tensor_and_the_fix():
    with pytest.raises(RegistrationError) as err:
        describe_tensors({(3, "k"): torch.zeros(64)})
    text = str(err.value)
    assert "(layer 3, kind 'k')" in text and "private memory" in text
    assert "kvxferd.sdk.engine_memory.share_in_place(" in text


def test_describe_refuses_non_contiguous_naming_shape_and_stride():
    t = torch.zeros(4, 6)
    with share_in_place([t], name="t-nc"):
        with pytest.raises(RegistrationError) as err:
            describe_tensors({(0, "v"): t.t()})
    assert "[6, 4]" in str(err.value) and "[1, 6]" in str(err.value) and "not contiguous" in str(err.value)


def test_describe_finds_file_and_offset_of_several_tensors_in_one_file():
    raw = torch.zeros(3 * 1000, dtype=torch.uint8)
    parts = {(i, "k"): raw[i * 1000 + 3:i * 1000 + 3 + 500] for i in range(3)}  # odd offsets on purpose
    with share_in_place(list(parts.values()), name="t-desc") as pool:
        for i, t in parts.items():
            t.fill_(10 + i[0])
        descs = describe_tensors(parts)
        file = _file_bytes(pool)
        for d in descs:  # a memfd is named by this process's descriptor of it
            assert d["mem"] == "shm" and d["fd"] == pool.fd and "path" not in d and d["nbytes"] == 500
            assert (file[d["offset"]:d["offset"] + 500] == 10 + d["layer"]).all()
        assert [d["offset"] for d in descs] == [3, 1003, 2003]


def test_describe_names_a_named_file_by_path_and_by_descriptor_once_unlinked():
    t = torch.zeros(2000, dtype=torch.uint8)
    with share_in_place([t], name="t-named", shm_dir="/dev/shm") as pool:
        (d,) = describe_tensors({(0, "k"): t})
        assert d["path"] == pool.path and "fd" not in d
        os.unlink(pool.path)  # no name any more: only a descriptor of this process reaches it
        (d,) = describe_tensors({(0, "k"): t})
        assert "path" not in d and os.readlink(f"/proc/self/fd/{d['fd']}") == pool.path + " (deleted)"


# -- an engine's own tensors through real daemons ------------------------------------------

class Engine:
    """One engine rank holding its KV like SGLang: per layer a K and a V tensor of
    ``[num_pages * page_size, heads, head_dim]``, all views of one plain torch allocation."""

    def __init__(self, s: InstanceSpec, num_pages: int, name: str, tp_rank: int = 0, fill: int = 0) -> None:
        self.geometry = RankGeometry(s, tp_rank, 0, num_pages)
        kinds = s.region_kinds
        n_layers = s.num_layers
        per = num_pages * s.page_size * s.local_heads * s.head_dim
        self.raw = torch.full((n_layers * len(kinds) * per,), 0, dtype=torch.bfloat16)
        self.raw.view(torch.int16).fill_(fill * 257)
        self.kv = {}
        for layer in range(n_layers):
            for k, kind in enumerate(kinds):
                at = (layer * len(kinds) + k) * per
                self.kv[(layer, kind)] = self.raw[at:at + per].view(num_pages * s.page_size, s.local_heads,
                                                                    s.head_dim)
        self.pool = share_in_place(list(self.kv.values()), name=name)

    def rows(self, key: tuple[int, str]) -> torch.Tensor:
        """One row of bytes per token slot."""
        return self.kv[key].view(torch.uint8).reshape(self.kv[key].shape[0], -1)

    def randomize(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for t in self.kv.values():
            b = t.view(torch.uint8)
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))

    def close(self) -> None:
        self.pool.close()


def _slot(pages: list[int], page_size: int, token: int) -> int:
    return pages[token // page_size] * page_size + token % page_size


def _wait(client: EngineClient, rank: str, request_id: str) -> dict:
    return client.wait(rank, request_id, timeout=60)


@pytest.fixture(scope="module")
def nodes(request):
    yield from module_cluster(request, "prefill-node", "decode-node")


def test_described_engine_tensors_register_and_move_byte_exact(nodes):
    pd, dd = nodes.daemons["prefill-node"], nodes.daemons["decode-node"]
    s = spec(num_layers=2, page_size=4, total_kv_heads=2)
    src, dst = Engine(s, 12, "t-reg-p"), Engine(s, 12, "t-reg-d", fill=MARK)
    pc, dc = EngineClient(pd.socket_path), EngineClient(dd.socket_path)
    try:
        src.randomize(1)
        p_rank = pc.register("ep-reg", "prefill", src.geometry, describe_tensors(src.kv))
        d_rank = dc.register("ed-reg", "decode", dst.geometry, describe_tensors(dst.kv))
        n, src_pages, dst_pages = 14, [7, 2, 9, 0], [3, 11, 5, 1]
        dc.expect(d_rank, "r-reg", source_instance="ep-reg", source_address=pd.address, pages=dst_pages,
                  num_tokens=n)
        pc.send(p_rank, "r-reg", pages=src_pages, start=0, end=n, last=True)
        assert _wait(dc, d_rank, "r-reg")["state"] == "done"
        assert _wait(pc, p_rank, "r-reg")["state"] == "done"
        for key in src.kv:
            want, got = src.rows(key), dst.rows(key)
            for t in range(n):
                assert torch.equal(got[_slot(dst_pages, 4, t)], want[_slot(src_pages, 4, t)]), (key, t)
            assert int((got[1 * 4 + (n % 4):1 * 4 + 4] != MARK).sum()) == 0  # tail of the last page
    finally:
        pc.close()
        dc.close()
        src.close()
        dst.close()


@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_expect_start_moves_only_the_suffix(nodes, transport):
    pd = nodes.daemons["prefill-node"]
    dd = pd if transport == "local" else nodes.daemons["decode-node"]
    s = spec(num_layers=2, page_size=4, total_kv_heads=2)
    tag = f"st-{transport}"
    src, dst = Engine(s, 16, f"t-{tag}-p"), Engine(s, 16, f"t-{tag}-d", fill=MARK)
    pc, dc = EngineClient(pd.socket_path), EngineClient(dd.socket_path)
    try:
        src.randomize(2)
        p_rank = pc.register(f"p-{tag}", "prefill", src.geometry, describe_tensors(src.kv))
        d_rank = dc.register(f"d-{tag}", "decode", dst.geometry, describe_tensors(dst.kv))
        n, start = 30, 13
        src_pages = [4, 14, 0, 9, 2, 7, 11, 5]
        dst_pages = [6, 1, 15, 3, 10, 8, 12, 2]
        dc.expect(d_rank, "r-start", source_instance=f"p-{tag}", source_address=None if transport == "local"
                  else pd.address, pages=dst_pages, num_tokens=n, start=start)
        # the prefill engine sends the whole prompt: one chunk before start, one straddling it, the rest
        for a, b, last in ((0, 8, False), (8, 20, False), (20, n, True)):
            pc.send(p_rank, "r-start", pages=src_pages[a // 4:-(-b // 4)], start=a, end=b, last=last)
        done = _wait(dc, d_rank, "r-start")
        assert done["state"] == "done", done
        assert _wait(pc, p_rank, "r-start")["state"] == "done"
        row = s.local_heads * s.head_dim * 2
        assert done["bytes"] == 2 * 2 * (n - start) * row  # layers x kinds x suffix tokens
        for key in src.kv:
            want, got = src.rows(key), dst.rows(key)
            for t in range(n):
                slot = got[_slot(dst_pages, 4, t)]
                if t < start:
                    assert int((slot != MARK).sum()) == 0, (key, t)  # the prefix stays as it was
                else:
                    assert torch.equal(slot, want[_slot(src_pages, 4, t)]), (key, t)
    finally:
        pc.close()
        dc.close()
        src.close()
        dst.close()


def test_expect_start_is_validated(nodes):
    dd = nodes.daemons["decode-node"]
    s = spec(num_layers=1, page_size=4, total_kv_heads=2)
    dst = Engine(s, 4, "t-stval")
    dc = EngineClient(dd.socket_path)
    try:
        d_rank = dc.register("d-stval", "decode", dst.geometry, describe_tensors(dst.kv))
        with pytest.raises(DaemonError) as err:
            dc.expect(d_rank, "r-v1", source_instance="p", pages=[0, 1], num_tokens=6, start=6)
        assert err.value.field == "start" and "start 6" in str(err.value) and "num_tokens 6" in str(err.value)
        with pytest.raises(DaemonError) as err:
            dc.expect(d_rank, "r-v2", source_instance="p", pages=[0, 1], start=8)
        assert err.value.field == "start" and "8 tokens of 2 pages" in str(err.value)
    finally:
        dc.close()
        dst.close()


def _poll_until(client: EngineClient, rank: str, request_id: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.poll(rank, request_id)
        except DaemonError as err:
            if err.code != "request" or time.monotonic() > deadline:
                raise
        time.sleep(0.02)


def test_prefill_poll_says_waiting_for_input_once_the_expect_arrived(nodes):
    """Prefill TP 2 with one KV head (both ranks hold it, rank 0 writes it) to decode TP 1."""
    pd, dd = nodes.daemons["prefill-node"], nodes.daemons["decode-node"]
    ps, ds = spec(num_layers=2, total_kv_heads=1, tp_size=2), spec(num_layers=2, total_kv_heads=1)
    srcs = [Engine(ps, 8, f"t-ready-p{r}", tp_rank=r) for r in range(2)]
    dst = Engine(ds, 8, "t-ready-d", fill=MARK)
    pcs = [EngineClient(pd.socket_path) for _ in srcs]
    dc = EngineClient(dd.socket_path)
    try:
        for e in srcs:
            e.randomize(10)  # replicas of one head hold the same bytes
        p_ranks = [c.register("p-ready", "prefill", e.geometry, describe_tensors(e.kv)) for c, e in zip(pcs, srcs)]
        d_rank = dc.register("d-ready", "decode", dst.geometry, describe_tensors(dst.kv))
        for c, r in zip(pcs, p_ranks):  # no expect yet: unknown (an adapter's Bootstrapping)
            with pytest.raises(DaemonError) as err:
                c.poll(r, "r-ready")
            assert err.value.code == "request" and err.value.field == "request_id"
        n, src_pages, dst_pages = 10, [5, 1, 6], [2, 7, 0]
        dc.expect(d_rank, "r-ready", source_instance="p-ready", source_address=pd.address, pages=dst_pages,
                  num_tokens=n)
        # writer (rank 0) and non-writer (rank 1) alike, before either sent a byte
        assert [_poll_until(c, r, "r-ready")["state"] for c, r in zip(pcs, p_ranks)] == ["waiting_for_input"] * 2
        for c, r in zip(pcs, p_ranks):
            c.send(r, "r-ready", pages=src_pages, start=0, end=n, last=True)
        assert _wait(dc, d_rank, "r-ready")["state"] == "done"
        assert [_wait(c, r, "r-ready")["state"] for c, r in zip(pcs, p_ranks)] == ["done", "done"]
        for key in dst.kv:
            want, got = srcs[0].rows(key), dst.rows(key)
            for t in range(n):
                assert torch.equal(got[_slot(dst_pages, 4, t)], want[_slot(src_pages, 4, t)]), (key, t)
    finally:
        for c in pcs + [dc]:
            c.close()
        for e in srcs + [dst]:
            e.close()


def test_async_client_forwards_start(nodes):
    """AsyncEngineClient.expect carries start: the daemon's start check answers it."""
    import asyncio

    from kvxferd.sdk.client import AsyncEngineClient

    dd = nodes.daemons["decode-node"]
    s = spec(num_layers=1, page_size=4, total_kv_heads=2)
    dst = Engine(s, 4, "t-astart")

    async def main() -> None:
        client = AsyncEngineClient(dd.socket_path)
        try:
            rank = await client.register("d-astart", "decode", dst.geometry, describe_tensors(dst.kv))
            with pytest.raises(DaemonError) as err:
                await client.expect(rank, "r-as1", source_instance="p", pages=[0, 1], num_tokens=5, start=5)
            assert err.value.field == "start" and "start 5" in str(err.value)
            assert await client.expect(rank, "r-as2", source_instance="p-none", pages=[0, 1], num_tokens=5,
                                       start=4) == "bootstrapping"
            assert await client.abort(rank, "r-as2") == "failed"
        finally:
            client.close()

    try:
        asyncio.run(main())
    finally:
        dst.close()

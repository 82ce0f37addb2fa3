"""Real SGLang objects driving the kvxferd backend, in the order SGLang's queues call them.

SGLang cannot run a model here, so its scheduler is not running; every object that touches
KV transfer is SGLang's own: CPU ``MHATokenToKVPool``/``MLATokenToKVPool``,
``MetadataBuffers`` (written by its ``set_buf``), KVArgs filled by the real
``PrefillBootstrapQueue._init_kv_manager`` / ``DecodePreallocQueue._init_kv_manager``
(called on a queue object that holds what those methods read), ``get_kv_class`` through the
plugin, ``kv_to_page_indices``, and SGLang's poll reducers (``poll_and_all_reduce*``, with
the decode side's metadata gate) over a one-process gloo group. The scheduler itself is a namespace with the fields those
methods read (model config, worker's kv dtype string).
"""

from __future__ import annotations

import os
import random
import time
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.decode import DecodePreallocQueue
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
from sglang.srt.disaggregation.utils import KVClassType, MetadataBuffers, TransferBackend, get_kv_class
from sglang.srt.mem_cache.common import kv_to_page_indices
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.runtime_context import get_context, get_parallel

from kvxferd.tools.sim import DaemonProc, free_port

BACKEND = TransferBackend("kvxferd")
POLL_TIMEOUT = 30.0


@dataclass
class Model:
    """The model both sides serve (what SGLang's model config would say)."""

    num_layers: int = 4
    total_kv_heads: int = 4
    head_dim: int = 16
    dtype: torch.dtype = torch.float16
    mla: bool = False
    kv_lora_rank: int = 24
    rope_dim: int = 8
    hidden_size: int = 32

    def model_config(self, give_heads: bool = True) -> Any:
        cfg = types.SimpleNamespace(num_hidden_layers=self.num_layers, hf_text_config=None)
        if give_heads:
            cfg.get_total_num_kv_heads = lambda: self.total_kv_heads
        return cfg


@dataclass
class Rank:
    role: str
    tp_rank: int
    pp_rank: int
    pool: Any
    metadata: MetadataBuffers
    manager: Any
    page_size: int
    free_pages: list[int] = field(default_factory=list)

    def buffers(self) -> dict[tuple[int, str], torch.Tensor]:
        if getattr(self.pool, "kv_buffer", None) is not None:
            return {(self.pool.start_layer + i, "latent"): t for i, t in enumerate(self.pool.kv_buffer)}
        out = {}
        for kind, ts in (("k", self.pool.k_buffer), ("v", self.pool.v_buffer)):
            out.update({(self.pool.start_layer + i, kind): t for i, t in enumerate(ts)})
        return out

    def take_pages(self, n: int, rng: random.Random) -> list[int]:
        got = rng.sample(self.free_pages, n)
        for p in got:
            self.free_pages.remove(p)
        return got


@contextmanager
def published(**server_args: Any) -> Iterator[Any]:
    """SGLang's own test publisher of a ServerArgs into its runtime context."""
    override = get_context().override_server_args(**server_args)
    sa = override.install()
    try:
        yield sa
    finally:
        override.restore()


@contextmanager
def socket_of(daemon: DaemonProc) -> Iterator[None]:
    old = os.environ.get("KVXFERD_ENGINE_SOCKET_PATH")
    os.environ["KVXFERD_ENGINE_SOCKET_PATH"] = daemon.socket_path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("KVXFERD_ENGINE_SOCKET_PATH", None)
        else:
            os.environ["KVXFERD_ENGINE_SOCKET_PATH"] = old


def layer_range(model: Model, pp_rank: int, pp_size: int) -> tuple[int, int]:
    from sglang.srt.distributed.utils import get_pp_indices

    return get_pp_indices(model.num_layers, pp_rank, pp_size)


def make_rank(role: str, daemon: DaemonProc, model: Model, *, tp_rank: int, tp_size: int, pp_rank: int = 0,
              pp_size: int = 1, page_size: int, num_pages: int, port: int, bootstrap_port: int,
              give_heads: bool = True, seed: int = 0, attn_dp: tuple[int, int] | None = None,
              **server_args: Any) -> Rank:
    """One scheduler rank: its pool, metadata buffers and the manager SGLang's queue builds.

    ``attn_dp=(k, n)``: the rank is in attention-DP group ``k`` of ``n`` (SGLang's
    ``attn_dp_size``; ``tp_size`` counts all of the deployment's TP ranks, each DP group has
    ``tp_size // n`` of them); ``Rank.tp_rank`` is then its attention TP rank."""
    start, end = layer_range(model, pp_rank, pp_size)
    attn_tp = tp_size // attn_dp[1] if attn_dp else tp_size
    heads = max(1, model.total_kv_heads // attn_tp)
    size = (num_pages - 1) * page_size  # SGLang allocates size + page_size rows (page 0 padding)
    if model.mla:
        pool = MLATokenToKVPool(size=size, page_size=page_size, dtype=model.dtype, kv_lora_rank=model.kv_lora_rank,
                                qk_rope_head_dim=model.rope_dim, layer_num=end - start, device="cpu",
                                enable_memory_saver=False, start_layer=start, end_layer=end - 1)
    else:
        pool = MHATokenToKVPool(size=size, page_size=page_size, dtype=model.dtype, head_num=heads,
                                head_dim=model.head_dim, layer_num=end - start, device="cpu",
                                enable_memory_saver=False, start_layer=start, end_layer=end - 1)
    gen = torch.Generator().manual_seed(seed)
    bufs = list(pool.kv_buffer) if model.mla else [*pool.k_buffer, *pool.v_buffer]
    for t in bufs:  # what a model computed (prefill) or what the pages held before (decode)
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    metadata = MetadataBuffers(16, hidden_size=model.hidden_size, hidden_states_dtype=torch.float32,
                               max_sampling_mask_tokens=4)
    scheduler = types.SimpleNamespace(
        rust_server=None, enable_hisparse=False, model_config=model.model_config(give_heads),
        tp_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(kv_cache_dtype_str="auto")))
    queue_cls = PrefillBootstrapQueue if role == "prefill" else DecodePreallocQueue
    queue = object.__new__(queue_cls)
    queue.__dict__.update(token_to_kv_pool=pool, draft_token_to_kv_pool=None, is_mla_backend=model.mla,
                          metadata_buffers=metadata, tp_rank=tp_rank, pp_rank=pp_rank, scheduler=scheduler,
                          transfer_backend=BACKEND, enable_staging=False)
    placement: dict[str, Any] = {}
    if attn_dp:  # SGLang's layout: tp_rank = attn_dp_rank * attn_tp_size + attn_tp_rank
        server_args["attn_dp_size"] = attn_dp[1]
        placement = dict(attn_dp_rank=attn_dp[0], attn_tp_rank=tp_rank % attn_tp, attn_cp_rank=0)
    with published(tp_size=tp_size, pp_size=pp_size, disaggregation_mode=role,
                   disaggregation_transfer_backend="kvxferd", host="127.0.0.1", port=port,
                   disaggregation_bootstrap_port=bootstrap_port, **server_args) as sa:
        scheduler.server_args = sa
        with get_parallel().override(tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=0, **placement), socket_of(daemon):
            manager = queue._init_kv_manager()
    return Rank(role, tp_rank % attn_tp, pp_rank, pool, metadata, manager, page_size, list(range(1, num_pages)))


def bootstrap_server(port: int) -> Any:
    """What SGLang's disagg service starts on a prefill node for this backend."""
    return get_kv_class(BACKEND, KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=port)


def wait_poll(obj: Any, wanted: set[int], timeout: float = POLL_TIMEOUT) -> int:
    """Poll like SGLang's queues do (over and over) until a wanted or final state."""
    deadline = time.monotonic() + timeout
    while True:
        p = int(obj.poll())
        if p in wanted or p == KVPoll.Failed:
            return p
        if time.monotonic() > deadline:
            raise AssertionError(f"poll stuck at {p}, wanted {wanted}")
        time.sleep(0.01)


def sglang_wait(pollers: list[Any], group: Any, *, decode_metadata: Any = None, aux_index: int = 3,
                wanted: int = KVPoll.Success, timeout: float = POLL_TIMEOUT) -> list[int]:
    """Poll through SGLang's own reducers until every poller is final: the prefill inflight
    queue's poll_and_all_reduce_attn_cp_tp_group, or the decode transfer queue's
    poll_and_all_reduce with its metadata gate (Success only once the row's room landed)."""
    from sglang.srt.disaggregation.utils import poll_and_all_reduce, poll_and_all_reduce_attn_cp_tp_group

    deadline = time.monotonic() + timeout
    while True:
        if decode_metadata is None:
            polls = poll_and_all_reduce_attn_cp_tp_group(pollers, group, group)
        else:
            reqs = [types.SimpleNamespace(req=types.SimpleNamespace(bootstrap_host="127.0.0.1"),
                                          metadata_buffer_index=aux_index) for _ in pollers]
            polls = poll_and_all_reduce(pollers, group, decode_reqs=reqs, metadata_buffers=decode_metadata)
        if all(p in (wanted, KVPoll.Failed) for p in polls):
            return [int(p) for p in polls]
        if time.monotonic() > deadline:
            raise AssertionError(f"polls stuck at {polls}")
        time.sleep(0.01)


def slots_of(pages: list[int], n_tokens: int, page_size: int) -> torch.Tensor:
    """req_to_token row of a request: token t lives in slot pages[t // ps] * ps + t % ps."""
    t = torch.arange(n_tokens)
    return torch.tensor(pages, dtype=torch.int64)[t // page_size] * page_size + t % page_size


@dataclass
class Request:
    room: int
    n_tokens: int
    prefix: int = 0  # decode_prefix_len: tokens decode already holds
    first_token: int = 7


def set_metadata_row(rank: Rank, index: int, req: Request) -> None:
    """The prefill scheduler's MetadataBuffers.set_buf for the request's first output token."""
    fake_req = types.SimpleNamespace(
        metadata_buffer_index=index, output_ids=[req.first_token], cached_tokens=req.prefix,
        cached_tokens_device=req.prefix, cached_tokens_host=0, cached_tokens_storage=0,
        get_mm_token_counts=lambda: (0, 0, 0), return_logprob=False, return_sampling_mask=False,
        hidden_states_tensor=None, bootstrap_room=req.room)
    rank.metadata.set_buf(fake_req)


def run_decode_until_metadata(decoders: list[Rank], bootstrap_addr: str, req: Request, rng: random.Random,
                              aux_index: int = 3) -> list[tuple[Any, torch.Tensor]]:
    """DecodePreallocQueue + transfer queue side, up to send_metadata. Returns (receiver, slots) per rank."""
    out = []
    for d in decoders:
        recv = get_kv_class(BACKEND, KVClassType.RECEIVER)(mgr=d.manager, bootstrap_addr=bootstrap_addr,
                                                          bootstrap_room=req.room)
        assert recv.poll() == KVPoll.Bootstrapping
        assert d.manager.try_ensure_parallel_info(bootstrap_addr)
        assert d.manager.prefill_info_table[bootstrap_addr].dp_size == 1
        recv.init(0)
        assert recv.poll() == KVPoll.WaitingForInput
        pages = d.take_pages(-(-req.n_tokens // d.page_size), rng)
        slots = slots_of(pages, req.n_tokens, d.page_size)
        d.metadata.clear_slot(aux_index)
        page_indices = kv_to_page_indices(slots[req.prefix:], d.page_size).astype(np.int32)
        recv.send_metadata(page_indices, aux_index, [], decode_prefix_len=req.prefix)
        out.append((recv, slots))
    return out


def new_senders(prefillers: list[Rank], bootstrap_addr: str, req: Request) -> list[Any]:
    senders = []
    for p in prefillers:
        s = get_kv_class(BACKEND, KVClassType.SENDER)(mgr=p.manager, bootstrap_addr=bootstrap_addr,
                                                      bootstrap_room=req.room, req_has_disagg_prefill_dp_rank=False)
        senders.append(s)
    return senders


def run_prefill(prefillers: list[Rank], senders: list[Any], req: Request, rng: random.Random,
                chunk_ends: list[int] | None = None, aux_index: int = 5) -> list[torch.Tensor]:
    """PrefillBootstrapQueue.pop_bootstrapped + send_kv_chunk, per rank: poll to WaitingForInput,
    init, then one send per chunk (SGLang keeps a partial last page for the next chunk)."""
    slots_per_rank = []
    for p, s in zip(prefillers, senders):
        assert wait_poll(s, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
        pages = p.take_pages(-(-req.n_tokens // p.page_size), rng)
        slots = slots_of(pages, req.n_tokens, p.page_size)
        s.init(-(-req.n_tokens // p.page_size), aux_index)  # pop_decode_prefix_len() is 0: whole prompt
        slots_per_rank.append(slots)
    ends = list(chunk_ends or []) + [req.n_tokens]
    for p, s, slots in zip(prefillers, senders, slots_per_rank):
        start = 0
        for i, e in enumerate(ends):
            last = i == len(ends) - 1
            end = e if last else e - e % p.page_size
            if end < start:
                continue
            if last:
                set_metadata_row(p, aux_index, req)
            page_indices = kv_to_page_indices(slots[start:end], p.page_size)
            if s.should_send_kv_chunk(len(page_indices), last):
                s.send(page_indices, [] if last else None, num_kv_tokens=end - start)
            start = end
    return slots_per_rank


def expected_decode(decoder: Rank, before: dict[tuple[int, str], torch.Tensor], dslots: torch.Tensor,
                    prefillers: list[Rank], pslots: list[torch.Tensor], req: Request, model: Model,
                    tp_p: int, tp_d: int) -> dict[tuple[int, str], torch.Tensor]:
    """The oracle: decode buffers as they must be, computed head by head from the prefill pools."""
    expect = {k: v.clone() for k, v in before.items()}
    tokens = torch.arange(req.prefix, req.n_tokens)
    for (layer, kind), buf in expect.items():
        if model.mla:
            src = next(p for p in prefillers if (layer, kind) in p.buffers())
            i = prefillers.index(src)
            buf[dslots[tokens]] = src.buffers()[(layer, kind)][pslots[i][tokens]]
            continue
        hd = max(1, model.total_kv_heads // tp_d)
        hp = max(1, model.total_kv_heads // tp_p)
        for local in range(hd):
            h = (decoder.tp_rank * hd + local) % model.total_kv_heads
            src_tp = h // hp
            i, src = next((i, p) for i, p in enumerate(prefillers)
                          if p.tp_rank == src_tp and (layer, kind) in p.buffers())
            buf[dslots[tokens], local] = src.buffers()[(layer, kind)][pslots[i][tokens], h - src_tp * hp]
    return expect


def assert_bytes_equal(got: dict[tuple[int, str], torch.Tensor], want: dict[tuple[int, str], torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in got:
        g, w = got[key].view(torch.uint8), want[key].view(torch.uint8)
        if not torch.equal(g, w):
            rows = (g != w).reshape(g.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
            raise AssertionError(f"region {key}: {len(rows)} rows differ, first {rows[:8]}")


def close_all(*ranks: Rank) -> None:
    for r in ranks:
        r.manager.close()


__all__ = ["sglang_wait", "BACKEND", "Model", "Rank", "Request", "make_rank", "bootstrap_server", "wait_poll", "free_port",
           "run_decode_until_metadata", "new_senders", "run_prefill", "expected_decode", "assert_bytes_equal",
           "close_all", "KVPoll"]

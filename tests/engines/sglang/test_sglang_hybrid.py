"""Models whose cache is more than uniform KV, through the SGLang backend, against real daemons.

- hybrid linear attention: SGLang's CPU ``MambaPool`` (conv and temporal state; GDN conv
  shard groups q|k|v, and Kimi Linear's ``[K - 1, channels]`` conv split on its second
  axis) inside a ``HybridLinearKVPool`` whose full-attention layers are an
  ``MHATokenToKVPool``; the state payload is what SGLang's ``_mamba_payload`` builds
  (``[array(slot)]`` aligned with ``state_types``);
- speculative decoding: a target ``MHATokenToKVPool`` with a draft pool beside it;
- sliding-window layers: SGLang's ``SWAKVPool``, the decode side through its real
  ``_send_kv_metadata`` (the plugin's hook hands the receiver the prompt's length).

KVArgs are filled by the real ``_init_kv_manager`` of both queues (``state_types``,
``state_dim_per_tensor``, ``state_conv_shard_groups``, ``num_draft_entries``, ... from
SGLang's own code). Every KV region is checked against the head-by-head oracle of
``harness.expected_decode`` (for SWA layers over the window's tokens only), every state
slot against the state rebuilt from the prefill ranks' slices, byte for byte, with every
other row and slot untouched.

The transfers run over each transport (``transport_util``): tcp on the conftest's daemons,
and NIXL on the same two daemons accepting NIXL alone. Their metrics must count, sent and
received, exactly what the oracle says lands on that transport, every cache group summed
(the full-attention rows, the window's rows of the SWA layers, the draft rows, the state
slot), and nothing on the other. The refusals run on tcp only.
"""

from __future__ import annotations

import random
import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from sglang.srt.configs.mamba_utils import (KimiLinearCacheParams, KimiLinearStateShape, Mamba2CacheParams,
                                            Mamba2StateDType, Mamba2StateShape)
from sglang.srt.disaggregation.decode import DecodePreallocQueue
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
from sglang.srt.disaggregation.utils import KVClassType, MetadataBuffers, get_kv_class
from sglang.srt.mem_cache.common import kv_to_page_indices
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool, MHATokenToKVPool
from sglang.srt.runtime_context import get_parallel

from harness import (BACKEND, KVPoll, Model, Rank, Request, assert_bytes_equal, bootstrap_server, close_all,
                     expected_decode, free_port, new_senders, published, run_decode_until_metadata, run_prefill,
                     set_metadata_row, sglang_wait, slots_of, socket_of, wait_poll)
from kvxferd.adapters.sglang.state import mamba_groups
from kvxferd.errors import RegistrationError
from kvxferd.sdk.client import EngineClient
from transport_util import Carried, daemons, transport  # noqa: F401 - fixtures

FULL_LAYERS = [1, 3]  # Qwen3-Next-like: full attention every other layer, linear attention between
MAMBA_LAYERS = [0, 2, 4]
MODEL = Model(num_layers=5, total_kv_heads=2, head_dim=16)
HEADS, HEAD_DIM, STATE = 4, 8, 8
MAMBA_SLOTS = 6  # MambaPool(size=6): 7 slots, slot 0 included


@dataclass(frozen=True)
class Variant:
    """A linear-attention family as SGLang's own state-shape factory builds it."""

    name: str
    conv_axis: int  # the per-slot axis TP splits in the conv state
    shard_groups: tuple[int, ...]  # the full q|k|v (or x|B|C) parts of that axis

    def cache_params(self, tp: int):
        dtype = Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32)
        if self.name == "gdn":  # Qwen3-Next-like Gated DeltaNet: conv [channels, K - 1]
            shape = Mamba2StateShape.create(tp_world_size=tp, intermediate_size=32, n_groups=2, num_heads=HEADS,
                                            head_dim=HEAD_DIM, state_size=STATE, conv_kernel=4,
                                            conv_shard_groups=list(self.shard_groups))
            assert shape.conv_dim == sum(self.shard_groups)
            return Mamba2CacheParams(shape=shape, layers=MAMBA_LAYERS, dtype=dtype)
        # Kimi Linear: conv [K - 1, channels], split on its second axis
        shape = KimiLinearStateShape.create(tp_world_size=tp, num_heads=HEADS, head_dim=HEAD_DIM, num_k_heads=2,
                                            head_k_dim=HEAD_DIM, conv_kernel_size=4)
        assert tuple(shape.conv_shard_groups) == self.shard_groups and shape.conv_slice_axis == self.conv_axis
        return KimiLinearCacheParams(shape=shape, layers=MAMBA_LAYERS, dtype=dtype)


GDN = Variant("gdn", 0, (16, 16, 32))
KIMI = Variant("kimi", 1, (HEADS * HEAD_DIM, 2 * HEAD_DIM, 2 * HEAD_DIM))


def mamba_pool(tp: int, variant: Variant = GDN) -> MambaPool:
    return MambaPool(size=MAMBA_SLOTS, spec_state_size=MAMBA_SLOTS, cache_params=variant.cache_params(tp),
                     mamba_layer_ids=MAMBA_LAYERS, device="cpu")


def make_hybrid_rank(role: str, daemon, *, tp_rank: int, tp_size: int, page_size: int, num_pages: int, port: int,
                     bootstrap_port: int, seed: int, variant: Variant = GDN, draft=None) -> Rank:
    """A scheduler rank of the hybrid model: the pools SGLang builds for it, and the manager its queue builds."""
    mp = mamba_pool(tp_size, variant)
    pool = HybridLinearKVPool(size=(num_pages - 1) * page_size, dtype=MODEL.dtype, page_size=page_size,
                              head_num=MODEL.total_kv_heads // tp_size, head_dim=MODEL.head_dim,
                              full_attention_layer_ids=FULL_LAYERS, device="cpu", mamba_pool=mp)
    model_config = MODEL.model_config()
    model_config.hf_text_config = types.SimpleNamespace(full_attention_layer_ids=FULL_LAYERS)
    fill([*mp.mamba_cache.conv, mp.mamba_cache.temporal], seed + 1)
    rank = queue_rank(role, daemon, pool, pool.full_kv_pool, model_config=model_config, tp_rank=tp_rank,
                      tp_size=tp_size, port=port, bootstrap_port=bootstrap_port, page_size=page_size,
                      num_pages=num_pages, seed=seed, draft=draft)
    rank.mamba = mp  # type: ignore[attr-defined]
    return rank


def fill(tensors: list[torch.Tensor], seed: int) -> None:
    """What a model computed (prefill) or what the memory held before (decode): random bytes."""
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def queue_rank(role: str, daemon, pool, full, *, model_config, tp_rank: int, tp_size: int, port: int,
               bootstrap_port: int, page_size: int, num_pages: int, seed: int, draft=None,
               sliding_window: int | None = None) -> Rank:
    """The manager SGLang's queue builds for ``pool`` (and a draft pool), KVArgs by its real ``_init_kv_manager``."""
    fill([*full.k_buffer, *full.v_buffer], seed)
    if draft is not None:
        fill([*draft.k_buffer, *draft.v_buffer], seed + 2)
    metadata = MetadataBuffers(16, hidden_size=MODEL.hidden_size, hidden_states_dtype=torch.float32,
                               max_sampling_mask_tokens=4)
    scheduler = types.SimpleNamespace(
        rust_server=None, enable_hisparse=False, model_config=model_config, sliding_window_size=sliding_window,
        tp_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(kv_cache_dtype_str="auto")))
    queue_cls = PrefillBootstrapQueue if role == "prefill" else DecodePreallocQueue
    queue = object.__new__(queue_cls)
    queue.__dict__.update(token_to_kv_pool=pool, draft_token_to_kv_pool=draft, is_mla_backend=False,
                          metadata_buffers=metadata, tp_rank=tp_rank, pp_rank=0, scheduler=scheduler,
                          transfer_backend=BACKEND, enable_staging=False)
    with published(tp_size=tp_size, pp_size=1, disaggregation_mode=role, disaggregation_transfer_backend="kvxferd",
                   host="127.0.0.1", port=port, disaggregation_bootstrap_port=bootstrap_port) as sa:
        scheduler.server_args = sa
        with get_parallel().override(tp_rank=tp_rank, pp_rank=0, dp_rank=0), socket_of(daemon):
            manager = queue._init_kv_manager()
    rank = Rank(role, tp_rank, 0, full, metadata, manager, page_size, list(range(1, num_pages)))
    rank.queue = queue  # type: ignore[attr-defined]
    return rank


def states(rank: Rank) -> list[torch.Tensor]:
    """The rank's state entries ([slots, ...] per state tensor and Mamba layer), SGLang's order."""
    return [t for _, t, _, _ in rank.mamba._iter_transfer_state_entries()]


def conv_entry(entry: int) -> bool:
    """KVArgs' state entries are tensor-major: the conv tensor over the Mamba layers, then the temporal one."""
    return entry < len(MAMBA_LAYERS)


def full_state(prefill: list[Rank], entry: int, slot: int, variant: Variant) -> torch.Tensor:
    """One slot of one state entry as the unsplit model holds it, rebuilt from the TP ranks' slices."""
    tp = len(prefill)
    pieces = [states(p)[entry][slot] for p in sorted(prefill, key=lambda r: r.tp_rank)]
    if not conv_entry(entry):
        return torch.cat(pieces)  # temporal: heads
    axis, out, off = variant.conv_axis, [], 0
    for part in variant.shard_groups:  # conv: each part split by TP on its own
        n = part // tp
        out += [piece.narrow(axis, off, n) for piece in pieces]
        off += n
    return torch.cat(out, dim=axis)


def local_state(full: torch.Tensor, entry: int, tp_rank: int, tp: int, variant: Variant) -> torch.Tensor:
    if not conv_entry(entry):
        n = full.shape[0] // tp
        return full[tp_rank * n:(tp_rank + 1) * n]
    axis, out, off = variant.conv_axis, [], 0
    for part in variant.shard_groups:
        n = part // tp
        out.append(full.narrow(axis, off + tp_rank * n, n))
        off += part
    return torch.cat(out, dim=axis)


def row_bytes(ranks: list[Rank]) -> int:
    """One token's row in every KV buffer of ``ranks`` (all their layers and heads): what each
    token that lands in them moves."""
    return sum(buf[0].nbytes for r in ranks for buf in r.buffers().values())


def slot_bytes(ranks: list[Rank], slot: int) -> int:
    """One slot of every state entry of ``ranks`` (their TP slices of conv and temporal state)."""
    return sum(t[slot].nbytes for r in ranks for t in states(r))


def carried(daemons) -> Carried:
    return Carried([daemons.daemons["pd"]], [daemons.daemons["dd"]])


def mamba_payload(slot: int) -> list:
    """SGLang's state_indices for state_types [MAMBA]: _mamba_payload's [array(slot)] (0-d, from a tensor)."""
    return [[torch.tensor(slot).cpu().numpy()]]


@pytest.mark.parametrize("variant,tp_p,tp_d", [(GDN, 2, 1), (GDN, 1, 2), (GDN, 1, 1), (KIMI, 2, 1)],
                         ids=["gdn_tp2to1", "gdn_tp1to2", "gdn_tp1to1", "kimi_tp2to1"])
def test_hybrid_mamba_state_and_full_attention(daemons, transport, gloo, variant, tp_p, tp_d):
    bport = free_port()
    server = bootstrap_server(bport)
    addr = f"127.0.0.1:{bport}"
    prefill = [make_hybrid_rank("prefill", daemons.daemons["pd"], tp_rank=t, tp_size=tp_p, page_size=4, num_pages=16,
                                port=free_port(), bootstrap_port=bport, seed=700 + t, variant=variant)
               for t in range(tp_p)]
    dport = free_port()
    decode = [make_hybrid_rank("decode", daemons.daemons["dd"], tp_rank=t, tp_size=tp_d, page_size=4, num_pages=16,
                               port=dport, bootstrap_port=bport, seed=750 + t, variant=variant) for t in range(tp_d)]
    try:
        spec = prefill[0].manager.geometry.spec
        assert [g.name for g in spec.groups] == ["mamba_0", "mamba_1"]
        conv = spec.groups[0]
        assert conv.split_parts == variant.shard_groups and conv.num_layers == len(MAMBA_LAYERS)
        assert conv.split_dim == variant.conv_axis  # Kimi: (K - 1 rows, channels, 1)
        assert spec.num_layers == len(FULL_LAYERS)
        req = Request(room=9100 + 100 * (variant is KIMI) + 10 * tp_p + tp_d, n_tokens=23)
        rng = random.Random(tp_p * 10 + tp_d)
        p_slot, d_slot = 3, 5
        before = [{k: v.clone() for k, v in d.buffers().items()} for d in decode]
        state_before = [[t.clone() for t in states(d)] for d in decode]
        wire = carried(daemons)
        senders = new_senders(prefill, addr, req)
        receivers = []
        for d in decode:
            recv = get_kv_class(BACKEND, KVClassType.RECEIVER)(mgr=d.manager, bootstrap_addr=addr,
                                                              bootstrap_room=req.room)
            recv.init(0)
            pages = d.take_pages(-(-req.n_tokens // d.page_size), rng)
            dslots = slots_of(pages, req.n_tokens, d.page_size)
            d.metadata.clear_slot(3)
            recv.send_metadata(kv_to_page_indices(dslots, d.page_size).astype(np.int32), 3, mamba_payload(d_slot),
                               decode_prefix_len=0)
            assert recv.failure is None, recv.failure
            receivers.append((recv, dslots))
        pslots = []
        for p, s in zip(prefill, senders):
            assert wait_poll(s, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
            pages = p.take_pages(-(-req.n_tokens // p.page_size), rng)
            slots = slots_of(pages, req.n_tokens, p.page_size)
            s.init(len(pages), 5)
            pslots.append(slots)
            # two chunks like SGLang's chunked prefill: the state travels with the last one only
            s.send(kv_to_page_indices(slots[:12], p.page_size), None, num_kv_tokens=12)
            set_metadata_row(p, 5, req)
            s.send(kv_to_page_indices(slots[12:], p.page_size), mamba_payload(p_slot), num_kv_tokens=req.n_tokens - 12)
            assert s.failure is None, s.failure
        assert sglang_wait(senders, gloo) == [KVPoll.Success] * len(senders), [s.failure for s in senders]
        for (recv, dslots), d, old, old_state in zip(receivers, decode, before, state_before):
            assert sglang_wait([recv], gloo, decode_metadata=d.metadata) == [KVPoll.Success], recv.failure
            want = expected_decode(d, old, dslots, prefill, pslots, req, MODEL, tp_p, tp_d)
            assert_bytes_equal(d.buffers(), want)
            assert int(d.metadata.output_ids[3, 0]) == req.first_token
            for entry, (got, was) in enumerate(zip(states(d), old_state)):
                expect = was.clone()
                expect[d_slot] = local_state(full_state(prefill, entry, p_slot, variant), entry, d.tp_rank, tp_d,
                                             variant)
                assert not torch.equal(expect.view(torch.uint8), was.view(torch.uint8)), "the oracle expects no change"
                assert torch.equal(got.view(torch.uint8), expect.view(torch.uint8)), f"state entry {entry} differs"
        # every token's full-attention rows, and the state slot: each decode rank its own slice
        wire.assert_only(transport, req.n_tokens * row_bytes(decode) + slot_bytes(decode, d_slot))
    finally:
        close_all(*prefill, *decode)
        server.close()


def test_state_fields_that_cannot_map_are_refused_naming_the_field():
    """What sglang's setup_state_kv_args would never fill, refused with the KVArgs field."""
    base = dict(item_lens=[240], data_lens=[240 * 7], dims=[40], outer_counts=[1], layer_ids=[0], itemsizes=[2],
                dtypes=["bfloat16"])
    with pytest.raises(RegistrationError) as err:  # parts that do not add up to local channels x TP
        mamba_groups(**base, shard_groups=[[64, 8, 4]], tp_size=2)
    assert err.value.field == "state_conv_shard_groups"
    with pytest.raises(RegistrationError) as err:  # a slot that is not rows x channels x inner
        mamba_groups(**{**base, "dims": [7]}, shard_groups=[None], tp_size=2)
    assert err.value.field == "state_dim_per_tensor"
    with pytest.raises(RegistrationError) as err:
        mamba_groups(**{**base, "data_lens": [1000]}, shard_groups=[None], tp_size=2)
    assert err.value.field == "state_data_lens"
    [t] = mamba_groups(**base, shard_groups=[[64, 8, 8]], tp_size=2)
    assert (t.group.shape, t.group.split_dim, t.group.split_parts, t.slots) == ((80, 3), 0, (64, 8, 8), 7)


# -- speculative decoding: a draft model's KV beside the target's ------------------------------

TARGET = Model(num_layers=3, total_kv_heads=2, head_dim=16)
DRAFT = Model(num_layers=1, total_kv_heads=4, head_dim=32, dtype=torch.bfloat16)  # EAGLE-like: one layer


def draft_rank(role: str, daemon, *, tp_rank: int, tp_size: int, port: int, bootstrap_port: int,
               seed: int) -> tuple[Rank, Rank]:
    """(target rank, the same rank seen through its draft pool) with SGLang's own pools."""
    page_size, num_pages = 4, 16
    size = (num_pages - 1) * page_size
    target = MHATokenToKVPool(size=size, page_size=page_size, dtype=TARGET.dtype,
                              head_num=TARGET.total_kv_heads // tp_size, head_dim=TARGET.head_dim,
                              layer_num=TARGET.num_layers, device="cpu", enable_memory_saver=False, start_layer=0,
                              end_layer=TARGET.num_layers - 1)
    draft = MHATokenToKVPool(size=size, page_size=page_size, dtype=DRAFT.dtype,
                             head_num=DRAFT.total_kv_heads // tp_size, head_dim=DRAFT.head_dim, layer_num=1,
                             device="cpu", enable_memory_saver=False)
    rank = queue_rank(role, daemon, target, target, model_config=TARGET.model_config(), tp_rank=tp_rank,
                      tp_size=tp_size, port=port, bootstrap_port=bootstrap_port, page_size=page_size,
                      num_pages=num_pages, seed=seed, draft=draft)
    return rank, Rank(role, tp_rank, 0, draft, rank.metadata, rank.manager, page_size)


@pytest.mark.parametrize("tp_p,tp_d,prefix", [(2, 1, 8), (1, 2, 0)], ids=["tp2to1_prefix", "tp1to2"])
def test_draft_model_kv_moves_with_the_target(daemons, transport, gloo, tp_p, tp_d, prefix):
    """KVArgs lists the draft pool's buffers after the target's (num_draft_entries): both
    move over the target's pages, the draft by its own heads and head_dim, byte-exact; with
    a decode prefix only the suffix of either lands."""
    bport = free_port()
    server = bootstrap_server(bport)
    addr = f"127.0.0.1:{bport}"
    pairs_p = [draft_rank("prefill", daemons.daemons["pd"], tp_rank=t, tp_size=tp_p, port=free_port(),
                          bootstrap_port=bport, seed=800 + t) for t in range(tp_p)]
    dport = free_port()
    pairs_d = [draft_rank("decode", daemons.daemons["dd"], tp_rank=t, tp_size=tp_d, port=dport,
                          bootstrap_port=bport, seed=850 + t) for t in range(tp_d)]
    prefill, pdraft = [p for p, _ in pairs_p], [d for _, d in pairs_p]
    decode, ddraft = [p for p, _ in pairs_d], [d for _, d in pairs_d]
    try:
        assert prefill[0].manager.kv_args.num_draft_entries == 2
        [group] = prefill[0].manager.geometry.spec.groups
        assert (group.kind, group.num_layers, group.total_kv_heads, group.head_dim) == ("draft", 1, 4, 32)
        req = Request(room=9300 + 10 * tp_p + tp_d, n_tokens=26, prefix=prefix)
        rng = random.Random(tp_p + 7 * tp_d)
        before = [{k: v.clone() for k, v in d.buffers().items()} for d in decode]
        dbefore = [{k: v.clone() for k, v in d.buffers().items()} for d in ddraft]
        wire = carried(daemons)
        senders = new_senders(prefill, addr, req)
        receivers = run_decode_until_metadata(decode, addr, req, rng)
        pslots = run_prefill(prefill, senders, req, rng, chunk_ends=[13])
        assert sglang_wait(senders, gloo) == [KVPoll.Success] * len(senders), [s.failure for s in senders]
        for (recv, dslots), d, dd, old, dold in zip(receivers, decode, ddraft, before, dbefore):
            assert sglang_wait([recv], gloo, decode_metadata=d.metadata) == [KVPoll.Success], recv.failure
            assert_bytes_equal(d.buffers(), expected_decode(d, old, dslots, prefill, pslots, req, TARGET, tp_p, tp_d))
            want = expected_decode(dd, dold, dslots, pdraft, pslots, req, DRAFT, tp_p, tp_d)
            assert any(not torch.equal(want[k], dold[k]) for k in want), "the oracle expects no change"
            assert_bytes_equal(dd.buffers(), want)
        # the tokens past the prefix, in the target's rows and the draft's
        wire.assert_only(transport, (req.n_tokens - prefix) * (row_bytes(decode) + row_bytes(ddraft)))
    finally:
        close_all(*prefill, *decode)
        server.close()


def test_draft_pool_whose_heads_cannot_be_told_is_refused(cluster):
    """One draft KV head per rank over TP 2 may be a replicated head: refused at start, naming the field."""
    bport = free_port()
    server = bootstrap_server(bport)
    try:
        size = 15 * 4
        target = MHATokenToKVPool(size=size, page_size=4, dtype=TARGET.dtype, head_num=1, head_dim=16, layer_num=2,
                                  device="cpu", enable_memory_saver=False, start_layer=0, end_layer=1)
        draft = MHATokenToKVPool(size=size, page_size=4, dtype=TARGET.dtype, head_num=1, head_dim=16, layer_num=1,
                                 device="cpu", enable_memory_saver=False)
        with pytest.raises(RegistrationError) as err:
            queue_rank("prefill", cluster.daemons["pd"], target, target, model_config=Model(
                num_layers=2, total_kv_heads=2).model_config(), tp_rank=0, tp_size=2, port=free_port(),
                bootstrap_port=bport, page_size=4, num_pages=16, seed=1, draft=draft)
        assert err.value.field == "draft_token_to_kv_pool.head_num"
    finally:
        server.close()


W = 8  # the sliding window, in tokens
SWA_MODEL = Model(num_layers=4, total_kv_heads=2, head_dim=16)


def swa_rank(role: str, daemon, *, tp_rank: int, tp_size: int, port: int, bootstrap_port: int, seed: int,
             window: int | None = W) -> tuple[Rank, Rank]:
    """(full-attention view, sliding-window view) of a gpt-oss-like rank: SGLang's SWAKVPool, SWA and full
    layers alternating."""
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    pool = SWAKVPool(size=60, size_swa=60, page_size=4, dtype=SWA_MODEL.dtype,
                     head_num=SWA_MODEL.total_kv_heads // tp_size, head_dim=SWA_MODEL.head_dim,
                     swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1, 3], device="cpu",
                     enable_memory_saver=False)
    fill([*pool.swa_kv_pool.k_buffer, *pool.swa_kv_pool.v_buffer], seed + 3)
    rank = queue_rank(role, daemon, pool, pool.full_kv_pool, model_config=SWA_MODEL.model_config(), tp_rank=tp_rank,
                      tp_size=tp_size, port=port, bootstrap_port=bootstrap_port, page_size=4, num_pages=16, seed=seed,
                      sliding_window=window)
    swa = Rank(role, tp_rank, 0, pool.swa_kv_pool, rank.metadata, rank.manager, 4, list(range(1, 16)))
    return rank, swa


def window_start(n: int, prefix: int, page_size: int) -> int:
    """SGLang's _swa_payload: max(prefix, n - window), rounded down to a page."""
    return max(prefix, n - W) // page_size * page_size


@pytest.mark.parametrize("tp_p,tp_d,prefix", [(2, 1, 0), (1, 2, 16)], ids=["tp2to1", "tp1to2_prefix"])
def test_sliding_window_layers_move_only_the_window(daemons, transport, gloo, tp_p, tp_d, prefix):
    """A prompt of 23 tokens, window 8, chunked at 12: the full layers move [prefix, 23), the
    SWA layers only [max(prefix, 15), 23) into the SWA pages SGLang names for the window;
    every other byte of both pools (the window's first page before its first token included)
    stays as it was. The decode side goes through SGLang's real _send_kv_metadata (the
    plugin's hook hands the receiver the prompt's length)."""
    bport = free_port()
    server = bootstrap_server(bport)
    addr = f"127.0.0.1:{bport}"
    pairs_p = [swa_rank("prefill", daemons.daemons["pd"], tp_rank=t, tp_size=tp_p, port=free_port(),
                        bootstrap_port=bport, seed=900 + t) for t in range(tp_p)]
    dport = free_port()
    pairs_d = [swa_rank("decode", daemons.daemons["dd"], tp_rank=t, tp_size=tp_d, port=dport, bootstrap_port=bport,
                        seed=950 + t) for t in range(tp_d)]
    prefill, pswa = [a for a, _ in pairs_p], [b for _, b in pairs_p]
    decode, dswa = [a for a, _ in pairs_d], [b for _, b in pairs_d]
    try:
        group = prefill[0].manager.geometry.spec.group("swa")
        assert (group.kind, group.window, group.num_layers, group.total_kv_heads) == ("window", W, 2, 2)
        n, ps = 23, 4
        req = Request(room=9500 + 10 * tp_p + tp_d, n_tokens=n, prefix=prefix)
        rng = random.Random(tp_p * 3 + tp_d)
        ws = window_start(n, prefix, ps)
        num_pages = -(-n // ps)
        before = [{k: v.clone() for k, v in d.buffers().items()} for d in decode]
        sbefore = [{k: v.clone() for k, v in d.buffers().items()} for d in dswa]
        wire = carried(daemons)
        senders = new_senders(prefill, addr, req)
        receivers = swa_receivers(decode, dswa, addr, req, ps, prefix, rng)
        pslots, pswa_slots = [], []
        for p, sw, s in zip(prefill, pswa, senders):
            assert wait_poll(s, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
            slots = slots_of(p.take_pages(num_pages, rng), n, ps)
            swa_table = [0] * (ws // ps) + sw.take_pages(num_pages - ws // ps, rng)
            s.init(num_pages, 5)
            s.send(kv_to_page_indices(slots[:12], ps), None, num_kv_tokens=12)
            set_metadata_row(p, 5, req)
            s.send(kv_to_page_indices(slots[12:], ps), [kv_to_page_indices(slots_of(swa_table, n, ps)[ws:], ps)],
                   num_kv_tokens=n - 12)
            assert s.failure is None, s.failure
            pslots.append(slots)
            pswa_slots.append(slots_of(swa_table, n, ps))
        assert sglang_wait(senders, gloo) == [KVPoll.Success] * len(senders), [s.failure for s in senders]
        in_window = Request(room=req.room, n_tokens=n, prefix=max(prefix, n - W))
        for (recv, dslots, dswa_slots, aux), d, sw, old, sold in zip(receivers, decode, dswa, before, sbefore):
            assert sglang_wait([recv], gloo, decode_metadata=d.metadata, aux_index=aux) == [KVPoll.Success], \
                recv.failure
            want = expected_decode(d, old, dslots, prefill, pslots, req, SWA_MODEL, tp_p, tp_d)
            assert_bytes_equal(d.buffers(), want)
            want = expected_decode(sw, sold, dswa_slots, pswa, pswa_slots, in_window, SWA_MODEL, tp_p, tp_d)
            assert any(not torch.equal(want[k], sold[k]) for k in want), "the oracle expects no change"
            assert_bytes_equal(sw.buffers(), want)
        # the full layers' rows of [prefix, n), the SWA layers' of the window's tokens only
        wire.assert_only(transport, (n - prefix) * row_bytes(decode) + (n - in_window.prefix) * row_bytes(dswa))
    finally:
        close_all(*prefill, *decode)
        server.close()


def test_sliding_window_without_its_size_is_refused_naming_the_field(cluster):
    """An SWA pool whose scheduler gives no sliding_window_size: which pages move cannot be
    told; refused when the manager starts, naming the field, and no rank stays registered."""
    bport = free_port()
    server = bootstrap_server(bport)
    try:
        with pytest.raises(RegistrationError) as err:
            swa_rank("prefill", cluster.daemons["pd"], tp_rank=0, tp_size=1, port=free_port(), bootstrap_port=bport,
                     seed=1, window=None)
        assert err.value.field == "sliding_window_size"
        with EngineClient(cluster.daemons["pd"].socket_path) as client:
            ranks = client.status()["ranks"]
        assert not [r for r in ranks if r["instance"].endswith(f"-{bport}")], ranks
    finally:
        server.close()


def test_window_receiver_without_the_prompt_length_fails_naming_it(cluster):
    """send_metadata called without the plugin's _send_kv_metadata hook: the receiver of an
    SWA instance cannot tell the window, so the request fails at once naming num_tokens
    (no expect with a guessed length reaches the daemon)."""
    bport = free_port()
    server = bootstrap_server(bport)
    addr = f"127.0.0.1:{bport}"
    prefill, _ = swa_rank("prefill", cluster.daemons["pd"], tp_rank=0, tp_size=1, port=free_port(),
                          bootstrap_port=bport, seed=3)
    decode, _ = swa_rank("decode", cluster.daemons["dd"], tp_rank=0, tp_size=1, port=free_port(),
                         bootstrap_port=bport, seed=4)
    try:
        recv = get_kv_class(BACKEND, KVClassType.RECEIVER)(mgr=decode.manager, bootstrap_addr=addr, bootstrap_room=9601)
        recv.init(0)
        recv.send_metadata(np.array([1, 2, 3], dtype=np.int32), 3, [np.array([4, 5], dtype=np.int32)],
                           decode_prefix_len=0)
        assert recv.poll() == KVPoll.Failed
        assert recv.failure[0] == "registration" and "num_tokens" in recv.failure[1], recv.failure
        assert decode.manager.state(recv.request_id) is None  # the daemon never heard of it
    finally:
        close_all(prefill, decode)
        server.close()


def test_hybrid_model_with_a_draft_model(daemons, transport, gloo):
    """Qwen3-Next with MTP-like: Mamba state, full attention and a draft model's KV in one
    instance, TP 2->1; all three byte-exact."""
    bport = free_port()
    server = bootstrap_server(bport)
    addr = f"127.0.0.1:{bport}"
    size = 15 * 4

    def draft_pool(tp: int) -> MHATokenToKVPool:
        return MHATokenToKVPool(size=size, page_size=4, dtype=DRAFT.dtype, head_num=DRAFT.total_kv_heads // tp,
                                head_dim=DRAFT.head_dim, layer_num=1, device="cpu", enable_memory_saver=False)

    prefill = [make_hybrid_rank("prefill", daemons.daemons["pd"], tp_rank=t, tp_size=2, page_size=4, num_pages=16,
                                port=free_port(), bootstrap_port=bport, seed=1100 + t, draft=draft_pool(2))
               for t in range(2)]
    decode = [make_hybrid_rank("decode", daemons.daemons["dd"], tp_rank=0, tp_size=1, page_size=4, num_pages=16,
                               port=free_port(), bootstrap_port=bport, seed=1150, draft=draft_pool(1))]
    pdraft = [Rank("prefill", p.tp_rank, 0, p.queue.draft_token_to_kv_pool, p.metadata, p.manager, 4) for p in prefill]
    ddraft = [Rank("decode", 0, 0, decode[0].queue.draft_token_to_kv_pool, decode[0].metadata, decode[0].manager, 4)]
    try:
        assert [g.name for g in prefill[0].manager.geometry.spec.groups] == ["draft", "mamba_0", "mamba_1"]
        req = Request(room=9700, n_tokens=21)
        rng = random.Random(11)
        p_slot, d_slot = 2, 4
        d = decode[0]
        before = {k: v.clone() for k, v in d.buffers().items()}
        dbefore = {k: v.clone() for k, v in ddraft[0].buffers().items()}
        state_before = [t.clone() for t in states(d)]
        wire = carried(daemons)
        senders = new_senders(prefill, addr, req)
        recv = get_kv_class(BACKEND, KVClassType.RECEIVER)(mgr=d.manager, bootstrap_addr=addr, bootstrap_room=req.room)
        recv.init(0)
        dslots = slots_of(d.take_pages(-(-req.n_tokens // 4), rng), req.n_tokens, 4)
        d.metadata.clear_slot(3)
        recv.send_metadata(kv_to_page_indices(dslots, 4).astype(np.int32), 3, mamba_payload(d_slot),
                           decode_prefix_len=0)
        pslots = []
        for p, s in zip(prefill, senders):
            assert wait_poll(s, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
            slots = slots_of(p.take_pages(-(-req.n_tokens // 4), rng), req.n_tokens, 4)
            s.init(-(-req.n_tokens // 4), 5)
            s.send(kv_to_page_indices(slots[:8], 4), None, num_kv_tokens=8)
            set_metadata_row(p, 5, req)
            s.send(kv_to_page_indices(slots[8:], 4), mamba_payload(p_slot), num_kv_tokens=req.n_tokens - 8)
            assert s.failure is None, s.failure
            pslots.append(slots)
        assert sglang_wait(senders, gloo) == [KVPoll.Success] * 2, [s.failure for s in senders]
        assert sglang_wait([recv], gloo, decode_metadata=d.metadata) == [KVPoll.Success], recv.failure
        assert_bytes_equal(d.buffers(), expected_decode(d, before, dslots, prefill, pslots, req, MODEL, 2, 1))
        want = expected_decode(ddraft[0], dbefore, dslots, pdraft, pslots, req, DRAFT, 2, 1)
        assert any(not torch.equal(want[k], dbefore[k]) for k in want), "the oracle expects no change"
        assert_bytes_equal(ddraft[0].buffers(), want)
        for entry, (got, was) in enumerate(zip(states(d), state_before)):
            expect = was.clone()
            expect[d_slot] = local_state(full_state(prefill, entry, p_slot, GDN), entry, 0, 1, GDN)
            assert torch.equal(got.view(torch.uint8), expect.view(torch.uint8)), f"state entry {entry} differs"
        # all three groups: the target's full-attention rows, the draft's rows, the state slot
        wire.assert_only(transport, req.n_tokens * (row_bytes(decode) + row_bytes(ddraft)) + slot_bytes(decode, d_slot))
    finally:
        close_all(*prefill, *decode)
        server.close()


def swa_receivers(decode, dswa, addr: str, req, ps: int, prefix: int, rng: random.Random) -> list:
    """One SGLang receiver per decode rank of an SWA model, its metadata sent through SGLang's own
    ``_send_kv_metadata`` (hooked by the plugin): full pages from token 0, SWA pages from the
    window's first page on. Returns (receiver, full slots, SWA slots, metadata index) per rank."""
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator

    n = req.n_tokens
    ws = window_start(n, prefix, ps)
    num_pages = -(-n // ps)
    receivers = []
    for d, sw in zip(decode, dswa):
        recv = get_kv_class(BACKEND, KVClassType.RECEIVER)(mgr=d.manager, bootstrap_addr=addr,
                                                          bootstrap_room=req.room)
        recv.init(0)
        dslots = slots_of(d.take_pages(num_pages, rng), n, ps)
        swa_table = [0] * (ws // ps) + sw.take_pages(num_pages - ws // ps, rng)
        queue = d.queue
        queue.__dict__.update(req_to_metadata_buffer_idx_allocator=ReqToMetadataIdxAllocator(16),
                              transfer_queue=types.SimpleNamespace(enable_staging=False),
                              _num_published_destinations=0)
        decode_req = types.SimpleNamespace(
            kv_receiver=recv, is_rebootstrap=False, metadata_buffer_index=None,
            req=types.SimpleNamespace(origin_input_ids=list(range(n)), output_ids=[], bootstrap_room=req.room,
                                      time_stats=types.SimpleNamespace(
                                          set_decode_transfer_queue_entry_time=lambda: None)))
        swa_payload = kv_to_page_indices(slots_of(swa_table, n, ps)[ws:], ps)
        queue._send_kv_metadata(decode_req, dslots[prefix:], ps, [swa_payload], decode_prefix_len=prefix)
        assert recv.prompt_len == n and recv.failure is None, recv.failure
        receivers.append((recv, dslots, slots_of(swa_table, n, ps), decode_req.metadata_buffer_index))
    return receivers

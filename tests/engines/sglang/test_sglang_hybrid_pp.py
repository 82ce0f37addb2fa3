"""Hybrid models over PP stages through the SGLang backend, against real daemons.

Each PP stage is built the way sglang 0.5.23's pool configurator builds it: the model
config lists every layer of each kind (``hf_text_config.full_attention_layer_ids`` and
``mamba2_cache_params.layers`` for a linear-attention hybrid, ``ModelConfig``'s
``swa_attention_layer_ids`` / ``full_attention_layer_ids`` for sliding-window layers), the
stage's pools hold those of them inside its ``get_pp_indices`` range (a
``HybridLinearKVPool`` with ``start_layer``, its ``MambaPool`` with the stage's
``mamba_layer_ids``; an ``SWAKVPool`` with the stage's layer ids), and KVArgs come from the
real ``_init_kv_manager``. The oracle knows nothing of kvxferd's numbering: it pairs
prefill and decode buffers by *model* layer id, rebuilds every moved head and state slice
from the prefill stage and TP rank that hold it, and compares byte for byte, with every
other row and slot untouched.

The transfers run over each transport (``transport_util``): tcp on the conftest's daemons,
and NIXL on the same two daemons accepting NIXL alone. Their metrics must count, sent and
received, exactly the bytes the oracle says landed, summed over the cache groups and the
decode stages (full-attention rows, the window's SWA rows, each stage's state slot), on that
transport alone. The refusals run on tcp only.
"""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch

from sglang.srt.disaggregation.decode import DecodePreallocQueue
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
from sglang.srt.disaggregation.utils import KVClassType, MetadataBuffers, get_kv_class
from sglang.srt.distributed.utils import get_pp_indices
from sglang.srt.mem_cache.common import kv_to_page_indices
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool, MHATokenToKVPool
from sglang.srt.runtime_context import get_parallel

from harness import (BACKEND, KVPoll, Rank, Request, assert_bytes_equal, bootstrap_server, close_all,
                     expected_decode, free_port, new_senders, published, set_metadata_row, sglang_wait, slots_of,
                     socket_of, wait_poll)
from test_sglang_hybrid import (DRAFT, FULL_LAYERS, GDN, MAMBA_LAYERS, MAMBA_SLOTS, MODEL, SWA_MODEL, TARGET, W,
                                carried, fill, mamba_payload, row_bytes, swa_receivers, window_start)
from transport_util import daemons, transport  # noqa: F401 - fixtures
from kvxferd.adapters.sglang.stages import own_splits
from kvxferd.errors import RegistrationError
from kvxferd.sdk.client import EngineClient

SWA_LAYERS, SWA_FULL = [0, 2], [1, 3]  # gpt-oss-like: SWA and full layers alternating (SWA_MODEL, 4 layers)
PS, PAGES = 4, 16


def stage_rank(role: str, daemon, pool, full, *, model_config, tp_rank: int, tp_size: int,
               pp_rank: int, pp_size: int, port: int, bootstrap_port: int, seed: int, full_offset: int,
               draft=None, sliding_window: int | None = None) -> Rank:
    """One scheduler rank of one PP stage: KVArgs by the real ``_init_kv_manager`` of its queue.

    The returned rank's ``buffers()`` name the full-attention layers by their place among
    the model's full layers (``full_offset`` is the stage's first), for the oracle.
    """
    fill([*full.k_buffer, *full.v_buffer], seed)
    if draft is not None:
        fill([*draft.k_buffer, *draft.v_buffer], seed + 2)
    metadata = MetadataBuffers(16, hidden_size=MODEL.hidden_size, hidden_states_dtype=torch.float32,
                               max_sampling_mask_tokens=4)
    scheduler = types.SimpleNamespace(
        rust_server=None, enable_hisparse=False, model_config=model_config, sliding_window_size=sliding_window,
        tp_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(kv_cache_dtype_str="auto")))
    queue = object.__new__(PrefillBootstrapQueue if role == "prefill" else DecodePreallocQueue)
    queue.__dict__.update(token_to_kv_pool=pool, draft_token_to_kv_pool=draft, is_mla_backend=False,
                          metadata_buffers=metadata, tp_rank=tp_rank, pp_rank=pp_rank, scheduler=scheduler,
                          transfer_backend=BACKEND, enable_staging=False)
    with published(tp_size=tp_size, pp_size=pp_size, disaggregation_mode=role,
                   disaggregation_transfer_backend="kvxferd", host="127.0.0.1", port=port,
                   disaggregation_bootstrap_port=bootstrap_port) as sa:
        scheduler.server_args = sa
        with get_parallel().override(tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=0), socket_of(daemon):
            manager = queue._init_kv_manager()
    view = types.SimpleNamespace(start_layer=full_offset, k_buffer=full.k_buffer, v_buffer=full.v_buffer)
    rank = Rank(role, tp_rank, pp_rank, view, metadata, manager, PS, list(range(1, PAGES)))
    rank.queue = queue  # type: ignore[attr-defined]
    return rank


# -- linear-attention hybrid (Qwen3-Next-like): full layers [1, 3], Mamba layers [0, 2, 4] ----------

def mamba_stage(role: str, daemon, *, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, port: int,
                bootstrap_port: int, seed: int) -> Rank:
    start, end = get_pp_indices(MODEL.num_layers, pp_rank, pp_size)
    full_ids = [i for i in FULL_LAYERS if start <= i < end]
    params = GDN.cache_params(tp_size)  # the model's: every Mamba layer
    mp = MambaPool(size=MAMBA_SLOTS, spec_state_size=MAMBA_SLOTS, cache_params=params,
                   mamba_layer_ids=[i for i in MAMBA_LAYERS if start <= i < end], device="cpu")
    pool = HybridLinearKVPool(size=(PAGES - 1) * PS, dtype=MODEL.dtype, page_size=PS,
                              head_num=MODEL.total_kv_heads // tp_size, head_dim=MODEL.head_dim,
                              full_attention_layer_ids=full_ids, device="cpu", mamba_pool=mp, start_layer=start)
    model_config = MODEL.model_config()
    model_config.hf_text_config = types.SimpleNamespace(full_attention_layer_ids=FULL_LAYERS,
                                                        mamba2_cache_params=params)
    fill([*mp.mamba_cache.conv, mp.mamba_cache.temporal], seed + 1)
    rank = stage_rank(role, daemon, pool, pool.full_kv_pool, model_config=model_config, tp_rank=tp_rank,
                      tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, port=port, bootstrap_port=bootstrap_port,
                      seed=seed,
                      full_offset=sum(1 for i in FULL_LAYERS if i < start))
    rank.mamba = mp  # type: ignore[attr-defined]
    return rank


def state_entries(rank: Rank) -> dict[tuple[str, int], torch.Tensor]:
    """The rank's state entries by (state tensor, model layer): SGLang's own listing."""
    return {(name, layer): t for name, t, _, layer in rank.mamba._iter_transfer_state_entries()}


def model_state(prefill: list[Rank], key: tuple[str, int], slot: int) -> torch.Tensor:
    """One slot of one state tensor at one model layer, unsplit, from the TP ranks of the stage holding it."""
    pieces = [state_entries(p)[key][slot] for p in sorted(prefill, key=lambda r: r.tp_rank)
              if key in state_entries(p)]
    if key[0] != "conv":
        return torch.cat(pieces)  # temporal: heads
    out, off, tp = [], 0, len(pieces)
    for part in GDN.shard_groups:  # conv: each of q|k|v split by TP on its own
        out += [piece.narrow(GDN.conv_axis, off, part // tp) for piece in pieces]
        off += part // tp
    return torch.cat(out, dim=GDN.conv_axis)


def rank_slice(full: torch.Tensor, name: str, tp_rank: int, tp: int) -> torch.Tensor:
    if name != "conv":
        n = full.shape[0] // tp
        return full[tp_rank * n:(tp_rank + 1) * n]
    out, off = [], 0
    for part in GDN.shard_groups:
        n = part // tp
        out.append(full.narrow(GDN.conv_axis, off + tp_rank * n, n))
        off += part
    return torch.cat(out, dim=GDN.conv_axis)


EVEN = ((0, 1), (1, 3))  # Mamba layers 0 | 2, 4 by SGLang's default partition of 5 layers: [0, 2) | [2, 5)


@pytest.mark.parametrize("pp_p,tp_p,pp_d,tp_d,partition,p_mamba", [
    (2, 1, 1, 2, None, EVEN), (1, 2, 2, 1, None, None), (2, 1, 2, 1, "3,2", ((0, 2), (2, 3)))],
    ids=["pp2tp1-to-pp1tp2", "pp1tp2-to-pp2tp1", "pp2-partition-3,2-to-pp2"])
def test_hybrid_mamba_across_pp_stages(daemons, transport, gloo, monkeypatch, pp_p, tp_p, pp_d, tp_d, partition, p_mamba):
    """5 layers over PP 2 by SGLang's partition: stage 0 [0, 2) holds full layer 1 and Mamba
    layer 0, stage 1 [2, 5) full layer 3 and Mamba layers 2 and 4 (an uneven Mamba split);
    with SGLANG_PP_LAYER_PARTITION 3,2 on the prefill deployment its stages hold [0, 3)
    (full 1, Mamba 0, 2) and [3, 5) (full 3, Mamba 4), so the two sides split the Mamba
    groups differently. Each stage sends and receives its own layers with its own state
    slot; the TP changes with the PP."""
    bport = free_port()
    server = bootstrap_server(bport)
    addr = f"127.0.0.1:{bport}"
    if partition:  # the prefill deployment's environment only
        monkeypatch.setenv("SGLANG_PP_LAYER_PARTITION", partition)
    prefill = [mamba_stage("prefill", daemons.daemons["pd"], tp_rank=t, tp_size=tp_p, pp_rank=p, pp_size=pp_p,
                           port=free_port(), bootstrap_port=bport, seed=2000 + 10 * p + t)
               for p in range(pp_p) for t in range(tp_p)]
    monkeypatch.delenv("SGLANG_PP_LAYER_PARTITION", raising=False)
    dport = free_port()
    decode = [mamba_stage("decode", daemons.daemons["dd"], tp_rank=t, tp_size=tp_d, pp_rank=p, pp_size=pp_d,
                          port=dport, bootstrap_port=bport, seed=2050 + 10 * p + t)
              for p in range(pp_d) for t in range(tp_d)]
    try:
        for ranks, mamba in ((prefill, p_mamba), (decode, EVEN if pp_d == 2 else None)):
            if mamba is None:
                continue
            staged = ranks[-1].manager.geometry.spec
            assert (staged.num_layers, staged.splits) == (2, ((0, 1), (1, 2)))  # full layers 1 | 3
            for name in ("mamba_0", "mamba_1"):
                assert (staged.group(name).num_layers, staged.group(name).layer_splits) == (3, mamba)
        req = Request(room=9800 + 10 * pp_p + pp_d + 100 * bool(partition), n_tokens=23)
        rng = random.Random(pp_p * 10 + pp_d)
        def p_slot(r: Rank) -> int:  # every stage its own slot
            return 3 + r.pp_rank

        def d_slot(r: Rank) -> int:
            return 5 - 2 * r.pp_rank

        before = [{k: v.clone() for k, v in d.buffers().items()} for d in decode]
        state_before = [{k: v.clone() for k, v in state_entries(d).items()} for d in decode]
        wire = carried(daemons)
        senders = new_senders(prefill, addr, req)
        receivers = []
        for d in decode:
            recv = get_kv_class(BACKEND, KVClassType.RECEIVER)(mgr=d.manager, bootstrap_addr=addr,
                                                              bootstrap_room=req.room)
            recv.init(0)
            dslots = slots_of(d.take_pages(-(-req.n_tokens // PS), rng), req.n_tokens, PS)
            d.metadata.clear_slot(3)
            recv.send_metadata(kv_to_page_indices(dslots, PS).astype(np.int32), 3, mamba_payload(d_slot(d)),
                               decode_prefix_len=0)
            assert recv.failure is None, recv.failure
            receivers.append((recv, dslots))
        pslots = []
        for p, s in zip(prefill, senders):
            assert wait_poll(s, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
            slots = slots_of(p.take_pages(-(-req.n_tokens // PS), rng), req.n_tokens, PS)
            s.init(-(-req.n_tokens // PS), 5)
            pslots.append(slots)
            s.send(kv_to_page_indices(slots[:12], PS), None, num_kv_tokens=12)
            set_metadata_row(p, 5, req)
            s.send(kv_to_page_indices(slots[12:], PS), mamba_payload(p_slot(p)), num_kv_tokens=req.n_tokens - 12)
            assert s.failure is None, s.failure
        assert sglang_wait(senders, gloo) == [KVPoll.Success] * len(senders), [s.failure for s in senders]
        for (recv, dslots), d, old, old_state in zip(receivers, decode, before, state_before):
            assert sglang_wait([recv], gloo, decode_metadata=d.metadata) == [KVPoll.Success], recv.failure
            assert_bytes_equal(d.buffers(), expected_decode(d, old, dslots, prefill, pslots, req, MODEL, tp_p, tp_d))
            assert int(d.metadata.output_ids[3, 0]) == req.first_token
            got = state_entries(d)
            assert sorted({layer for _, layer in got}) == [i for i in MAMBA_LAYERS if i in
                                                           range(*get_pp_indices(MODEL.num_layers, d.pp_rank, pp_d))]
            for (name, layer), was in old_state.items():
                holders = [p for p in prefill if (name, layer) in state_entries(p)]
                expect = was.clone()
                expect[d_slot(d)] = rank_slice(model_state(holders, (name, layer), p_slot(holders[0])), name,
                                               d.tp_rank, tp_d)
                assert not torch.equal(expect.view(torch.uint8), was.view(torch.uint8)), "the oracle expects no change"
                assert torch.equal(got[(name, layer)].view(torch.uint8), expect.view(torch.uint8)), \
                    f"state {name} of model layer {layer} differs"
        # every token's full-attention rows on every decode stage, and each stage's state slot of its layers
        state = sum(t[d_slot(d)].nbytes for d in decode for t in state_entries(d).values())
        wire.assert_only(transport, req.n_tokens * row_bytes(decode) + state)
    finally:
        close_all(*prefill, *decode)
        server.close()


def test_a_stage_without_full_attention_layers_is_refused(cluster, monkeypatch):
    """SGLANG_PP_LAYER_PARTITION 3,1,1 leaves PP stage 2 (model layer 4) without a full-attention
    layer: SGLang runs it, kvxferd builds no group a stage lacks. Refused when the manager
    starts (stage 0 already), naming pp_size, and no rank stays registered."""
    monkeypatch.setenv("SGLANG_PP_LAYER_PARTITION", "3,1,1")
    bport = free_port()
    server = bootstrap_server(bport)
    try:
        with pytest.raises(RegistrationError) as err:
            mamba_stage("prefill", cluster.daemons["pd"], tp_rank=0, tp_size=1, pp_rank=0, pp_size=3,
                        port=free_port(), bootstrap_port=bport, seed=1)
        assert err.value.field == "pp_size" and "PP stage 2" in str(err.value), err.value
        assert "SGLANG_PP_LAYER_PARTITION" in err.value.fix
        with EngineClient(cluster.daemons["pd"].socket_path) as client:
            ranks = client.status()["ranks"]
        assert not [r for r in ranks if r["instance"].endswith(f"-{bport}")], ranks
    finally:
        server.close()


def test_stage_layers_that_disagree_with_the_model_config_are_refused():
    """The pure rule: a pool holding other layers than the model config gives the stage, or
    a config without the list, is refused naming the field at fault."""
    ranges = ((0, 2), (2, 5))
    assert own_splits("Mamba", [0, 2, 4], "layers", ranges, 1, [2, 4], "state_layer_ids") == ((0, 1), (1, 3))
    with pytest.raises(RegistrationError) as err:
        own_splits("Mamba", [0, 2, 4], "layers", ranges, 1, [4], "state_layer_ids")
    assert err.value.field == "state_layer_ids"
    with pytest.raises(RegistrationError) as err:
        own_splits("Mamba", None, "hf_text_config.mamba2_cache_params.layers", ranges, 0, [0], "state_layer_ids")
    assert err.value.field == "hf_text_config.mamba2_cache_params.layers"
    with pytest.raises(RegistrationError) as err:
        own_splits("full-attention", [1, 3], "ids", ((0, 2), (2, 3), (3, 5)), 0, [1], "mapping")
    assert err.value.field == "pp_size" and "PP stage 1" in str(err.value)


# -- sliding-window layers (gpt-oss-like): SWA layers [0, 2], full layers [1, 3] ------------------

def swa_stage(role: str, daemon, *, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, port: int,
              bootstrap_port: int, seed: int) -> tuple[Rank, Rank]:
    """(full-attention view, sliding-window view) of one stage's SWAKVPool, as layer_setup filters the lists."""
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    start, end = get_pp_indices(SWA_MODEL.num_layers, pp_rank, pp_size)
    swa_ids = [i for i in SWA_LAYERS if start <= i < end]
    pool = SWAKVPool(size=(PAGES - 1) * PS, size_swa=(PAGES - 1) * PS, page_size=PS, dtype=SWA_MODEL.dtype,
                     head_num=SWA_MODEL.total_kv_heads // tp_size, head_dim=SWA_MODEL.head_dim,
                     swa_attention_layer_ids=swa_ids,
                     full_attention_layer_ids=[i for i in SWA_FULL if start <= i < end],
                     device="cpu", enable_memory_saver=False)
    fill([*pool.swa_kv_pool.k_buffer, *pool.swa_kv_pool.v_buffer], seed + 3)
    model_config = SWA_MODEL.model_config()
    model_config.swa_attention_layer_ids, model_config.full_attention_layer_ids = SWA_LAYERS, SWA_FULL
    rank = stage_rank(role, daemon, pool, pool.full_kv_pool, model_config=model_config, tp_rank=tp_rank,
                      tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, port=port, bootstrap_port=bootstrap_port,
                      seed=seed,
                      full_offset=sum(1 for i in SWA_FULL if i < start), sliding_window=W)
    inner = pool.swa_kv_pool
    view = types.SimpleNamespace(start_layer=sum(1 for i in SWA_LAYERS if i < start), k_buffer=inner.k_buffer,
                                 v_buffer=inner.v_buffer)
    return rank, Rank(role, tp_rank, pp_rank, view, rank.metadata, rank.manager, PS, list(range(1, PAGES)))


@pytest.mark.parametrize("pp_p,tp_p,pp_d,tp_d", [(2, 1, 1, 2), (1, 2, 2, 1)], ids=["pp2tp1-to-pp1tp2",
                                                                                 "pp1tp2-to-pp2tp1"])
def test_sliding_window_layers_across_pp_stages(daemons, transport, gloo, pp_p, tp_p, pp_d, tp_d):
    """PP 2 (stage 0: SWA layer 0, full layer 1; stage 1: SWA layer 2, full layer 3) on one
    side, PP 1 on the other, the TP changing with it; a prompt of 23 tokens, window 8: the
    full layers move all 23, the SWA layers only the window's tokens, stage by stage."""
    bport = free_port()
    server = bootstrap_server(bport)
    addr = f"127.0.0.1:{bport}"
    pairs_p = [swa_stage("prefill", daemons.daemons["pd"], tp_rank=t, tp_size=tp_p, pp_rank=p, pp_size=pp_p,
                         port=free_port(), bootstrap_port=bport, seed=2100 + 10 * p + t)
               for p in range(pp_p) for t in range(tp_p)]
    dport = free_port()
    pairs_d = [swa_stage("decode", daemons.daemons["dd"], tp_rank=t, tp_size=tp_d, pp_rank=p, pp_size=pp_d,
                         port=dport, bootstrap_port=bport, seed=2150 + 10 * p + t)
               for p in range(pp_d) for t in range(tp_d)]
    prefill, pswa = [a for a, _ in pairs_p], [b for _, b in pairs_p]
    decode, dswa = [a for a, _ in pairs_d], [b for _, b in pairs_d]
    try:
        staged = (prefill if pp_p == 2 else decode)[-1].manager.geometry.spec
        assert staged.splits == ((0, 1), (1, 2))  # full layers 1 | 3
        group = staged.group("swa")
        assert (group.num_layers, group.layer_splits, group.window) == (2, ((0, 1), (1, 2)), W)  # SWA 0 | 2
        n, prefix = 23, 0
        req = Request(room=9900 + 10 * pp_p + pp_d, n_tokens=n)
        rng = random.Random(5)
        ws = window_start(n, prefix, PS)
        num_pages = -(-n // PS)
        before = [{k: v.clone() for k, v in d.buffers().items()} for d in decode]
        sbefore = [{k: v.clone() for k, v in d.buffers().items()} for d in dswa]
        wire = carried(daemons)
        senders = new_senders(prefill, addr, req)
        receivers = swa_receivers(decode, dswa, addr, req, PS, prefix, rng)
        pslots, pswa_slots = [], []
        for p, sw, s in zip(prefill, pswa, senders):
            assert wait_poll(s, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
            slots = slots_of(p.take_pages(num_pages, rng), n, PS)
            swa_table = [0] * (ws // PS) + sw.take_pages(num_pages - ws // PS, rng)
            s.init(num_pages, 5)
            s.send(kv_to_page_indices(slots[:12], PS), None, num_kv_tokens=12)
            set_metadata_row(p, 5, req)
            s.send(kv_to_page_indices(slots[12:], PS), [kv_to_page_indices(slots_of(swa_table, n, PS)[ws:], PS)],
                   num_kv_tokens=n - 12)
            assert s.failure is None, s.failure
            pslots.append(slots)
            pswa_slots.append(slots_of(swa_table, n, PS))
        assert sglang_wait(senders, gloo) == [KVPoll.Success] * len(senders), [s.failure for s in senders]
        in_window = Request(room=req.room, n_tokens=n, prefix=max(prefix, n - W))
        for (recv, dslots, dswa_slots, aux), d, sw, old, sold in zip(receivers, decode, dswa, before, sbefore):
            assert sglang_wait([recv], gloo, decode_metadata=d.metadata, aux_index=aux) == [KVPoll.Success], \
                recv.failure
            assert_bytes_equal(d.buffers(), expected_decode(d, old, dslots, prefill, pslots, req, SWA_MODEL, tp_p,
                                                            tp_d))
            want = expected_decode(sw, sold, dswa_slots, pswa, pswa_slots, in_window, SWA_MODEL, tp_p, tp_d)
            assert any(not torch.equal(want[k], sold[k]) for k in want), "the oracle expects no change"
            assert_bytes_equal(sw.buffers(), want)
        # the full layers' rows of all n tokens, the SWA layers' of the window's tokens only, every stage
        wire.assert_only(transport, n * row_bytes(decode) + (n - in_window.prefix) * row_bytes(dswa))
    finally:
        close_all(*prefill, *decode)
        server.close()


# -- speculative decoding: SGLang holds the draft model on the last PP stage only --------------------

def test_draft_model_kv_with_pp_is_refused_naming_the_reason(cluster):
    """The last PP stage registers a draft pool beside its target layers (SGLang's
    EAGLEWorkerV2 runs the draft there only; the other stages have none): refused when its
    manager starts, naming pp_size and the fix, and no rank stays registered."""
    bport = free_port()
    server = bootstrap_server(bport)
    try:
        start, end = get_pp_indices(TARGET.num_layers, 1, 2)
        target = MHATokenToKVPool(size=(PAGES - 1) * PS, page_size=PS, dtype=TARGET.dtype, head_num=2, head_dim=16,
                                  layer_num=end - start, device="cpu", enable_memory_saver=False, start_layer=start,
                                  end_layer=end - 1)
        draft = MHATokenToKVPool(size=(PAGES - 1) * PS, page_size=PS, dtype=DRAFT.dtype, head_num=DRAFT.total_kv_heads,
                                 head_dim=DRAFT.head_dim, layer_num=1, device="cpu", enable_memory_saver=False)
        with pytest.raises(RegistrationError) as err:
            stage_rank("prefill", cluster.daemons["pd"], target, target, model_config=TARGET.model_config(),
                       tp_rank=0, tp_size=1, pp_rank=1, pp_size=2, port=free_port(),
                       bootstrap_port=bport, seed=1, full_offset=start, draft=draft)
        assert err.value.field == "pp_size" and "last PP stage" in str(err.value), err.value
        assert "pp_size 1" in err.value.fix
        with EngineClient(cluster.daemons["pd"].socket_path) as client:
            ranks = client.status()["ranks"]
        assert not [r for r in ranks if r["instance"].endswith(f"-{bport}")], ranks
    finally:
        server.close()

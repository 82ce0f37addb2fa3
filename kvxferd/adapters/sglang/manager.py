"""The per-rank manager SGLang builds for ``--disaggregation-transfer-backend kvxferd``.

One :class:`KvxferdKVManager` per scheduler rank maps the rank's KV pool (and its cache
groups: draft KV, Mamba state, sliding-window layers) onto kvxferd regions, registers them
in place with the local daemon (SGLang's pool was moved into shared memory on CPU, CUDA
tensors go by IPC handle), and, on the prefill side, files the rank with the bootstrap
server. The per-request classes in :mod:`.conn` go through it to the daemon.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from sglang.srt.disaggregation.base.conn import BaseKVManager, KVArgs

from ...errors import ConfigError, KvxferError, RegistrationError
from ...model.geometry import RankGeometry
from ...model.groups import Group, qualified_kind
from ...ops.config import default_socket_path
from ...sdk.client import DaemonError, EngineClient
from ...sdk.engine_memory import describe_tensors
from . import topology
from .bootstrap import get_route, put_route, reachable_address, split_host_port
from .draft import DRAFT_GROUP, draft_group
from .layout import RankFacts, aux_row_spans, build_geometry
from .pool import (CURRENT_POOL, PoolContext, composite_layer_ids, dtype_name, full_pool, pool_buffers, pool_facts,
                   pool_region_tensors, state_tensors, swa_pool)
from .stages import Splits, own_splits, unique_in_order
from .state import StateTensor, mamba_groups, state_slot
from .window import WINDOW_GROUP, window_group, window_table

log = logging.getLogger("kvxferd.sglang")

MAPPED_STATES = ("mamba", "swa")  # SGLang state components the backend maps onto cache groups

SOCKET_ENV = "KVXFERD_ENGINE_SOCKET_PATH"  # the same variable `kvxferd serve` reads
CALL_TIMEOUT_ENV = "KVXFERD_SGLANG_CALL_TIMEOUT_S"  # a scheduler must not hang on a dead local daemon
INSTANCE_ENV = "KVXFERD_SGLANG_INSTANCE"
BOOTSTRAP_HOST_ENV = "KVXFERD_SGLANG_BOOTSTRAP_HOST"
BOOTSTRAP_WAIT_ENV = "KVXFERD_SGLANG_BOOTSTRAP_WAIT_S"
RENDEZVOUS_ENV = "KVXFERD_SGLANG_RENDEZVOUS"
#: requests whose SGLang priority reaches this value (or, under --schedule-low-priority-values-first,
#: does not exceed it) ask their daemon for the latency transfer class, others bulk; unset: they ask
#: none and take their instance's class from the daemon's qos.instances
LATENCY_PRIORITY_ENV = "KVXFERD_SGLANG_LATENCY_PRIORITY"
FOLLOW_ROOM = "follow_bootstrap_room"


@dataclass(frozen=True)
class PrefillInfo:
    """One prefill deployment as the decode scheduler sees it (``prefill_info_table`` values)."""

    instance: str
    daemon_address: str
    dp_size: int = 1
    follow_bootstrap_room: bool = True


class KvxferdKVManager(BaseKVManager):
    """One scheduler rank's registration with its local kvxferd daemon."""

    enable_deferred_decode_kv_release = False  # kvxferd tells a failure only once no byte is in flight
    supports_host_destination = False

    def __init__(self, args: KVArgs, disaggregation_mode: Any, server_args: Any,
                 is_mla_backend: Optional[bool] = False) -> None:
        self.kv_args = args
        self.server_args = server_args
        self.mode = getattr(disaggregation_mode, "value", str(disaggregation_mode))
        if self.mode not in ("prefill", "decode"):
            raise RegistrationError(f"disaggregation mode {self.mode!r} has no kvxferd role",
                                    field="disaggregation_mode", fix="use prefill or decode")
        self.is_mla_backend = bool(is_mla_backend)
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        self.lock = threading.Lock()
        ctx = CURRENT_POOL.get()
        if ctx is None:
            raise RegistrationError(
                "the kvxferd manager was built without its KV pool (the plugin's hook on _init_kv_manager "
                "did not run)", field="token_to_kv_pool",
                fix="load the plugin with sglang.srt.plugins.load_plugins() before the scheduler starts")
        self._refuse_unsupported(args, ctx)
        self._refuse_unsupported_options()
        self.facts = pool_facts(ctx.pool)
        if self.facts.page_size != int(args.page_size):
            raise RegistrationError(f"KVArgs.page_size {args.page_size} differs from the pool's {self.facts.page_size}",
                                    field="page_size", fix="build KVArgs from the registered pool")
        self.dp = self._dp_group(args)
        # --disaggregation-enable-kv-checksum: kvxferd checks every chunk's bytes end to end
        # (integrity "full" for this instance's ranks), across TP, PP and page-size changes, where
        # SGLang's own digest is compared only between ranks of one layout
        self.integrity = "full" if self._setting("disagg", "disaggregation_enable_kv_checksum") else None
        self.follow_bootstrap_room = self._follows_room()
        tensors = self._map_regions(args, ctx)
        self.aux_ptrs = [int(p) for p in args.aux_data_ptrs]
        self.aux_item_lens = [int(n) for n in args.aux_item_lens]
        self.aux_row_bytes = sum(self.aux_item_lens)
        self.bootstrap_port = int(self._setting("disagg", "disaggregation_bootstrap_port"))
        self.own_bootstrap_addr = self._bootstrap_address()  # the prefill deployment's own server
        self.instance = os.environ.get(INSTANCE_ENV) or self._default_instance()
        self.latency_priority = self._latency_priority()
        self.low_priority_values_first = bool(self._setting("schedule", "schedule_low_priority_values_first"))
        self.socket_path = os.environ.get(SOCKET_ENV) or default_socket_path()
        self._register(tensors)

    def _map_regions(self, args: KVArgs, ctx: PoolContext) -> dict:
        """The rank's geometry (with its cache groups) and the tensors that back every region."""
        rank_facts = self._rank_facts(args, ctx)
        self.geometry = build_geometry(self.facts, rank_facts)
        tensors = pool_region_tensors(ctx.pool, self.facts)
        # draft-model KV (speculative decoding): a draft group over the target's page table (see .draft)
        self.draft: Group | None = None
        draft_regions = self._draft_regions(args, ctx, rank_facts)
        self._check_pointers(args, {**tensors, **draft_regions})
        tensors.update(draft_regions)
        # Mamba/linear-attention state: one kvxferd state group per state tensor (see .state)
        self.state_kinds = [getattr(s, "value", s) for s in getattr(args, "state_types", None) or []]
        self.state_groups: list[StateTensor] = []
        if "mamba" in self.state_kinds:
            tensors.update(self._state_regions(args, ctx, rank_facts))
        self.window: Group | None = None
        if "swa" in self.state_kinds:
            tensors.update(self._window_regions(args, ctx, rank_facts))
        if self.draft is not None or self.state_groups or self.window is not None:
            self.geometry = self._with_groups(self.geometry)
        return tensors

    def _register(self, tensors: dict) -> None:
        """Register the rank with its daemon; a failure after it unregisters (close) before raising."""
        self.client = EngineClient(self.socket_path, timeout=float(os.environ.get(CALL_TIMEOUT_ENV, "5")))
        try:
            self.own_address = str(self.client.status()["peer_endpoint"]).removeprefix("tcp://")
            self.rendezvous = topology.rendezvous(
                os.environ.get(RENDEZVOUS_ENV), nnodes=self._parallel("nnodes", 1),
                node_rank=self._parallel("node_rank", 0), dist_init_addr=self._parallel("dist_init_addr", None),
                own_address=self.own_address)
            self.rank_id = self.client.register(self.instance, self.mode, self.geometry, describe_tensors(tensors),
                                                rendezvous=self.rendezvous, dp=self.dp, integrity=self.integrity)
        except BaseException:
            self.client.close()
            raise
        try:
            # what decode names as the source address: the rendezvous, where the instance's ranks are known
            self.daemon_address = self.rendezvous or self.own_address
            log.info("event=sglang_rank_registered instance=%s role=%s rank_id=%s daemon=%s rendezvous=%s dp=%s "
                     "integrity=%s", self.instance, self.mode, self.rank_id, self.own_address, self.rendezvous,
                     self.dp, self.integrity or "daemon")
            if self.mode == "prefill":
                self.register_to_bootstrap()
        except BaseException:
            self.close()  # no rank stays registered for a manager SGLang never got
            raise

    # -- start-up checks -----------------------------------------------------------------
    @staticmethod
    def _refuse_unsupported(args: KVArgs, ctx: PoolContext) -> None:
        kinds = [getattr(s, "value", s) for s in getattr(args, "state_types", None) or []]
        other = [k for k in kinds if k not in MAPPED_STATES]
        if other:
            raise RegistrationError(f"state transfer of {other} (state_types {kinds}) is not supported by the kvxferd "
                                    f"backend; of SGLang's state components it maps {list(MAPPED_STATES)} only",
                                    field="state_types",
                                    fix="serve models without DSA/QSA/MiniMax/block-scale state, or use another "
                                        "backend")
        twice = sorted({k for k in kinds if kinds.count(k) > 1})
        if twice:
            raise RegistrationError(f"state_types {kinds} lists {twice} twice", field="state_types",
                                    fix="fill KVArgs with SGLang's setup_state_kv_args")
        if getattr(args, "num_draft_entries", 0) and ctx.draft_pool is None:
            raise RegistrationError("KVArgs lists draft-model KV but no draft pool reached the kvxferd manager",
                                    field="num_draft_entries",
                                    fix="load the plugin with sglang.srt.plugins.load_plugins() before the scheduler "
                                        "starts")
        aux = getattr(ctx.metadata_buffers, "output_ids", None)
        if aux is None or aux.device.type != "cpu":
            raise RegistrationError("MetadataBuffers are not in CPU memory; the kvxferd backend copies the first "
                                    "token's row on the host", field="metadata_buffers",
                                    fix="unset SGLANG_MOONCAKE_CUSTOM_MEM_POOL=INTRA_NODE_NVLINK")

    def _refuse_unsupported_options(self) -> None:
        policy = self._setting("disagg", "disaggregation_decode_allocation_policy")
        if policy == "prefill_complete":
            raise RegistrationError("--disaggregation-decode-allocation-policy prefill_complete is not supported by "
                                    "the kvxferd backend", field="disaggregation_decode_allocation_policy",
                                    fix="use the default allocation policy")

    def _rank_facts(self, args: KVArgs, ctx: PoolContext) -> RankFacts:
        from sglang.srt.distributed.utils import get_pp_indices
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        attn_tp = int(parallel.attn_tp_size)
        pp_size = int(parallel.pp_size)
        cp = int(self._parallel("attn_cp_size", 1))
        if cp > 1:  # context parallel splits a request's tokens over ranks: no page table names them
            raise RegistrationError(f"attn_cp_size is {cp}; the kvxferd backend moves a request's KV from one "
                                    "attention TP x PP group, and context parallel splits its tokens over "
                                    f"{cp} of them", field="attn_cp_size",
                                    fix="run with attn_cp_size 1 (no --attn-cp-size / context parallel)")
        pp_rank = int(args.pp_rank)
        # each stage's model layers, SGLang's partition (SGLANG_PP_LAYER_PARTITION included)
        self.stage_ranges: Splits = tuple((int(a), int(b)) for a, b in (
            get_pp_indices(ctx.num_hidden_layers, r, pp_size) for r in range(pp_size)))
        splits = self.stage_ranges
        if full_pool(ctx.pool) is not ctx.pool:
            # a hybrid pool's KV lists only its full-attention layers, in their own numbering
            splits = ((0, self.facts.num_layers),)
            if pp_size > 1 and 0 <= pp_rank < pp_size:
                splits = self._full_splits(ctx, pp_rank)
                self.facts = dataclasses.replace(self.facts, start_layer=splits[pp_rank][0])
        return RankFacts(tp_rank=int(args.engine_rank) % attn_tp, tp_size=attn_tp, pp_rank=pp_rank,
                         pp_size=pp_size, layer_splits=splits,
                         kv_head_num=getattr(args, "kv_head_num", None),
                         total_kv_head_num=getattr(args, "total_kv_head_num", None),
                         model_total_kv_heads=ctx.model_total_kv_heads)

    def _full_splits(self, ctx: PoolContext, pp_rank: int) -> Splits:
        """A hybrid pool's full-attention layers per PP stage, in their own numbering (see .stages)."""
        if swa_pool(ctx.pool) is not None:  # SWAKVPool: the model config's lists, as layer_setup filters them
            return own_splits("full-attention", _attr(ctx.model_config, "full_attention_layer_ids"),
                              "model_config.full_attention_layer_ids", self.stage_ranges, pp_rank,
                              composite_layer_ids(ctx.pool, swa=False), "SWAKVPool.layers_mapping")
        # HybridLinearKVPool: what SGLang's own _transfer_start_layer reads
        text_config = _attr(ctx.model_config, "hf_text_config")
        return own_splits("full-attention", _attr(text_config, "full_attention_layer_ids"),
                          "hf_text_config.full_attention_layer_ids", self.stage_ranges, pp_rank,
                          list(getattr(ctx.pool, "full_attention_layer_id_mapping", None) or {}),
                          "full_attention_layer_id_mapping")

    @staticmethod
    def _parallel(name: str, default: Any) -> Any:
        """A field of SGLang's parallel context; ``default`` where this process has none."""
        from sglang.srt.runtime_context import get_parallel

        try:
            value = getattr(get_parallel(), name)
        except (AttributeError, RuntimeError, ValueError):
            return default
        return default if value is None else value

    def _follows_room(self) -> bool:
        """Whether a request's prefill DP rank is ``room % dp_size`` (SGLang's rule, and its switch to
        querying the bootstrap server instead)."""
        from sglang.srt.environ import envs

        if envs.SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK.get():
            return False
        return self._parallel("load_balance_method", FOLLOW_ROOM) == FOLLOW_ROOM

    def _dp_group(self, args: KVArgs) -> tuple[int, int] | None:
        """This rank's ``(dp_rank, dp_size)`` as SGLang's bootstrap server counts DP ranks (see .topology)."""
        return topology.dp_group(int(self._parallel("attn_dp_rank", 0)), int(self._parallel("attn_dp_size", 1)),
                                 getattr(args, "system_dp_rank", None), int(self._parallel("dp_size", 1)))

    def _with_groups(self, geometry: RankGeometry) -> RankGeometry:
        """The rank's geometry with its cache groups (draft KV, Mamba state)."""
        groups = ([self.draft] if self.draft is not None else []) + [g.group for g in self.state_groups]
        pages = ([(DRAFT_GROUP, geometry.num_pages)] if self.draft is not None else []) + [
            (g.group.name, g.slots) for g in self.state_groups]
        if self.window is not None:
            groups.append(self.window)
            pages.append((WINDOW_GROUP, self.window_pages))
        spec = dataclasses.replace(geometry.spec, groups=tuple(groups))
        return RankGeometry(spec, geometry.tp_rank, geometry.pp_rank, geometry.num_pages, group_pages=tuple(pages))

    def _draft_regions(self, args: KVArgs, ctx: PoolContext, rank: RankFacts) -> dict[tuple[int, str], torch.Tensor]:
        """The draft pool's regions (``(layer, "draft.k")``...), and :attr:`draft`; none without a draft model."""
        count = int(getattr(args, "num_draft_entries", 0) or 0)
        if not count:
            return {}
        if rank.pp_size != 1:
            # sglang 0.5.23 (EAGLEWorkerV2._hosts_draft) runs the draft model on the last PP stage only:
            # the other stages register no draft KV, and kvxferd builds no group that a stage lacks
            raise RegistrationError(
                f"pp_size is {rank.pp_size}: SGLang runs the draft model on the last PP stage only, so stages 0 to "
                f"{rank.pp_size - 2} hold no draft-model KV (num_draft_entries 0), and the kvxferd backend moves a "
                "cache group only when every PP stage holds some of its layers", field="pp_size",
                fix="run instances with speculative decoding (a draft model) at pp_size 1")
        facts = pool_facts(ctx.draft_pool)
        self.draft = draft_group(facts, self.facts, rank.tp_size, count)
        _, buffers = pool_buffers(ctx.draft_pool)
        return {(i, qualified_kind(DRAFT_GROUP, kind)): t for kind, ts in buffers.items() for i, t in enumerate(ts)}

    def _window_regions(self, args: KVArgs, ctx: PoolContext, rank: RankFacts) -> dict[tuple[int, str], torch.Tensor]:
        """An SWA pool's sliding-window layers (KVArgs' ``StateType.SWA`` component) as the ``swa`` window group."""
        idx = self.state_kinds.index("swa")
        inner = swa_pool(ctx.pool)
        if inner is None:
            raise RegistrationError(f"KVArgs lists SWA state but the KV pool {type(ctx.pool).__name__} has no "
                                    "swa_kv_pool", field="state_types", fix="serve SWA models with SGLang's SWAKVPool")
        facts = pool_facts(inner)
        _, buffers = pool_buffers(inner)
        ours = [t.data_ptr() for ts in buffers.values() for t in ts]
        if sorted(ours) != sorted(int(p) for p in args.state_data_ptrs[idx]):
            raise RegistrationError(f"KVArgs.state_data_ptrs of the SWA component ({len(args.state_data_ptrs[idx])} "
                                    f"pointers) are not the SWA pool's buffers ({len(ours)})", field="state_data_ptrs",
                                    fix="fill KVArgs after the pool was placed in shared memory (the plugin's hook)")
        self.window = window_group(facts, self.facts, rank.tp_size, self.geometry.spec.total_kv_heads,
                                   ctx.sliding_window)
        self.window_pages = facts.rows // facts.page_size
        first = 0
        if rank.pp_size > 1:  # this stage's SWA layers in the window group's own numbering
            splits = own_splits("sliding-window", _attr(ctx.model_config, "swa_attention_layer_ids"),
                                "model_config.swa_attention_layer_ids", self.stage_ranges, rank.pp_rank,
                                composite_layer_ids(ctx.pool, swa=True), "SWAKVPool.layers_mapping")
            self.window = dataclasses.replace(self.window, num_layers=splits[-1][1], layer_splits=splits)
            first = splits[rank.pp_rank][0]
        return {(first + i, qualified_kind(WINDOW_GROUP, kind)): t
                for kind, ts in buffers.items() for i, t in enumerate(ts)}

    def _state_regions(self, args: KVArgs, ctx: PoolContext, rank: RankFacts) -> dict[tuple[int, str], torch.Tensor]:
        """The pool's Mamba state regions, and :attr:`state_groups`."""
        idx = self.state_kinds.index("mamba")
        views = state_tensors(ctx.pool)
        ptrs = [int(p) for p in args.state_data_ptrs[idx]]
        if not views:
            raise RegistrationError(f"KVArgs lists Mamba state but the KV pool {type(ctx.pool).__name__} holds none",
                                    field="state_types", fix="serve a hybrid model with SGLang's HybridLinearKVPool")
        if [t.data_ptr() for t in views] != ptrs:
            raise RegistrationError(
                f"KVArgs.state_data_ptrs ({len(ptrs)} pointers) are not the Mamba pool's state buffers ({len(views)})",
                field="state_data_ptrs", fix="fill KVArgs after the pool was placed in shared memory (the plugin's "
                                             "hook does this)")
        for i, t in enumerate(views):
            if not t.is_contiguous():
                raise RegistrationError(f"Mamba state entry {i} of shape {list(t.shape)} is not contiguous per slot",
                                        field="state_data_ptrs", fix="use SGLang's standard (non-AMX, non-envelope) "
                                                                     "Mamba state layout")

        def field(name: str) -> Any:
            lists = getattr(args, name, None) or []
            return lists[idx] if idx < len(lists) else None

        self.state_groups = mamba_groups(
            item_lens=[int(n) for n in args.state_item_lens[idx]],
            data_lens=[int(n) for n in args.state_data_lens[idx]],
            dims=field("state_dim_per_tensor"), outer_counts=field("state_slice_outer_counts"),
            shard_groups=field("state_conv_shard_groups"), layer_ids=field("state_layer_ids"),
            itemsizes=[t.element_size() for t in views],
            dtypes=[dtype_name(t, "state_data_ptrs") for t in views], tp_size=rank.tp_size)
        first = 0
        if rank.pp_size > 1:  # this stage's Mamba layers in the state groups' own numbering
            params = _attr(_attr(ctx.model_config, "hf_text_config"), "mamba2_cache_params")
            splits = own_splits("Mamba", _attr(params, "layers"), "hf_text_config.mamba2_cache_params.layers",
                                self.stage_ranges, rank.pp_rank, unique_in_order(field("state_layer_ids") or []),
                                "state_layer_ids")
            self.state_groups = [dataclasses.replace(g, group=dataclasses.replace(
                g.group, num_layers=splits[-1][1], layer_splits=splits)) for g in self.state_groups]
            first = splits[rank.pp_rank][0]
        return {(first + layer, qualified_kind(g.group.name, "state")): views[entry]
                for g in self.state_groups for layer, entry in enumerate(g.entries)}

    def request_groups(self, pages: list[int], state_indices: Any, *, with_state: bool) -> dict[str, Any]:
        """kvxferd ``groups`` of a request or chunk: the draft group's pages are the target's
        (``pages``); with ``with_state``, every state group gets the slot of SGLang's
        ``state_indices`` (aligned with ``state_types``) and the window group SGLang's SWA pages
        at the end of a table as long as ``pages`` (see :func:`.window.window_table`)."""
        out: dict[str, Any] = {}
        if self.draft is not None:
            out[DRAFT_GROUP] = list(pages)
        if (self.state_groups or self.window is not None) and with_state:
            if state_indices is None or len(state_indices) != len(self.state_kinds):
                got = None if state_indices is None else len(state_indices)
                raise RegistrationError(f"state_indices has {got} entries, state_types {self.state_kinds}",
                                        field="state_indices", fix="pass one state payload per state type")
            if self.state_groups:
                slot = state_slot(state_indices[self.state_kinds.index("mamba")], "mamba")
                out.update({g.group.name: [slot] for g in self.state_groups})
            if self.window is not None:
                out[WINDOW_GROUP] = window_table(state_indices[self.state_kinds.index("swa")], len(pages))
        return out

    @staticmethod
    def _check_pointers(args: KVArgs, tensors: dict[tuple[int, str], torch.Tensor]) -> None:
        """KVArgs' pointers must be the registered tensors' (computed after the move to shared memory)."""
        ours = sorted(t.data_ptr() for t in tensors.values())
        theirs = sorted(int(p) for p in args.kv_data_ptrs)
        if ours != theirs:
            raise RegistrationError(
                f"KVArgs.kv_data_ptrs ({len(theirs)} pointers) are not the KV pool's buffers ({len(ours)})",
                field="kv_data_ptrs", fix="fill KVArgs after the pool was placed in shared memory (the plugin's "
                                          "hook does this; do not cache pointers before it runs)")

    @staticmethod
    def _latency_priority() -> int | None:
        raw = os.environ.get(LATENCY_PRIORITY_ENV)
        if raw is None or raw == "":
            return None
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{LATENCY_PRIORITY_ENV} must be an integer, got {raw!r}", field=LATENCY_PRIORITY_ENV,
                              fix="set the SGLang priority from which requests are latency-class, e.g. 1") from None

    def qos_class(self, priority: int | None) -> str | None:
        """The transfer class a request of SGLang ``priority`` asks for (None: its instance's)."""
        if self.latency_priority is None or priority is None:
            return None
        urgent = priority <= self.latency_priority if self.low_priority_values_first else \
            priority >= self.latency_priority
        return "latency" if urgent else "bulk"

    def _setting(self, bag: str, name: str) -> Any:
        """A published setting (SGLang's runtime config bags), else the ServerArgs field."""
        from sglang.srt import runtime_context

        try:
            return getattr(getattr(runtime_context, f"get_{bag}")(), name)
        except (AttributeError, ValueError, RuntimeError):
            return getattr(self.server_args, name, None)

    def _default_instance(self) -> str:
        host = socket.gethostname()
        if self.mode == "prefill":
            return f"sglang-prefill-{host}-{self.bootstrap_port}"
        return f"sglang-decode-{host}-{self._setting('serving', 'port')}"

    # -- bootstrap -----------------------------------------------------------------------
    def bootstrap_address(self) -> str:
        return self.own_bootstrap_addr

    def _bootstrap_address(self) -> str:
        host = topology.bootstrap_host(os.environ.get(BOOTSTRAP_HOST_ENV), nnodes=self._parallel("nnodes", 1),
                                       dist_init_addr=self._parallel("dist_init_addr", None),
                                       serving_host=self._setting("serving", "host"))
        return f"[{host}]:{self.bootstrap_port}" if ":" in host else f"{host}:{self.bootstrap_port}"

    def register_to_bootstrap(self) -> None:
        """Tell the prefill deployment's bootstrap server this instance and daemon (retries while it starts)."""
        addr = self.bootstrap_address()
        deadline = time.monotonic() + float(os.environ.get(BOOTSTRAP_WAIT_ENV, "60"))
        while True:
            try:
                answer = put_route(addr, self.instance, self.daemon_address, dp_size=self.dp[1] if self.dp else 1,
                                   follow_bootstrap_room=self.follow_bootstrap_room)
            except OSError as exc:
                answer = {"error": str(exc)}
            if "error" not in answer:
                return
            if answer.get("status") == 409 or time.monotonic() > deadline:
                if answer.get("status") == 409:
                    raise RegistrationError(
                        f"bootstrap server {addr} already serves another kvxferd instance or daemon; instance "
                        f"{self.instance!r} at daemon {self.daemon_address} refused: {answer['error']}",
                        field="bootstrap", fix="give every prefill deployment its own bootstrap port, and every "
                                               "rank of one deployment the same instance name and, over several "
                                               f"nodes, the same rendezvous ({RENDEZVOUS_ENV} or --dist-init-addr)")
                raise RegistrationError(
                    f"could not register instance {self.instance!r} with bootstrap server {addr}: {answer['error']}",
                    field="disaggregation_bootstrap_port",
                    fix=f"start the prefill server's bootstrap server on that port (or set {BOOTSTRAP_HOST_ENV} to "
                        f"the host it listens on); {BOOTSTRAP_WAIT_ENV} sets how long ranks wait for it")
            time.sleep(0.2)

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode side: learn (once) which kvxferd instance and daemon serve ``bootstrap_addr``."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        info = get_route(bootstrap_addr)
        if info is None:
            return False
        host, _ = split_host_port(bootstrap_addr)
        self.prefill_info_table[bootstrap_addr] = PrefillInfo(
            instance=info["instance"], daemon_address=reachable_address(info["daemon_address"], host),
            dp_size=int(info.get("dp_size", 1)), follow_bootstrap_room=bool(info.get("follow_bootstrap_room", True)))
        return True

    # -- daemon calls (one client per rank; SGLang may poll from a helper thread) ---------
    def state(self, request_id: str) -> dict[str, Any] | None:
        """The daemon's record of a request at this rank; None while it does not know it."""
        with self.lock:
            try:
                return self.client.poll(self.rank_id, request_id)
            except DaemonError as exc:
                if exc.code == "request" and exc.field == "request_id":
                    return None
                raise

    def call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return getattr(self.client, op)(self.rank_id, *args, **kwargs)

    def forget(self, request_id: str) -> None:
        with self.lock:
            self.client.events.pop((self.rank_id, request_id), None)

    # -- the aux row (first output token and friends) ------------------------------------
    def read_aux(self, index: int) -> bytes:
        return b"".join(ctypes.string_at(ptr + off, n)
                        for ptr, (off, n) in zip(self.aux_ptrs, aux_row_spans(self.aux_item_lens, index)))

    def write_aux(self, index: int, data: bytes) -> None:
        if len(data) != self.aux_row_bytes:
            raise RegistrationError(f"the prefill side's metadata row has {len(data)} bytes, this decode rank's "
                                    f"{self.aux_row_bytes}", field="aux_item_lens",
                                    fix="run prefill and decode with the same sglang version and metadata options")
        pos = 0
        for ptr, (off, n) in zip(self.aux_ptrs, aux_row_spans(self.aux_item_lens, index)):
            ctypes.memmove(ptr + off, data[pos:pos + n], n)
            pos += n

    def close(self) -> None:
        with self.lock:
            self.client.timeout = min(self.client.timeout, 2.0)
            try:
                self.client.unregister(self.rank_id)
            except KvxferError:
                pass
            self.client.close()


def _attr(obj: Any, name: str) -> Any:
    """A field of an SGLang config object; None where it has none (or its property cannot be computed)."""
    if obj is None:
        return None
    try:
        return getattr(obj, name, None)
    except Exception:  # a config property (mamba2_cache_params) that fails here: the caller names the field
        return None

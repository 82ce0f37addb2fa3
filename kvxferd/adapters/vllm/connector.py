"""``KvxferdConnector``: vLLM's KV connector interface (v1) on a kvxferd daemon.

vLLM builds one instance in the scheduler (role SCHEDULER) and one in every worker (role
WORKER). The scheduler side only keeps books (``logic.SchedulerBook``) and tells workers,
once per step, what to load and what was computed; the worker side registers vLLM's own
KV tensors with the node's daemon and turns the step plan into ``expect``, ``send`` and
``abort`` calls. The daemon moves the bytes; vLLM's blocks stay pinned until the daemon
says a transfer is terminal.

Load it with::

    kv_transfer_config = {"kv_connector": "KvxferdConnector",
                          "kv_connector_module_path": "kvxferd.adapters.vllm",
                          "kv_role": "kv_both",
                          "kv_connector_extra_config": {"socket_path": "/run/kvxferd/engine.sock",
                                                        "instance": "llama-a",
                                                        "address": "10.0.0.1:5557"}}
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from ...errors import ConfigError, KvxferError
from ...model.geometry import RankGeometry
from ...sdk.client import DaemonError, EngineClient
from ...sdk.engine_memory import SharedPool, describe_tensors, share_in_place
from .groups import FULL, MAMBA, SLIDING, GroupMap, VllmGroup, map_groups, single_group
from .layout import (
    REQUIRED_LAYOUT,
    HybridPart,
    LayerLayout,
    decide,
    hybrid_geometry,
    layer_span,
    rank_geometry,
    same_for_all,
)
from .logic import (
    ConnectorSettings,
    SchedulerBook,
    StepPlan,
    TransferParams,
    WorkerBook,
    dp_of,
    group_pages,
    load_error_blocks,
    next_chunk,
    pages_for,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvxferd.vllm")


@dataclass
class KvxferdMetadata(KVConnectorMetadata):
    """The scheduler's plan for one step, as vLLM carries it to every worker."""

    plan: StepPlan


def _settings(vllm_config: "VllmConfig") -> ConnectorSettings:
    cfg = vllm_config.kv_transfer_config
    parallel = vllm_config.parallel_config
    index = getattr(parallel, "data_parallel_index", None)  # the DP rank, kept where vLLM resets the rank
    dp = dp_of(parallel.data_parallel_rank if index is None else index, parallel.data_parallel_size)
    return ConnectorSettings.from_config(cfg.kv_connector_extra_config, kv_role=cfg.kv_role,
                                         engine_id=cfg.engine_id, dp=dp)


def _spec_kind(spec: Any) -> tuple[str, Any]:
    """(kind, a representative layer spec) of one vLLM KV cache group's spec."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec, UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        kinds = {_spec_kind(s)[0] for s in spec.kv_cache_specs.values()}
        first = next(iter(spec.kv_cache_specs.values()))
        return (kinds.pop() if len(kinds) == 1 else type(spec).__name__), first
    if isinstance(spec, SlidingWindowSpec):
        return SLIDING, spec
    if isinstance(spec, FullAttentionSpec):
        return FULL, spec
    if isinstance(spec, MambaSpec):
        return MAMBA, spec
    return type(spec).__name__, spec


def group_map_of(kv_cache_config: "KVCacheConfig | None") -> GroupMap:
    """kvxferd's view of vLLM's KV cache groups (groups.map_groups), read from the KVCacheConfig
    vLLM builds the connector with; refuses (ConfigError) what it cannot move."""
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        return single_group()
    groups = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        kind, spec = _spec_kind(g.kv_cache_spec)
        groups.append(VllmGroup(i, kind, tuple(g.layer_names), int(spec.block_size),
                                getattr(spec, "sliding_window", None) if kind == SLIDING else None,
                                int(getattr(spec, "extra_retained_tokens", 0) or 0),
                                bool(getattr(g, "enable_kv_transfer", True))))
    return map_groups(groups)


def _describe(exc: KvxferError) -> str:
    return f"code={exc.code} reason={str(exc)!r}"


class KvxferdConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring; vLLM calls every method here from one thread per role.

    ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on, so a hybrid model's layers
    come in several KV cache groups, each with its own block ids per request; ``groups``
    says which kvxferd cache group each one is (adapters/vllm/groups.py).
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = _settings(vllm_config)
        self.groups = group_map_of(kv_cache_config)
        self.book: SchedulerBook | None = None
        self.worker: _Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.book = SchedulerBook(self.settings)
        else:
            self.worker = _Worker(vllm_config, self.settings, self.groups)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        """Token rows (LBNHC): any page size and TP pairing moves; HND moves whole pages only.

        vLLM drops the request (with a warning) when a backend cannot use it (CPU attention,
        FlashInfer on compute capability 10); registration then takes what vLLM chose, or
        refuses it naming the fix (layout.decide). MLA caches hold one head: no preference.
        """
        model = getattr(vllm_config, "model_config", None)
        if model is not None and getattr(model, "use_mla", False):
            return None
        return REQUIRED_LAYOUT

    # -- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.book is not None
        try:
            transfer = TransferParams.from_request(request.kv_transfer_params) if self.settings.consumes else None
            if transfer is not None and transfer.num_tokens != request.num_prompt_tokens:
                log.warning("event=kv_transfer_length_mismatch request=%s transfer=%s num_tokens=%d prompt=%d "
                            "fix='pass decode the same prompt as prefill'", request.request_id,
                            transfer.transfer_id, transfer.num_tokens, request.num_prompt_tokens)
            return self.book.matched_tokens(request.request_id, request.kv_transfer_params,
                                            request.num_prompt_tokens, num_computed_tokens)
        except ConfigError as exc:
            # one malformed request must not stop the engine: it is computed here instead
            log.error("event=bad_kv_transfer_params request=%s %s", request.request_id, _describe(exc))
            return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self.book is not None
        try:
            default, groups = self.groups.split(blocks.get_block_ids())
            self.book.after_alloc(request.request_id, request.kv_transfer_params, default,
                                  request.num_prompt_tokens, num_external_tokens, groups,
                                  getattr(request, "priority", None))
        except ConfigError as exc:
            log.error("event=bad_kv_transfer_params request=%s %s", request.request_id, _describe(exc))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.book is not None
        scheduled = []
        counts = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self.book.sends:
                default, groups = self.groups.split(new.block_ids)
                scheduled.append((new.req_id, default, new.num_computed_tokens + counts.get(new.req_id, 0), groups))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self.book.sends:
                default, groups = self.groups.split(self._block_ids(req_id))
                scheduled.append((req_id, default, cached.num_computed_tokens[i] + counts.get(req_id, 0), groups))
        plan = self.book.plan(scheduled, sorted(scheduler_output.preempted_req_ids or ()))
        return KvxferdMetadata(plan)

    def _block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """Every KV cache group's block ids of a running request (a sliding-window group's
        blocks before the window are already vLLM's null block)."""
        assert self._kv_cache_manager is not None, "vLLM binds the KV cache manager before scheduling"
        return tuple(list(ids) for ids in self._kv_cache_manager.get_block_ids(req_id))

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        assert self.book is not None
        self.book.received(sorted(connector_output.finished_recving or ()))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.book is not None
        from vllm.v1.request import RequestStatus

        aborted = request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)
        return self.book.finished(request.request_id, computed=request.num_computed_tokens, aborted=aborted)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """The hybrid manager's ``request_finished``: True holds every group's blocks (the window
        group's kept ones included) until the daemon says the send is terminal."""
        return self.request_finished(request, list(block_ids[self.groups.default.index]) if block_ids else [])

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self.worker is not None
        if isinstance(kv_connector_metadata, KvxferdMetadata):
            self.worker.drop_preempted(kv_connector_metadata.plan)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxferdMetadata)
        self.worker.start_loads(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # loads are asynchronous (whole requests, between steps): nothing waits per layer
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # the daemon reads vLLM's own pages, so there is nothing to copy per layer; the
        # step's tokens are handed over once in wait_for_save
        return

    def wait_for_save(self) -> None:
        assert self.worker is not None
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KvxferdMetadata)
            self.worker.save(meta.plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        sending, recving = self.worker.finished(finished_req_ids)
        self.worker.book.take_failed(recving)  # this path reports failures by block id only
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Failed loads come back by request (``failed_recving``) too: with several KV cache
        groups block ids are unique per group only and vLLM refuses block-level errors."""
        assert self.worker is not None
        sending, recving = self.worker.finished(finished_req_ids)
        failed = self.worker.book.take_failed(recving)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed if self.groups.hybrid else set())

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        errors = self.worker.book.take_load_errors()
        return set() if self.groups.hybrid else errors

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()


def _backend_name(vllm_config: "VllmConfig", layer_name: str) -> str:
    """The attention backend of a layer, for messages only (best effort: '?' when unknown)."""
    try:
        layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
        return str(layer.get_attn_backend().get_name())
    except Exception:  # noqa: BLE001 - a name for a log line must never fail registration
        return "?"


class _Worker:
    """One vLLM worker's link to its daemon: registration, then expect/send/abort per step."""

    def __init__(self, vllm_config: "VllmConfig", settings: ConnectorSettings, groups: GroupMap) -> None:
        self.vllm_config = vllm_config
        self.settings = settings
        self.groups = groups
        self.book = WorkerBook()
        self.client: EngineClient | None = None
        self.pool: SharedPool | None = None
        self.ranks: dict[str, str] = {}   # role -> rank id
        self.page_size = 0
        self.on_cuda = False

    # -- registration ----------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        if self.groups.hybrid:
            geometry, spans = self._hybrid(kv_caches)
        else:
            by_layer: dict[int, torch.Tensor] = {}
            for name, tensor in kv_caches.items():
                by_layer.setdefault(extract_layer_index(name), tensor)
            layout = self._layout(by_layer, next(iter(kv_caches)))
            geometry = self._geometry(layout, by_layer[min(by_layer)].dtype)
            spans = {(layer, layout.kind): (t, layout.span_bytes) for layer, t in sorted(by_layer.items())}
        layout_name = geometry.spec.layout
        self.page_size = geometry.spec.page_size
        self.on_cuda = next(iter(spans.values()))[0].device.type == "cuda"
        if not self.on_cuda:
            # every tensor object vLLM's layers hold must be rebound, not just the dict's
            self.pool = share_in_place(self._cpu_holders(kv_caches),
                                       name=f"vllm-{self.settings.instance}-tp{geometry.tp_rank}-pp{geometry.pp_rank}")
        # a hybrid cache's groups overlay one allocation (a block id belongs to one group at a
        # time), so regions of different groups may span the same bytes
        regions = describe_tensors({key: layer_span(t, nbytes) for key, (t, nbytes) in spans.items()})
        self.client = EngineClient(self.settings.socket_path, timeout=self.settings.call_timeout_s)
        for role in self.settings.roles:
            self.ranks[role] = self.client.register(self.settings.instance_for(role), role, geometry, regions,
                                                    rendezvous=self.settings.rendezvous, dp=self.settings.dp,
                                                    integrity=self.settings.integrity)
        log.info("event=vllm_registered instance=%s roles=%s tp=%d/%d pp=%d/%d layout=%s pages=%d page_size=%d "
                 "groups=%s", self.settings.instance, ",".join(self.settings.roles), geometry.tp_rank,
                 geometry.spec.tp_size, geometry.pp_rank, geometry.spec.pp_size, layout_name, geometry.num_pages,
                 self.page_size, ",".join(f"{g.name}:{g.kind}:{g.window}" for g in geometry.spec.groups) or "-")

    def _layout(self, by_layer: dict[int, torch.Tensor], any_name: str, block_size: int | None = None) -> LayerLayout:
        """One layout for the given layers (decide + same_for_all), logged once."""
        model = self.vllm_config.model_config
        backend = _backend_name(self.vllm_config, any_name)
        layout = same_for_all({layer: decide(tuple(t.shape), tuple(t.stride()), t.element_size(),
                                             block_size=block_size or self.vllm_config.cache_config.block_size,
                                             mla=bool(getattr(model, "use_mla", False)),
                                             on_cpu=t.device.type == "cpu", backend=backend)
                               for layer, t in by_layer.items()})
        log.info("event=vllm_layout layers=%d layout=%s vllm_layout=%s backend=%s page_size=%d page_stride=%d",
                 len(by_layer), layout.layout, layout.vllm_layout, backend, layout.page_size, layout.page_stride)
        return layout

    def _hybrid(self, kv_caches: dict[str, torch.Tensor]) -> tuple[RankGeometry, dict[tuple[int, str], Any]]:
        """Several vLLM KV cache groups: each group's layers in model order, laid out, then
        ``layout.hybrid_geometry`` (the default group numbered from 0, the others as groups)."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.utils import extract_layer_index

        parts = []
        for g in self.groups.groups:
            missing = [n for n in g.layer_names if n not in kv_caches]
            if missing:
                raise ConfigError(f"vLLM KV cache group {g.index} names layer {missing[0]!r}, which register_kv_caches "
                                  "did not hand over", field="kv_caches", fix="report this model to kvxferd's "
                                  "maintainers")
            names = sorted(g.layer_names, key=extract_layer_index)
            layers = [kv_caches[n] for n in names]
            parts.append(HybridPart(g.name, g.index, g.kind, g.window,
                                    self._layout(dict(enumerate(layers)), names[0], g.block_size), layers))
        parallel = self.vllm_config.parallel_config
        return hybrid_geometry(parts, total_kv_heads=self.vllm_config.model_config.get_total_num_kv_heads(),
                               tp_size=parallel.tensor_parallel_size, tp_rank=get_tensor_model_parallel_rank(),
                               pp_size=parallel.pipeline_parallel_size)

    def _cpu_holders(self, kv_caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The dict's tensors plus the ones bound to attention layers (other objects, same storage)."""
        holders: dict[int, torch.Tensor] = {id(t): t for t in kv_caches.values()}
        context = self.vllm_config.compilation_config.static_forward_context
        for name in kv_caches:
            bound = getattr(context.get(name), "kv_cache", None)
            for t in bound if isinstance(bound, (list, tuple)) else [bound]:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    holders.setdefault(id(t), t)
        return list(holders.values())

    def _geometry(self, layout: LayerLayout, dtype: torch.dtype) -> RankGeometry:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
        from vllm.distributed.utils import get_pp_indices

        model = self.vllm_config.model_config
        parallel = self.vllm_config.parallel_config
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        num_layers = model.get_total_num_hidden_layers()
        splits = tuple(get_pp_indices(num_layers, r, pp) for r in range(pp)) if pp > 1 else None
        return rank_geometry(layout, str(dtype).removeprefix("torch."), num_layers=num_layers,
                             total_kv_heads=model.get_total_num_kv_heads(), tp_size=tp, pp_size=pp,
                             layer_splits=splits, tp_rank=get_tensor_model_parallel_rank(),
                             pp_rank=get_pp_group().rank_in_group if pp > 1 else 0)

    # -- per step --------------------------------------------------------------------
    def _events(self) -> None:
        """Take every completion the daemon pushed since the last step."""
        assert self.client is not None
        while (event := self.client.wait_any(0)) is not None:
            tid, state = event.get("request_id"), event.get("state")
            if event.get("rank_id") == self.ranks.get("prefill"):
                req = self.book.send_terminal(tid)
                if req is not None and state != "done":
                    log.warning("event=vllm_send_failed request=%s transfer=%s code=%s reason=%r", req, tid,
                                event.get("code"), event.get("reason"))
            elif event.get("rank_id") == self.ranks.get("decode"):
                req = self.book.load_terminal(tid, state == "done")
                if req is not None and state != "done":
                    log.warning("event=vllm_load_failed request=%s transfer=%s code=%s reason=%r", req, tid,
                                event.get("code"), event.get("reason"))

    def start_loads(self, plan: StepPlan) -> None:
        if not plan.loads and not plan.aborts:
            return
        assert self.client is not None
        for load in plan.loads:
            p: TransferParams = load.params
            errors = load_error_blocks(load.block_ids, load.start, p.num_tokens, self.page_size)
            try:
                pages = pages_for(load.block_ids, 0, p.num_tokens, self.page_size)
                self.client.expect(self.ranks["decode"], p.transfer_id, source_instance=p.source_instance,
                                   source_address=p.source_address, pages=pages, num_tokens=p.num_tokens,
                                   start=load.start, source_dp_rank=p.source_dp_rank,
                                   groups=group_pages(load.groups, 0, p.num_tokens, self.page_size))
            except KvxferError as exc:
                log.warning("event=vllm_load_failed request=%s transfer=%s %s", load.req_id, p.transfer_id,
                            _describe(exc))
                self.book.load_failed_now(load.req_id, errors)
                continue
            self.book.load_started(p.transfer_id, load.req_id, errors)
        for req_id, tid, role in plan.aborts:
            if role == "decode" and tid in self.book.loads:
                self._abort("decode", req_id, tid)

    def save(self, plan: StepPlan) -> None:
        if not plan.saves and not plan.aborts:
            return
        assert self.client is not None
        if plan.saves and self.on_cuda:
            torch.cuda.current_stream().synchronize()  # the daemon reads the pages on its own stream
        for s in plan.saves:
            state = self.book.send_state(s.transfer_id, s.req_id)
            chunk = next_chunk(state.sent, s.computed, s.num_tokens, self.page_size)
            if chunk is None or state.last_sent or state.terminal:
                continue
            start, end, last = chunk
            try:
                self.client.send(self.ranks["prefill"], s.transfer_id,
                                 pages=pages_for(s.block_ids, start, end, self.page_size), start=start, end=end,
                                 last=last, groups=group_pages(s.groups, start, end, self.page_size),
                                 qos_class=s.qos_class if start == 0 else None)
            except KvxferError as exc:
                log.warning("event=vllm_send_failed request=%s transfer=%s %s", s.req_id, s.transfer_id,
                            _describe(exc))
                if state.sent:
                    self._abort("prefill", s.req_id, s.transfer_id)
                else:
                    self.book.send_terminal(s.transfer_id)  # nothing of it is at the daemon
                continue
            state.sent, state.last_sent = end, last
        for req_id, tid, role in plan.aborts:
            if role == "prefill" and self.book.abort_send(req_id, tid):
                self._abort("prefill", req_id, tid)

    def _abort(self, role: str, req_id: str, tid: str) -> None:
        assert self.client is not None
        try:
            self.client.abort(self.ranks[role], tid, reason=f"vLLM request {req_id} ended")
        except DaemonError as exc:
            # the daemon no longer knows it (already terminal, event taken): nothing reads the pages
            log.info("event=vllm_abort_unknown request=%s transfer=%s %s", req_id, tid, _describe(exc))
            if role == "prefill":
                self.book.send_terminal(tid)
            else:
                self.book.load_terminal(tid, False)

    def drop_preempted(self, plan: StepPlan) -> None:
        """Before vLLM reuses a preempted request's blocks, make sure the daemon no longer reads them."""
        if not plan.preempted:
            return
        assert self.client is not None
        for req_id, tid in plan.preempted:
            state = self.book.sends.get(tid)
            if state is not None and state.sent:
                try:
                    self.client.abort(self.ranks["prefill"], tid, reason=f"vLLM preempted request {req_id}")
                    self.client.wait(self.ranks["prefill"], tid, timeout=self.settings.preempt_wait_s)
                except KvxferError as exc:
                    log.info("event=vllm_preempt_abort request=%s transfer=%s %s", req_id, tid, _describe(exc))
            self.book.send_dropped(tid)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        if self.client is None:
            return set(), set()
        self._events()
        return self.book.take_finished(finished_req_ids)

    def close(self) -> None:
        if self.client is not None:
            for rank in self.ranks.values():
                try:
                    self.client.unregister(rank)
                except KvxferError:
                    pass
            self.client.close()
            self.client = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None

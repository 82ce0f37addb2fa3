"""SGLang plugin: adds the ``kvxferd`` transfer backend without editing SGLang.

Declared as the ``sglang.srt.plugins`` entry point ``kvxferd``; SGLang's
``load_plugins()`` (run by ``Engine`` and every scheduler process) calls :func:`register`,
then applies the hooks:

- REPLACE ``sglang.srt.disaggregation.utils.TransferBackend`` with the same enum plus
  ``KVXFERD = "kvxferd"`` (SGLang's hook registry re-points every module that imported it);
- AROUND ``get_kv_class``: the kvxferd classes for ``KVXFERD``, SGLang's own otherwise;
- AROUND ``PrefillBootstrapQueue._init_kv_manager`` and
  ``DecodePreallocQueue._init_kv_manager``: for kvxferd only, move a CPU KV pool (with its
  Mamba state, SWA layers and draft pool) into kvxferd shared memory first (so KVArgs'
  pointers are computed after the move) and hand the pools to the manager built inside;
- AROUND ``DecodePreallocQueue._send_kv_metadata``: the prompt's length for the receiver
  (a sliding-window group's window is its last tokens; ``send_metadata`` has pages only);
- AROUND ``PrefillBootstrapQueue._process_req``: the request's priority for its sender (SGLang
  builds senders without the request), which asks its daemon for a transfer class by it;
- the CLI choice: ``--disaggregation-transfer-backend kvxferd``.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

log = logging.getLogger("kvxferd.sglang")

BACKEND = "kvxferd"


def _transfer_backend_with_kvxferd(original: type[enum.Enum]) -> type[enum.Enum]:
    members = {m.name: m.value for m in original}
    members["KVXFERD"] = BACKEND
    new = enum.Enum("TransferBackend", members, module=original.__module__)
    new.__qualname__ = original.__qualname__
    return new


def _get_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND:
        return original(transfer_backend, class_type)
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import KVClassType

    from .conn import KvxferdKVBootstrapServer, KvxferdKVManager, KvxferdKVReceiver, KvxferdKVSender

    return {
        KVClassType.KVARGS: KVArgs,
        KVClassType.MANAGER: KvxferdKVManager,
        KVClassType.SENDER: KvxferdKVSender,
        KVClassType.RECEIVER: KvxferdKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: KvxferdKVBootstrapServer,
    }.get(class_type)


def _rebind_pool_pointers(pool: Any) -> None:
    """Pointer tables SGLang's pools cache for their kernels, recomputed after the move."""
    if hasattr(pool, "_init_data_ptrs_and_strides") and getattr(pool, "k_buffer", None) is not None:
        pool._init_data_ptrs_and_strides()
    elif getattr(pool, "kv_buffer", None) is not None and hasattr(pool, "data_ptrs"):
        import torch

        pool.data_ptrs = torch.tensor([x.data_ptr() for x in pool.kv_buffer], dtype=torch.uint64,
                                      device=pool.data_ptrs.device)


def _init_kv_manager(original: Any, queue: Any) -> Any:
    if getattr(queue.transfer_backend, "value", None) != BACKEND:
        return original(queue)
    from ...sdk.engine_memory import share_in_place
    from .pool import CURRENT_POOL, PoolContext, full_pool, pool_buffers, state_base_tensors, swa_pool

    pool = queue.token_to_kv_pool
    _, buffers = pool_buffers(pool)
    # a hybrid pool's Mamba state moves too: its base tensors, so every per-layer view follows
    tensors = [t for ts in buffers.values() for t in ts] + state_base_tensors(pool)
    draft = getattr(queue, "draft_token_to_kv_pool", None)  # speculative decoding's draft KV moves too
    if draft is not None:
        tensors += [t for ts in pool_buffers(draft)[1].values() for t in ts]
    swa = swa_pool(pool)  # an SWA pool's sliding-window layers
    if swa is not None:
        tensors += [t for ts in pool_buffers(swa)[1].values() for t in ts]
    shared = None
    if tensors and tensors[0].device.type == "cpu":
        role = "prefill" if type(queue).__name__.startswith("Prefill") else "decode"
        shared = share_in_place(tensors, name=f"sglang-{role}-tp{queue.tp_rank}-pp{queue.pp_rank}")
        _rebind_pool_pointers(full_pool(pool))
        for inner in (draft, swa):
            if inner is not None:
                _rebind_pool_pointers(inner)
    model_config = queue.scheduler.model_config
    try:
        total = int(model_config.get_total_num_kv_heads())
    except (AttributeError, TypeError, ValueError):
        total = None
    ctx = PoolContext(pool=pool, metadata_buffers=queue.metadata_buffers, model_total_kv_heads=total,
                      num_hidden_layers=int(model_config.num_hidden_layers), shared=shared,
                      draft_pool=draft, sliding_window=_window(queue.scheduler), model_config=model_config)
    token = CURRENT_POOL.set(ctx)
    try:
        return original(queue)
    except BaseException:
        if shared is not None:
            shared.close()
        raise
    finally:
        CURRENT_POOL.reset(token)
        if shared is not None and shared.path is not None:
            shared.close()  # a named file: the daemon mapped it, the name must not outlive start-up
        # a memfd stays open: it has no name to leak, and re-registering after a daemon
        # restart hands the daemon this descriptor again


def _window(scheduler: Any) -> int | None:
    try:
        value = int(getattr(scheduler, "sliding_window_size", None) or 0)
    except (TypeError, ValueError):
        return None
    return value or None


def _send_kv_metadata(original: Any, queue: Any, decode_req: Any, *args: Any, **kwargs: Any) -> Any:
    """Hand the decode receiver the prompt's length before SGLang calls its ``send_metadata``.

    ``send_metadata`` carries pages only; a sliding-window group needs the exact length
    (the window is its last tokens). SGLang's own ``_rebootstrap_prefill_len`` gives it,
    the length its ``_swa_payload`` computes the window from.
    """
    if getattr(queue.transfer_backend, "value", None) == BACKEND:
        try:
            decode_req.kv_receiver.prompt_len = int(type(queue)._rebootstrap_prefill_len(decode_req.req))
        except (AttributeError, TypeError, ValueError):
            pass  # the receiver refuses a window group without it, naming what is missing
    return original(queue, decode_req, *args, **kwargs)


def _process_req(original: Any, queue: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """Hand a kvxferd sender its request's SGLang priority (``KVXFERD_SGLANG_LATENCY_PRIORITY``
    maps it to the transfer class its first chunk asks for)."""
    from .conn import KvxferdKVSender

    sender = getattr(req, "disagg_kv_sender", None)
    if isinstance(sender, KvxferdKVSender):
        priority = getattr(req, "priority", None)
        sender.priority = priority if isinstance(priority, int) and not isinstance(priority, bool) else None
    return original(queue, req, *args, **kwargs)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point."""
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    if "KVXFERD" not in utils.TransferBackend.__members__:
        HookRegistry.register("sglang.srt.disaggregation.utils.TransferBackend",
                              _transfer_backend_with_kvxferd(utils.TransferBackend), HookType.REPLACE)
    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", _get_kv_class, HookType.AROUND)
    HookRegistry.register("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager",
                          _init_kv_manager, HookType.AROUND)
    HookRegistry.register("sglang.srt.disaggregation.decode.DecodePreallocQueue._init_kv_manager",
                          _init_kv_manager, HookType.AROUND)
    HookRegistry.register("sglang.srt.disaggregation.decode.DecodePreallocQueue._send_kv_metadata",
                          _send_kv_metadata, HookType.AROUND)
    HookRegistry.register("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._process_req",
                          _process_req, HookType.AROUND)
    log.info("event=sglang_plugin_registered backend=%s", BACKEND)

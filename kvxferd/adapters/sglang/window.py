"""SGLang's sliding-window layers (an SWA pool, KVArgs ``StateType.SWA``) as a kvxferd ``window`` group (pure).

sglang 0.5.23's ``SWAKVPool`` keeps full-attention and sliding-window layers in two
token pools with page tables of their own; KVArgs lists the full layers' buffers as the
KV and the SWA pool's (K of its layers, then V) as the ``SWA`` state component. A
request's SWA payload (``state_indices``, prefill's last ``send`` and decode's
``send_metadata``) is the SWA pages of ``[max(prefix, n - window)`` rounded down to a page,
``n)``: the last pages of the prompt. kvxferd moves it as the ``swa`` window group, whose
table covers the request from its first token: SGLang's pages at its end, SGLang's padding
page 0 before them (pages wholly before the window are never read or written). The two
facts the group needs that a payload does not carry come from SGLang itself: the window
(the scheduler's ``sliding_window_size``) and, on the decode side, the prompt's exact
length (the plugin's hook on ``_send_kv_metadata``). Nothing here imports SGLang or does I/O.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import RegistrationError
from ...model.groups import Group
from .layout import PoolFacts

WINDOW_GROUP = "swa"


def window_group(swa: PoolFacts, full: PoolFacts, tp_size: int, total_kv_heads: int | None,
                 window: int | None) -> Group:
    """The ``swa`` group of a rank; refusals name the field SGLang's pool or scheduler gives."""
    if not window or window <= 0:
        raise RegistrationError(f"the scheduler's sliding_window_size is {window!r}; the SWA layers' window is "
                                "needed to know which pages move", field="sliding_window_size",
                                fix="serve the SWA model with SGLang's hybrid SWA memory (its scheduler sets "
                                    "sliding_window_size)")
    if swa.page_size != full.page_size:
        raise RegistrationError(f"the SWA pool's page_size {swa.page_size} differs from the full pool's "
                                f"{full.page_size}", field="page_size", fix="build both pools with one page size")
    heads: int | None = None
    if swa.attention == "mha":
        if swa.local_heads == full.local_heads and total_kv_heads is not None:
            heads = total_kv_heads  # gpt-oss, Gemma: the same attention heads in both kinds of layers
        elif swa.local_heads > 1 or tp_size == 1:
            heads = swa.local_heads * tp_size
        else:
            raise RegistrationError(
                f"the SWA pool holds 1 KV head per rank (swa_kv_pool.head_num) over attention TP {tp_size}, the "
                f"full pool {full.local_heads}: the SWA layers' total head count cannot be told",
                field="swa_kv_pool.head_num", fix="serve with attention TP 1 or a model whose SWA layers have as "
                                                  "many KV heads as its full layers")
    return Group(WINDOW_GROUP, "window", swa.num_layers, dtype=swa.dtype, attention=swa.attention,
                 head_dim=swa.head_dim, total_kv_heads=heads, page_size=swa.page_size, window=int(window))


def window_table(payload: Any, num_pages: int) -> list[int]:
    """The window group's table for a request of ``num_pages`` pages: SGLang's SWA pages last."""
    try:
        pages = [int(p) for p in np.asarray(payload, dtype=np.int64).reshape(-1)]
    except (TypeError, ValueError) as exc:
        raise RegistrationError(f"state_indices for swa is not a list of pages: {exc}", field="state_indices",
                                fix="pass SGLang's own SWA payload") from None
    if len(pages) > num_pages:
        raise RegistrationError(f"state_indices for swa names {len(pages)} pages, the request has {num_pages}",
                                field="state_indices", fix="pass the SWA pages of the request's window only")
    return [0] * (num_pages - len(pages)) + pages

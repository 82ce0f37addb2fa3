"""SGLang's draft-model KV (speculative decoding, EAGLE/MTP) as a kvxferd ``draft`` group (pure).

sglang 0.5.23 appends the draft pool's per-layer buffers to KVArgs' ``kv_data_ptrs``
(``num_draft_entries`` of them, K of every draft layer then V, or the MLA latent). The
draft pool is indexed by the target's token slots (it "shares target virtual ids"), so a
request's draft pages are its target pages; SGLang's own backends move the draft entries
with the same ``kv_indices``. kvxferd moves them as a ``draft`` group: its own layers
(numbered from 0), heads, head_dim and dtype, the target's page size and page table.
Nothing here imports SGLang or does I/O.
"""

from __future__ import annotations

from ...errors import RegistrationError
from ...model.groups import Group
from .layout import PoolFacts

DRAFT_GROUP = "draft"


def draft_group(draft: PoolFacts, target: PoolFacts, tp_size: int, num_draft_entries: int) -> Group:
    """The draft group of a rank; every refusal names the field SGLang's KVArgs or pool gives."""
    regions = draft.num_layers * (1 if draft.attention == "mla" else 2)
    if num_draft_entries != regions:
        raise RegistrationError(f"KVArgs.num_draft_entries is {num_draft_entries}, the draft pool holds {regions} "
                                f"buffers ({draft.num_layers} layers)", field="num_draft_entries",
                                fix="fill KVArgs from the registered draft pool")
    if draft.page_size != target.page_size or draft.rows != target.rows:
        raise RegistrationError(f"the draft pool (draft_token_to_kv_pool) has {draft.rows} rows of page_size "
                                f"{draft.page_size}, the target "
                                f"pool {target.rows} of {target.page_size}; the draft shares the target's token slots",
                                field="draft_token_to_kv_pool.page_size",
                                fix="build the draft pool with the target pool's size and page size")
    total: int | None = None
    if draft.attention == "mha":
        if draft.local_heads == 1 and tp_size > 1:
            raise RegistrationError(
                f"the draft pool holds 1 KV head per rank (draft_token_to_kv_pool.head_num) over attention TP "
                f"{tp_size}: the draft model's total "
                "head count cannot be told from the pool (a replicated head or one head per rank)",
                field="draft_token_to_kv_pool.head_num",
                fix="serve a draft model with more KV heads than attention TP ranks, or with attention TP 1")
        total = draft.local_heads * tp_size
    return Group(DRAFT_GROUP, "draft", draft.num_layers, dtype=draft.dtype, attention=draft.attention,
                 head_dim=draft.head_dim, total_kv_heads=total, page_size=draft.page_size)

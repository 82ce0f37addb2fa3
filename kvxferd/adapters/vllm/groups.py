"""vLLM's KV cache groups -> kvxferd cache groups. Pure: no vLLM import, no I/O.

With its hybrid KV cache manager on (a connector that declares ``SupportsHMA``), vLLM 0.32
splits a hybrid model's layers into *KV cache groups* (``KVCacheConfig.kv_cache_groups``),
each with its own block table per request and one spec (``v1/core/kv_cache_utils.py``
``_get_kv_cache_groups_uniform_page_size``): gpt-oss's 12 full + 12 sliding-window layers
are two groups, a 2:1 pattern three. Every group's layers are views of one allocation and
the groups overlay each other (a block id belongs to one group at a time), so each layer
still gets its own ``[B, H, N, C]`` view and block ids index it as usual.

kvxferd's mapping (``map_groups``):

- the first full-attention group is the instance's default group; any further one a
  ``draft``-kind group (own layers and page table, moved whole like the default group);
- a sliding-window group (``SlidingWindowSpec``) a ``window`` group whose window is the
  tokens vLLM keeps for the next token: ``sliding_window - 1 + extra_retained_tokens``
  (``SlidingWindowManager.get_num_skipped_tokens``). vLLM replaces the blocks before them
  with its null block (id 0) on both sides, so the window never reaches a freed block;
- a Mamba group (``MambaSpec``) is refused at start: vLLM hands ``register_kv_caches`` one
  int8 view ``[blocks, 1, 1, page bytes]`` per Mamba layer, every state tensor of the layer
  packed one after another inside each block's page (so each tensor is strided by the page,
  which kvxferd's cache groups do not take), and the spec's ``shapes`` are per rank, without
  the dimension TP splits nor its parts (model-specific: Mamba2's conv ``x|B|C``, GDN's
  ``q|k|v``), so no state group can be described from them;
- a group vLLM does not transfer (``enable_kv_transfer`` false: rebuilt after a load) is
  left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...errors import ConfigError

FULL, SLIDING, MAMBA = "full", "sliding_window", "mamba"
HMA_FIX = ("run vLLM with --disable-hybrid-kv-cache-manager (sliding-window layers then run as full attention in "
           "one group, which kvxferd moves), or serve the model with another KV connector")


@dataclass(frozen=True)
class VllmGroup:
    """What the connector reads of one ``KVCacheGroupSpec`` (``kind``: FULL, SLIDING, MAMBA or
    the spec's class name)."""

    index: int
    kind: str
    layer_names: tuple[str, ...]
    block_size: int
    sliding_window: int | None = None
    extra_retained_tokens: int = 0
    transfer: bool = True


@dataclass(frozen=True)
class MappedGroup:
    index: int                 # vLLM's group index
    name: str                  # kvxferd's group name, "" for the default group
    kind: str                  # "" (default), "draft" or "window"
    layer_names: tuple[str, ...]
    block_size: int
    window: int | None = None


@dataclass(frozen=True)
class GroupMap:
    """Which of vLLM's groups kvxferd moves, under which name."""

    groups: tuple[MappedGroup, ...]    # the default group first
    num_vllm_groups: int = 1

    @property
    def default(self) -> MappedGroup:
        return self.groups[0]

    @property
    def extra(self) -> tuple[MappedGroup, ...]:
        return self.groups[1:]

    @property
    def hybrid(self) -> bool:
        """vLLM has several groups: block ids are unique per group only, so a failed load is
        reported by request (``failed_recving``), never by block id."""
        return self.num_vllm_groups > 1

    def split(self, block_ids: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], tuple[tuple[str, tuple[int, ...]], ...]]:
        """vLLM's per-group block ids -> (the default group's, ((name, ids), ...) of the others)."""
        if len(block_ids) != self.num_vllm_groups:
            raise ConfigError(f"vLLM gave block ids of {len(block_ids)} KV cache groups, its KVCacheConfig has "
                              f"{self.num_vllm_groups}", field="block_ids",
                              fix="this is a bookkeeping bug in the connector: report it")
        default = tuple(int(b) for b in block_ids[self.default.index])
        return default, tuple((g.name, tuple(int(b) for b in block_ids[g.index])) for g in self.extra)


def single_group(layer_names: Sequence[str] = ()) -> GroupMap:
    """A uniform cache (or a config the connector was built without): one full-attention group."""
    return GroupMap((MappedGroup(0, "", "", tuple(layer_names), 0),), 1)


def map_groups(groups: Sequence[VllmGroup]) -> GroupMap:
    """vLLM's KV cache groups -> kvxferd's, refusing what kvxferd cannot move (see the module doc)."""
    if not groups:
        return single_group()
    mapped: list[MappedGroup] = []
    default: VllmGroup | None = None
    for g in groups:
        where = f"kv_cache_config.kv_cache_groups[{g.index}].kv_cache_spec"
        if not g.transfer:
            continue
        if g.kind == MAMBA:
            raise ConfigError(f"vLLM KV cache group {g.index} ({len(g.layer_names)} layers, e.g. {g.layer_names[:1]}) "
                              "is a MambaSpec: kvxferd's vLLM connector does not map Mamba state (vLLM packs a "
                              "layer's state tensors in one page per block, and MambaSpec.shapes are per rank "
                              "without the TP-split dimension or its parts)", field=where,
                              fix="serve hybrid SSM models with another KV connector (kvxferd moves Mamba state "
                                  "for SGLang), or a model without Mamba layers")
        if g.kind not in (FULL, SLIDING):
            raise ConfigError(f"vLLM KV cache group {g.index} is a {g.kind}, which kvxferd's vLLM connector does not "
                              "map (full attention and sliding window only)", field=where, fix=HMA_FIX)
        if g.kind == FULL and default is None:
            default = g
            mapped.insert(0, MappedGroup(g.index, "", "", g.layer_names, g.block_size))
        elif g.kind == FULL:
            mapped.append(MappedGroup(g.index, f"full{g.index}", "draft", g.layer_names, g.block_size))
        else:
            if g.sliding_window is None or g.sliding_window < 1:
                raise ConfigError(f"vLLM KV cache group {g.index} is a sliding-window group without a window "
                                  f"({g.sliding_window!r})", field=f"{where}.sliding_window", fix=HMA_FIX)
            window = g.sliding_window - 1 + max(0, g.extra_retained_tokens)
            mapped.append(MappedGroup(g.index, f"swa{g.index}", "window", g.layer_names, g.block_size,
                                      max(1, window)))
    if default is None:
        kinds = sorted({g.kind for g in groups})
        raise ConfigError(f"vLLM's KV cache groups ({kinds}) have no full-attention group, which kvxferd needs as "
                          "the instance's default group", field="kv_cache_config.kv_cache_groups", fix=HMA_FIX)
    for g in groups:
        if g.transfer and g.block_size != default.block_size:
            raise ConfigError(f"vLLM KV cache group {g.index} has {g.block_size}-token blocks, the full-attention "
                              f"group {default.index} {default.block_size}-token ones; kvxferd's vLLM connector "
                              "cuts chunks at one block size", field=f"kv_cache_config.kv_cache_groups[{g.index}]"
                              ".kv_cache_spec.block_size", fix=HMA_FIX)
    return GroupMap(tuple(mapped), len(groups))

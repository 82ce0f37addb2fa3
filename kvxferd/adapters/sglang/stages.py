"""Which of a cache group's own layers each PP stage holds, from SGLang's facts (pure).

kvxferd numbers a group's layers among themselves (the full-attention layers of a hybrid
model 0..n-1, its Mamba layers 0..m-1, its sliding-window layers 0..s-1) and gives each PP
stage a ``[start, end)`` of that numbering (``Group.layer_splits``, the default group's
``InstanceSpec.layer_splits``). sglang 0.5.23 gives the pieces for this in global model
layer ids:

- the stage's model layers: ``get_pp_indices(num_hidden_layers, rank, pp_size)`` (what
  ``model.start_layer``/``end_layer`` are; ``SGLANG_PP_LAYER_PARTITION`` included);
- every layer of a kind in the model: the model config's lists, the same ones SGLang's
  pool configurator filters by the stage's range to build its pools
  (``hf_text_config.full_attention_layer_ids``, ``mamba2_cache_params.layers``,
  ``ModelConfig.swa_attention_layer_ids`` / ``full_attention_layer_ids``);
- the layers a stage's pool really holds, in its dense order: ``HybridLinearKVPool``'s
  ``full_attention_layer_id_mapping``, KVArgs' ``state_layer_ids``, ``SWAKVPool``'s
  ``layers_mapping``.

A stage's own range of a kind is then the count of that kind's layers before its first and
before its end layer; the pool must hold exactly those layers, in order. Nothing here
imports SGLang or does I/O.
"""

from __future__ import annotations

from typing import Sequence

from ...errors import RegistrationError

Splits = tuple[tuple[int, int], ...]


def own_splits(group: str, model_ids: Sequence[int] | None, source: str, stage_ranges: Sequence[tuple[int, int]],
               pp_rank: int, held: Sequence[int], held_field: str) -> Splits:
    """``[start, end)`` of ``group``'s own layers per stage; refusals name the SGLang field at fault.

    ``model_ids``: every layer of the group's kind in the model (from ``source``);
    ``stage_ranges``: each stage's ``[start, end)`` of model layers; ``held``: the model
    layers this stage's pool holds (``held_field`` names where they came from).
    """
    if model_ids is None:
        raise RegistrationError(f"the model config gives no {source}: which of the {group} layers each PP stage "
                                "holds cannot be told", field=source,
                                fix="serve the hybrid model with SGLang's own model config (it lists them), or run "
                                    "with pp_size 1")
    ids = [int(i) for i in model_ids]
    if ids != sorted(set(ids)):
        raise RegistrationError(f"{source} {ids} is not ascending without repeats", field=source,
                                fix="serve the hybrid model with SGLang's own model config")
    splits: list[tuple[int, int]] = []
    for rank, (start, end) in enumerate(stage_ranges):
        first = sum(1 for i in ids if i < start)
        last = sum(1 for i in ids if i < end)
        if first == last:
            raise RegistrationError(
                f"PP stage {rank} holds model layers [{start}, {end}) and none of the {len(ids)} {group} layers "
                f"{ids}; kvxferd moves a cache group only when every PP stage holds some of its layers",
                field="pp_size", fix="choose SGLANG_PP_LAYER_PARTITION so that every stage holds at least one "
                                     f"{group} layer, or run with a smaller pp_size")
        splits.append((first, last))
    start, end = stage_ranges[pp_rank]
    want = [i for i in ids if start <= i < end]
    if [int(i) for i in held] != want:
        raise RegistrationError(
            f"PP stage {pp_rank} (model layers [{start}, {end})) should hold the {group} layers {want} by "
            f"{source}, its pool holds {list(held)} ({held_field})", field=held_field,
            fix="check SGLANG_PP_LAYER_PARTITION and the model config are the same on every rank")
    return tuple(splits)


def unique_in_order(values: Sequence[int]) -> list[int]:
    """Each value once, first occurrence first (KVArgs lists a layer once per state tensor)."""
    return list(dict.fromkeys(int(v) for v in values))

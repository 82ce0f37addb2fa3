"""The plan of an instance pair: its full-attention KV paired (:mod:`kvxferd.model.pairing`) and each
of its cache groups (:mod:`kvxferd.model.group_plan`), under one mode.

``make_plan`` is a pure function of the prefill and decode :class:`InstanceSpec`. The source daemon
computes it when a hello comes and sends it back (:mod:`kvxferd.model.plan_wire`); the decode
daemon checks it and plans nothing.
"""

from __future__ import annotations

from dataclasses import replace

from .geometry import InstanceSpec
from .group_plan import group_plans
from .pairing import pair
from .plan import Plan


def make_plan(prefill: InstanceSpec, decode: InstanceSpec, *, mode: str = "auto",
              prefill_tensors: bool = True, decode_tensors: bool = True,
              require_same_page_size: bool = False) -> Plan:
    """Match a prefill instance to a decode instance, or raise :class:`~kvxferd.errors.PlanRefusal`.

    ``prefill_tensors``/``decode_tensors`` say whether the daemon holds a mapped tensor
    view of that side's KV buffers; staging gathers and scatters through them.
    """
    plan = pair(prefill, decode, mode=mode, prefill_tensors=prefill_tensors, decode_tensors=decode_tensors,
                require_same_page_size=require_same_page_size)
    if not (prefill.groups or decode.groups):
        return plan
    groups = group_plans(prefill, decode, mode if mode == "auto" else plan.mode, prefill_tensors, decode_tensors)
    resolved = plan.mode
    if mode == "auto" and any(g.plan.mode == "staged" for g in groups):
        resolved = "staged"  # one mode per pair: a group's small head slices make it staged
    groups = tuple(replace(g, plan=replace(g.plan, mode=resolved)) for g in groups)
    return replace(plan, mode=resolved, groups=groups)

"""A plan on the wire: made once, by the source daemon, and checked where it lands.

The prefill daemon plans an instance pair when a decode daemon's hello reaches it
(:func:`~kvxferd.model.planner.make_plan`) and sends the plan back in its handshake answer, one
row per writer. The decode daemon does not plan again: it rebuilds the plan from the rows and
its own view of both specs, and :func:`check_plan` proves what its memory relies on, whoever
computed the plan and however: every writer stays inside the rows of both ranks, and the
writers of each destination cover its rows exactly once (so a request is ``done`` only when
every byte of its pages was written, and no write lands outside them).

A row is ``[destination, group, part, tp, pp, head_start, head_end, layer_start, layer_end,
src_head_offset, dst_head_offset, slice_bytes]``; the destination is an index into the decode
instance's ranks (``pp * tp_size + tp``); row widths are the specs' own, never the peer's.
"""

from __future__ import annotations

from typing import Any

from ..errors import PlanRefusal
from .geometry import InstanceSpec
from .group_plan import check_groups
from .pairing import check_compatible
from .plan import Destination, GroupPlan, Plan, Writer

ROW_FIELDS = ("destination", "group", "part", "tp", "pp", "head_start", "head_end", "layer_start", "layer_end",
              "src_head_offset", "dst_head_offset", "slice_bytes")

FIX = "run the same kvxferd version on both daemons; a plan that breaks these rules is a bug of the daemon that sent it"


def plan_to_wire(plan: Plan) -> list[list[Any]]:
    """Every writer of the plan, of every group, as one row."""
    rows: list[list[Any]] = []
    for name, sub in [("", plan), *((g.name, g.plan) for g in plan.groups)]:
        for index, dest in enumerate(sub.destinations):
            for w in dest.writers:
                rows.append([index, name, w.part, w.tp_rank, w.pp_rank, *w.heads, *w.layers,
                             w.src_head_offset, w.dst_head_offset, w.slice_bytes])
    return rows


def plan_from_wire(rows: list[list[Any]], prefill: InstanceSpec, decode: InstanceSpec, mode: str, *,
                   require_same_page_size: bool = False) -> Plan:
    """The plan a source daemon sent, rebuilt over this daemon's specs and checked
    (:func:`check_plan`); :class:`PlanRefusal` names the first rule it breaks."""
    # the field-by-field refusals, as a planner gives them, under this daemon's own rules
    check_compatible(prefill, decode, require_same_page_size=require_same_page_size)
    check_groups(prefill, decode)
    if mode not in ("direct", "staged"):
        raise PlanRefusal(f"plan mode is {mode!r}, not direct or staged", field="mode", fix=FIX)
    names = [g.name for g in prefill.groups]
    by_group: dict[str, list[list[Writer]]] = {
        name: [[] for _ in range(decode.group_spec(name).tp_size * decode.group_spec(name).pp_size)]
        for name in ["", *names]}
    for row in rows:
        index, name, part, tp, pp, h0, h1, l0, l1, src_off, dst_off, slice_bytes = row
        dests = by_group.get(name)
        if dests is None:
            raise PlanRefusal(f"plan row {row} names group {name!r}; the instances have groups {names}",
                              field="plan", fix=FIX)
        if not 0 <= index < len(dests):
            raise PlanRefusal(f"plan row {row} names destination {index}; the decode instance has {len(dests)} ranks",
                              field="plan", fix=FIX)
        p_spec, d_spec = prefill.group_spec(name), decode.group_spec(name)
        dests[index].append(Writer(tp, pp, (h0, h1), (l0, l1), src_off, dst_off, slice_bytes,
                                   p_spec.row_bytes, d_spec.row_bytes, name, part))

    def sub_plan(name: str) -> Plan:
        p_spec, d_spec = prefill.group_spec(name), decode.group_spec(name)
        dests = tuple(Destination(i % d_spec.tp_size, i // d_spec.tp_size, d_spec.head_range(i % d_spec.tp_size),
                                  d_spec.layer_range(i // d_spec.tp_size), tuple(writers))
                      for i, writers in enumerate(by_group[name]))
        return Plan(p_spec, d_spec, dests, mode)

    groups = tuple(GroupPlan(name, prefill.group(name).kind, prefill.group(name).window, sub_plan(name)) for name in names)
    plan = Plan(prefill, decode, sub_plan("").destinations, mode, groups)
    check_plan(plan)
    return plan


def check_plan(plan: Plan) -> None:
    """Raise :class:`PlanRefusal` unless every destination of every group is covered exactly once by
    writers that stay inside the rows, layers and ranks of both sides."""
    for name, sub in [("", plan), *((g.name, g.plan) for g in plan.groups)]:
        for dest in sub.destinations:
            _check_destination(sub.prefill, sub.decode, dest, name)


def _check_destination(prefill: InstanceSpec, decode: InstanceSpec, dest: Destination, group: str) -> None:
    where = f"decode rank tp{dest.tp_rank} pp{dest.pp_rank}" + (f" of group {group!r}" if group else "")

    def refuse(what: str) -> PlanRefusal:
        return PlanRefusal(f"the plan for {where} {what}", field="plan", fix=FIX)

    keys = set()
    cells: list[tuple[int, int, int, int]] = []  # (layer start, layer end, byte start, byte end) in a dst row
    area = 0
    for w in dest.writers:
        if w.key in keys:
            raise refuse(f"names writer {list(w.key)} twice")
        keys.add(w.key)
        if not (0 <= w.tp_rank < prefill.tp_size and 0 <= w.pp_rank < prefill.pp_size):
            raise refuse(f"names prefill rank tp{w.tp_rank} pp{w.pp_rank}, outside tp {prefill.tp_size} x pp "
                         f"{prefill.pp_size}")
        width = w.heads[1] - w.heads[0]
        src_layers = prefill.layer_range(w.pp_rank)
        if not (dest.layers[0] <= w.layers[0] < w.layers[1] <= dest.layers[1]
                and src_layers[0] <= w.layers[0] and w.layers[1] <= src_layers[1]):
            raise refuse(f"has writer {list(w.key)} on layers {list(w.layers)}, outside the destination's "
                         f"{list(dest.layers)} or the source rank's {list(src_layers)}")
        if width <= 0 or w.slice_bytes <= 0 or w.slice_bytes * 8 != width * decode.head_slot_bits:
            raise refuse(f"has writer {list(w.key)} moving {w.slice_bytes} bytes for heads {list(w.heads)} "
                         f"({decode.head_slot_bits} bits a head)")
        per_head = w.slice_bytes // width
        dst_at, src_at = w.dst_head_offset * per_head, w.src_head_offset * per_head
        if w.dst_head_offset < 0 or w.src_head_offset < 0 or dst_at + w.slice_bytes > decode.row_bytes \
                or src_at + w.slice_bytes > prefill.row_bytes:
            raise refuse(f"has writer {list(w.key)} at byte {dst_at} (source {src_at}) of rows of {decode.row_bytes} "
                         f"(source {prefill.row_bytes}) bytes, {w.slice_bytes} bytes wide: past the row's end")
        cell = (w.layers[0], w.layers[1], dst_at, dst_at + w.slice_bytes)
        for other in cells:
            if cell[0] < other[1] and other[0] < cell[1] and cell[2] < other[3] and other[2] < cell[3]:
                raise refuse(f"has writer {list(w.key)} overlapping another on layers {list(w.layers)}, "
                             f"bytes [{cell[2]}, {cell[3]}) of a row")
        cells.append(cell)
        area += (w.layers[1] - w.layers[0]) * w.slice_bytes
    whole = (dest.layers[1] - dest.layers[0]) * decode.row_bytes
    if area != whole:
        raise refuse(f"covers {area} of its {whole} bytes per token (layers x row bytes): some bytes would "
                     "never be written")

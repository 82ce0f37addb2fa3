"""The plan a source daemon sends in its handshake answer, as the decode daemon rebuilds and checks it.

The round trip over every planner case is in the planner oracles (``test_planner_oracle.py``,
``test_planner_groups_oracle.py``): they run their byte-exact checks on the rebuilt plan. Here:
a plan that would leave a byte unwritten, write one twice or write past a row is refused, naming
the destination and the writer, whoever made it.
"""

from __future__ import annotations

import copy

import pytest

from kvxferd.errors import PlanRefusal
from kvxferd.model.geometry import InstanceSpec
from kvxferd.model.groups import Group
from kvxferd.model.plan_wire import ROW_FIELDS, plan_from_wire, plan_to_wire
from kvxferd.model.planner import make_plan
from kvxferd.wire import messages

F = {name: i for i, name in enumerate(ROW_FIELDS)}


def mha(tp: int, pp: int = 1, **kw) -> InstanceSpec:
    return InstanceSpec("mha", 4, 8, "bfloat16", 4, tp_size=tp, pp_size=pp, total_kv_heads=4, **kw)


def hybrid(tp: int) -> InstanceSpec:
    state = Group.from_dict({"name": "conv", "kind": "state", "num_layers": 2, "shape": [8, 4], "split_dim": 0,
                             "dtype": "bfloat16", "split_parts": [4, 4]})
    return mha(tp, groups=(state,))


CASES = {"tp2>1": (mha(2), mha(1)), "tp1>2": (mha(1), mha(2)), "tp2pp2>tp4": (mha(2, 2), mha(4)),
         "state parts tp1>2": (hybrid(1), hybrid(2))}


@pytest.mark.parametrize("case", list(CASES))
def test_a_carried_plan_is_the_planners(case: str) -> None:
    prefill, decode = CASES[case]
    plan = make_plan(prefill, decode, mode="direct")
    rows = plan_to_wire(plan)
    # through the handshake answer's own checks, as the decode daemon parses it
    answer = messages.parse_handshake_answer(
        messages.HandshakeOk(prefill.to_dict(), plan.mode, rows, "inc", {"transport": "tcp"}).to_wire())
    assert isinstance(answer, messages.HandshakeOk)
    assert plan_from_wire(answer.plan, prefill, decode, answer.mode) == plan


def _refused(rows: list[list], prefill: InstanceSpec, decode: InstanceSpec, *words: str) -> str:
    with pytest.raises(PlanRefusal) as err:
        plan_from_wire(rows, prefill, decode, "direct")
    assert err.value.field == "plan"
    for word in words:
        assert word in str(err.value), (word, str(err.value))
    return str(err.value)


def test_a_missing_writer_leaves_bytes_unwritten_and_is_refused() -> None:
    prefill, decode = CASES["tp2>1"]
    rows = plan_to_wire(make_plan(prefill, decode, mode="direct"))
    _refused(rows[:-1], prefill, decode, "decode rank tp0 pp0", "never be written")


def test_a_writer_past_the_row_is_refused() -> None:
    prefill, decode = CASES["tp2>1"]  # two writers, each half of the decode row
    rows = plan_to_wire(make_plan(prefill, decode, mode="direct"))
    bad = copy.deepcopy(rows)
    bad[1][F["dst_head_offset"]] += 1  # heads 2..3 of a 4-head row, moved one head on: past its end
    _refused(bad, prefill, decode, "past the row's end", "writer [1, 0]")


def test_two_writers_on_the_same_bytes_are_refused() -> None:
    prefill, decode = CASES["tp2>1"]
    rows = plan_to_wire(make_plan(prefill, decode, mode="direct"))
    bad = copy.deepcopy(rows)
    bad[1][F["dst_head_offset"]] = 0  # both write heads 0..1: heads 2..3 never, 0..1 twice
    _refused(bad, prefill, decode, "overlapping")


def test_a_writer_named_twice_is_refused() -> None:
    prefill, decode = CASES["tp1>2"]
    rows = plan_to_wire(make_plan(prefill, decode, mode="direct"))
    _refused(rows + [rows[0]], prefill, decode, "twice")


@pytest.mark.parametrize("field, value, words", [
    ("destination", 2, ("destination 2", "2 ranks")),
    ("tp", 5, ("prefill rank tp5",)),
    ("layer_end", 9, ("layers [0, 9]",)),
    ("slice_bytes", 48, ("48 bytes",)),
])
def test_a_row_outside_the_ranks_is_refused(field: str, value: int, words: tuple[str, ...]) -> None:
    prefill, decode = CASES["tp1>2"]
    rows = plan_to_wire(make_plan(prefill, decode, mode="direct"))
    bad = copy.deepcopy(rows)
    bad[0][F[field]] = value
    _refused(bad, prefill, decode, *words)


def test_a_state_part_moved_onto_the_other_is_refused() -> None:
    prefill, decode = CASES["state parts tp1>2"]
    rows = plan_to_wire(make_plan(prefill, decode, mode="direct"))
    parts = [r for r in rows if r[F["group"]] == "conv" and r[F["destination"]] == 0]
    assert [r[F["part"]] for r in parts] == [0, 1]  # each part of the state is its own writer
    parts[1][F["dst_head_offset"]] = parts[0][F["dst_head_offset"]]
    _refused(rows, prefill, decode, "group 'conv'", "overlapping")


def test_an_unknown_group_or_mode_is_refused() -> None:
    prefill, decode = CASES["tp1>2"]
    rows = plan_to_wire(make_plan(prefill, decode, mode="direct"))
    bad = copy.deepcopy(rows)
    bad[0][F["group"]] = "swa"
    _refused(bad, prefill, decode, "group 'swa'")
    with pytest.raises(PlanRefusal) as err:
        plan_from_wire(rows, prefill, decode, "auto")
    assert err.value.field == "mode"


def test_the_specs_are_compared_before_the_plan() -> None:
    """A source whose spec disagrees gets the field-by-field refusal a planner gives, not a plan error."""
    prefill, decode = CASES["tp1>2"]
    rows = plan_to_wire(make_plan(prefill, decode, mode="direct"))
    other = InstanceSpec("mha", 4, 8, "float16", 4, tp_size=1, total_kv_heads=4)
    with pytest.raises(PlanRefusal) as err:
        plan_from_wire(rows, other, decode, "direct")
    assert err.value.field == "dtype"
    with pytest.raises(PlanRefusal) as err:
        plan_from_wire(rows, InstanceSpec("mha", 4, 8, "bfloat16", 8, tp_size=1, total_kv_heads=4), decode, "direct",
                       require_same_page_size=True)
    assert err.value.field == "page_size"


def test_a_malformed_row_is_a_protocol_error() -> None:
    prefill, decode = CASES["tp1>2"]
    rows = plan_to_wire(make_plan(prefill, decode, mode="direct"))
    for bad in ([*rows[0][:11]], [*rows[0][:1], "Bad-Name", *rows[0][2:]], [*rows[0][:11], 0], [-1, *rows[0][1:]]):
        wire_msg = messages.HandshakeOk(prefill.to_dict(), "direct", [bad], "inc", {"transport": "tcp"}).to_wire()
        with pytest.raises(Exception) as err:
            messages.parse_handshake_answer(wire_msg)
        assert getattr(err.value, "field", "").startswith("plan"), err.value

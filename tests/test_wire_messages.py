"""Each wire message has one definition, its class: the schema the validator checks an op against
is exactly the class's fields (each with the checker it declares), and every message survives
its own trip over the wire: instance -> ``to_wire`` -> msgpack -> parse -> an equal instance."""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable, ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxferd import PROTOCOL_VERSION
from kvxferd.errors import ProtocolError
from kvxferd.wire import messages, protocol
from kvxferd.wire.messages import Message

#: each table of checked messages: op -> class, op -> the schema its validator uses, the parser
TABLES: dict[str, tuple[dict[str, type[Message]], dict[str, protocol.Schema], Callable[[Any], Message]]] = {
    "engine": (messages.ENGINE_TYPES, messages.ENGINE_SCHEMAS, messages.parse_engine),
    "peer": (messages.PEER_TYPES, messages.PEER_SCHEMAS, messages.parse_peer),
    "handshake answer": (messages.HANDSHAKE_ANSWER_TYPES, messages.HANDSHAKE_ANSWERS,
                         messages.parse_handshake_answer),
}

#: messages the daemon only sends: the other side reads them as plain maps, nothing checks them
SENT_ONLY = {messages.Event, messages.AnnounceOk, messages.Ranks, messages.PeerError}

CHECKED = [(table, op, cls) for table, (types, _, _) in TABLES.items() for op, cls in types.items()]


def mismatches(cls: type, schema: protocol.Schema) -> list[str]:
    """How ``schema`` differs from what ``cls`` declares (nothing: it is the class's own)."""
    own = {f.name: f for f in fields(cls)}
    required = [n for n, f in own.items() if f.default is MISSING and f.default_factory is MISSING]
    optional = [n for n in own if n not in required and n != "extra"]
    extra = dict(own["extra"].metadata.get(messages.EXTRAS, {})) if "extra" in own else {}
    found = []
    if list(schema.required) != required:
        found.append(f"required {list(schema.required)}, fields without a default {required}")
    if list(schema.optional) != optional:
        found.append(f"optional {list(schema.optional)}, fields with a default {optional}")
    if dict(schema.extra) != extra:
        found.append(f"extra {sorted(schema.extra)}, the extra field takes {sorted(extra)}")
    for name, check in {**schema.required, **schema.optional}.items():
        if name in own and own[name].metadata.get(messages.CHECK) is not check:
            found.append(f"{name} is checked by another checker than its field declares")
    return found


def all_subclasses(cls: type) -> set[type]:
    return {c for sub in cls.__subclasses__() for c in (sub, *all_subclasses(sub))}


def test_every_message_class_is_checked_or_only_sent():
    defined = {c for c in all_subclasses(Message) if c.__module__ == messages.__name__}
    checked = {cls for _, _, cls in CHECKED}
    assert defined == checked | SENT_ONLY, "place a new message class in a table of messages or in SENT_ONLY"
    assert not checked & SENT_ONLY


@pytest.mark.parametrize("table, op, cls", CHECKED, ids=[f"{t}:{op}" for t, op, _ in CHECKED])
def test_the_validators_schema_is_the_class(table, op, cls):
    assert cls.op == op
    assert mismatches(cls, TABLES[table][1][op]) == []


def test_a_field_without_a_checker_or_a_checker_without_a_field_is_seen():
    """Made-up classes (not Message subclasses, so no table of the package ever sees them)."""

    @dataclass(frozen=True)
    class Unchecked:
        op: ClassVar[str] = "unchecked"
        request_id: str = messages.wire(protocol.REQUEST_ID)
        note: str | None = None

    with pytest.raises(TypeError, match="Unchecked.note has no checker"):
        messages.schema_of(Unchecked)  # type: ignore[arg-type]

    @dataclass(frozen=True)
    class Clashing:
        op: ClassVar[str] = "clashing"
        nixl_agent: str = messages.wire(protocol.NAME)
        extra: dict[str, Any] = messages.extras(protocol.NIXL_OFFER)

    with pytest.raises(TypeError, match="nixl_agent"):
        messages.schema_of(Clashing)  # type: ignore[arg-type]

    @dataclass(frozen=True)
    class Checked:
        op: ClassVar[str] = "checked"
        request_id: str = messages.wire(protocol.REQUEST_ID)
        note: str | None = messages.wire(protocol.text(512), None)

    schema = messages.schema_of(Checked)  # type: ignore[arg-type]
    assert mismatches(Checked, schema) == []
    with_more = protocol.Schema({**schema.required, "stray": protocol.NAME}, schema.optional)
    assert mismatches(Checked, with_more) and mismatches(Checked, protocol.Schema(schema.required, {}))
    other = protocol.Schema(schema.required, {"note": protocol.text(512)})
    assert mismatches(Checked, other) == ["note is checked by another checker than its field declares"]


REGION = {"op": "region", "layer": 1, "kind": "k", "mem": "shm", "nbytes": 4096, "path": "/dev/shm/kv", "offset": 0}
NIXL_REGION = [0, 0, 1, "kv", 4096, 8192, -1, 256]

#: one message of each checked op with every field set, each value in the form its checker
#: returns (a pair is a tuple, a number a float, a region map keeps its op)
FULL: list[Message] = [
    messages.Register("pre", "prefill", {"num_layers": 2}, [REGION], 4321, "h:7", 1, 2, "sampled"),
    messages.Unregister("pre/0/0"),
    messages.Expect("dec/0/0", "r1", "pre", [1, 2], "h:1", 64, 16, 2.5, 1, {"kv": [1, 2], "ssm": [3]}),
    messages.Send("pre/0/0", "r1", [1, 2], 0, 16, True, b"aux", {"kv": [1]}, "latency", 250.0, 1.8e9),
    messages.Poll("pre/0/0", "r1"),
    messages.Abort("pre/0/0", "r1", "engine gave up"),
    messages.Status(),
    messages.Ping(),
    messages.Handshake(PROTOCOL_VERSION, "h:1", "h:2", "p", "d", {"x": 1}, "staged", ["nixl", "tcp"], b"t" * 16,
                       "inc", True, 20, extra={"nixl_agent": "agent-d", "nixl_md": [b"md"], "nixl_regions": [NIXL_REGION],
                                           "nixl_landing": [3, 4096, 4096, 4, -1],
                                           "nixl_unusable": "rank d/tp0/pp0 could not be registered",
                                           "nixl_private": True},
                       ranks=[(0, 0), (1, 0)]),
    messages.PeerExpect("r1", "p", "d", (1, 0), 64, 16,
                        {"dst_pages": [3, 4], "dst_groups": {"kv": [3]}, "nixl_md": [b"md"],
                         "nixl_regions": [NIXL_REGION]}, [(0, 0), (1, 0)],
                        [20, 3, {"": [0, b"\x05\x80"], "swa": [4, b"\x01"]}]),  # granules picked page by page
    messages.PeerAbort("r1", "the engine aborted", "aborted"),
    messages.PeerEnded("r1", "p", "d", "timeout", "bootstrap took too long"),
    messages.Fence("r1"),
    messages.Fenced("r1"),
    messages.Landed("r1", "d", (1, 0)),
    messages.Announce("h:2", "inc", "p", "prefill", {"x": 1}, [(0, 0), (1, 0)], 2),
    messages.Lookup("p", "decode"),
    messages.PeerPing("h:1", "inc", b"d" * 16),
    messages.Pong("h:1", "inc", 64, True),
    messages.HandshakeOk({"x": 1}, "direct", [[0, "", 0, 0, 0, 0, 8, 0, 32, 0, 0, 512], [1, "swa", 1, 1, 0, 8, 16, 0, 32, 0, 0, 512]],
                         "inc",
                         {"transport": "nixl", "transport_reason": "asked first", "nixl_agent": "agent-p",
                          "nixl_md": [b"md"]}, [[0, 0, "h:1"], [1, 0, "h:3"]], 8, 1),
    messages.HandshakeRefused({"code": "plan_refused", "message": "no"}),
    messages.HandshakeRetry("the source is busy"),
]


def parser_of(msg: Message) -> Callable[[Any], Message]:
    return next(parse for types, _, parse in TABLES.values() if types.get(msg.op) is type(msg))


def over_the_wire(msg: Message) -> Message:
    wire = protocol.decode(protocol.encode(msg.to_wire()), 1 << 22)
    return parser_of(msg)(wire)


def test_the_samples_set_every_field_of_every_checked_message():
    assert sorted(type(m).__name__ for m in FULL) == sorted(cls.__name__ for _, _, cls in CHECKED)
    for msg in FULL:
        name, schema = type(msg).__name__, messages.schema_of(type(msg))
        unset = [f.name for f in fields(msg) if getattr(msg, f.name) is None]
        assert not unset, f"the {name} sample leaves {unset} unset"
        if schema.extra:
            sent = set(msg.extra)  # type: ignore[attr-defined]
            assert sent == set(schema.extra), f"the {name} sample's extra sends {sorted(sent)}"


@pytest.mark.parametrize("msg", FULL, ids=[f"{type(m).__name__}" for m in FULL])
def test_every_message_comes_back_equal_from_the_wire(msg):
    back = over_the_wire(msg)
    assert type(back) is type(msg) and back == msg
    assert "extra" not in msg.to_wire()


@given(st.data())
def test_messages_with_fields_left_out_come_back_equal(data):
    """Any optional field left unset (so left out on the wire), any transport field not sent."""
    msg = data.draw(st.sampled_from(FULL))
    schema = messages.schema_of(type(msg))
    unset = data.draw(st.sets(st.sampled_from(sorted(schema.optional)))) if schema.optional else set()
    changes: dict[str, Any] = {name: None for name in unset}
    if schema.extra:
        kept = data.draw(st.sets(st.sampled_from(sorted(schema.extra))))
        changes["extra"] = {k: v for k, v in msg.extra.items() if k in kept}  # type: ignore[attr-defined]
    smaller = dataclasses.replace(msg, **changes)
    wire = smaller.to_wire()
    assert not unset & set(wire)
    assert over_the_wire(smaller) == smaller


@pytest.mark.parametrize("integrity", [
    [20, 3, []], [20, 3, {"": [0]}], [20, 3, {"": [-1, b"\x01"]}], [20, 3, {"": [0, "x"]}],
    [20, 3, {"": [True, b""]}], [20, 3, {"": [0, bytes(protocol.MAX_PICK_BYTES + 1)]}], [20, 3, {7: [0, b""]}],
    [20, 3, {f"g{i}": [0, b""] for i in range(40)}], [20, 3, {}, 1], [20, 30, {"": [0, b""]}],
])
def test_an_expect_whose_integrity_picks_are_malformed_is_refused_naming_the_field(integrity):
    wire = dict(messages.PeerExpect("r1", "p", "d", (0, 0), 64).to_wire(), integrity=integrity)
    with pytest.raises(ProtocolError) as err:
        parser_of(messages.PeerExpect("r1", "p", "d", (0, 0), 64))(wire)
    assert err.value.field.startswith("integrity"), err.value

"""Typed messages: they put exactly the old wire maps on the wire and read back what the schemas accept."""

from __future__ import annotations

import pytest

from kvxferd import PROTOCOL_VERSION
from kvxferd.errors import ProtocolError
from kvxferd.wire import messages, protocol


def test_peer_expect_wire_is_the_map_peers_speak():
    msg = messages.PeerExpect("r1", "p", "d", [1, 0], 64, None, {"dst_pages": [3, 4]})
    assert msg.to_wire() == {"op": "expect", "request_id": "r1", "prefill_instance": "p", "decode_instance": "d",
                             "dst": [1, 0], "num_tokens": 64, "dst_pages": [3, 4]}
    back = messages.parse_peer(protocol.decode(protocol.encode(msg.to_wire()), 1 << 20))
    assert isinstance(back, messages.PeerExpect)
    assert (back.request_id, tuple(back.dst), back.start, back.extra) == ("r1", (1, 0), None, {"dst_pages": [3, 4]})
    with_start = messages.PeerExpect("r1", "p", "d", [0, 0], 64, 16)
    assert with_start.to_wire()["start"] == 16


def test_abort_cuts_reason_and_code_to_what_the_schema_takes():
    msg = messages.PeerAbort.of("r", "c" * 100, "x" * 900)
    wire = msg.to_wire()
    assert len(wire["reason"]) == messages.MAX_REASON and len(wire["code"]) == messages.MAX_CODE
    assert messages.check_peer(wire) == wire


@pytest.mark.parametrize("msg", [
    messages.Fence("r"), messages.Fenced("r"), messages.PeerPing("h:1", "abc"), messages.Pong("h:1", "abc"),
    messages.Handshake(PROTOCOL_VERSION, "h:1", "h:2", "p", "d", {"x": 1}, "auto", ["tcp"], b"t" * 16, "inc"),
])
def test_peer_messages_round_trip_through_the_schemas(msg):
    wire = msg.to_wire()
    assert messages.check_peer(wire) == wire
    assert messages.parse_peer(wire) == msg


def test_handshake_carries_transport_fields_in_extra():
    msg = messages.Handshake(PROTOCOL_VERSION, "h:1", "h:2", "p", "d", {}, "auto", ["nixl", "tcp"],
                             extra={"nixl_agent": "a"})
    wire = msg.to_wire()
    assert wire["nixl_agent"] == "a" and "extra" not in wire and "data_token" not in wire
    assert messages.parse_peer(wire).extra == {"nixl_agent": "a"}


def test_engine_messages_parse_into_types_and_refuse_bad_fields():
    send = messages.parse_engine({"op": "send", "rank_id": "i/0/0", "request_id": "r", "pages": [1],
                                  "start": 0, "end": 16, "last": True, "seq": 3})
    assert isinstance(send, messages.Send) and (send.end, send.last, send.aux) == (16, True, None)
    with pytest.raises(ProtocolError) as info:
        messages.parse_engine({"op": "send", "rank_id": "i/0/0", "request_id": "r", "pages": [1],
                               "start": 0, "end": "16", "last": True})
    assert info.value.field == "end"
    with pytest.raises(ProtocolError) as info:
        messages.parse_peer({"op": "nope"})
    assert info.value.field == "op"


def test_event_and_errors():
    done = messages.Event.of("i/0/0", "r", {"state": "done", "bytes": 10, "aux": b"a"})
    assert done.to_wire() == {"op": "event", "rank_id": "i/0/0", "request_id": "r", "state": "done",
                              "bytes": 10, "aux": b"a"}
    failed = messages.Event.of("i/0/0", "r", {"state": "failed", "bytes": 0, "code": "c", "reason": "why"})
    assert failed.to_wire()["code"] == "c" and "aux" not in failed.to_wire()
    err = messages.PeerError.about("r", "request_bound", "taken", "request_id").to_wire()
    assert err == {"op": "error", "request_id": "r",
                   "error": {"code": "request_bound", "field": "request_id", "message": "taken"}}


@pytest.mark.parametrize("msg", [
    messages.Announce("h:2", "inc", "p", "prefill", {"x": 1}, [(2, 0), (3, 0)]),
    messages.Lookup("p", "prefill"),
    messages.PeerExpect("r1", "p", "d", (1, 0), 64, None, {}, [(2, 0)]),
])
def test_directory_messages_round_trip_through_the_schemas(msg):
    wire = msg.to_wire()
    assert messages.check_peer(wire) == wire
    assert messages.parse_peer(wire) == msg


def test_an_announce_with_a_bad_rank_names_the_field():
    wire = messages.Announce("h:2", "inc", "p", "prefill", {}, [[2, 0]]).to_wire()
    with pytest.raises(ProtocolError) as bad:
        messages.check_peer({**wire, "ranks": [[2]]})
    assert bad.value.field.startswith("ranks")
    with pytest.raises(ProtocolError) as bad_role:
        messages.check_peer({**wire, "role": "both"})
    assert bad_role.value.field == "role"

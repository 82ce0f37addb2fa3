"""Wire messages: msgpack maps with an ``op`` field, validated against small schemas.

Nothing from a socket is trusted: size is checked before decoding, the decoder is bounded,
and every field is type- and range-checked before any handler sees it. A bad message
raises :class:`ProtocolError` naming the field, which endpoints turn into an error reply.

This module holds the field checkers and :class:`Schema`, the one validator. The schemas of
the engine and peer messages are not written here: each message class of
:mod:`kvxferd.wire.messages` declares its fields' checkers and its schema is derived from it.
What stays here are the maps that are no message class (a region, a data header) and the
fields a transport adds to a message (:data:`NIXL_OFFER`, :data:`EXPECT_TARGETS`,
:data:`TRANSPORT_CHOICE`).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import msgpack

from .. import PROTOCOL_VERSION
from ..errors import ProtocolError, RequestError
from ..model.groups import MAX_GROUPS
from ..model.qos import CLASSES
from ..model.sampling import MAX_PERIOD

MAX_ID_LEN = 256
MAX_NAME_LEN = 128
MAX_AUX_BYTES = 1 << 20
MAX_LIST = 1 << 22


def encode(message: Mapping[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def decode(data: bytes, max_bytes: int) -> dict[str, Any]:
    """Decode one message; refuse oversize input before msgpack does any work."""
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}",
                            field="message", fix="send smaller messages or raise limits.max_message_bytes")
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=True,
                                max_bin_len=max_bytes, max_str_len=max_bytes,
                                max_array_len=MAX_LIST, max_map_len=4096, max_ext_len=0)
    except Exception as exc:  # msgpack raises many types for malformed input
        raise ProtocolError(f"message is not valid msgpack ({type(exc).__name__}: {exc})"[:300],
                            field="message", fix="send one msgpack-encoded map per frame") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"message must be a map, got {type(value).__name__}", field="message",
                            fix="send a msgpack map with an 'op' field")
    op = value.get("op")
    if not isinstance(op, str):
        raise ProtocolError("message has no string 'op' field", field="op", fix="set op")
    return value


# -- field checkers ----------------------------------------------------------------------

Checker = Callable[[str, Any], Any]


def integer(minimum: int = 0, maximum: int = 2**62) -> Checker:
    def check(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{name} must be an integer, got {type(value).__name__}", field=name,
                                fix=f"send {name} as an integer")
        if not minimum <= value <= maximum:
            raise ProtocolError(f"{name} = {value} is outside [{minimum}, {maximum}]", field=name,
                                fix=f"send {name} within [{minimum}, {maximum}]")
        return value
    return check


def number(minimum: float = 0.0, maximum: float = 1e9) -> Checker:
    def check(name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not minimum <= value <= maximum:
            raise ProtocolError(f"{name} must be a number in [{minimum}, {maximum}], got {value!r}"[:200],
                                field=name, fix=f"send {name} as a number")
        return float(value)
    return check


def text(max_len: int = MAX_NAME_LEN, choices: tuple[str, ...] | None = None) -> Checker:
    def check(name: str, value: Any) -> str:
        if not isinstance(value, str):
            raise ProtocolError(f"{name} must be a string, got {type(value).__name__}", field=name,
                                fix=f"send {name} as a string")
        if not value or len(value) > max_len:
            raise ProtocolError(f"{name} must have 1..{max_len} characters, got {len(value)}", field=name,
                                fix=f"send a shorter, non-empty {name}")
        if choices is not None and value not in choices:
            raise ProtocolError(f"{name} = {value!r} is not one of {choices}", field=name,
                                fix=f"use one of {choices}")
        return value
    return check


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f"{name} must be a boolean, got {type(value).__name__}", field=name,
                            fix=f"send {name} as true or false")
    return value


def blob(max_len: int = MAX_AUX_BYTES) -> Checker:
    def check(name: str, value: Any) -> bytes:
        if not isinstance(value, (bytes, bytearray)):
            raise ProtocolError(f"{name} must be bytes, got {type(value).__name__}", field=name,
                                fix=f"send {name} as binary")
        if len(value) > max_len:
            raise ProtocolError(f"{name} has {len(value)} bytes, limit {max_len}", field=name,
                                fix=f"keep {name} under {max_len} bytes")
        return bytes(value)
    return check


def int_list(max_len: int = MAX_LIST) -> Checker:
    def check(name: str, value: Any) -> list[int]:
        if not isinstance(value, (list, tuple)):
            raise ProtocolError(f"{name} must be a list of integers, got {type(value).__name__}", field=name,
                                fix=f"send {name} as a list")
        if len(value) > max_len:
            raise ProtocolError(f"{name} has {len(value)} entries, limit {max_len}", field=name,
                                fix=f"send at most {max_len} entries")
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int):
                raise ProtocolError(f"{name} must hold only integers, found {type(item).__name__}",
                                    field=name, fix=f"send {name} as integers")
        return list(value)
    return check


def mapping(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{name} must be a map, got {type(value).__name__}", field=name,
                            fix=f"send {name} as a map")
    return value


def pair(name: str, value: Any) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 16 for v in value)):
        raise ProtocolError(f"{name} must be [tp_rank, pp_rank], got {value!r}"[:200], field=name,
                            fix="send two small non-negative integers")
    return (value[0], value[1])


def sample(name: str, value: Any) -> list[int]:
    """[period, offset] of an integrity sample (kvxferd.model.sampling): one granule in period."""
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            or not 1 <= value[0] <= MAX_PERIOD or not 0 <= value[1] < value[0]):
        raise ProtocolError(f"{name} must be [period, offset] with 1 <= period <= {MAX_PERIOD} and "
                            f"0 <= offset < period, got {value!r}"[:200], field=name,
                            fix="send the sample as two integers")
    return [value[0], value[1]]


#: bytes of one cache group's picks (one bit per granule): bounds an expect's and a header's
MAX_PICK_BYTES = 1 << 17


def picks(name: str, value: Any) -> list[Any]:
    """[first granule, bits] of the granules a sample chooses one by one (kvxferd.model.sampling.Picks)."""
    if (not isinstance(value, (list, tuple)) or len(value) != 2 or isinstance(value[0], bool)
            or not isinstance(value[0], int) or not 0 <= value[0] < 1 << 40
            or not isinstance(value[1], (bytes, bytearray)) or len(value[1]) > MAX_PICK_BYTES):
        raise ProtocolError(f"{name} must be [first granule, bits] with at most {MAX_PICK_BYTES} bytes of bits, "
                            f"got {value!r}"[:200], field=name,
                            fix="send the first granule's index and one bit per granule")
    return [value[0], bytes(value[1])]


def asked_sample(name: str, value: Any) -> list[Any]:
    """An expect's integrity ask: [period, offset], and where the decode side chose granules page
    by page, a third item mapping each cache group ("" the default) to its picks."""
    if not isinstance(value, (list, tuple)) or len(value) not in (2, 3):
        raise ProtocolError(f"{name} must be [period, offset] or [period, offset, picks by group], got "
                            f"{value!r}"[:200], field=name, fix="send the sample as a list")
    out: list[Any] = sample(name, list(value[:2]))
    if len(value) == 3:
        groups = value[2]
        if not isinstance(groups, dict) or len(groups) > MAX_GROUPS + 1:
            raise ProtocolError(f"{name}'s picks must be a map of at most {MAX_GROUPS + 1} cache groups, got "
                                f"{type(groups).__name__}", field=name, fix="send picks as a map by group name")
        for g in groups:
            if not isinstance(g, str) or len(g) > MAX_NAME_LEN:
                raise ProtocolError(f"{name}'s picks are keyed by cache group names, got {g!r}"[:200], field=name,
                                    fix='key picks by group name ("" for the default group)')
        out.append({g: picks(f"{name} picks of {g!r}", p) for g, p in groups.items()})
    return out


def list_of(item: Checker, max_len: int) -> Checker:
    def check(name: str, value: Any) -> list[Any]:
        if not isinstance(value, (list, tuple)) or len(value) > max_len:
            raise ProtocolError(f"{name} must be a list of at most {max_len} entries", field=name,
                                fix=f"send {name} as a list")
        return [item(f"{name}[{i}]", v) for i, v in enumerate(value)]
    return check


@dataclass(frozen=True)
class Schema:
    """A message's fields and their checkers. ``extra`` are optional fields a transport adds
    (checked as the optional ones are), apart so a message class can tell its own fields from
    what it passes on."""

    required: Mapping[str, Checker]
    optional: Mapping[str, Checker]
    extra: Mapping[str, Checker] = field(default_factory=dict)

    def check(self, message: Mapping[str, Any]) -> dict[str, Any]:
        allowed = set(self.required) | set(self.optional) | set(self.extra) | {"op", "seq", "v"}
        unknown = sorted((k for k in message if k not in allowed), key=repr)  # keys may be str and bytes
        if unknown:
            raise ProtocolError(f"unknown field {unknown[0]!r} in {message.get('op')!r}", field=str(unknown[0])[:64],
                                fix=f"send only {sorted(allowed)}")
        out: dict[str, Any] = {"op": message["op"]}
        for name, checker in self.required.items():
            if name not in message:
                raise ProtocolError(f"{message['op']!r} is missing field {name!r}", field=name,
                                    fix=f"send {name}")
            out[name] = checker(name, message[name])
        for name, checker in (*self.optional.items(), *self.extra.items()):
            if message.get(name) is not None:
                out[name] = checker(name, message[name])
        return out


MAX_DP = 1 << 12  # DP ranks of an instance (dp.MAX_DP)
REQUEST_ID = text(MAX_ID_LEN)
NAME = text(MAX_NAME_LEN)
ADDRESS = text(300)

BASE_KINDS = ("k", "v", "latent", "kv")
_GROUP_KIND = re.compile(r"^[a-z][a-z0-9_]{0,23}\.(k|v|latent|state|kv)$")


def region_kind(name: str, value: Any) -> str:
    """A region's kind: a base kind, or ``<group>.<kind>`` for a cache group's region."""
    kind = text(40)(name, value)
    if kind not in BASE_KINDS and not _GROUP_KIND.match(kind):
        raise ProtocolError(f"{name} = {kind!r} is not one of {BASE_KINDS} nor <group>.<k|v|latent|state|kv>",
                            field=name, fix="use the kinds the rank's geometry names")
    return kind


REGION = Schema(
    required={"layer": integer(0, 1 << 16), "kind": region_kind,
              "mem": text(16, ("shm", "cuda_ipc")), "nbytes": integer(1, 1 << 48)},
    optional={"path": text(4096), "fd": integer(0, 1 << 31), "offset": integer(0, 1 << 48), "handle": mapping},
)


def region(name: str, value: Any) -> dict[str, Any]:
    return REGION.check({"op": "region", **mapping(name, value)})


_GROUP_NAME = re.compile(r"^[a-z][a-z0-9_]{0,23}$")


def group_tables(name: str, value: Any) -> dict[str, list[int]]:
    """``{group: [pages]}`` or ``{group: [state slot]}``: what a request names of its cache groups."""
    if not isinstance(value, dict) or len(value) > 16:
        raise ProtocolError(f"{name} must map at most 16 group names to lists of integers", field=name,
                            fix="send groups as {name: [pages]} or {name: [slot]}")
    out = {}
    for key, pages in value.items():
        if not isinstance(key, str) or not _GROUP_NAME.match(key):
            raise ProtocolError(f"{name} has key {str(key)[:40]!r}, not a group name", field=name,
                                fix="name groups as the geometry does")
        out[key] = int_list()(f"{name}.{key}", pages)
    return out


MAX_DST_PAGES = 1 << 20  # destination pages a peer expect may carry (transport nixl)
MAX_NIXL_MD = 1 << 22  # one rank's partial NIXL agent metadata


def nixl_region(name: str, value: Any) -> list[Any]:
    """``[tp_rank, pp_rank, layer, kind, address, nbytes, device, page_stride]``: one decode region
    for NIXL WRITEs; ``page_stride`` is the bytes between page starts (0, or left out: dense pages)."""
    if not isinstance(value, (list, tuple)) or len(value) not in (7, 8):
        raise ProtocolError(f"{name} must be [tp, pp, layer, kind, address, nbytes, device, page_stride]",
                            field=name, fix="send one 8-entry list per region (page_stride 0 when dense)")
    tp, pp = pair(name, value[:2])
    stride = integer(0, 1 << 48)(name, value[7]) if len(value) == 8 else 0
    return [tp, pp, integer(0, 1 << 16)(name, value[2]), region_kind(name, value[3]),
            integer(1, 2**64 - 1)(name, value[4]), integer(1, 1 << 48)(name, value[5]),
            integer(-1, 1 << 10)(name, value[6]), stride]


MAX_INSTANCE_RANKS = 1 << 12  # ranks of one instance a directory message may name


def rank_at(name: str, value: Any) -> list[Any]:
    """``[tp_rank, pp_rank, daemon]``: where a rank of an instance is registered (a directory entry)."""
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ProtocolError(f"{name} must be [tp, pp, daemon]", field=name, fix="send one 3-entry list per rank")
    tp, pp = pair(name, value[:2])
    return [tp, pp, ADDRESS(name, value[2])]


MAX_PLAN_ROWS = 1 << 16  # writers of one instance pair's plan, every group's (model.plan_wire)
_GROUP_OR_MAIN = re.compile(r"^([a-z][a-z0-9_]{0,23})?$")


def plan_row(name: str, value: Any) -> list[Any]:
    """One writer of a carried plan (:mod:`kvxferd.model.plan_wire`): ``[destination, group, part, tp,
    pp, head_start, head_end, layer_start, layer_end, src_head_offset, dst_head_offset, slice_bytes]``.
    Only types and ranges here; whether the writers fit the ranks is the plan check's."""
    if not isinstance(value, (list, tuple)) or len(value) != 12:
        raise ProtocolError(f"{name} must be a 12-entry plan row", field=name,
                            fix="send one [destination, group, part, tp, pp, heads x2, layers x2, offsets x2, "
                                "slice_bytes] list per writer")
    group = value[1]
    if not isinstance(group, str) or not _GROUP_OR_MAIN.match(group):
        raise ProtocolError(f"{name}: group must be a group name or \"\", got {group!r}"[:200], field=name,
                            fix="send the cache group's name, or \"\" for the full-attention KV")
    small = integer(0, 1 << 24)
    return [small(name, value[0]), group, *(small(name, v) for v in value[2:11]), integer(1, 1 << 40)(name, value[11])]


def landing_ring(name: str, value: Any) -> list[int]:
    """``[ring, address, slot_bytes, count, device]``: where a prefill daemon writes staged blocks over NIXL."""
    if not isinstance(value, (list, tuple)) or len(value) != 5:
        raise ProtocolError(f"{name} must be [ring, address, slot_bytes, count, device]", field=name,
                            fix="send one 5-entry list")
    return [integer(0, 2**62)(name, value[0]), integer(1, 2**64 - 1)(name, value[1]),
            integer(1, 1 << 34)(name, value[2]), integer(1, 1 << 20)(name, value[3]),
            integer(-1, 1 << 10)(name, value[4])]


#: random per daemon process start: a peer whose incarnation changed was restarted, and nothing of
#: what the old process knew (handshakes, plans, agents, requests) exists in the new one
INCARNATION = text(64)

#: what a decode daemon that offers NIXL adds to its handshake (and to an expect naming a new rank)
NIXL_OFFER: dict[str, Checker] = {
    "nixl_agent": text(MAX_NAME_LEN),
    "nixl_md": list_of(blob(MAX_NIXL_MD), 4096),
    "nixl_regions": list_of(nixl_region, 1 << 20),
    "nixl_landing": landing_ring,
    #: NIXL is offered but cannot carry this decode instance (a rank it would not register): why
    "nixl_unusable": text(512),
    #: the decode daemon exposes no engine memory (peer.nixl_engine_memory = "private"): its offer
    #: describes its landing ring alone, its expects carry no page tables, and every chunk lands there
    "nixl_private": boolean,
}

#: what a decode daemon adds to a peer expect: the destination's page table and cache groups for
#: one-sided writes, and a rank's NIXL metadata and regions when the handshake did not name it yet
EXPECT_TARGETS: dict[str, Checker] = {
    "dst_pages": int_list(MAX_DST_PAGES),
    "dst_groups": group_tables,
    "nixl_md": NIXL_OFFER["nixl_md"],
    "nixl_regions": NIXL_OFFER["nixl_regions"],
}

#: what a source daemon adds to its handshake_ok: the transport it chose for the pair, why it is
#: not the first preferred, and what NIXL needs of it (its agent and connection info)
TRANSPORT_CHOICE: dict[str, Checker] = {
    "transport": text(32),
    "transport_reason": text(512),
    "nixl_agent": NIXL_OFFER["nixl_agent"],
    "nixl_md": NIXL_OFFER["nixl_md"],
}

#: what a daemon may say it reads from one multipart peer message (pong, handshake_ok)
BATCH_PARTS = integer(1, 1 << 16)

PEER_REPLY_OPS = ("handshake_ok", "handshake_refused", "handshake_retry", "error", "pong", "announce_ok",
                  "ranks")

#: regions one chunk may span (layers x kinds of one writer): bounds a data header's digest list
MAX_CHUNK_REGIONS = 1 << 14

DATA_HEADER = Schema(
    required={"request_id": REQUEST_ID, "decode_instance": NAME, "dst": pair, "src": pair,
              "start": integer(0, 1 << 40), "end": integer(0, 1 << 40), "last": boolean,
              "nbytes": integer(0, 1 << 48)},
    optional={"aux": blob(), "token": blob(64),
              # staged over NIXL: the landing ring and slot the block was written into, the block's
              # index in its chunk and the block size the chunk was cut into
              "ring": integer(0, 2**62), "slot": integer(0, 1 << 20), "block": integer(0, 1 << 40),
              "pack": integer(1, 1 << 34),
              # a cache group's chunk (kvxferd.model.groups): its writer is (src, group) at the destination
              "group": text(24), "part": integer(0, 16),
              # integrity: the digest (``hash``) of the chunk's bytes in each of its regions, in wire
              # order, as the source's pages held them (kvxferd.datapath.digest)
              "digests": list_of(integer(0, 2**64 - 1), MAX_CHUNK_REGIONS),
              # ... over the granules of this sample only (left out: every slot of the chunk)
              "sample": sample,
              # ... and of a sample chosen page by page, the chunk's granules it checks
              "picks": picks,
              # the digests (of every slot) follow the payload, the source having hashed the bytes as
              # they left (kvxferd.datapath.digest.RunningDigests): over tcp in a DIGESTS_TRAILER frame;
              # staged over NIXL in the last block's header (every block of the chunk says trailer)
              "trailer": boolean,
              # ... and which digest: left out or "xxh3", XXH3-64; "wsum", the device's word sums
              # (kvxferd.datapath.word_sums), for pages on a GPU
              "hash": text(8, ("xxh3", "wsum")),
              # with digests (here or trailing): XXH3-64 of this header's own fields that the decode side
              # acts on (kvxferd.datapath.digest.header_digest), checked before any of them is used
              "header_digest": integer(0, 2**64 - 1),
              # over tcp, the QoS lane of the connection the chunk travels on (kvxferd.transport.tcp): a
              # receiver runs a bulk connection's thread at its qos.bulk_nice
              "lane": text(8, CLASSES)},
)

#: the frame after a data payload whose header said ``trailer``: the source's digests
DIGESTS_TRAILER = Schema(required={"digests": list_of(integer(0, 2**64 - 1), MAX_CHUNK_REGIONS)}, optional={})

#: a decode daemon hands a landing slot back to the prefill daemon that wrote it (NIXL notification)
NIXL_FREE = Schema(required={"ring": integer(0, 2**62), "slot": integer(0, 1 << 20)}, optional={})


def check_op(schemas: Mapping[str, Schema], message: Mapping[str, Any], endpoint: str) -> dict[str, Any]:
    """Check a decoded message against the schema of its op (an op not in ``schemas`` is refused);
    ``seq``, which any message may carry to be matched with its answer, is checked here."""
    op = message["op"]
    schema = schemas.get(op)
    if schema is None:
        raise ProtocolError(f"unknown {endpoint} op {op[:64]!r}", field="op",
                            fix=f"use one of {sorted(schemas)}")
    checked = schema.check(message)
    if "seq" in message:
        checked["seq"] = integer(0, 2**63)("seq", message["seq"])
    return checked


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise RequestError(f"address {address!r} is not host:port", field="source_address",
                           fix="give the peer daemon as host:control_port")
    return host.strip("[]"), int(port)


#: geometry sizes past these are refused before anything is built from them: a num_layers
#: or pp_size of 10**9 makes per-layer lists that size, a tp_size drives the planner's loops
GEOMETRY_BOUNDS = {"num_layers": 1 << 16, "pp_size": 1 << 12, "tp_size": 1 << 12,
                   "total_kv_heads": 1 << 16, "heads_per_rank": 1 << 16}


def bounded_geometry(data: Any, field: str) -> Any:
    """Refuse a geometry map with non-string keys or sizes no deployment has, before parsing it."""
    if isinstance(data, dict):
        if not all(isinstance(k, str) for k in data):
            raise ProtocolError(f"{field} has a key that is not a string", field=field,
                                fix="send geometry fields by name")
        for key, limit in GEOMETRY_BOUNDS.items():
            value = data.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > limit:
                raise ProtocolError(f"{field}.{key} = {value} exceeds {limit}", field=key,
                                    fix=f"send a real {key} (at most {limit})")
    return data


def check_version(version: int) -> None:
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"peer speaks protocol v{version}, this daemon v{PROTOCOL_VERSION}",
                            field="v", fix="run the same kvxferd protocol version on both daemons")


# -- length-prefixed frames for the data connection --------------------------------------

FRAME_LEN = struct.Struct("!I")


def frame(message: Mapping[str, Any]) -> bytes:
    body = encode(message)
    return FRAME_LEN.pack(len(body)) + body

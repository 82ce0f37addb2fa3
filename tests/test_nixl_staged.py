"""Staged transfers over NIXL: byte-exact through running daemons, credits, landing-slot checks.

The cluster runs with 4 KiB staging slots and one landing slot per source daemon, so a
chunk travels as several blocks and every block after the first waits for the decode
side to scatter the one before and hand its slot back. Metrics say which transport and
mode moved the bytes. The pieces without processes (credits, rings, block cutting,
schemas) are tested at the end.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import digest_oracles
from e2e_util import Cluster, Node, close, cluster_run, finished, module_cluster, spec, untouched_bytes
from kvxferd.datapath.staging import Piece, StagingPool, block_pieces, pack
from kvxferd.errors import ConfigError, ProtocolError, RequestError, TransferError
from kvxferd.lifecycle.inbox import Sink
from kvxferd.ops import config
from kvxferd.sdk.client import EngineClient
from kvxferd.transport.nixl.receive import NixlReceiver
from kvxferd.transport.nixl.staging import Assemblies, Credits, LandingRing, LandingRings, RingInfo
from kvxferd.wire import messages, protocol
from nixl_util import (NIXL_ENV, NIXL_MISSING, NUM_PAGES, SLOW_TIMEOUTS, UCX_ENV, FakePrefillDaemon, instances,
                       metric, needs_nixl, run_case)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import reliability_report as rr  # noqa: E402

SLOT = 4096
# NIXL stages in blocks of its own size: tcp's staging slots stay at their default here
STAGED_ENV = {**NIXL_ENV, "KVXFERD_LIMITS_NIXL_BLOCK_BYTES": str(SLOT),
              "KVXFERD_LIMITS_STAGING_BYTES": str(4 * SLOT), "KVXFERD_LIMITS_NIXL_LANDING_SLOTS": "1"}


@pytest.fixture(scope="module")
def cluster(request):
    if NIXL_MISSING:
        pytest.skip(f"NIXL unusable here: {NIXL_MISSING}")
    yield from module_cluster(
        request, Node("prefill-st", env=STAGED_ENV), Node("decode-st", env=STAGED_ENV),
        # a decode daemon that gives no landing ring: sliced plans over NIXL must run direct
        Node("decode-no-ring", env={**STAGED_ENV, "KVXFERD_LIMITS_NIXL_LANDING_SLOTS": "0"}),
        Node("prefill-forced", env={**STAGED_ENV, "KVXFERD_PEER_MODE": "staged"}))


def moved(cluster: Cluster) -> dict[tuple[str, str, str], float]:
    pd, dd = cluster.daemons["prefill-st"], cluster.daemons["decode-st"]
    out = {}
    for t in ("nixl", "tcp"):
        for m in ("staged", "direct"):
            out[("sent", t, m)] = metric(pd, "kvxferd_sent_bytes_total", transport=t, mode=m)
        out[("received", t, "")] = metric(dd, "kvxferd_received_bytes_total", transport=t)
    return out


def kv_bytes(s, n_tokens: int) -> int:
    return n_tokens * s.num_layers * 2 * s.total_kv_heads * s.head_dim * 2  # bf16


CASES = [
    (spec(tp_size=2), spec(), 50, [[0, 7], [7, 30], [30, 50]], "expect_first"),
    (spec(), spec(tp_size=2), 41, None, "send_first"),
    (spec(tp_size=4, total_kv_heads=2), spec(total_kv_heads=2), 29, [[0, 8], [8, 29]], "expect_first"),
    # an empty last chunk carries no bytes, yet must still reach the decode side
    (spec(tp_size=2), spec(), 20, [[0, 20], [20, 20]], "expect_first"),
]


@needs_nixl
@pytest.mark.parametrize("pspec,dspec,n_tokens,chunks,order", CASES,
                         ids=["tp2-to-tp1-chunked", "tp1-to-tp2-send-first", "tp4-replicated-to-tp1-chunked",
                              "empty-last-chunk"])
def test_sliced_plans_stage_over_nixl_byte_exact(cluster, pspec, dspec, n_tokens, chunks, order):
    before = moved(cluster)
    run_case(cluster, pspec, dspec, prefill="prefill-st", decode="decode-st", n_tokens=n_tokens, chunks=chunks,
             order=order, requests=2)
    after = moved(cluster)
    # replicated heads are written once per destination: the decode side's bytes are what moves
    expected = 2 * kv_bytes(dspec, n_tokens)
    assert after[("sent", "nixl", "staged")] - before[("sent", "nixl", "staged")] == expected
    assert after[("received", "nixl", "")] - before[("received", "nixl", "")] == expected
    for key in (("sent", "nixl", "direct"), ("sent", "tcp", "staged"), ("sent", "tcp", "direct")):
        assert after[key] == before[key], key
    assert "mode=staged transport=nixl" in cluster.daemons["prefill-st"].log()
    # operators see the rings (decode side) and that every landing slot came back (prefill side)
    with EngineClient(cluster.daemons["decode-st"].socket_path, timeout=5) as client:
        landing = client.status()["transports"]["landing"]
    assert landing["rings"] >= 1 and landing["bytes_held"] >= SLOT and landing["budget_bytes"] > 0, landing
    with EngineClient(cluster.daemons["prefill-st"].socket_path, timeout=5) as client:
        credits_out = client.status()["transports"]["credits_out"]
    assert credits_out and set(credits_out.values()) == {0}, credits_out


@needs_nixl
def test_without_a_landing_ring_auto_runs_direct_and_staged_falls_back_to_tcp(cluster):
    pd, forced, dd = (cluster.daemons[n] for n in ("prefill-st", "prefill-forced", "decode-no-ring"))
    direct0 = metric(pd, "kvxferd_sent_bytes_total", transport="nixl", mode="direct")
    run_case(cluster, spec(tp_size=2), spec(), prefill="prefill-st", decode="decode-no-ring", n_tokens=21, requests=1)
    assert metric(pd, "kvxferd_sent_bytes_total", transport="nixl", mode="direct") - direct0 == kv_bytes(spec(), 21)
    # mode=staged insists on staging: NIXL cannot give it here, tcp can
    run_case(cluster, spec(tp_size=2), spec(), prefill="prefill-forced", decode="decode-no-ring", n_tokens=21,
             requests=1)
    assert metric(forced, "kvxferd_sent_bytes_total", transport="tcp", mode="staged") == kv_bytes(spec(), 21)
    assert metric(forced, "kvxferd_sent_bytes_total", transport="nixl") == 0
    assert "staged mode needs a landing ring" in forced.log()
    assert "limits.nixl_landing_slots is 0" not in dd.log()  # a ring turned off is no warning


@needs_nixl
def test_explicit_staged_mode_uses_nixl_when_the_decode_side_offers_a_ring(cluster):
    forced = cluster.daemons["prefill-forced"]
    nixl0 = metric(forced, "kvxferd_sent_bytes_total", transport="nixl", mode="staged")
    # whole rows (TP 1 -> 1) staged because the operator asked for it
    run_case(cluster, spec(), spec(), prefill="prefill-forced", decode="decode-st", n_tokens=23, requests=1)
    assert metric(forced, "kvxferd_sent_bytes_total", transport="nixl", mode="staged") - nixl0 == kv_bytes(spec(), 23)


# -- landing-slot checks against a stand-in prefill daemon ----------------------------------

def _free_notifs(fake: FakePrefillDaemon, want: int, timeout: float) -> list[dict]:
    got: list[dict] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        for _agent, notes in fake.agent.get_new_notifs().items():
            got.extend(msgpack.unpackb(m) for m in notes)
        time.sleep(0.02)
    return got


@needs_nixl
def test_staged_notifications_naming_foreign_slots_or_wrong_sizes_are_refused(cluster, monkeypatch):
    for key, value in UCX_ENV.items():
        monkeypatch.setenv(key, value)
    dd = cluster.daemons["decode-st"]
    fake = FakePrefillDaemon(spec(tp_size=2), mode="staged")
    decode = cluster.instance(dd, "fake-sd", "decode", spec(), NUM_PAGES)
    try:
        hs = fake.engage(decode[0], "forged-1", pages=[1, 2], n=8)
        ring, address, slot_bytes, count, _device = hs["nixl_landing"]
        assert (slot_bytes, count) == (SLOT, 1)
        invalid0 = metric(dd, "kvxferd_invalid_messages_total", endpoint="data")
        header = {"op": "data", "request_id": "forged-1", "decode_instance": "fake-sd", "dst": [0, 0],
                  "src": [0, 0], "start": 0, "end": 8, "last": True, "nbytes": 8 * 8 * 2 * 16 * 2,
                  "token": hs["data_token"], "ring": ring, "block": 0, "pack": SLOT}
        # a slot outside the ring, a ring that is not this sender's, blocks larger than a slot:
        # refused, the request lives on
        for bad in ({"slot": count}, {"slot": 0, "ring": ring + 1000}, {"slot": 0, "pack": SLOT + 1}):
            fake.agent.send_notif(hs["nixl_agent"], msgpack.packb({**header, **bad}, use_bin_type=True))
        deadline = time.monotonic() + 10
        while metric(dd, "kvxferd_invalid_messages_total", endpoint="data") < invalid0 + 3:
            assert time.monotonic() < deadline, "foreign slots were not refused"
            time.sleep(0.05)
        assert _free_notifs(fake, 1, 0.5) == []  # nothing of ours was taken, nothing is handed back
        assert "holds ring" in dd.log() and "no ring here" not in dd.log()
        # its own slot with a size the geometry contradicts: the request fails, the slot comes back
        fake.agent.send_notif(hs["nixl_agent"], msgpack.packb({**header, "slot": 0, "nbytes": 999},
                                                             use_bin_type=True))
        ev = finished(decode[0], "forged-1", timeout=15)
        assert ev["state"] == "failed" and ev["code"] == "peer_refused", ev
        assert "999" in ev["reason"] and "geometry says 4096" in ev["reason"], ev
        assert _free_notifs(fake, 1, 10) == [{"op": "free", "ring": ring, "slot": 0}]
    finally:
        close(decode)
        fake.close()


@needs_nixl
def test_blocks_written_in_place_are_checked_like_landed_ones(cluster, monkeypatch):
    """A block WRITTEN straight into the decode pages (no ring, no slot) goes through the same
    header checks as a landed one: a size the geometry contradicts fails the request, and no
    landing slot is handed back for it (it took none)."""
    for key, value in UCX_ENV.items():
        monkeypatch.setenv(key, value)
    dd = cluster.daemons["decode-st"]
    fake = FakePrefillDaemon(spec(tp_size=2), mode="staged")
    decode = cluster.instance(dd, "fake-pl", "decode", spec(), NUM_PAGES)
    try:
        hs = fake.engage(decode[0], "forged-2", pages=[1, 2], n=8)
        header = {"op": "data", "request_id": "forged-2", "decode_instance": "fake-pl", "dst": [0, 0],
                  "src": [0, 0], "start": 0, "end": 8, "last": True, "nbytes": 999,
                  "token": hs["data_token"], "block": 0, "pack": SLOT}
        fake.agent.send_notif(hs["nixl_agent"], msgpack.packb(header, use_bin_type=True))
        ev = finished(decode[0], "forged-2", timeout=15)
        assert ev["state"] == "failed" and ev["code"] == "peer_refused", ev
        assert "block 0" in ev["reason"] and "999" in ev["reason"], ev
        assert _free_notifs(fake, 1, 0.5) == []
    finally:
        close(decode)
        fake.close()


@needs_nixl
@pytest.mark.parametrize("extra,says", [({"block": 0, "pack": SLOT, "slot": 0}, "trail lacks them"),
                                        ({}, "a direct NIXL chunk's header carries them")],
                         ids=["last-block-without-digests", "direct-chunk"])
def test_digests_said_to_trail_must_come_in_a_staged_chunks_last_block(cluster, monkeypatch, extra, says):
    """``trailer`` over NIXL means the digests ride in the last staged block: a last block
    without them, or a direct chunk's header saying it, fails the request as refused rather
    than leaving a chunk with nothing to be checked against."""
    for key, value in UCX_ENV.items():
        monkeypatch.setenv(key, value)
    dd = cluster.daemons["decode-st"]
    fake = FakePrefillDaemon(spec(tp_size=2), mode="staged")
    name = f"fake-tr{len(extra)}"
    decode = cluster.instance(dd, name, "decode", spec(), NUM_PAGES)
    try:
        hs = fake.engage(decode[0], "trail", pages=[1, 2], n=8)
        ring = hs["nixl_landing"][0]
        header = {"op": "data", "request_id": "trail", "decode_instance": name, "dst": [0, 0], "src": [0, 0],
                  "start": 0, "end": 8, "last": True, "nbytes": 8 * 8 * 2 * 16 * 2, "token": hs["data_token"],
                  "trailer": True, **extra, **({"ring": ring} if "slot" in extra else {})}
        header["header_digest"] = digest_oracles.header(header)  # the header itself is as sent
        fake.agent.send_notif(hs["nixl_agent"], msgpack.packb(header, use_bin_type=True))
        ev = finished(decode[0], "trail", timeout=15)
        assert ev["state"] == "failed" and ev["code"] == "peer_refused" and says in ev["reason"], ev
        if "slot" in extra:  # the landing slot is read and handed back
            assert _free_notifs(fake, 1, 10) == [{"op": "free", "ring": ring, "slot": 0}]
        assert "Traceback" not in dd.log() and "check_crashed" not in dd.log()
    finally:
        close(decode)
        fake.close()


# -- a frozen decode daemon while blocks wait for landing slots ----------------------------

@needs_nixl
def test_sender_waiting_for_landing_slots_of_a_frozen_decode_daemon_fails_within_the_deadline():
    with cluster_run(kill_engines=True) as c:
        pd = c.daemon("prefill-f", extra_toml=SLOW_TIMEOUTS, env=STAGED_ENV)
        dd = c.daemon("decode-f", extra_toml=SLOW_TIMEOUTS, env=STAGED_ENV)
        prefill, decode = instances(c, (pd, "fp", "prefill", spec(tp_size=2)), (dd, "fd", "decode", spec()))
        decode[0].command(cmd="expect", request_id="frozen", pages=list(range(10)), n=40, source_instance="fp",
                          source_address=pd.address)
        for w in prefill:
            w.command(cmd="send", request_id="frozen", pages=list(range(20, 30)), n=40, chunks=[[0, 4], [4, 40]],
                      hold_last=True)
        deadline = time.monotonic() + 20
        while metric(dd, "kvxferd_received_bytes_total", transport="nixl") < kv_bytes(spec(), 4):
            assert time.monotonic() < deadline, "first chunk never landed"
            time.sleep(0.05)
        dd.signal(signal.SIGSTOP)  # no scatter, no free: the second block of each writer waits for a slot
        for w in prefill:  # 36 tokens x 512 bytes per writer: 5 blocks of 8 tokens through one landing slot
            w.command(cmd="send_chunks", request_id="frozen", pages=list(range(20, 30)), n=40,
                      chunks=[[4, 40, True]])
        # waited for less than the 30 s phase timeouts: ended by the heartbeats (peer_dead) or not at all
        events = [finished(w, "frozen", timeout=25) for w in prefill]
        dd.signal(signal.SIGKILL)
        dd.proc.wait()
        for ev in events:
            if ev["event"] == "finished":
                assert ev["state"] == "failed" and ev["code"] == "peer_dead", ev
            else:  # the heartbeat failed it before the last chunk was handed over
                assert ev["code"] == "request_finished" and "peer_dead" in ev["error"], ev


# -- pieces without processes ------------------------------------------------------------------

def test_credits_hand_out_each_slot_once_and_take_back_only_what_they_gave():
    credits = Credits("decode-agent", RingInfo(7, 1 << 20, 4096, 2, -1))
    a = credits.acquire(time.monotonic() + 1, lambda: "")
    b = credits.acquire(time.monotonic() + 1, lambda: "")
    assert {a, b} == {0, 1} and credits.outstanding == 2
    assert credits.info.slot_address(b) == (1 << 20) + 4096 * b
    with pytest.raises(TransferError) as err:
        credits.acquire(time.monotonic() + 0.1, lambda: "")
    assert err.value.code == "staging_timeout" and err.value.field == "limits.nixl_landing_slots"
    with pytest.raises(TransferError) as err:
        credits.acquire(time.monotonic() + 5, lambda: "decode daemon unresponsive")
    assert err.value.code == "peer_dead" and "unresponsive" in str(err.value)
    assert credits.release(a) is True
    assert credits.release(a) is False  # a repeated free changes nothing
    assert credits.release(5) is False
    assert credits.acquire(time.monotonic() + 1, lambda: "") == a


def test_a_credit_waiter_wakes_when_a_slot_comes_back():
    credits = Credits("decode-agent", RingInfo(1, 4096, 4096, 1, -1))
    first = credits.acquire(time.monotonic() + 1, lambda: "")
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(credits.acquire(time.monotonic() + 5, lambda: "")))
    waiter.start()
    time.sleep(0.1)
    assert got == []  # still waiting: the only slot is out
    credits.release(first)
    waiter.join(5)
    assert got == [first]


def test_block_pieces_cut_the_wire_stream_at_region_boundaries():
    # 3 regions x 5 tokens = 15 slices of 10 bytes, 4 slices per block
    assert block_pieces(0, 3, 5, 4, 10) == [Piece(0, 0, 4, 0)]
    assert block_pieces(1, 3, 5, 4, 10) == [Piece(0, 4, 5, 0), Piece(1, 0, 3, 10)]
    assert block_pieces(2, 3, 5, 4, 10) == [Piece(1, 3, 5, 0), Piece(2, 0, 2, 20)]
    assert block_pieces(3, 3, 5, 4, 10) == [Piece(2, 2, 5, 0)]
    assert pack(3, 5, 10, 40) == [block_pieces(k, 3, 5, 4, 10) for k in range(4)]


@given(regions=st.integers(1, 12), tokens=st.integers(1, 300), per_slot=st.integers(1, 64))
def test_any_block_can_be_cut_alone_and_the_blocks_tile_the_chunk(regions, tokens, per_slot):
    seen = np.zeros((regions, tokens), dtype=int)
    for k in range(-(-regions * tokens // per_slot)):
        used = 0
        for piece in block_pieces(k, regions, tokens, per_slot, 1):
            assert piece.offset == used and piece.lo < piece.hi
            seen[piece.region, piece.lo:piece.hi] += 1
            used += piece.hi - piece.lo
        assert 0 < used <= per_slot
    assert (seen == 1).all()


class _Rank:
    id = "d/0/0"

    class geometry:  # noqa: N801 - shaped like RankGeometry for Sink.regions()
        class spec:  # noqa: N801
            region_kinds = ("k", "v")

        @staticmethod
        def kinds_of(group: str = "") -> tuple[str, ...]:
            return ("k", "v")  # no cache groups: the main KV's kinds

    def region(self, layer, kind):
        return (layer, kind)


class _Entry:
    rank = _Rank()


class _Writer:
    src = (0, 0)
    group = ""
    layers = (0, 2)
    slice_bytes = 64


class _Inbox:
    """Records what the assemblies reserve and release (the real inbox is exercised end to end above)."""

    def __init__(self):
        self.begun, self.finished, self.headers = [], [], []

    def begin(self, header, rid, transport=""):
        self.begun.append((header["start"], header["end"]))
        self.headers.append(header)
        return Sink(_Entry(), _Writer(), header["start"], header["end"], header["last"], header["nbytes"],
                    np.arange(header["end"] - header["start"]), 0, None, header.get("digests"), None,
                    bool(header.get("trailer")))

    def finish(self, sink, ok, transport=""):
        self.finished.append(((sink.start, sink.end), ok))


def _block(k, **extra):
    # 4 regions x 10 tokens x 64 bytes, blocks of 1024 bytes (16 slices): 3 blocks
    return {"request_id": "r", "src": [0, 0], "start": 0, "end": 10, "last": True, "nbytes": 2560,
            "pack": 1024, "block": k, **extra}


def test_a_staged_chunk_counts_as_received_only_when_its_last_block_is_scattered():
    inbox = _Inbox()
    asm_of = Assemblies(inbox)
    ok = lambda sink: None  # noqa: E731 - the sender is the request's source
    a2, pieces = asm_of.start_block(_block(2), "d/0/0", "agent", ok)
    assert pieces == [Piece(3, 2, 10, 0)] and inbox.begun == [(0, 10)]
    assert asm_of.end_block(a2, True) is None
    a0, _ = asm_of.start_block(_block(0), "d/0/0", "agent", ok)
    with pytest.raises(RequestError, match="out of range or repeated"):
        asm_of.start_block(_block(0), "d/0/0", "agent", ok)
    with pytest.raises(RequestError, match="out of range"):
        asm_of.start_block(_block(3), "d/0/0", "agent", ok)
    with pytest.raises(RequestError, match="disagrees"):
        asm_of.start_block(_block(1), "d/0/0", "other-agent", ok)
    with pytest.raises(RequestError, match="disagrees"):
        asm_of.start_block(_block(1, nbytes=999), "d/0/0", "agent", ok)
    assert asm_of.end_block(a0, True) is None
    a1, _ = asm_of.start_block(_block(1), "d/0/0", "agent", ok)
    assert inbox.finished == []
    assert asm_of.end_block(a1, True) is True
    assert inbox.begun == [(0, 10)] and inbox.finished == [((0, 10), True)] and len(asm_of) == 0


def test_a_trailer_chunks_digests_come_with_its_last_block_whichever_block_arrives_first():
    """The sender hashes each block as it gathers it and sends the digests with the last block;
    the receiver takes them from that block only, and refuses them anywhere else."""
    inbox = _Inbox()
    asm_of = Assemblies(inbox)
    ok = lambda sink: None  # noqa: E731 - the sender is the request's source
    last, _ = asm_of.start_block(_block(2, trailer=True, digests=[1, 2, 3, 4]), "d/0/0", "agent", ok)
    # the chunk is reserved without them (a header with trailer and digests is otherwise malformed)
    assert "digests" not in inbox.headers[0] and inbox.headers[0]["trailer"] is True
    assert last.sink.trailer and last.sink.digests == [1, 2, 3, 4]
    with pytest.raises(RequestError, match="block 1 of a chunk of 3 blocks whose digests trail carries them"):
        asm_of.start_block(_block(1, trailer=True, digests=[1, 2, 3, 4]), "d/0/0", "agent", ok)
    with pytest.raises(RequestError, match="disagrees"):  # a block that says nothing of a trailer
        asm_of.start_block(_block(1), "d/0/0", "agent", ok)
    first, _ = asm_of.start_block(_block(0, trailer=True), "d/0/0", "agent", ok)
    middle, _ = asm_of.start_block(_block(1, trailer=True), "d/0/0", "agent", ok)
    assert [asm_of.end_block(a, True) for a in (last, first, middle)] == [None, None, True]
    assert inbox.finished == [((0, 10), True)] and middle.sink.digests == [1, 2, 3, 4]
    # the last block without them: refused (the chunk would have nothing to be checked against)
    other = Assemblies(_Inbox())
    other.start_block(_block(0, trailer=True), "d/0/0", "agent", ok)
    with pytest.raises(RequestError, match="block 2 of a chunk of 3 blocks whose digests trail lacks them"):
        other.start_block(_block(2, trailer=True), "d/0/0", "agent", ok)


class _Region:
    def __init__(self):
        self.flat = torch.zeros(10 * 64, dtype=torch.uint8)


class _PagesRank(_Rank):
    def __init__(self):
        self.pages = {(layer, kind): _Region() for layer in range(2) for kind in ("k", "v")}

    def region(self, layer, kind):
        return self.pages[(layer, kind)]


class _PagesWriter(_Writer):
    dst_row_bytes = 64


class _CheckingInbox(_Inbox):
    """Begins chunks over real pages, and notes at each finish (where the landed check runs) how
    many landing slots had been handed back by then."""

    def __init__(self, frees):
        super().__init__()
        self.frees, self.rank, self.at_finish = frees, _PagesRank(), []

    def begin(self, header, rid, transport=""):
        self.begun.append((header["start"], header["end"]))
        entry = type("Entry", (), {"rank": self.rank})()
        return Sink(entry, _PagesWriter(), header["start"], header["end"], header["last"], header["nbytes"],
                    np.arange(header["end"] - header["start"]), 0, None)

    def finish(self, sink, ok, transport=""):
        self.at_finish.append(len(self.frees))
        super().finish(sink, ok, transport)


class _Receiver(NixlReceiver):
    """The receiving methods over a ring and a recording agent, no NIXL."""

    def __init__(self, inbox, frees):
        self.assemblies = Assemblies(inbox)
        self.agent = type("Agent", (), {"send_notif": lambda _self, who, msg: frees.append(msgpack.unpackb(msg))})()
        self.on_received = self.on_invalid = self.on_refused = None

    def _check_source(self, sender, sink):
        pass  # the stand-in sender is the request's source


def test_a_landing_slot_is_handed_back_before_its_chunks_landed_check_runs():
    """The last block's end runs the check over every page of the chunk: its slot, already
    scattered, goes back to the sender first, so the sender's next block need not wait for it.
    The pages hold the slots' bytes, byte for byte."""
    frees: list[dict] = []
    inbox = _CheckingInbox(frees)
    receiver = _Receiver(inbox, frees)
    ring = LandingRing(7, "source", count=3, slot_bytes=1024)
    stream = torch.randint(0, 256, (2560,), dtype=torch.uint8)  # the chunk's wire bytes, 3 blocks of <= 1 KiB
    for k in (2, 0, 1):  # in any order: the chunk ends with the block that completes it
        ring.slot(k, 1024)[:min(1024, 2560 - 1024 * k)] = stream[1024 * k:1024 * (k + 1)]
        assert ring.claim(k)
        receiver._scatter_block("agent", ring, k, _block(k, decode_instance="d", dst=[0, 0]))
    assert inbox.finished == [((0, 10), True)]
    assert inbox.at_finish == [3], "the completing block's slot came back only after the check"
    assert frees == [{"op": "free", "ring": 7, "slot": k} for k in (2, 0, 1)]
    assert all(ring.claim(k) for k in range(3))  # every slot free to be written again
    pages = [inbox.rank.pages[(layer, kind)].flat for layer in range(2) for kind in ("k", "v")]
    assert torch.equal(torch.cat(pages), stream)  # 4 regions x 10 rows of 64 bytes, in wire order


def test_an_abandoned_chunk_is_released_as_failed_only_after_its_busy_blocks_return():
    inbox = _Inbox()
    asm_of = Assemblies(inbox)
    busy, _ = asm_of.start_block(_block(1), "d/0/0", "agent", lambda sink: None)
    assert asm_of.abandon(busy.sink.entry) == 0  # a scatter still writes its pages
    assert inbox.finished == []
    with pytest.raises(RequestError, match="already failed"):
        asm_of.start_block(_block(0), "d/0/0", "agent", lambda sink: None)
    assert asm_of.end_block(busy, True) is False
    assert inbox.finished == [((0, 10), False)] and len(asm_of) == 0


def test_a_first_block_from_a_stranger_releases_its_reservation():
    inbox = _Inbox()

    def not_the_source(sink):
        raise RequestError("not the agent of the source daemon", field="sender")

    with pytest.raises(RequestError, match="not the agent"):
        Assemblies(inbox).start_block(_block(0), "d/0/0", "stranger", not_the_source)
    assert inbox.finished == [((0, 10), False)]


def test_landing_rings_are_bounded_and_quarantined_before_their_memory_is_reused():
    registered, deregistered = [], []
    rings = LandingRings(2, 1024, budget_bytes=4096, quarantine_s=0.2,
                         register=lambda r: registered.append(r.ring), deregister=lambda r: deregistered.append(r.ring))
    a, _ = rings.for_source("10.0.0.1:5000")
    b, _ = rings.for_source("10.0.0.2:5000")
    assert a is not None and b is not None and a.ring != b.ring and a.nbytes == 2048
    assert rings.for_source("10.0.0.1:5000")[0] is a  # one ring per source link
    none, why = rings.for_source("10.0.0.3:5000")
    assert none is None and "limits.nixl_landing_bytes" in why
    rings.bind("10.0.0.1:5000", "agent-a")
    assert rings.by_agent("agent-a") is a and rings.by_agent("agent-b") is None
    rings.retire("10.0.0.1:5000")
    assert deregistered == [a.ring] and rings.by_agent("agent-a") is None
    assert rings.for_source("10.0.0.3:5000")[0] is None  # the retired ring still counts
    time.sleep(0.25)
    c, _ = rings.for_source("10.0.0.3:5000")
    assert c is not None and c.ring not in (a.ring, b.ring)
    assert registered == [a.ring, b.ring, c.ring]


def test_staging_pool_try_acquire_never_waits():
    pool = StagingPool(2048, 1024)
    one, two = pool.try_acquire(), pool.try_acquire()
    assert one is not None and two is not None
    assert pool.try_acquire() is None
    pool.release(one)
    assert pool.try_acquire() is one


def test_landing_fields_are_bounded_by_the_schemas():
    hs = {"op": "handshake", "v": 1, "daemon": "a:1", "data_address": "a:2", "prefill_instance": "p",
          "decode_instance": "d", "decode_spec": {}, "mode": "auto", "transports": ["nixl"]}
    assert messages.check_peer({**hs, "nixl_landing": [3, 4096, 4096, 4, -1]})["nixl_landing"] == [3, 4096, 4096, 4, -1]
    for bad in ([3, 0, 4096, 4, -1], [3, 4096, 4096, 0, -1], [3, 4096], "ring"):
        with pytest.raises(ProtocolError) as err:
            messages.check_peer({**hs, "nixl_landing": bad})
        assert err.value.field == "nixl_landing"
    assert protocol.NIXL_FREE.check({"op": "free", "ring": 3, "slot": 0}) == {"op": "free", "ring": 3, "slot": 0}
    with pytest.raises(ProtocolError):
        protocol.NIXL_FREE.check({"op": "free", "ring": 3, "slot": -1})


def test_config_bounds_the_landing_rings():
    cfg = config.load(None, {})
    assert (cfg.limits.nixl_landing_slots, cfg.limits.nixl_block_bytes, cfg.limits.nixl_landing_bytes) == \
        (4, 16 << 20, 256 << 20)
    assert config.load(None, {"KVXFERD_LIMITS_NIXL_LANDING_SLOTS": "0"}).limits.nixl_landing_slots == 0
    with pytest.raises(ConfigError) as err:
        config.load(None, {"KVXFERD_LIMITS_NIXL_LANDING_SLOTS": "100"})
    assert err.value.field == "limits.nixl_landing_bytes" and "1677721600" in str(err.value)
    # the ring is sized by NIXL's block, not by tcp's staging slot
    small = config.load(None, {"KVXFERD_LIMITS_NIXL_LANDING_SLOTS": "100", "KVXFERD_LIMITS_NIXL_BLOCK_BYTES": "1048576"})
    assert small.limits.nixl_landing_slots * small.limits.nixl_block_bytes <= small.limits.nixl_landing_bytes


@needs_nixl
def test_agents_of_peer_daemons_that_died_are_removed():
    """Both directions: the decode daemon drops a dead source's agent, the prefill daemon a dead destination's."""
    quick = "[timeouts]\ntransfer_s = 2.0\nwaiting_for_input_s = 10.0\nbootstrap_s = 10.0\ndrain_grace_s = 1.0\n"
    with cluster_run(kill_engines=True) as c:
        p1 = c.daemon("prefill-1", extra_toml=quick, env=STAGED_ENV)
        p2 = c.daemon("prefill-2", extra_toml=quick, env=STAGED_ENV)
        d1 = c.daemon("decode-1", extra_toml=quick, env=STAGED_ENV)
        a, b, d = instances(c, (p1, "ga", "prefill", spec()), (p2, "gb", "prefill", spec()),
                            (d1, "gd", "decode", spec()))
        for n, (group, daemon) in enumerate(((a, p1), (b, p2))):
            d[0].command(cmd="expect", request_id=f"gone-{n}", pages=[n], n=4, source_instance=group[0].instance,
                         source_address=daemon.address)
            group[0].command(cmd="send", request_id=f"gone-{n}", pages=[n], n=4)
            assert finished(d[0], f"gone-{n}")["state"] == "done"
        p2.signal(signal.SIGKILL)
        p2.proc.wait()
        deadline = time.monotonic() + 20
        while "event=nixl_agent_removed" not in d1.log():
            assert time.monotonic() < deadline, "the decode daemon kept the dead source's agent"
            time.sleep(0.2)
        d1.signal(signal.SIGKILL)
        d1.proc.wait()
        while "event=nixl_agent_removed" not in p1.log():
            assert time.monotonic() < deadline + 20, "the prefill daemon kept the dead destination's agent"
            time.sleep(0.2)
        removed = d1.log().split("event=nixl_agent_removed agent=", 1)[1].split("\n", 1)[0]
        assert "kvxferd-prefill-2-" in removed  # the dead source's agent, not the live one's
        assert "kvxferd-decode-1-" in p1.log().split("event=nixl_agent_removed agent=", 1)[1].split("\n", 1)[0]


def _mutations(valid: dict, ring: int, rng) -> list[bytes]:
    """Notifications a confused or hostile source agent might send: valid ones with one field
    dropped or replaced, or digests said to trail, unknown ops, frees of slots it never held, and
    bytes that are not msgpack."""
    junk = [None, -1, 0, 1, 2, 3, 2**31, 2**63 - 1, "x" * 70, b"\x00" * 9, [1, 2], {"a": 1}, True, 1.5]
    out = []
    for _ in range(300):
        msg = dict(valid)
        for key in rng.sample(sorted(msg), rng.randint(1, 3)):
            if key != "op" and rng.random() < 0.25:
                del msg[key]
            else:
                msg[key] = rng.choice(junk + [ring, ring + 1, valid.get(key)])
        out.append(msgpack.packb(msg, use_bin_type=True))
    for _ in range(60):
        out.append(msgpack.packb({"op": rng.choice(["free", "data", "fenced", "ack", ""]),
                                  "ring": rng.choice(junk + [ring]), "slot": rng.choice(junk)}, use_bin_type=True))
    for _ in range(40):  # digests said to trail: in the block or not, of any shape; a direct header saying so
        msg = dict(valid, trailer=rng.choice([True, True, False, 1, "x"]))
        if rng.random() < 0.6:
            msg["digests"] = rng.choice(junk + [[rng.getrandbits(64) for _ in range(rng.randint(0, 40))]])
        for key in rng.choice(((), (), ("ring", "slot"), ("ring", "slot", "block", "pack"))):
            del msg[key]
        out.append(msgpack.packb(msg, use_bin_type=True))
    out += [bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64))) for _ in range(40)]
    return out


@needs_nixl
def test_fuzzed_staged_notifications_never_write_outside_the_request_and_the_daemon_keeps_serving(cluster,
                                                                                                  monkeypatch):
    import random
    for key, value in UCX_ENV.items():
        monkeypatch.setenv(key, value)
    dd = cluster.daemons["decode-st"]
    fake = FakePrefillDaemon(spec(tp_size=2), mode="staged")
    decode = cluster.instance(dd, "fuzz-sd", "decode", spec(), NUM_PAGES)
    try:
        hs = fake.engage(decode[0], "fuzz-1", pages=[1, 2, 3, 4], n=16)
        ring = hs["nixl_landing"][0]
        valid = {"op": "data", "request_id": "fuzz-1", "decode_instance": "fuzz-sd", "dst": [0, 0], "src": [0, 0],
                 "start": 0, "end": 16, "last": True, "nbytes": 16 * 8 * 2 * 16 * 2, "token": hs["data_token"],
                 "ring": ring, "slot": 0, "block": 0, "pack": SLOT}
        invalid0 = metric(dd, "kvxferd_invalid_messages_total", endpoint="data")
        messages = _mutations(valid, ring, random.Random(7))
        started = time.monotonic()
        for message in messages:
            fake.agent.send_notif(hs["nixl_agent"], message)
        deadline = time.monotonic() + 30
        while metric(dd, "kvxferd_invalid_messages_total", endpoint="data") < invalid0 + 100:
            assert time.monotonic() < deadline, "the fuzzed notifications were not refused"
            time.sleep(0.1)
        # the daemon keeps serving: a real staged transfer through it is still byte-exact
        run_case(cluster, spec(tp_size=2), spec(), prefill="prefill-st", decode="decode-st", n_tokens=19,
                 requests=1)
        log = dd.log()
        assert "Traceback" not in log and "scatter_crashed" not in log
        # whatever landed, landed only in the fuzzed request's own pages
        outside = untouched_bytes(decode[0], [p for p in range(NUM_PAGES) if p not in (1, 2, 3, 4)])
        assert outside == 0
        rr.record("fuzz", "nixl_staged_notifications", {
            "endpoint": "nixl", "messages": len(messages), "answered": "n/a (one-sided)",
            "invalid_metric_delta": int(metric(dd, "kvxferd_invalid_messages_total", endpoint="data") - invalid0),
            "internal_errors": 0, "bytes_outside_destinations": outside, "daemon_alive": True,
            "seconds": round(time.monotonic() - started, 2)})
        decode[0].command(cmd="abort", request_id="fuzz-1", reason="fuzz done")
    finally:
        close(decode)
        fake.close()

"""End-to-end integrity: a changed landed byte fails its request ``integrity``, never ``done``.

Real daemons and engine processes on 127.0.0.1, over tcp, NIXL (UCX on loopback tcp) and the
local copy, direct and staged, TP matched (1 -> 1) and mismatched (2 -> 1: head slices). The
corruption is the daemon's test-only fault injection (``integrity.corrupt_landed_every = 1``):
one byte of each landed chunk flipped in the decode pages after the transport wrote them and
before the check read them, which is where a stale writer or a bad transport would leave it.

- The source daemon runs with integrity off and still sends digests: its decode peers ask.
- Clean requests land byte-exact and the decode daemon counts the chunks it checked.
- Corrupted ones fail with code ``integrity`` on the decode side, naming the request and the
  layer, and on the prefill side too, except over NIXL, whose one-sided writes may have told
  the prefill side done (its bytes left) before the check ran.
- A source in ``full`` towards a decode daemon in ``off``: the digests come anyway and are
  checked (the stricter side wins).
- ``sampled``: the same over a share of each request's pages (the injection flips a byte of a
  sampled page); an instance that asks at register is checked on a daemon in ``off``.
- The header: ``aux`` or ``last`` flipped as the decode daemon reads a data header (the
  test-only ``integrity.corrupt_header``) fails the request ``integrity`` on both sides through
  the header's own digest, on every route, before the inbox acts on the header.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from e2e_util import NUM_PAGES, Node, assert_verified, cluster_run, pages_for, spec, start_nodes, transfer
from kvxferd.datapath.integrity import LandedCheck
from kvxferd.lifecycle.inbox import Sink
from kvxferd.ops.metrics import Metrics
from kvxferd.tools import procstats
from nixl_util import NIXL_ENV, NIXL_MISSING, metric

FULL = '[integrity]\nmode = "full"\n'
CORRUPT = '[integrity]\nmode = "full"\ncorrupt_landed_every = 1\n'
OFF_CORRUPT = '[integrity]\nmode = "off"\ncorrupt_landed_every = 1\n'
# one granule (a page here) in two: every request of N_TOKENS has some in each of its chunks
SAMPLED = '[integrity]\nmode = "sampled"\nsample_share = 0.5\n'
SAMPLED_CORRUPT = SAMPLED + 'corrupt_landed_every = 1\n'
STAGED = {"KVXFERD_PEER_MODE": "staged"}  # the run dir's config has its own [peer] table
TRANSPORTS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(bool(NIXL_MISSING), reason=f"NIXL: {NIXL_MISSING}"))]
SHAPES = {"matched": (spec(tp_size=1), spec(tp_size=1)), "sliced": (spec(tp_size=2), spec(tp_size=1))}
# the source's rows sliced and the destination's whole: what NIXL may write in place into the decode pages
SPLIT = {"split": (spec(tp_size=1), spec(tp_size=2))}
N_TOKENS = 22  # several pages and a partial last one; clean requests go in two chunks


def _request(c, pd, dd, tag: str, shape: str, rng: random.Random, local: bool = False,
             chunks: list[list[int]] | None = None, asks: tuple[str | None, str | None] = (None, None)):
    """One request; ``asks``: the integrity mode the prefill and the decode instance register with."""
    pspec, dspec = {**SHAPES, **SPLIT}[shape]
    if asks == (None, None):
        prefill, decode = c.instances((pd, f"{tag}-p", "prefill", pspec, NUM_PAGES),
                                      (dd, f"{tag}-d", "decode", dspec, NUM_PAGES))
    else:
        [prefill] = c.instances((pd, f"{tag}-p", "prefill", pspec, NUM_PAGES), integrity=asks[0])
        [decode] = c.instances((dd, f"{tag}-d", "decode", dspec, NUM_PAGES), integrity=asks[1])
    src = pages_for(rng, NUM_PAGES, N_TOKENS, pspec.page_size)
    dst = pages_for(rng, NUM_PAGES, N_TOKENS, dspec.page_size)
    return transfer(prefill, decode, f"{tag}-r", N_TOKENS, src_pages=src, dst_pages=dst,
                    source_address=None if local else pd.address, chunks=chunks)


def _clean(c, pd, dd, tag, shape, rng, transport, local=False, asks=(None, None), digest="xxh3"):
    checked = metric(dd, "kvxferd_integrity_checked_chunks_total", transport=transport, digest=digest)
    dec, pre = _request(c, pd, dd, tag, shape, rng, local, chunks=[[0, 12], [12, N_TOKENS]], asks=asks)
    assert_verified(dec, pre)
    assert metric(dd, "kvxferd_integrity_checked_chunks_total", transport=transport, digest=digest) > checked, \
        f"{tag}: no chunk was checked with {digest} over {transport}"


def _corrupted(c, pd, dd, tag, shape, rng, transport, local=False, asks=(None, None)):
    failures = metric(dd, "kvxferd_integrity_failures_total", transport=transport)
    # one chunk: a second send after the request failed would be refused, which is not under test
    dec, pre = _request(c, pd, dd, tag, shape, rng, local, asks=asks)
    for ev in dec:
        assert ev["event"] == "finished" and ev["state"] == "failed" and ev["code"] == "integrity", ev
    for ev in pre:
        # NIXL writes are one-sided: the prefill side may already have been told done (its bytes
        # left, and its pages are free) when the decode side's check fails the request
        if transport == "nixl" and ev.get("state") == "done":
            continue
        if ev["event"] == "error":  # a rank whose send came after the request failed hears why in its answer
            assert ev["cmd"] == "send" and "already failed" in ev["error"] and "(integrity:" in ev["error"], ev
            continue
        assert ev["event"] == "finished" and ev["state"] == "failed" and ev["code"] == "integrity", ev
    for ev in dec:
        assert f"{tag}-r" in ev["reason"] and "layer" in ev["reason"], ev
    assert metric(dd, "kvxferd_integrity_failures_total", transport=transport) > failures


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_changed_landed_byte_fails_the_request_on_every_route(request, transport):
    env = NIXL_ENV if transport == "nixl" else {}
    rng = random.Random(7)
    with cluster_run(request) as c:
        src, clean, bad, clean_staged, bad_staged = start_nodes(
            c, Node("src", env=env), Node("clean", FULL, env), Node("bad", CORRUPT, env),
            Node("clean-staged", FULL, {**env, **STAGED}), Node("bad-staged", CORRUPT, {**env, **STAGED}))
        for shape in SHAPES:
            for mode, (ok, broken) in (("direct", (clean, bad)), ("staged", (clean_staged, bad_staged))):
                _clean(c, src, ok, f"ok-{shape}-{mode}", shape, rng, transport)
                _corrupted(c, src, broken, f"bad-{shape}-{mode}", shape, rng, transport)
        # the daemons keep serving after the failures
        _clean(c, src, clean, "after", "sliced", rng, transport)


# landing slots of 1 KiB, four per ring: a chunk of this file's requests is several staged blocks,
# scattered by two threads in whatever order they land
MANY_BLOCKS = {**NIXL_ENV, **STAGED, "KVXFERD_LIMITS_NIXL_BLOCK_BYTES": "1024", "KVXFERD_LIMITS_NIXL_LANDING_SLOTS": "4"}
# ... and a source that takes whole rows in place in runs of 128 bytes or more (a page here is 256-512):
# it reads its own (route ``read``: TP matched and 2 -> 1) or writes the decode side's (``place``:
# 1 -> 2); the other source gathers and lands (``land``)
IN_PLACE = {**MANY_BLOCKS, "KVXFERD_LIMITS_NIXL_IN_PLACE_BYTES": "128"}


@pytest.mark.skipif(bool(NIXL_MISSING), reason=f"NIXL: {NIXL_MISSING}")
def test_staged_nixl_chunks_of_many_blocks_are_checked_on_every_block_route(request):
    """A NIXL source in full hashes each staged block as it goes (just after gathering it, routes
    ``land`` and ``place``, or just before NIXL reads it in place, ``read``) and sends the digests
    with the chunk's last block: chunks of many blocks land byte-exact and checked, a changed
    landed byte fails the request ``integrity``, TP matched, 2 -> 1 and 1 -> 2."""
    rng = random.Random(13)
    with cluster_run(request) as c:
        src, in_place, clean, bad = start_nodes(
            c, Node("src", FULL, MANY_BLOCKS), Node("src-in-place", FULL, IN_PLACE),
            Node("clean", FULL, MANY_BLOCKS), Node("bad", CORRUPT, MANY_BLOCKS))
        for source in (src, in_place):
            for shape in (*SHAPES, *SPLIT):
                tag = f"{shape}-{source.name}"
                staged = metric(source, "kvxferd_sent_bytes_total", transport="nixl", mode="staged")
                _clean(c, source, clean, f"ok-{tag}", shape, rng, "nixl")
                assert metric(source, "kvxferd_sent_bytes_total", transport="nixl", mode="staged") > staged, tag
                _corrupted(c, source, bad, f"bad-{tag}", shape, rng, "nixl")
            moved = procstats.scrape(source.metrics_url)  # a staged chunk's fragments are at least its blocks
            assert moved["kvxferd_chunk_fragments_sum"] >= 3 * moved["kvxferd_chunk_fragments_count"] > 0, moved
        assert "Traceback" not in clean.log() and "check_crashed" not in clean.log()


# a source whose pages are on a GPU checks them with the device digest; here host pages are made
# to (integrity.device_digest_on_cpu), so its whole path runs without a GPU
WSUM = FULL + 'device_digest_on_cpu = true\n'
WSUM_SAMPLED = SAMPLED + 'device_digest_on_cpu = true\n'


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_device_digest_is_checked_on_every_route_and_a_changed_byte_fails(request, transport):
    """A source checked with word sums sends them (``hash = "wsum"``) in its headers, never as a
    trailer; the destination takes the same digest over its own landed pages: clean requests land
    byte-exact and checked with ``wsum``, full and sampled, direct and staged, TP matched and
    sliced; a flipped landed byte fails the request ``integrity``."""
    env = NIXL_ENV if transport == "nixl" else {}
    rng = random.Random(12)
    with cluster_run(request) as c:
        src, src_sampled, clean, bad, clean_staged, bad_staged, sampled_bad, local_bad = start_nodes(
            c, Node("src", WSUM, env), Node("src-sampled", WSUM_SAMPLED, env), Node("clean", FULL, env),
            Node("bad", CORRUPT, env), Node("clean-staged", FULL, {**env, **STAGED}),
            Node("bad-staged", CORRUPT, {**env, **STAGED}), Node("sampled-bad", OFF_CORRUPT, env),
            Node("local-bad", WSUM + "corrupt_landed_every = 1\n", env))
        for shape in SHAPES:
            for mode, (ok, broken) in (("direct", (clean, bad)), ("staged", (clean_staged, bad_staged))):
                _clean(c, src, ok, f"wok-{shape}-{mode}", shape, rng, transport, digest="wsum")
                _corrupted(c, src, broken, f"wbad-{shape}-{mode}", shape, rng, transport)
            _clean(c, src_sampled, clean, f"wsok-{shape}", shape, rng, transport, digest="wsum")
            _corrupted(c, src_sampled, sampled_bad, f"wsbad-{shape}", shape, rng, transport)
        for shape in SHAPES:  # the local copy (a source and a destination on one daemon)
            _clean(c, src, src, f"wlok-{shape}", shape, rng, "local", local=True, digest="wsum")
            _corrupted(c, local_bad, local_bad, f"wlbad-{shape}", shape, rng, "local", local=True)
        # a source checked with XXH3 towards the same daemons: both digests side by side
        _clean(c, clean_staged, clean, "xok", "sliced", rng, transport)


# pages of 32 KiB per region (16 tokens of 8 heads x 128 x 2 bytes): a request of BIG_TOKENS is
# one chunk of about 9 MiB, which a tcp source in full hashes as it leaves (the digests after the
# payload) and a decode daemon hashes as it lands in place, several blocks per region
BIG = {"matched": (spec(total_kv_heads=8, head_dim=128, page_size=16),) * 2,
       "sliced": (spec(total_kv_heads=8, head_dim=128, page_size=16, tp_size=2),
                  spec(total_kv_heads=8, head_dim=128, page_size=16))}
BIG_TOKENS = 600


def _big(c, pd, dd, tag, shape, rng):
    pspec, dspec = BIG[shape]
    prefill, decode = c.instances((pd, f"{tag}-p", "prefill", pspec, NUM_PAGES),
                                  (dd, f"{tag}-d", "decode", dspec, NUM_PAGES))
    return transfer(prefill, decode, f"{tag}-r", BIG_TOKENS, source_address=pd.address,
                    src_pages=pages_for(rng, NUM_PAGES, BIG_TOKENS, pspec.page_size),
                    dst_pages=pages_for(rng, NUM_PAGES, BIG_TOKENS, dspec.page_size))


def test_large_tcp_chunks_are_hashed_as_they_move_and_a_changed_byte_fails(request):
    """Where every slot is checked, a large tcp chunk is hashed block by block as it leaves and
    as it lands (direct), or as it is gathered (staged): clean requests land byte-exact and
    checked, a byte flipped in the landed pages fails the request ``integrity``."""
    rng = random.Random(11)
    with cluster_run(request) as c:
        src, clean, bad, src_staged = start_nodes(c, Node("src", FULL), Node("clean", FULL), Node("bad", CORRUPT),
                                                  Node("src-staged", FULL, STAGED))
        for shape in BIG:
            for source in (src, src_staged):
                tag = f"{shape}-{source.name}"
                checked = metric(clean, "kvxferd_integrity_checked_chunks_total", transport="tcp")
                assert_verified(*_big(c, source, clean, f"ok-{tag}", shape, rng))
                assert metric(clean, "kvxferd_integrity_checked_chunks_total", transport="tcp") > checked
                failures = metric(bad, "kvxferd_integrity_failures_total", transport="tcp")
                dec, pre = _big(c, source, bad, f"bad-{tag}", shape, rng)
                for ev in dec + pre:
                    if ev["event"] == "error":  # a rank whose send came after the request failed
                        assert ev["cmd"] == "send" and "(integrity:" in ev["error"], ev
                        continue
                    assert ev["event"] == "finished" and ev["state"] == "failed" and ev["code"] == "integrity", ev
                assert metric(bad, "kvxferd_integrity_failures_total", transport="tcp") > failures


def test_local_copies_are_checked_and_a_changed_byte_fails(request):
    rng = random.Random(8)
    with cluster_run(request) as c:
        clean, bad = start_nodes(c, Node("clean", FULL), Node("bad", CORRUPT))
        for shape in SHAPES:
            _clean(c, clean, clean, f"lok-{shape}", shape, rng, "local", local=True)
            _corrupted(c, bad, bad, f"lbad-{shape}", shape, rng, "local", local=True)


def test_the_stricter_side_wins_a_source_in_full_sends_digests_to_a_decode_daemon_in_off(request):
    rng = random.Random(9)
    with cluster_run(request) as c:
        src, dst, plain = start_nodes(c, Node("src", FULL), Node("dst", OFF_CORRUPT), Node("plain"))
        _corrupted(c, src, dst, "strict", "sliced", rng, "tcp")
        # neither side in full: no digests, nothing checked, and nothing corrupted (the injection
        # only touches chunks that carry digests)
        before = metric(plain, "kvxferd_integrity_checked_chunks_total")
        dec, pre = _request(c, dst, plain, "neither", "matched", rng)
        assert_verified(dec, pre)
        assert metric(plain, "kvxferd_integrity_checked_chunks_total") == before
        # engines hear the mode in status, and both sides each pair's, as its handshake agreed it
        from kvxferd.sdk.client import EngineClient
        with EngineClient(src.socket_path, timeout=30) as client:
            status = client.status()
        assert status["integrity"] == "full"
        assert [(x["side"], x["prefill"], x["decode"], x["integrity"]) for x in status["integrity_pairs"]] == [
            ("prefill", "strict-p", "strict-d", "full")]
        with EngineClient(dst.socket_path, timeout=30) as client:
            pairs = {(x["side"], x["prefill"], x["decode"]): x["integrity"] for x in client.status()["integrity_pairs"]}
        assert pairs == {("decode", "strict-p", "strict-d"): "full", ("prefill", "neither-p", "neither-d"): "off"}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sampled_mode_checks_each_request_and_fails_a_changed_byte_in_its_sample(request, transport):
    env = NIXL_ENV if transport == "nixl" else {}
    rng = random.Random(10)
    with cluster_run(request) as c:
        src, clean, bad = start_nodes(c, Node("src", env=env), Node("clean", SAMPLED, env),
                                      Node("bad", SAMPLED_CORRUPT, env))
        for shape in SHAPES:
            _clean(c, src, clean, f"sok-{shape}", shape, rng, transport)
            _corrupted(c, src, bad, f"sbad-{shape}", shape, rng, transport)
        from kvxferd.sdk.client import EngineClient
        with EngineClient(clean.socket_path, timeout=30) as client:
            status = client.status()
        assert (status["integrity"], status["integrity_sample_share"]) == ("sampled", 0.5)


def test_sampled_local_copies_and_a_sampled_source_towards_a_daemon_in_off(request):
    rng = random.Random(11)
    with cluster_run(request) as c:
        sampled, bad, off_bad = start_nodes(c, Node("sampled", SAMPLED), Node("bad", SAMPLED_CORRUPT),
                                            Node("off-bad", OFF_CORRUPT))
        for shape in SHAPES:
            _clean(c, sampled, sampled, f"slok-{shape}", shape, rng, "local", local=True)
            _corrupted(c, bad, bad, f"slbad-{shape}", shape, rng, "local", local=True)
        # the source samples on its own: the decode daemon in off checks what it sent
        _corrupted(c, sampled, off_bad, "s-src", "sliced", rng, "tcp")


def test_an_instance_that_asks_at_register_is_checked_on_daemons_in_off(request):
    rng = random.Random(12)
    with cluster_run(request) as c:
        src, off, off_bad = start_nodes(c, Node("src"), Node("off"), Node("off-bad", OFF_CORRUPT))
        # the decode instance asks: its daemon asks the source for digests in each expect
        _clean(c, src, off, "ask-d", "sliced", rng, "tcp", asks=(None, "full"))
        _corrupted(c, src, off_bad, "ask-d-bad", "sliced", rng, "tcp", asks=(None, "full"))
        # the prefill instance asks: its daemon sends digests, which the decode daemon checks
        _corrupted(c, src, off_bad, "ask-p-bad", "matched", rng, "tcp", asks=("full", None))
        # the rank's ask shows in status
        from kvxferd.sdk.client import EngineClient
        with EngineClient(off.socket_path, timeout=30) as client:
            ranks = client.status()["ranks"]
        assert {r["instance"]: r.get("integrity") for r in ranks}["ask-d-d"] == "full"


def test_a_chunk_whose_digests_were_to_trail_and_never_came_fails_closed():
    """Without a process: a landed chunk that said its digests would follow its bytes (its
    sample set, its digests not) fails the check with a reason and a counted failure, rather
    than counting, or crashing the thread that checks it. Every transport fills or refuses the
    digests before this; the check does not rely on it."""
    metrics = Metrics()
    side = SimpleNamespace(group_spec=lambda group: SimpleNamespace(page_size=4))
    rank = SimpleNamespace(id="d/tp0/pp0", geometry=SimpleNamespace(
        spec=SimpleNamespace(page_size=4), group=lambda group: SimpleNamespace(spec=SimpleNamespace(page_size=4))))
    entry = SimpleNamespace(integrity=None, plan=SimpleNamespace(prefill=side, decode=side), request_id="r-1",
                            rank=rank, groups={}, pages=np.array([5, 6]), daemon_of=lambda src: "127.0.0.1:9")
    writer = SimpleNamespace(src=(0, 0), group="")
    sink = Sink(entry, writer, 0, 8, True, 1024, np.arange(8), 0, None, None, FULL, True)
    sink.__dict__["_regions"] = ("k", "v")
    why = LandedCheck(metrics)(sink, "nixl")
    assert why is not None and "never came" in why and "'r-1'" in why and "[5, 6]" in why, why
    assert metrics.registry.get_sample_value("kvxferd_integrity_failures_total",
                                             {"peer": "127.0.0.1:9", "transport": "nixl"}) == 1


# -- the header: a field flipped in flight (integrity.corrupt_header, the test-only injection that
# flips it in every data header with digests as the decode daemon reads it, before the inbox does)

AUX = b"first-token:4242"


def _flipped(field: str, extra: str = "") -> str:
    return f'{extra or FULL}corrupt_header = "{field}"\n'


def _with_aux(c, pd, dd, tag, shape, rng, local=False, chunks=None):
    pspec, dspec = SHAPES[shape]
    prefill, decode = c.instances((pd, f"{tag}-p", "prefill", pspec, NUM_PAGES),
                                  (dd, f"{tag}-d", "decode", dspec, NUM_PAGES))
    return transfer(prefill, decode, f"{tag}-r", N_TOKENS, src_pages=pages_for(rng, NUM_PAGES, N_TOKENS, pspec.page_size),
                    dst_pages=pages_for(rng, NUM_PAGES, N_TOKENS, dspec.page_size),
                    source_address=None if local else pd.address, chunks=chunks, aux=AUX)


def _header_failed(dec, pre, tag):
    """Both sides end ``integrity``, the decode side naming the header (a NIXL source too: its
    WRITEs complete before the decode daemon reads the header, and it is done only on ``landed``)."""
    for ev in dec:
        assert ev["event"] == "finished" and ev["state"] == "failed" and ev["code"] == "integrity", ev
        assert f"{tag}-r" in ev["reason"] and "header" in ev["reason"] and "layer" not in ev["reason"], ev
    for ev in pre:
        if ev["event"] == "error":  # a rank whose send came after the request failed hears why in its answer
            assert ev["cmd"] == "send" and "(integrity:" in ev["error"], ev
            continue
        assert ev["event"] == "finished" and ev["state"] == "failed" and ev["code"] == "integrity", ev


def _flip_fails(c, pd, dd, tag, shape, rng, transport, local=False, chunks=None):
    failures = metric(dd, "kvxferd_integrity_failures_total", transport=transport)
    dec, pre = _with_aux(c, pd, dd, tag, shape, rng, local, chunks)
    _header_failed(dec, pre, tag)
    assert metric(dd, "kvxferd_integrity_failures_total", transport=transport) > failures, tag


def _aux_clean(c, pd, dd, tag, shape, rng, transport, local=False):
    checked = metric(dd, "kvxferd_integrity_checked_chunks_total", transport=transport)
    dec, pre = _with_aux(c, pd, dd, tag, shape, rng, local, chunks=[[0, 12], [12, N_TOKENS]])
    assert_verified(dec, pre)
    assert all(ev["aux"] == AUX.hex() for ev in dec), dec
    assert metric(dd, "kvxferd_integrity_checked_chunks_total", transport=transport) > checked, tag


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_flipped_aux_or_last_in_flight_fails_the_request_on_both_sides(request, transport):
    """The header's own digest covers what the decode side acts on: ``aux`` (the token its engine
    continues from) or ``last`` flipped in flight fails the request ``integrity`` on both sides,
    never ``done`` with the altered aux nor a decode side left waiting for a last chunk that came,
    direct and staged, TP matched and sliced, XXH3 and word sums, full and sampled; a last flag
    flipped on a chunk that was not the last fails alike. The same daemons land clean requests,
    aux and bytes exact and checked, and keep serving."""
    env = NIXL_ENV if transport == "nixl" else {}
    rng = random.Random(21)
    with cluster_run(request) as c:
        src, src_wsum, clean, aux, last, aux_staged, last_staged, last_sampled = start_nodes(
            c, Node("src", env=env), Node("src-wsum", WSUM, env), Node("clean", FULL, env),
            Node("bad-aux", _flipped("aux"), env), Node("bad-last", _flipped("last"), env),
            Node("bad-aux-staged", _flipped("aux"), {**env, **STAGED}),
            Node("bad-last-staged", _flipped("last"), {**env, **STAGED}),
            Node("bad-last-sampled", _flipped("last", SAMPLED), env))
        for node in (aux, last):
            assert "event=integrity_fault_injection header_field=" in node.log()
        for shape in SHAPES:
            for source in (src, src_wsum):
                tag = f"{shape}-{source.name}"
                _aux_clean(c, source, clean, f"ok-{tag}", shape, rng, transport)
                for bad in (aux, last, aux_staged, last_staged):
                    _flip_fails(c, source, bad, f"{bad.name}-{tag}", shape, rng, transport)
            _flip_fails(c, src, last_sampled, f"sampled-{shape}", shape, rng, transport)
        # last flipped to true on a chunk that is not the last: refused as a changed header, not a range
        _flip_fails(c, src, last, "early-last", "matched", rng, transport, chunks=[[0, 12], [12, N_TOKENS]])
        assert "Traceback" not in last.log() and "check_crashed" not in last.log()
        _aux_clean(c, src, clean, "after", "sliced", rng, transport)


def test_a_flipped_header_fails_large_tcp_chunks_whose_digests_trail_and_local_copies(request):
    """A large tcp chunk whose digests follow its payload is checked by its header digest before
    a byte of it is written; a local copy's header goes through the same check. Either way a
    flipped ``aux`` or ``last`` fails the request ``integrity`` on both sides."""
    rng = random.Random(22)
    with cluster_run(request) as c:
        src, aux, last, clean = start_nodes(c, Node("src", FULL), Node("bad-aux", _flipped("aux")),
                                            Node("bad-last", _flipped("last")), Node("clean", FULL))
        for shape in BIG:
            for bad in (last, aux):
                pspec, dspec = BIG[shape]
                tag = f"big-{bad.name}-{shape}"
                prefill, decode = c.instances((src, f"{tag}-p", "prefill", pspec, NUM_PAGES),
                                              (bad, f"{tag}-d", "decode", dspec, NUM_PAGES))
                failures = metric(bad, "kvxferd_integrity_failures_total", transport="tcp")
                dec, pre = transfer(prefill, decode, f"{tag}-r", BIG_TOKENS, source_address=src.address, aux=AUX,
                                    src_pages=pages_for(rng, NUM_PAGES, BIG_TOKENS, pspec.page_size),
                                    dst_pages=pages_for(rng, NUM_PAGES, BIG_TOKENS, dspec.page_size))
                _header_failed(dec, pre, tag)
                assert metric(bad, "kvxferd_integrity_failures_total", transport="tcp") > failures
        for shape in SHAPES:  # the local copy: a source and a destination on one daemon
            _aux_clean(c, clean, clean, f"lok-{shape}", shape, rng, "local", local=True)
            for bad in (aux, last):
                _flip_fails(c, bad, bad, f"local-{bad.name}-{shape}", shape, rng, "local", local=True)
        for node in (aux, last):
            assert "scope=header" in node.log() and "Traceback" not in node.log()

"""Small-chunk fast paths give exactly what the general paths give.

A chunk of a few slots takes shortcuts: its one page's slots from cached in-page steps,
its runs found with Python ints, its copy made in one native call that keeps the GIL. Each
test here runs the same input through the shortcut and through the general (numpy) path
with the shortcut turned off, and checks both against a reference that shares no code
with either: per-token arithmetic for offsets, plain byte slices for copies.
"""

from __future__ import annotations

import shutil

import numpy as np
import prometheus_client
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxferd.datapath import copier, runcopy, staging
from kvxferd.datapath.regions import MappedRegion
from kvxferd.errors import GeometryError, RequestError, TransferError
from kvxferd.lifecycle.inbox import DestEntry, Inbox
from kvxferd.lifecycle.jobs import ChunkJob
from kvxferd.lifecycle.registry import Rank
from kvxferd.model import segments
from kvxferd.model.geometry import InstanceSpec, RankGeometry
from kvxferd.model.plan import Writer
from kvxferd.model.planner import make_plan
from kvxferd.model.segments import as_pages, paired_segments, unit_slots
from kvxferd.ops.metrics import Metrics

CC = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def ref_runs(src: list[int], dst: list[int], src_row: int, dst_row: int, row: int) -> list[tuple[int, int, int]]:
    """Whole rows token by token, neighbours merged by hand."""
    out: list[list[int]] = []
    for s, d in zip(src, dst):
        if out and out[-1][0] + out[-1][2] == s * src_row and out[-1][1] + out[-1][2] == d * dst_row:
            out[-1][2] += row
        else:
            out.append([s * src_row, d * dst_row, row])
    return [tuple(x) for x in out]


@st.composite
def slot_pairs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int]:
    """Slot arrays of pages of ``page`` slots in random order, cut anywhere (partial first and last pages)."""
    page = draw(st.sampled_from((1, 2, 3, 16)))
    n = draw(st.integers(0, segments.SMALL_SLOTS + 20))
    skip = draw(st.integers(0, page - 1))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    pages = -(-(n + skip) // page) + 2
    consecutive = draw(st.booleans())
    order = [np.arange(pages) if consecutive else rng.permutation(pages) for _ in range(2)]
    src, dst = ((o[:, None] * page + np.arange(page)).ravel()[skip:skip + n].astype(np.int64) for o in order)
    return src, dst, draw(st.sampled_from((2, 128, 2048)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=slot_pairs())
def test_paired_segments_small_path_equals_numpy_path(case: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst, row = case
    w = Writer(0, 0, (0, 1), (0, 1), 0, 0, row, row, row)
    small = paired_segments(src, dst, w)
    with monkeypatch.context() as m:
        m.setattr(segments, "SMALL_SLOTS", -1)
        general = paired_segments(src, dst, w)
    for a, b in ((small.src, general.src), (small.dst, general.dst), (small.lengths, general.lengths)):
        assert a.dtype == b.dtype == np.int64 and a.tolist() == b.tolist()
    got = list(zip(small.src.tolist(), small.dst.tolist(), small.lengths.tolist()))
    assert got == ref_runs(src.tolist(), dst.tolist(), row, row, row)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=slot_pairs())
def test_side_runs_small_path_equals_numpy_path(case: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    slots_, _, row = case
    small = segments.side_runs(slots_, row, 0, row)
    with monkeypatch.context() as m:
        m.setattr(segments, "SMALL_SLOTS", -1)
        general = segments.side_runs(slots_, row, 0, row)
    for a, b in ((small.offsets, general.offsets), (small.lengths, general.lengths)):
        assert a.dtype == b.dtype == np.int64 and a.tolist() == b.tolist()
    ref = ref_runs(slots_.tolist(), slots_.tolist(), row, row, row)
    assert list(zip(small.offsets.tolist(), small.lengths.tolist())) == [(s, n) for s, _, n in ref]


def test_paired_segments_small_path_refuses_unequal_slot_counts() -> None:
    w = Writer(0, 0, (0, 1), (0, 1), 0, 0, 64, 64, 64)
    with pytest.raises(RequestError) as err:
        paired_segments(np.arange(3, dtype=np.int64), np.arange(4, dtype=np.int64), w)
    assert err.value.field == "tokens" and "source has 3 tokens, destination 4" in str(err.value)


@settings(max_examples=200, deadline=None)
@given(ps=st.sampled_from((1, 4, 16, 64)), page=st.integers(0, 9), lo=st.integers(0, 63), n=st.integers(1, 64),
       pitch_extra=st.integers(0, 3))
def test_one_page_slots_are_fresh_arrays_equal_to_the_reference(ps: int, page: int, lo: int, n: int,
                                                               pitch_extra: int) -> None:
    lo, n = lo % ps, min(n, ps - lo % ps)  # one page: [lo, lo + n) inside page 0 of the request
    spec = InstanceSpec("mha", 1, 8, "bfloat16", ps, total_kv_heads=1)
    table = as_pages([page, (page + 1) % 10], 10, "pages")
    pitch = ps + pitch_extra if pitch_extra else None
    got = unit_slots(spec, table, lo, lo + n, 0, pitch)
    want = [page * (pitch or ps) + t for t in range(lo, lo + n)]
    assert got.dtype == np.int64 and got.tolist() == want
    got[:] = -1  # the caller owns it: the cached in-page steps behind it must not change
    assert unit_slots(spec, table, lo, lo + n, 0, pitch).tolist() == want


@st.composite
def copy_cases(draw: st.DrawFn) -> dict:
    src, dst, row = draw(slot_pairs())
    return dict(src=src, dst=dst, row=row, regions=draw(st.integers(1, 4)), seed=draw(st.integers(0, 2**32 - 1)))


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> runcopy.RunCopy:
    if CC is None:
        pytest.skip("no C compiler (cc, gcc, clang) to build kvxferd/datapath/runcopy.c")
    return runcopy.RunCopy(runcopy.build(tmp_path_factory.mktemp("runcopy") / "runcopy.so", cc=CC))


# the small path (GIL held, GIL released) and the numpy path, each against byte slices
@pytest.fixture(params=["small-held", "small-released", "numpy"])
def way(request: pytest.FixtureRequest, lib: runcopy.RunCopy, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(runcopy, "_loaded", [lib])
    monkeypatch.setattr(runcopy, "HOLD_GIL_BYTES", 0 if request.param == "small-released" else 1 << 62)
    if request.param == "numpy":
        monkeypatch.setattr(copier, "SMALL_SLOTS", -1)
        monkeypatch.setattr(runcopy, "SMALL_SLOTS", -1)
    return request.param


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=copy_cases())
def test_copy_regions_small_path_moves_the_reference_bytes(way: str, case: dict) -> None:
    rng = np.random.default_rng(case["seed"])
    src, dst, row = case["src"], case["dst"], case["row"]
    w = Writer(0, 0, (0, 1), (0, 1), 0, 0, row, row, row)
    size = (int(max(src.max(initial=0), dst.max(initial=0))) + 2) * row
    srcs = [torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8)) for _ in range(case["regions"])]
    dsts = [torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8)) for _ in range(case["regions"])]
    want = [d.numpy().copy() for d in dsts]
    for s, ref in zip(srcs, want):
        for a, b in zip(src.tolist(), dst.tolist()):
            ref[b * row:(b + 1) * row] = s.numpy()[a * row:(a + 1) * row]
    moved = copier.copy_regions(srcs, dsts, src, dst, w, 0, 0)
    for d, ref in zip(dsts, want):
        assert np.array_equal(d.numpy(), ref)
    # the fragments count (a metric) is the same whichever path ran
    assert moved == len(ref_runs(src.tolist(), dst.tolist(), row, row, row)) * case["regions"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=copy_cases(), heads=st.tuples(st.integers(1, 3), st.integers(0, 2), st.integers(0, 2)),
       offsets=st.tuples(st.integers(0, 2), st.integers(0, 2)))
def test_head_slices_small_path_move_the_reference_bytes(way: str, case: dict, heads: tuple, offsets: tuple) -> None:
    """Head slices (a TP mismatch): region to region, and gathered into / scattered from a staging slot."""
    rng = np.random.default_rng(case["seed"])
    src, dst, per_head = case["src"], case["dst"], case["row"]
    moved, src_extra, dst_extra = heads
    src_head, dst_head = min(offsets[0], src_extra) * per_head, min(offsets[1], dst_extra) * per_head
    sb, src_row, dst_row = moved * per_head, (moved + src_extra) * per_head, (moved + dst_extra) * per_head
    w = Writer(0, 0, (0, moved), (0, 1), src_head // per_head, dst_head // per_head, sb, src_row, dst_row)
    top = int(max(src.max(initial=0), dst.max(initial=0))) + 2
    srcs = [torch.from_numpy(rng.integers(0, 256, top * src_row, dtype=np.uint8)) for _ in range(case["regions"])]
    dsts = [torch.from_numpy(rng.integers(0, 256, top * dst_row, dtype=np.uint8)) for _ in range(case["regions"])]
    want = [d.numpy().copy() for d in dsts]
    for s, ref in zip(srcs, want):
        for a, b in zip(src.tolist(), dst.tolist()):
            ref[b * dst_row + dst_head:b * dst_row + dst_head + sb] = s.numpy()[a * src_row + src_head:
                                                                              a * src_row + src_head + sb]
    if not w.whole_rows:
        copier.copy_regions(srcs, dsts, src, dst, w, src_head, dst_head)
        for d, ref in zip(dsts, want):
            assert np.array_equal(d.numpy(), ref)
    slot = torch.zeros(max(1, src.size) * sb + 5, dtype=torch.uint8)
    copier.gather(srcs[0], src, src_row, src_head, sb, slot[:src.size * sb])
    gathered = b"".join(srcs[0].numpy()[a * src_row + src_head:a * src_row + src_head + sb].tobytes()
                        for a in src.tolist())
    assert slot.numpy()[:src.size * sb].tobytes() == gathered and not slot.numpy()[src.size * sb:].any()
    target = torch.zeros(top * dst_row, dtype=torch.uint8)
    copier.scatter(target, dst, dst_row, dst_head, sb, slot[:src.size * sb])
    ref = np.zeros(top * dst_row, dtype=np.uint8)
    for i, b in enumerate(dst.tolist()):
        ref[b * dst_row + dst_head:b * dst_row + dst_head + sb] = np.frombuffer(gathered[i * sb:(i + 1) * sb],
                                                                                dtype=np.uint8)
    assert np.array_equal(target.numpy(), ref)


def test_small_row_copies_refuse_what_the_numpy_path_refuses(lib: runcopy.RunCopy,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    region = torch.zeros(1024, dtype=torch.uint8)
    data = torch.ones(256, dtype=torch.uint8)
    calls = (lambda: lib.scatter_rows(region, np.array([0, 8]), 128, 0, 128, data),
             lambda: lib.scatter_rows(region, np.array([-1, 2]), 128, 0, 128, data),
             lambda: lib.gather_rows(region, np.array([0, 1, 2]), 128, 0, 128, data),
             lambda: lib.gather_rows(region, np.array([7]), 128, 64, 128, data),
             lambda: lib.copy_rows([region], [torch.zeros(512, dtype=torch.uint8)], np.array([1]), 128, 0,
                                   np.array([4]), 128, 0, 128),
             lambda: lib.copy_rows([data], [region], np.array([3]), 64, 8, np.array([1]), 128, 0, 64))
    for call in calls:
        with pytest.raises(TransferError) as small:
            call()
        with monkeypatch.context() as m:
            m.setattr(runcopy, "SMALL_SLOTS", -1)
            with pytest.raises(TransferError) as general:
                call()
        assert str(small.value) == str(general.value) and small.value.field == general.value.field
    assert not region.any()


def test_copy_run_lists_refuses_what_copy_runs_refuses_and_writes_nothing(lib: runcopy.RunCopy) -> None:
    region = torch.zeros(1024, dtype=torch.uint8)
    source = torch.ones(1024, dtype=torch.uint8)
    for src_off, dst_off, length in (([1000], [0], [100]), ([0], [1000], [100]), ([-1], [0], [10]),
                                     ([0], [-8], [10]), ([0, 900], [0, 200], [100, 200])):
        with pytest.raises(TransferError) as small:
            lib.copy_run_lists([source], [region], src_off, dst_off, length)
        with pytest.raises(TransferError) as general:
            lib.copy_runs([source], [region], np.array(src_off), np.array(dst_off), np.array(length))
        assert str(small.value) == str(general.value) and small.value.field == "slots"
    with pytest.raises(TransferError) as err:
        lib.copy_run_lists([source], [region], [0, 8], [0], [8])
    assert err.value.field == "segments"
    assert not region.any()


def test_chunk_job_and_sink_derive_the_same_values_as_the_geometry() -> None:
    spec = InstanceSpec("mha", 3, 64, "bfloat16", 16, total_kv_heads=1)
    geometry = RankGeometry(spec, num_pages=8)
    regions = {(layer, kind): MappedRegion(layer, kind, torch.zeros(geometry.region_bytes, dtype=torch.uint8))
               for layer, kind in geometry.region_names()}
    src = Rank("p", "prefill", geometry, regions, b"p")
    dst = Rank("d", "decode", geometry, dict(regions), b"d")
    plan = make_plan(spec, spec)
    w = plan.writers_of(0, 0)[0]
    pages = as_pages([3, 5], 8, "pages")
    job = ChunkJob("r", "d", (0, 0), src, w, 0, 20, True, None, unit_slots(spec, pages, 0, 20, 0), "direct", None)
    wire = [(layer, kind) for layer in range(3) for kind in ("k", "v")]
    for _ in range(2):  # asked twice: the second answer comes from the cache
        assert job.kinds == ("k", "v") and job.nbytes == 3 * 2 * 20 * 128
        assert [(r.layer, r.kind) for r in job.regions()] == wire
        assert job.header()["nbytes"] == job.nbytes
    inbox = Inbox(lambda entry: None)
    entry = DestEntry("r", dst, "p", pages, 20)
    inbox.add(entry)
    entry.bind(plan)
    sink = inbox.begin(job.header(), dst.id)
    first = sink.regions()
    first.clear()  # a caller's list is its own
    assert [(r.layer, r.kind) for r in sink.regions()] == wire
    assert sink.dst_slots.tolist() == [3 * 16 + t for t in range(16)] + [5 * 16 + t for t in range(4)]
    inbox.finish(sink, True)
    assert entry.bytes_received == job.nbytes and len(inbox) == 1


def test_kinds_of_is_cached_only_for_known_groups() -> None:
    geometry = RankGeometry(InstanceSpec("mla", 2, 576, "bfloat16", 16), num_pages=4)
    assert geometry.kinds_of("") == geometry.kinds_of() == ("latent",)
    for _ in range(2):
        with pytest.raises(GeometryError):
            geometry.kinds_of("nope")
    assert geometry == RankGeometry(InstanceSpec("mla", 2, 576, "bfloat16", 16), num_pages=4)


def test_inbox_remove_drops_only_that_entry_of_a_request() -> None:
    spec = InstanceSpec("mha", 1, 8, "bfloat16", 4, tp_size=2, total_kv_heads=2)
    ranks = [Rank("d", "decode", RankGeometry(spec, tp_rank=tp, num_pages=4), {}, b"d") for tp in (0, 1)]
    inbox = Inbox(lambda entry: None)
    entries = [DestEntry("r", rank, "p", as_pages([0, 1], 4, "pages"), 8) for rank in ranks]
    for e in entries:
        inbox.add(e)
    inbox.remove(entries[0])
    assert inbox.for_request("r") == [entries[1]] and inbox.for_request("r")[0] is entries[1]
    assert len(inbox) == 1 and inbox.get("r", ranks[0].id) is None
    inbox.remove(entries[1])
    assert inbox.for_request("r") == [] and len(inbox) == 0


def _samples(registry: prometheus_client.CollectorRegistry) -> list[tuple[str, tuple, float]]:
    return sorted((s.name, tuple(sorted(s.labels.items())), s.value) for m in registry.collect() for s in m.samples
                  if not s.name.endswith("_created"))


def test_cached_label_children_export_exactly_what_prometheus_client_does() -> None:
    ours = Metrics()
    plain = prometheus_client.CollectorRegistry()
    theirs = {
        "chunks": prometheus_client.Counter("kvxferd_chunks", "x", ["transport", "mode", "why"], registry=plain),
        "phase_latency": prometheus_client.Histogram("kvxferd_phase_duration_seconds", "x", ["phase"],
                                                     buckets=ours.phase_latency._upper_bounds[:-1], registry=plain),
        "peers": prometheus_client.Gauge("kvxferd_peers", "x", ["state"], registry=plain),
    }
    for metrics in (ours, theirs):
        get = (lambda name: getattr(metrics, name)) if metrics is ours else metrics.__getitem__
        for _ in range(3):
            get("chunks").labels("local", "direct", "plan").inc()
            get("chunks").labels(transport="tcp", mode="staged", why="short_runs").inc(2)
            get("phase_latency").labels("queue").observe(0.003)
            get("peers").labels(7).set(4)  # not a str: converted by prometheus_client, never cached
        get("peers").labels("up").set(1)
        get("chunks").remove("local", "direct", "plan")
        get("chunks").labels("local", "direct", "plan").inc(5)  # a fresh child after remove, as without the cache
    wanted = {"kvxferd_chunks_total", "kvxferd_phase_duration_seconds_bucket", "kvxferd_phase_duration_seconds_sum",
              "kvxferd_phase_duration_seconds_count", "kvxferd_peers"}
    mine = [s for s in _samples(ours.registry) if s[0] in wanted and s[1]]
    assert mine == _samples(plain) and ("kvxferd_chunks_total", (("mode", "direct"), ("transport", "local"), ("why", "plan")), 5.0) in mine
    assert ours.chunks.labels("tcp", "staged", "short_runs") is ours.chunks.labels(transport="tcp", mode="staged",
                                                                                  why="short_runs")
    ours.peers.clear()
    assert ours.peers.labels("up")._value.get() == 0.0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pages=st.lists(st.one_of(st.integers(-3, 40), st.booleans(), st.integers(2**62, 2**70)), max_size=70),
       num_pages=st.integers(1, 40))
def test_as_pages_small_path_answers_like_the_numpy_path(pages: list, num_pages: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def answer() -> tuple:
        try:
            array = as_pages(pages, num_pages, "pages")
        except RequestError as exc:
            return "refused", str(exc), exc.field
        return "ok", array.dtype, array.tolist()

    small = answer()
    with monkeypatch.context() as m:
        m.setattr(segments, "SMALL_SLOTS", -1)
        general = answer()
    assert small == general
    assert (small[0] == "ok") == all(0 <= p < num_pages for p in pages)  # booleans are pages 0 and 1


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(regions=st.integers(1, 8), tokens=st.integers(0, 80), slice_bytes=st.sampled_from((1, 64, 128, 2048)),
       per_slot=st.integers(1, 200))
def test_pack_cached_for_small_chunks_equals_pack_uncached(regions: int, tokens: int, slice_bytes: int,
                                                           per_slot: int, monkeypatch: pytest.MonkeyPatch) -> None:
    slot_bytes = per_slot * slice_bytes
    first, again = (staging.pack(regions, tokens, slice_bytes, slot_bytes) for _ in range(2))
    first.append([])  # a caller's lists are its own
    if first[0]:
        first[0].clear()
    with monkeypatch.context() as m:
        m.setattr(staging, "CACHED_BLOCKS", -1)
        fresh = staging.pack(regions, tokens, slice_bytes, slot_bytes)
    assert again == fresh == staging.pack(regions, tokens, slice_bytes, slot_bytes)
    # every slice of the region-major sequence exactly once, in wire order
    seen = [(p.region, t) for block in fresh for p in block for t in range(p.lo, p.hi)]
    assert seen == [(r, t) for r in range(regions) for t in range(tokens)]

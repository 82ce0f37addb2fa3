"""Every layout the engine adapters register, moved over NIXL alone.

The daemons here accept NIXL only (``peer.transports = ["nixl"]``), so a pair negotiated
to any other transport would be refused and its request fail: every case below proves
NIXL carried it, and the metrics count the exact bytes on NIXL and none on tcp.

- ``NHD_kv`` (vLLM GPU LBNHC), ``HND_kv`` (LBHNC) and ``packed_page`` (vLLM CPU) through
  simulated engines and the shared byte oracle, direct and staged, matched and TP-mismatched.
- Strided decode ranks (``page_stride``: vLLM's block-outer layouts keep every layer's page
  of a block together) and a decode side that already holds a prefix (``expect start``),
  through hand-registered tensors checked with index arithmetic written here: a destination
  unit (token row, or packed page) is the prefill TP ranks' units side by side.
"""

from __future__ import annotations

import itertools
import re
import urllib.request
from dataclasses import replace

import pytest
import torch

from e2e_util import Node, module_cluster
from e2e_util import run_case as e2e_run_case
from kvxferd.model.geometry import InstanceSpec, RankGeometry
from kvxferd.model.segments import slot_count
from kvxferd.sdk.client import EngineClient
from kvxferd.sdk.engine_memory import describe_tensors, share_in_place
from kvxferd.transport import chunk_modes
from nixl_util import NIXL_MISSING, metric
from transport_util import ONLY_NIXL, Carried
NUM_PAGES = 24
_ids = itertools.count()


#: this file's direct and in-place rows write into the decode pages: engine memory exposed outright
EXPOSED_NIXL = {**ONLY_NIXL, "KVXFERD_PEER_NIXL_ENGINE_MEMORY": "exposed"}


@pytest.fixture(scope="module")
def cluster(request):
    if NIXL_MISSING:
        pytest.skip(f"NIXL unusable here: {NIXL_MISSING}")
    yield from module_cluster(
        request, Node("decode-nx", env=EXPOSED_NIXL),
        # no landing ring: nothing to stage into, so every chunk is one direct WRITE of its runs
        Node("decode-no-ring", env={**EXPOSED_NIXL, "KVXFERD_LIMITS_NIXL_LANDING_SLOTS": "0"}),
        Node("prefill-direct", env={**EXPOSED_NIXL, "KVXFERD_PEER_MODE": "direct"}),
        Node("prefill-staged", env={**EXPOSED_NIXL, "KVXFERD_PEER_MODE": "staged"}),
        # auto: the daemon decides per chunk (short runs through a slot)
        Node("prefill-auto", env=EXPOSED_NIXL),
        # whole-row sides of sliced chunks used in place at any run length (this file's pages are small);
        # auto, which writes to a decode daemon without a landing ring too
        Node("prefill-in-place", env={**EXPOSED_NIXL, "KVXFERD_LIMITS_NIXL_IN_PLACE_BYTES": "64"}))


#: mode -> (prefill daemon, decode daemon): direct WRITEs of every run, or staged blocks
PAIRS = {"direct": ("prefill-direct", "decode-no-ring"), "staged": ("prefill-staged", "decode-nx")}


def kv(layout: str, **overrides) -> InstanceSpec:
    base = dict(attention="mha", num_layers=3, total_kv_heads=4, head_dim=8, dtype="float16", page_size=8,
                layout=layout)
    base.update(overrides)
    return InstanceSpec(**base)


def request_bytes(dspec: InstanceSpec, start: int, end: int) -> int:
    """KV bytes of tokens ``[start, end)`` over every head and layer (whole pages when packed)."""
    whole = replace(dspec, tp_size=1)
    return slot_count(whole, start, end) * whole.row_bytes * len(whole.region_kinds) * whole.num_layers


def carried(cluster, prefill: str, decode: str) -> Carried:
    """Bytes per transport on the pair's daemons from now on."""
    return Carried([cluster.daemons[prefill]], [cluster.daemons[decode]])


# -- simulated engines, the shared byte oracle ------------------------------------------------

CASES = {
    "nhd_kv-tp1": (kv("NHD_kv"), kv("NHD_kv"), 37, None),
    "nhd_kv-tp2to1-pages4to16": (kv("NHD_kv", tp_size=2, page_size=4), kv("NHD_kv", page_size=16), 37,
                                 [[0, 13], [13, 37]]),
    "hnd_kv-tp1to2": (kv("HND_kv"), kv("HND_kv", tp_size=2), 29, [[0, 16], [16, 29]]),
    "packed-tp2to1": (kv("packed_page", tp_size=2), kv("packed_page"), 37, [[0, 16], [16, 37]]),
    "packed-tp1": (kv("packed_page"), kv("packed_page"), 20, None),
}


@pytest.mark.parametrize("mode", ["direct", "staged"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_layout_moves_byte_exact_over_nixl_alone(cluster, case, mode):
    pspec, dspec, n, chunks = CASES[case]
    prefill, decode = PAIRS[mode]
    moved = carried(cluster, prefill, decode)
    pd = cluster.daemons[prefill]
    before = metric(pd, "kvxferd_sent_bytes_total", transport="nixl", mode=mode)
    e2e_run_case(cluster, pspec, dspec, prefill=prefill, decode=decode, n_tokens=n, chunks=chunks,
                 requests=2, aux=b"nx", tag=f"nl{mode[0]}-", num_pages=NUM_PAGES)
    moved.assert_only("nixl", 2 * request_bytes(dspec, 0, n))
    sent = metric(pd, "kvxferd_sent_bytes_total", transport="nixl", mode=mode) - before
    assert sent == 2 * request_bytes(dspec, 0, n)  # every byte in the mode the pair was set up for


def chunk_whys(daemon) -> dict[tuple[str, str], float]:
    """Chunks a daemon has sent over NIXL so far, per (mode, why)."""
    return {(m, w): metric(daemon, "kvxferd_chunks_total", transport="nixl", mode=m, why=w)
            for m in ("direct", "staged") for w in chunk_modes.WHYS}


def _moved_as(cluster, prefill: str, case: str) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """One request of ``case`` from ``prefill`` into a decode daemon that gave a landing ring: its
    bytes per mode and its chunks per (mode, why)."""
    pspec, dspec, n, chunks = CASES[case]
    moved = carried(cluster, prefill, "decode-nx")
    pd = cluster.daemons[prefill]
    before = ({m: metric(pd, "kvxferd_sent_bytes_total", transport="nixl", mode=m) for m in ("direct", "staged")},
              chunk_whys(pd))
    e2e_run_case(cluster, pspec, dspec, prefill=prefill, decode="decode-nx", n_tokens=n, chunks=chunks,
                 requests=1, tag=f"nla{next(_ids)}-", num_pages=NUM_PAGES)
    moved.assert_only("nixl", request_bytes(dspec, 0, n))
    sent = {m: metric(pd, "kvxferd_sent_bytes_total", transport="nixl", mode=m) - before[0][m]
            for m in ("direct", "staged")}
    whys = {k: v - before[1].get(k, 0.0) for k, v in chunk_whys(pd).items() if v - before[1].get(k, 0.0)}
    return sent, whys


def test_an_explicit_direct_is_kept_for_small_head_slices(cluster):
    """peer.mode = "direct" asked outright: 64-byte head slices are WRITten in place one descriptor
    each, though the decode daemon gave a landing ring the daemon could have staged them through."""
    case = "nhd_kv-tp2to1-pages4to16"
    sent, whys = _moved_as(cluster, "prefill-direct", case)
    assert sent == {"direct": request_bytes(CASES[case][1], 0, CASES[case][2]), "staged": 0}
    assert set(whys) == {("direct", "plan")}
    # the operator hears what the choice costs, at the handshake
    assert "event=direct_short_runs" in cluster.daemons["prefill-direct"].log()


def test_auto_stages_short_runs_per_chunk_and_says_why(cluster):
    """Under auto, whole TP-matched rows of small pages plan direct, but their runs average under
    8 KiB: the daemon gathers each chunk into blocks and counts it as staged for short runs."""
    case = "nhd_kv-tp1"
    sent, whys = _moved_as(cluster, "prefill-auto", case)
    assert sent == {"direct": 0, "staged": request_bytes(CASES[case][1], 0, CASES[case][2])}
    assert set(whys) == {("staged", "short_runs")}


def fragments(daemon) -> tuple[float, float]:
    """(descriptors, chunks) a daemon has sent so far: ``kvxferd_chunk_fragments`` sum and count."""
    text = urllib.request.urlopen(daemon.metrics_url, timeout=5).read().decode()
    found = {name: float(re.search(rf"^kvxferd_chunk_fragments_{name}\s+(\S+)$", text, re.M).group(1))
             for name in ("sum", "count")}
    return found["sum"], found["count"]


@pytest.mark.parametrize("case", ["nhd_kv-tp2to1-pages4to16", "packed-tp2to1"])
def test_a_source_holding_whole_rows_is_read_in_place(cluster, case):
    """tp2>1: each prefill rank's rows are the decode rows' halves, so the source's pages are
    WRITten as they lie into the landing slot (one descriptor per page run, no gather) and only
    the decode side scatters. The same chunks gathered first take one descriptor per block."""
    pspec, dspec, n, chunks = CASES[case]
    counts = {}
    for prefill in ("prefill-staged", "prefill-in-place"):
        moved = carried(cluster, prefill, "decode-nx")
        pd = cluster.daemons[prefill]
        before_staged = metric(pd, "kvxferd_sent_bytes_total", transport="nixl", mode="staged")
        before = fragments(pd)
        e2e_run_case(cluster, pspec, dspec, prefill=prefill, decode="decode-nx", n_tokens=n, chunks=chunks,
                     requests=1, tag="nlr-", num_pages=NUM_PAGES)
        moved.assert_only("nixl", request_bytes(dspec, 0, n))
        assert metric(pd, "kvxferd_sent_bytes_total", transport="nixl", mode="staged") - before_staged == \
            request_bytes(dspec, 0, n)
        after = fragments(pd)
        counts[prefill] = (after[0] - before[0], after[1] - before[1])
    (gathered, chunks_g), (in_place, chunks_i) = counts["prefill-staged"], counts["prefill-in-place"]
    assert chunks_g == chunks_i > 0
    # random source pages: every page (every page's run per layer and kind) is a descriptor of its own
    assert in_place > gathered, counts


def test_a_destination_holding_whole_rows_is_written_in_place_without_a_landing_ring(cluster):
    """tp1>2 into a decode daemon that gave no landing ring: each decode rank's rows are a slice of
    the prefill rows, so the prefill daemon gathers the slices into its staging slot and WRITEs the
    slot into the decode pages as they lie (one descriptor per page run), instead of one
    descriptor per head slice of every token."""
    pspec, dspec, n, chunks = CASES["hnd_kv-tp1to2"]
    moved = carried(cluster, "prefill-in-place", "decode-no-ring")
    pd = cluster.daemons["prefill-in-place"]
    before_staged = metric(pd, "kvxferd_sent_bytes_total", transport="nixl", mode="staged")
    before = fragments(pd)
    e2e_run_case(cluster, pspec, dspec, prefill="prefill-in-place", decode="decode-no-ring", n_tokens=n,
                 chunks=chunks, requests=2, tag="nlp-", num_pages=NUM_PAGES)
    moved.assert_only("nixl", 2 * request_bytes(dspec, 0, n))
    assert metric(pd, "kvxferd_sent_bytes_total", transport="nixl", mode="staged") - before_staged == \
        2 * request_bytes(dspec, 0, n)
    descriptors = fragments(pd)[0] - before[0]
    slices = 2 * n * dspec.tp_size * dspec.num_layers  # direct: one per token, decode rank and layer
    pages = 2 * dspec.tp_size * dspec.num_layers * (-(-n // dspec.page_size) + len(chunks or ()))
    assert 0 < descriptors <= pages < slices, (descriptors, pages, slices)


# -- strided decode pages and a prefix already held, hand-registered ------------------------

class Engine:
    """One instance's ranks, each a client and its pages in shared memory, ``[block, layer, page]``.

    ``strided``: registered as the decode side of vLLM's block-outer layout, each layer a region
    whose pages lie ``layers`` pages apart (``page_stride``); otherwise each layer is a dense
    tensor of its own."""

    def __init__(self, daemon, name: str, role: str, spec: InstanceSpec, blocks: int, strided: bool,
                 seed: int | None) -> None:
        self.spec = spec
        self.clients: list[EngineClient] = []
        self.ranks: list[str] = []
        self.pools = []
        self.pages: list = []  # per rank: (block, layer) -> the page's bytes, as they are now
        page = spec.page_bytes
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        try:
            for tp in range(spec.tp_size):
                if strided:
                    raw = torch.zeros((blocks, spec.num_layers, page), dtype=torch.uint8)
                    self.pools.append(share_in_place([raw], name=f"{name}-{tp}"))
                    geo = RankGeometry(spec, tp, 0, blocks, page_stride=spec.num_layers * page)
                    flat = raw.view(-1)
                    regions = {(layer, "kv"): flat[layer * page:layer * page + geo.region_bytes]
                               for layer in range(spec.num_layers)}
                    self.pages.append(lambda b, layer, raw=raw: raw[b, layer])
                else:
                    layers = [torch.randint(0, 256, (blocks, page), dtype=torch.uint8, generator=g)
                              for _ in range(spec.num_layers)]
                    self.pools.append(share_in_place(layers, name=f"{name}-{tp}"))
                    geo = RankGeometry(spec, tp, 0, blocks)
                    regions = {(layer, "kv"): t for layer, t in enumerate(layers)}
                    self.pages.append(lambda b, layer, layers=layers: layers[layer][b])
                client = EngineClient(daemon.socket_path, timeout=30)
                self.clients.append(client)
                self.ranks.append(client.register(name, role, geo, describe_tensors(regions)))
        except BaseException:
            self.close()
            raise

    def page(self, tp: int, block: int, layer: int) -> torch.Tensor:
        return self.pages[tp](block, layer)

    def units(self, tp: int, block: int, layer: int) -> torch.Tensor:
        """The page cut into units (token rows, or one packed page): ``[units, unit bytes]``."""
        per_page = self.spec.page_size // self.spec.slot_tokens
        return self.page(tp, block, layer).view(per_page, -1)

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for p in self.pools:
            p.close()


def _strided_case(cluster, mode: str, layout: str, tp: int, start: int) -> None:
    n, blocks = 37, 8
    pspec, dspec = kv(layout, tp_size=tp), kv(layout)
    tag = next(_ids)
    prefill_name, decode_name = PAIRS[mode]
    pd, dd = cluster.daemons[prefill_name], cluster.daemons[decode_name]
    prefill = Engine(pd, f"ns-p{tag}", "prefill", pspec, blocks, strided=False, seed=tag)
    decode = Engine(dd, f"ns-d{tag}", "decode", dspec, blocks, strided=True, seed=None)
    src, dst = [6, 1, 4, 2, 7], [3, 0, 5, 7, 2]
    try:
        for layer in range(dspec.num_layers):  # the prefix the decode side already holds
            decode.page(0, dst[0], layer).fill_(0xAB)
        moved = carried(cluster, prefill_name, decode_name)
        rid = f"ns-{tag}"
        decode.clients[0].expect(decode.ranks[0], rid, source_instance=f"ns-p{tag}", source_address=pd.address,
                                 pages=dst, num_tokens=n, start=start)
        ps = pspec.page_size
        for client, rank in zip(prefill.clients, prefill.ranks):  # the whole prompt, cut on a page boundary
            client.send(rank, rid, pages=src[:2], start=0, end=2 * ps, last=False)
            client.send(rank, rid, pages=src[2:], start=2 * ps, end=n, last=True)
        assert decode.clients[0].wait(decode.ranks[0], rid, timeout=60)["state"] == "done"
        for client, rank in zip(prefill.clients, prefill.ranks):
            assert client.wait(rank, rid, timeout=60)["state"] == "done"
        moved.assert_only("nixl", request_bytes(dspec, start, n))
        unit = dspec.slot_tokens
        for layer in range(dspec.num_layers):
            for i, (s, d) in enumerate(zip(src, dst)):
                got = decode.units(0, d, layer)
                if (i + 1) * ps <= start:
                    assert bool((got == 0xAB).all()), (layer, i)  # the prefix is left alone
                    continue
                want = torch.cat([prefill.units(tp_rank, s, layer) for tp_rank in range(tp)], dim=1)
                rows = min(ps, n - i * ps) if unit == 1 else 1  # a packed page moves whole
                assert torch.equal(got[:rows], want[:rows]), (layer, i)
                assert int(got[rows:].count_nonzero()) == 0, (layer, i)  # past the request's last token
            for b in set(range(blocks)) - set(dst):
                assert int(decode.page(0, b, layer).count_nonzero()) == 0, (layer, b)  # never a destination
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("mode", ["direct", "staged"])
@pytest.mark.parametrize("layout,tp", [("NHD_kv", 1), ("NHD_kv", 2), ("HND_kv", 2)])
def test_strided_decode_pages_take_nixl_writes(cluster, mode, layout, tp):
    if mode == "staged" and tp == 1:
        pytest.skip("a matched plan has no head slices to stage")
    _strided_case(cluster, mode, layout, tp, start=0)


@pytest.mark.parametrize("mode", ["direct", "staged"])
@pytest.mark.parametrize("layout", ["NHD_kv", "HND_kv"])
def test_a_prefix_held_by_the_decode_side_is_not_written_over_nixl(cluster, mode, layout):
    _strided_case(cluster, mode, layout, 2, start=8)

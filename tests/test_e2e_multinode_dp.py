"""Data-parallel attention: a prefill instance of 4 DP ranks (0-1 at A, 2-3 at B, A the rendezvous),
requests routed by the DP rank that holds them, into a decode instance at D, over tcp: real
daemons and engine processes, byte-exact against the oracle."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from e2e_util import assert_verified, close, finished, module_cluster, pages_for, peer_socket, spec
from kvxferd.model.geometry import RankGeometry
from kvxferd.sdk.client import EngineClient
from kvxferd.tools.sim import Worker
from kvxferd.wire import protocol

NUM_PAGES = 64


@pytest.fixture(scope="module")
def cluster(request):
    yield from module_cluster(request, "node-a", "node-b", "node-d")


@pytest.fixture(scope="module")
def instances(cluster):
    a, b, d = (cluster.daemons[n] for n in ("node-a", "node-b", "node-d"))
    pspec = spec(tp_size=1, total_kv_heads=2)  # each DP rank: attention TP1, its own KV cache
    groups = cluster.dp_instance([a, a, b, b], "dpp", "prefill", pspec, NUM_PAGES)
    (decode,) = cluster.instances((d, "dpd", "decode", spec(tp_size=2, total_kv_heads=2), NUM_PAGES))
    yield a, b, d, groups, decode, pspec
    close([w for g in groups for w in g] + decode)


def _expect(decode, request_id: str, pages: list[int], n: int, source_address: str, dp_rank: int) -> None:
    for w in decode:
        w.command(cmd="expect", request_id=request_id, pages=pages, n=n, source_instance="dpp",
                  source_address=source_address, source_dp_rank=dp_rank)


def test_requests_routed_by_dp_rank_byte_exact(instances):
    a, b, d, groups, decode, pspec = instances
    rng = random.Random(4)
    used: set[int] = set()
    for round_ in range(2):
        for k in (3, 0, 2, 1):  # every DP rank, in no particular order; only DP rank k holds (and sends) it
            rid, n = f"dp{k}-{round_}", 19 + 4 * k
            src = pages_for(rng, NUM_PAGES, n, pspec.page_size)
            dst = rng.sample([p for p in range(NUM_PAGES) if p not in used], -(-n // 4))
            used.update(dst)
            _expect(decode, rid, dst, n, a.address, k)
            for w in groups[k]:
                w.command(cmd="send", request_id=rid, pages=src, n=n, chunks=[[0, 8], [8, n]] if round_ else None)
            assert_verified([finished(w, rid) for w in decode], [finished(w, rid) for w in groups[k]])
    with EngineClient(d.socket_path, timeout=10) as client:
        plans = {p["address"]: p["plans"] for p in client.status()["peers"] if p["side"] == "prefill"}
    # DP ranks 2 and 3 are at B: the rendezvous A told D so, and D handshook with B for them
    assert {"dpp@dp2->dpd", "dpp@dp3->dpd"} <= set(plans[b.address]), plans
    assert {"dpp@dp0->dpd", "dpp@dp1->dpd"} <= set(plans[a.address]), plans


def test_a_decode_instance_of_dp_ranks_takes_requests_from_any_prefill_dp_rank(cluster, instances):
    """Decode DP ranks are instances of their own (``ddp@dp<k>``): each takes requests from
    whichever prefill DP rank holds them, at either source daemon."""
    a, b, d, groups, decode, pspec = instances
    ddp = cluster.dp_instance([d, d], "ddp", "decode", spec(tp_size=2, total_kv_heads=2), NUM_PAGES)
    rng = random.Random(9)
    try:
        for k, j in ((0, 3), (1, 0), (1, 2), (0, 1)):  # decode DP rank k, prefill DP rank j
            rid, n = f"ddp{k}-{j}", 21
            src = pages_for(rng, NUM_PAGES, n, pspec.page_size)
            dst = rng.sample(range(NUM_PAGES), -(-n // 4))
            for w in ddp[k]:
                w.command(cmd="expect", request_id=rid, pages=dst, n=n, source_instance="dpp",
                          source_address=a.address, source_dp_rank=j)
            for w in groups[j]:
                w.command(cmd="send", request_id=rid, pages=src, n=n)
            assert_verified([finished(w, rid) for w in ddp[k]], [finished(w, rid) for w in groups[j]])
    finally:
        close([w for g in ddp for w in g])


def test_the_rendezvous_answers_which_dp_ranks_an_instance_has(instances):
    a, b, *_ = instances
    sock = peer_socket(a.address)
    try:
        sock.send(protocol.encode({"op": "lookup", "instance": "dpp", "role": "prefill", "seq": 1}))
        answer = protocol.decode(sock.recv(), 1 << 20)
    finally:
        sock.close(0)
    assert answer["op"] == "ranks" and answer["dp_size"] == 4, answer
    assert answer["dp_ranks"] == [[0, [[0, 0, a.address]]], [1, [[0, 0, a.address]]], [2, [[0, 0, b.address]]],
                                  [3, [[0, 0, b.address]]]], answer
    assert not answer.get("missing"), answer


def test_a_dp_rank_the_instance_does_not_have_and_a_disagreeing_dp_size_are_refused(cluster, instances):
    a, b, d, groups, decode, pspec = instances
    _expect(decode[:1], "dp-far", [1, 2], 8, a.address, 4)
    ev = finished(decode[0], "dp-far")
    assert ev["state"] == "failed" and ev["code"] == "incompatible", ev
    assert "DP rank 4" in ev["reason"] and "dp_size = 4" in ev["reason"] and "prefill_dp_rank" in ev["reason"], ev
    # a rank of the same instance started with another dp_size is refused at registration
    odd = Worker(b, "dpp", "prefill", RankGeometry(pspec, 0, 0, NUM_PAGES), wait=False, rendezvous=a.address,
                 dp=(5, 8))
    cluster.workers.append(odd)
    with pytest.raises(RuntimeError) as refused:
        odd.wait_registered()
    message = str(refused.value)
    assert "dp_size = 8" in message and "dp_size = 4" in message and "dpp@dp5/tp0/pp0" in message, message
    odd.close()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvxferd", *args], capture_output=True, text=True, timeout=120)


def test_status_and_plan_show_which_daemon_holds_which_rank(instances, tmp_path):
    a, b, d, groups, decode, pspec = instances
    out = _cli("status", "--socket", a.socket_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    at = lines.index("  dpp@dp2/prefill: rendezvous here, 1 ranks")
    assert lines[at + 1].split() == [b.address, "tp0/pp0"], lines[at:at + 2]
    at = lines.index("  dpp@dp0/prefill: rendezvous here, 1 ranks")
    assert lines[at + 1].split() == [a.address, "tp0/pp0"], lines[at:at + 2]
    out = _cli("status", "--socket", b.socket_path)
    assert f"  dpp@dp3/prefill: ranks here announced to rendezvous {a.address}" in out.stdout, out.stdout
    # the rendezvous answers the DP ranks; a plan against DP rank 2 names the daemon of each writer
    out = _cli("plan", "--rendezvous", a.address, "--instance", "dpp")
    assert out.returncode == 0, out.stderr
    assert "instance dpp: 4 DP ranks" in out.stdout and f"    tp0 pp0  {b.address}" in out.stdout, out.stdout
    (tmp_path / "d.json").write_text(json.dumps(spec(tp_size=2, total_kv_heads=2).to_dict()))
    out = _cli("plan", "--rendezvous", a.address, "--instance", "dpp@dp2", "--decode", str(tmp_path / "d.json"))
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("tp")]
    assert rows and all(row[-1] == b.address for row in rows), out.stdout  # both decode ranks: writer at B
    out = _cli("plan", "--rendezvous", a.address, "--instance", "nobody", "--timeout", "10")
    assert out.returncode == 1 and "nobody" in out.stderr, (out.stdout, out.stderr)

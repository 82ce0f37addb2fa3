"""The operator HTTP endpoint of running daemons: /metrics, /healthz, /readyz.

Two real daemons (prefill node, decode node) with one real engine process each move real
KV pages over tcp on 127.0.0.1; the tests scrape the real endpoint with urllib, parse
it with prometheus_client's parser, and check that every counter moved by exactly what
the traffic implies. Each test works on deltas between two scrapes, so the tests do not
depend on each other's order.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import msgpack
import pytest

from kvxferd.model.geometry import RankGeometry
from kvxferd.sdk.client import EngineClient
from kvxferd.sdk.kv_cache import allocate_cpu

from e2e_util import cluster_run
from ops_support import (NUM_PAGES, Scrape, base_url, http_get, kv_bytes, next_for, pages, spec,
                         start_pair, status_of, transfer, wait_for)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pair(request):
    with cluster_run(request) as cluster:
        yield start_pair(cluster)


_ids = iter(range(10**6))


def run_requests(pair, sizes, chunked=()):
    """Move one request per size, prefill -> decode over tcp; assert each landed byte-exact."""
    pd, _dd, pw, dw = pair
    for n in sizes:
        rid = f"m-{next(_ids)}"
        chunks = [[0, 48], [48, n]] if n in chunked else None
        dec, pre = transfer(pw, dw, rid, n, pages(0, n), pages(NUM_PAGES // 2, n), pd.address, chunks)
        assert dec["state"] == "done" and dec["mismatched_bytes"] == 0, dec
        assert pre["state"] == "done", pre


def test_transfers_and_bytes_are_counted_exactly(pair):
    pd, dd, _pw, _dw = pair
    p0, d0 = Scrape(pd), Scrape(dd)
    sizes = [1, 17, 100]
    run_requests(pair, sizes, chunked=(100,))
    p1, d1 = Scrape(pd), Scrape(dd)

    def delta(a, b, name, **labels):
        return b.value(name, **labels) - a.value(name, **labels)

    total = kv_bytes(sum(sizes))
    assert total == 118 * 4 * 2 * 2 * 32 * 2
    # one finished request per side per request, over tcp, nothing failed
    assert delta(d0, d1, "kvxferd_transfers_total", side="decode", outcome="done", transport="tcp") == 3
    assert delta(p0, p1, "kvxferd_transfers_total", side="prefill", outcome="done", transport="tcp") == 3
    assert delta(d0, d1, "kvxferd_transfers_total", outcome="failed") == 0
    assert delta(d0, d1, "kvxferd_transfer_failures_total") == 0
    # exact bytes: tokens x layers x (K, V) x kv_heads x head_dim x 2 bytes (bf16), TP 1 -> 1
    assert delta(p0, p1, "kvxferd_sent_bytes_total", transport="tcp") == total
    assert delta(d0, d1, "kvxferd_received_bytes_total", transport="tcp") == total
    assert delta(p0, p1, "kvxferd_chunk_size_bytes_sum") == total
    # the 100-token request went in two chunks
    assert delta(p0, p1, "kvxferd_chunks_total", transport="tcp") == 4
    # whole TP 1 -> 1 rows under auto: every chunk in place, as the plan says, and status says so too
    assert delta(p0, p1, "kvxferd_chunks_total", transport="tcp", mode="direct", why="plan") == 4
    modes = status_of(pd)["chunk_modes"]
    assert modes == {f"tcp/{s['mode']}/{s['why']}": int(p1.value("kvxferd_chunks_total", **s))
                     for s in ({"mode": m, "why": w} for m in ("direct", "staged")
                               for w in ("plan", "short_runs", "device_memory", "no_landing_ring"))
                     if p1.value("kvxferd_chunks_total", **s)}
    assert delta(p0, p1, "kvxferd_chunk_size_bytes_count") == 4
    assert delta(d0, d1, "kvxferd_request_duration_seconds_count") == 3
    assert delta(d0, d1, "kvxferd_phase_duration_seconds_count", phase="transfer") == 3
    # nothing is left in flight on either side
    for s in (p1, d1):
        assert s.value("kvxferd_inflight_requests") == 0


def test_gauges_and_handshakes(pair):
    pd, dd, _pw, _dw = pair
    run_requests(pair, [5])  # at least one transfer, so the handshake has happened
    p, d = Scrape(pd), Scrape(dd)
    assert p.value("kvxferd_registered_ranks", role="prefill") == 1
    assert p.value("kvxferd_registered_ranks", role="decode") == 0
    assert d.value("kvxferd_registered_ranks", role="decode") == 1
    # one prefill/decode instance pair: exactly one handshake, on both ends
    assert d.value("kvxferd_handshakes_total", result="ok") == 1
    assert p.value("kvxferd_handshakes_total", result="ok") == 1
    # each daemon sees the other: the decode daemon its upstream link, the prefill daemon its downstream peer
    for s in (p, d):
        assert s.value("kvxferd_peers", state="up") == 1
        assert s.value("kvxferd_peers", state="down") == 0
        assert s.value("kvxferd_heartbeat_misses_total") == 0
        assert s.value("kvxferd_up") == 1
        assert abs(s.value("kvxferd_start_time_seconds") - time.time()) < 24 * 3600


def test_inflight_gauge_counts_waiting_requests_at_scrape_time(pair):
    pd, dd, pw, dw = pair
    for i in range(3):  # expected on the decode side, never sent: they wait for input
        dw.command(cmd="expect", request_id=f"gauge-{i}", pages=pages(40 + 2 * i, 8), n=8,
                   source_instance=pw.instance, source_address=pd.address)
    wait_for(lambda: Scrape(dd).value("kvxferd_inflight_requests", side="decode", state="waiting_for_input") == 3,
             what="three decode requests waiting for input")
    assert Scrape(dd).value("kvxferd_inflight_requests", side="decode", state="transferring") == 0
    for i in range(3):
        dw.command(cmd="abort", request_id=f"gauge-{i}", reason="test done")
        assert next_for(dw, f"gauge-{i}")["state"] == "failed"
    wait_for(lambda: Scrape(dd).value("kvxferd_inflight_requests", side="decode") == 0, what="gauge back to 0")


def test_incompatible_pair_is_refused_and_counted_by_field(pair, tmp_path):
    pd, dd, _pw, _dw = pair
    p0, d0 = Scrape(pd), Scrape(dd)
    geometry = RankGeometry(spec(head_dim=64), 0, 0, 8)  # the prefill instance has head_dim 32
    cache = allocate_cpu(geometry, name="ops-bad-decode")
    client = EngineClient(dd.socket_path, timeout=30)
    try:
        rid = client.register("decode-bad", "decode", geometry, cache.descriptors())
        assert Scrape(dd).value("kvxferd_registered_ranks", role="decode") == 2
        client.expect(rid, "bad-1", source_instance="prefill-a", source_address=pd.address, pages=[0, 1],
                      num_tokens=20)
        result = client.wait(rid, "bad-1", timeout=30)
        assert result["state"] == "failed" and result["code"] == "incompatible"
        assert "head_dim" in result["reason"]
        client.unregister(rid)
    finally:
        client.close()
        cache.close()
    p1, d1 = Scrape(pd), Scrape(dd)
    for a, b in ((p0, p1), (d0, d1)):
        assert b.value("kvxferd_compat_refusals_total", field="head_dim") \
            - a.value("kvxferd_compat_refusals_total", field="head_dim") == 1
        assert b.value("kvxferd_handshakes_total", result="refused") \
            - a.value("kvxferd_handshakes_total", result="refused") == 1
    assert d1.value("kvxferd_transfer_failures_total", side="decode", reason="incompatible") \
        - d0.value("kvxferd_transfer_failures_total", side="decode", reason="incompatible") == 1
    assert d1.value("kvxferd_transfers_total", side="decode", outcome="failed") \
        - d0.value("kvxferd_transfers_total", side="decode", outcome="failed") == 1
    # the gauge follows the unregister back down
    assert d1.value("kvxferd_registered_ranks", role="decode") == 1


def test_invalid_engine_messages_are_counted_and_answered(pair):
    _pd, dd, _pw, _dw = pair
    before = Scrape(dd).value("kvxferd_invalid_messages_total", endpoint="engine")
    client = EngineClient(dd.socket_path, timeout=30)
    try:
        for payload in (b"\xc1garbage bytes, not msgpack",             # not msgpack at all
                        msgpack.packb([1, 2, 3]),                       # not a map
                        msgpack.packb({"op": "expect", "seq": 7}),      # required fields missing
                        msgpack.packb({"op": "format_disk"})):          # unknown op
            reply = client.send_raw(payload)
            assert reply is not None and reply["ok"] is False, reply
            assert reply["error"]["code"] and reply["error"]["message"]
        assert client.call("ping")["ok"] is True  # still serving
    finally:
        client.close()
    after = Scrape(dd).value("kvxferd_invalid_messages_total", endpoint="engine")
    assert after - before == 4


def test_health_and_readiness_endpoints(pair):
    pd, dd, _pw, _dw = pair
    for d in (pd, dd):
        assert http_get(base_url(d) + "/healthz")[::2] == (200, "ok\n")
        assert http_get(base_url(d) + "/readyz")[::2] == (200, "ready\n")
        assert http_get(base_url(d) + "/nope")[0] == 404
        status, ctype, body = http_get(base_url(d) + "/metrics")
        assert status == 200 and ctype.startswith("text/plain; version="), ctype
        assert "kvxferd_up 1.0" in body
        # a scraper that asks for OpenMetrics gets it
        status, ctype, body = http_get(base_url(d) + "/metrics",
                                       headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        assert status == 200 and ctype.startswith("application/openmetrics-text"), ctype
        assert body.rstrip().endswith("# EOF") and "kvxferd_up 1.0" in body


def test_label_cardinality_is_bounded(pair):
    """Series are keyed by bounded labels only: new requests add no series and no request id shows."""
    pd, dd, _pw, _dw = pair
    run_requests(pair, [3, 70], chunked=(70,))
    before = {d.name: Scrape(d).series() for d in (pd, dd)}
    ids_before = next(_ids)
    run_requests(pair, [3, 70, 9], chunked=(70,))
    for d in (pd, dd):
        s = Scrape(d)
        assert s.series() == before[d.name], "new request ids must not create new series"
        for f in s.families.values():
            labels = {k for sample in f.samples for k in sample.labels}
            assert not {k for k in labels if "request" in k or k in ("id", "rank_id", "peer", "address")}, f.name
            values = {v for sample in f.samples for v in sample.labels.values()}
            assert not any(v.startswith("m-") for v in values), (f.name, values)
            non_bucket = [x for x in f.samples if not x.name.endswith("_bucket")]
            assert len(non_bucket) <= 64, f"{f.name} has {len(non_bucket)} series"
    assert ids_before >= 2


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not on PATH (Debian: apt-get install prometheus; .ci/run does)")
def test_promtool_accepts_the_exposition(pair):
    pd, dd, _pw, _dw = pair
    run_requests(pair, [2])  # labelled series exist on both daemons
    for d in (pd, dd):
        text = Scrape(d).text
        out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr


def test_dashboard_and_alerts_only_use_exported_metrics(pair):
    """Every kvxferd_* name in the Grafana dashboard and the alert rules is served by a daemon."""
    _pd, dd, _pw, _dw = pair
    exported: set[str] = set()
    for f in Scrape(dd).families.values():
        suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
                    "summary": ("_count", "_sum", "_created")}.get(f.type, ("",))
        exported.update(f.name + s for s in suffixes)
    for path in (ROOT / "deploy/grafana/kvxferd.json", ROOT / "deploy/prometheus/kvxferd-rules.yaml"):
        used = set(re.findall(r"\bkvxferd_[a-z_]+", path.read_text()))
        assert used, path
        assert used <= exported, f"{path.name} uses metrics no daemon exports: {sorted(used - exported)}"


def test_operations_doc_lists_every_metric():
    """The metric table of docs/OPERATIONS.md names each metric a daemon exports, and nothing else."""
    from kvxferd.ops.metrics import Metrics
    doc = (ROOT / "docs/OPERATIONS.md").read_text()
    section = doc[doc.index("## Metrics and health"):].split("\n## ", 1)[0]
    exported = {f.name + ("_total" if f.type == "counter" else "") for f in Metrics().registry.collect()}
    listed = set(re.findall(r"`(kvxferd_[a-z_]+)", section))
    assert exported - listed == set(), "metrics missing from docs/OPERATIONS.md"
    assert listed - exported == set(), "docs/OPERATIONS.md lists metrics that do not exist"

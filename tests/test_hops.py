"""Per-request hop stamps (``daemon.hop_trace``) and the bench's breakdown of them."""

from __future__ import annotations

import threading

import pytest

from kvxferd.errors import ConfigError
from kvxferd.ops import config
from kvxferd.ops.hops import HopTrace
from kvxferd.tools.bench.hops import CRITICAL, SEGMENTS, breakdown, render


def test_off_by_default_it_keeps_nothing():
    trace = HopTrace()
    trace.mark("r1", "send_in")
    assert trace.snapshot() == {}


def test_it_keeps_the_first_stamp_of_each_hop_for_the_last_requests():
    trace = HopTrace(keep=3)
    for i in range(5):
        trace.mark(f"r{i}", "send_in")
    trace.mark("r4", "send_in")  # a second chunk of the request: the first stamp stays
    trace.mark("r4", "told_engine")
    snap = trace.snapshot()
    assert list(snap) == ["r2", "r3", "r4"]
    assert set(snap["r4"]) == {"send_in", "told_engine"} and snap["r4"]["told_engine"] >= snap["r4"]["send_in"]
    trace.configure(1)
    assert list(trace.snapshot()) == ["r4"]


def test_threads_mark_at_once_without_losing_a_request():
    trace = HopTrace(keep=10_000)

    def mark(k: int) -> None:
        for i in range(1000):
            trace.mark(f"t{k}-{i}", "data_start")

    threads = [threading.Thread(target=mark, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(trace.snapshot()) == 4000


def test_the_config_bounds_it():
    cfg = config.Config()
    cfg.daemon.hop_trace = -1
    with pytest.raises(ConfigError) as err:
        config.validate(cfg)
    assert err.value.field == "daemon.hop_trace"


def _stamps(base: int, hops: list[str], step: int = 1000) -> dict[str, int]:
    return {hop: base + i * step for i, hop in enumerate(hops)}


def test_the_breakdown_takes_each_segments_median_over_requests_stamped_at_both_ends():
    source_hops = ["send_in", "job_queued", "data_start"]
    decode_hops = ["chunk_in", "landed", "loop_dest", "told_decode"]
    engine, source, decode = {}, {}, {}
    for i, slow in enumerate((1, 1, 3)):  # the third request is three times slower at every hop
        t0 = i * 10_000_000
        source[f"r{i}"] = _stamps(t0 + 1000 * slow, source_hops, 1000 * slow)
        decode[f"r{i}"] = _stamps(t0 + 4000 * slow, decode_hops, 1000 * slow)
        engine[f"r{i}"] = (t0, t0 + 8000 * slow)
    source["r0"].update(data_end=source["r0"]["send_in"] + 5500, loop_job=source["r0"]["send_in"] + 6000,
                        told_prefill=source["r0"]["send_in"] + 7000)
    out = breakdown(engine, source, decode)
    for name, _a, _b in SEGMENTS[:CRITICAL]:
        assert out[name] == 1.0, (name, out)  # 1 us: the median, not the slow request's 3 us
    assert out["to the source loop"] == 0.5 and out["requests"] == 1  # only r0 has the source's completion
    line = render(out)
    assert line.startswith("hops p50 us over 1 requests: engine call in 1 | source lifecycle 1")
    assert "beside it: acknowledged at source" in line


def test_one_daemon_is_both_source_and_decode():
    both = {"r": _stamps(1000, ["send_in", "job_queued", "data_start", "chunk_in", "landed", "loop_dest",
                                "told_decode"])}
    out = breakdown({"r": (0, 8000)}, both, both)
    assert [out[name] for name, _a, _b in SEGMENTS[:CRITICAL]] == [1.0] * CRITICAL

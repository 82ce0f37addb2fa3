"""Where one small request's time goes: the hops of a latency row, from the daemons' own clocks.

The daemons stamp each request at their hops (``daemon.hop_trace``, :mod:`kvxferd.ops.hops`)
and the bench engine stamps its own send and the done event's arrival, all with the host's
monotonic clock. Each segment below is the time between two stamps of one request; the row
shows each segment's median over the row's requests. Pure: stamps in, medians out.
"""

from __future__ import annotations

from typing import Any, Mapping

from .model import pct

#: (segment, from, to): each end is (who, hop); who is "engine", "source" or "decode" (one daemon
#: for a local row). The first eight are the path to the decode engine's done event, in order;
#: the last three the source's own completion, which runs beside them.
SEGMENTS: tuple[tuple[str, tuple[str, str], tuple[str, str]], ...] = (
    ("engine call in", ("engine", "send"), ("source", "send_in")),
    ("source lifecycle", ("source", "send_in"), ("source", "job_queued")),
    ("data thread hand-off", ("source", "job_queued"), ("source", "data_start")),
    ("to the receiver", ("source", "data_start"), ("decode", "chunk_in")),
    ("receive", ("decode", "chunk_in"), ("decode", "landed")),
    ("to the decode loop", ("decode", "landed"), ("decode", "loop_dest")),
    ("decode lifecycle", ("decode", "loop_dest"), ("decode", "told_decode")),
    ("event out", ("decode", "told_decode"), ("engine", "done")),
    ("acknowledged at source", ("decode", "landed"), ("source", "data_end")),
    ("to the source loop", ("source", "data_end"), ("source", "loop_job")),
    ("source lifecycle, done", ("source", "loop_job"), ("source", "told_prefill")),
)
#: the first segments, end to end: the engine's own send to its done event
CRITICAL = 8


def breakdown(engine: Mapping[str, tuple[int, int]], source: Mapping[str, Mapping[str, int]],
              decode: Mapping[str, Mapping[str, int]]) -> dict[str, Any]:
    """Median microseconds of each segment over the requests stamped everywhere it needs, and how
    many requests each median is over; ``engine`` maps request id -> (send ns, done ns)."""
    out: dict[str, Any] = {}
    counts: dict[str, int] = {}
    per_request = [{"engine": {"send": sent, "done": done}, "source": source.get(rid, {}),
                    "decode": decode.get(rid, {})} for rid, (sent, done) in engine.items()]
    for name, a, b in SEGMENTS:
        spans = []
        for stamps in per_request:
            start, end = stamps[a[0]].get(a[1]), stamps[b[0]].get(b[1])
            if start is not None and end is not None:
                spans.append((end - start) / 1e3)
        if spans:
            out[name] = round(pct(spans, 0.5), 1)
            counts[name] = len(spans)
    if out:
        out["requests"] = min(counts.values())
    return out


def render(hops: Mapping[str, Any]) -> str:
    """One line: each segment's median in microseconds, the critical path first."""
    parts = [f"{name} {hops[name]:.0f}" for name, _a, _b in SEGMENTS[:CRITICAL] if name in hops]
    side = [f"{name} {hops[name]:.0f}" for name, _a, _b in SEGMENTS[CRITICAL:] if name in hops]
    text = " | ".join(parts)
    if side:
        text += "  (beside it: " + " | ".join(side) + ")"
    return f"hops p50 us over {hops.get('requests', 0)} requests: {text}"

"""How long the planner takes for one long request: ``make_plan`` + ``request_segments`` for
every writer of a 128k-token request on an 80-layer model."""

from __future__ import annotations

import statistics
import time
from typing import Any

from .model import MODELS


def planner_bench(runs: int, p_tp: int, d_tp: int, tokens: int = 128 * 1024) -> dict[str, Any]:
    """Median ms of make_plan + request_segments for every writer of one request."""
    import numpy as np

    from ...model.geometry import InstanceSpec
    from ...model.planner import make_plan
    from ...model.segments import request_segments
    m = MODELS["70B"]
    p = InstanceSpec(tp_size=p_tp, page_size=16, **m)
    d = InstanceSpec(tp_size=d_tp, page_size=16, **m)
    rng = np.random.default_rng(7)
    pages = tokens // 16
    src = rng.permutation(pages + 1024)[:pages].astype(np.int64)
    dst = rng.permutation(pages + 1024)[:pages].astype(np.int64)
    times = []
    segments = 0
    for _ in range(runs + 1):
        t = time.perf_counter()
        plan = make_plan(p, d)
        segments = 0
        for dest in plan.destinations:
            for w in dest.writers:
                segments += len(request_segments(w, src, 16, 0, dst, 16, 0, tokens))
        times.append(time.perf_counter() - t)
    times = times[1:]
    return {"ms": statistics.median(times) * 1e3, "best_ms": min(times) * 1e3, "segments": segments, "writers":
            sum(len(dd.writers) for dd in plan.destinations), "mode": plan.mode}

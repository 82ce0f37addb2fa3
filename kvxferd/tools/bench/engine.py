"""The bench's engine process: ``python -m kvxferd.tools.bench.engine CONFIG_JSON``.

It allocates every rank of one scenario in shared memory, registers the ranks with the
daemons, fills the prefill pages once from the byte oracle and keeps a window of requests
in flight, timing from the first ``send`` to the last decode-side completion event.
Before the timed run every destination page set is written once (so the daemons'
first-touch page faults are not timed); the page sets of the checked requests are then
reset to the canary, and after the run their bytes are compared with the oracle, along
with pages that were never destinations. It prints one JSON result line.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable

from .engine_layout import Layout, Rank


def engine_main(cfg: dict[str, Any]) -> dict[str, Any]:
    """Drive one scenario from inside an engine process; returns the result record."""
    import torch
    torch.set_num_threads(1)
    lay = Layout(cfg)
    result: dict[str, Any] = {"verified": False, "bad_bytes": None, "failures": []}
    ranks: list[Rank] = []
    t_setup = time.perf_counter()
    try:
        ranks = lay.allocate()
        if cfg.get("client") == "async":
            import asyncio

            from .engine_async import drive_async
            asyncio.run(drive_async(lay, ranks, result, t_setup))
        else:
            from .engine_sync import drive_sync
            drive_sync(lay, ranks, result, t_setup)
    except Exception as exc:  # noqa: BLE001 - reported to the orchestrator as a failed row
        result["error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        for r in ranks:
            r.cache.close()
    return result


def process_main(run: Callable[[dict[str, Any]], dict[str, Any]], usage: str) -> int:
    """A bench engine process: ``run`` on the JSON config of argv[1], its result printed as one JSON
    line; exit 0 only if it verified its bytes."""
    if len(sys.argv) < 2:
        print(usage, file=sys.stderr)
        return 2
    from ...ops.signals import cleanup_on_signals
    with cleanup_on_signals():  # SIGTERM from the bench: the run's finally unlinks the caches
        out = run(json.loads(sys.argv[1]))
    print(json.dumps(out, default=str), flush=True)
    return 0 if out.get("verified") else 1


if __name__ == "__main__":
    sys.exit(process_main(engine_main, "usage: python -m kvxferd.tools.bench.engine CONFIG_JSON  "
                                       "(run the bench with `kvxferd bench`)"))

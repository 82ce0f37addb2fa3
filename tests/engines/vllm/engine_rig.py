"""Three real vLLM engines and two daemons: the rig of the end-to-end tests.

A plain engine with no connector gives the reference tokens; a prefill and a decode engine,
each with kvxferd's connector and its own daemon, are pinned to different cores where the
machine has two. The rig checks at the end that the engines unlinked the shared-memory files
their KV was moved into. ``daemon_env`` starts both daemons with that environment (NIXL alone:
``transport_util.ONLY_NIXL``); ``reference`` (the plain run's tokens, from an earlier rig of the
same model and prompts) spares the plain engine.
"""

from __future__ import annotations

import glob
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import vllm_util as vu
from kvxferd.tools.sim import Cluster
from ops_support import close_cluster, in_parallel
from procs import JsonProc


@contextmanager
def engine_rig(root: Path, model: Path, prompts: dict[str, list[int]], max_tokens: int, tag: str, *,
               daemon_env: dict[str, str] | None = None,
               reference: dict[str, list[int]] | None = None) -> Iterator[dict[str, Any]]:
    """Start the rig for ``model``; yield its engines, daemons, pins and the plain run's tokens."""
    shm_before = set(glob.glob("/dev/shm/kvxferd-vllm-*"))
    cluster = Cluster()
    pd = cluster.daemon("prefill-node", start=False)
    dd = cluster.daemon("decode-node", start=False)
    in_parallel(lambda: pd.start(daemon_env), lambda: dd.start(daemon_env))
    cpus = sorted(os.sched_getaffinity(0))
    pins = ([cpus[0]], [cpus[1]]) if len(cpus) >= 2 else (None, None)

    def engine(name: str, kv: dict | None, cpus: list[int] | None, budget: int = 256) -> JsonProc:
        return JsonProc("engine_proc.py", {"model_dir": str(model), "kv": kv, "cpus": cpus,
                                           "max_num_batched_tokens": budget}, root / f"{name}.log")

    plain = engine("plain", None, None) if reference is None else None
    prefill = engine("prefill", vu.kv_transfer_config(instance=f"prefill-{tag}", address=pd.address,
                                                      socket_path=pd.socket_path), pins[0], budget=64)
    decode = engine("decode", vu.kv_transfer_config(instance=f"decode-{tag}", address=dd.address,
                                                    socket_path=dd.socket_path), pins[1])
    engines = [e for e in (plain, prefill, decode) if e is not None]
    try:
        for e in engines:
            assert e.next(300)["event"] == "ready"
        if plain is not None:
            reference = {name: plain.call(cmd="generate", prompt=p, max_tokens=max_tokens)["tokens"]
                         for name, p in prompts.items()}
            plain.close()
        yield {"prefill": prefill, "decode": decode, "pd": pd, "dd": dd, "plain": reference, "pins": pins,
               "max_tokens": max_tokens}
    finally:
        in_parallel(*[e.close for e in engines])  # each takes seconds to shut vLLM down: side by side
        close_cluster(cluster)
    assert set(glob.glob("/dev/shm/kvxferd-vllm-*")) == shm_before


def disaggregated(rig: dict[str, Any], prompt: list[int],
                  params_from: list[int] | None = None) -> tuple[list[int], dict]:
    """Prefill ``params_from`` (default: the prompt itself), decode ``prompt`` with its params."""
    pre = rig["prefill"].call(cmd="generate", prompt=params_from or prompt, max_tokens=1,
                              params={"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    assert params and json.loads(json.dumps(params)) == params
    dec = rig["decode"].call(cmd="generate", prompt=prompt, max_tokens=rig["max_tokens"], params=params)
    return dec["tokens"], params

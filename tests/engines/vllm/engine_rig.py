"""Three real vLLM engines and two daemons: the rig of the end-to-end tests.

The package's rig (:func:`kvxferd.tools.vllm_engine.engine_rig`, which ``make demo-vllm`` runs
too): a single engine with no connector gives the reference tokens; a prefill and a decode
engine, each with kvxferd's connector and its own daemon, are pinned to different cores where
the machine has two. Here it yields a dict the tests read, keeps its run dir (pytest's, with the
engines' and daemons' logs), and checks at the end that the engines unlinked the shared-memory
files their KV was moved into, and that both daemons outlived the engines and stopped cleanly.
``daemon_env`` starts both daemons with that environment (NIXL alone:
``transport_util.ONLY_NIXL``); ``reference`` (the single engine's tokens, from an earlier rig of
the same model and prompts) spares the single engine.
"""

from __future__ import annotations

import glob
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from kvxferd.tools import vllm_engine


@contextmanager
def engine_rig(root: Path, model: Path, prompts: dict[str, list[int]], max_tokens: int, tag: str, *,
               daemon_env: dict[str, str] | None = None,
               reference: dict[str, list[int]] | None = None) -> Iterator[dict[str, Any]]:
    """Start the rig for ``model``; yield its engines, daemons, pins and the single engine's tokens."""
    shm_before = set(glob.glob("/dev/shm/kvxferd-vllm-*"))
    with vllm_engine.engine_rig(root / "run", model, tag=tag, daemon_env=daemon_env,
                                single=reference is None) as rig:
        rig.keep_logs = True  # pytest keeps its tmp dirs of the last runs, and removes older ones
        if rig.single is not None:
            reference = {name: rig.single.call(cmd="generate", prompt=p, max_tokens=max_tokens)["tokens"]
                         for name, p in prompts.items()}
            rig.close_single()
        yield {"prefill": rig.prefill, "decode": rig.decode, "pd": rig.pd, "dd": rig.dd, "plain": reference,
               "pins": rig.pins, "max_tokens": max_tokens, "rig": rig}
    assert set(glob.glob("/dev/shm/kvxferd-vllm-*")) == shm_before
    # each daemon outlived the engine ranks that unregistered from it, and stopped cleanly when told
    exits = {n: d.proc.returncode for n, d in rig.cluster.daemons.items()}
    assert exits == {n: 0 for n in exits}, f"daemon exit codes {exits}; their logs are in {rig.root}"


def rig_on(transport: str, tmp_path_factory: Any, model: Path, prompts: dict[str, list[int]], max_tokens: int,
           name: str, tag: str, plain: dict[str, dict[str, list[int]]]) -> Iterator[dict[str, Any]]:
    """The body of a module's rig fixture parametrized over the transports (``yield from``): its
    daemons on ``transport`` alone; the single engine's tokens are computed by the first rig and
    kept in ``plain`` (the module's), so the same model and prompts start it once."""
    from transport_util import daemon_env, require

    require(transport)
    root = tmp_path_factory.mktemp(f"{name}-{transport}")
    with engine_rig(root, model, prompts, max_tokens, tag, daemon_env=daemon_env(transport),
                    reference=plain.get("tokens")) as r:
        plain.setdefault("tokens", r["plain"])
        r["transport"] = transport
        yield r


def disaggregated(rig: dict[str, Any], prompt: list[int],
                  params_from: list[int] | None = None) -> tuple[list[int], dict]:
    """Prefill ``params_from`` (default: the prompt itself), decode ``prompt`` with its params."""
    tokens, params = vllm_engine.disaggregated(rig["rig"], prompt, rig["max_tokens"], params_from)
    assert json.loads(json.dumps(params)) == params
    return tokens, params

"""Real vLLM engines in their own processes, and the rig of two daemons and a prefill, a decode
and a single engine that ``make demo-vllm`` and the vLLM end-to-end tests run.

The engine process: ``python -m kvxferd.tools.vllm_engine '<json>'`` builds ``vllm.LLM`` on a
tiny local model (:mod:`kvxferd.tools.tiny_model`; CPU, float32, eager), with kvxferd's connector
when the config names a ``kv`` (vLLM's ``kv_transfer_config``), pinned to the CPUs it is given,
and reads JSON commands on stdin, one a line, answering each with one JSON event on stdout:
``generate`` (greedy, with optional ``kv_transfer_params`` in ``extra_args``, the way vLLM's
disaggregated-serving proxy passes them) and ``drain`` (step the engine until no finished
request still holds KV blocks, as a serving loop would). vLLM is imported only there: this
module imports without it.

The rig (:func:`engine_rig`): a prefill daemon and a decode daemon (``kvxferd serve``), a
prefill engine and a decode engine with kvxferd's connector, each at its own daemon and pinned
to its own core where the machine has two, and a single engine with no connector (the
reference), all separate processes. :func:`disaggregated` runs a prompt the way vLLM's
disaggregated serving does: prefill with ``max_tokens=1`` and ``{"do_remote_decode": True}``,
then decode with the params prefill returned.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .jsonlines import JsonProc
from .tiny_model import BLOCK

READY_TIMEOUT_S = 300.0   # an engine's start-up: vLLM's import, the model, its KV cache (tens of seconds on 2 cores)


# -- the engine process ---------------------------------------------------------------------

def main() -> int:
    cfg = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    # vLLM logs to stdout: the protocol gets its own copy of fd 1, and fd 1 goes to stderr
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def emit(obj: dict[str, Any]) -> None:
        protocol.write(json.dumps(obj) + "\n")
        protocol.flush()

    if cfg.get("cpus"):
        os.sched_setaffinity(0, set(cfg["cpus"]))
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = dict(model=cfg["model_dir"], enforce_eager=True, dtype="float32", max_model_len=256,
                                  skip_tokenizer_init=True, block_size=BLOCK, kv_cache_memory_bytes=32 << 20, seed=0,
                                  max_num_batched_tokens=cfg.get("max_num_batched_tokens", 256),
                                  enable_prefix_caching=True)
    if cfg.get("kv"):
        kwargs["kv_transfer_config"] = cfg["kv"]
    started = time.monotonic()
    llm = LLM(**kwargs)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    emit({"event": "ready", "startup_s": round(time.monotonic() - started, 1)})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "generate":
                extra = {"kv_transfer_params": cmd["params"]} if cmd.get("params") else None
                sp = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True, extra_args=extra)
                out = llm.generate([{"prompt_token_ids": cmd["prompt"]}], sp, use_tqdm=False)[0]
                emit({"event": "generated", "tokens": list(out.outputs[0].token_ids),
                      "finish_reason": out.outputs[0].finish_reason, "kv_transfer_params": out.kv_transfer_params})
            elif cmd["cmd"] == "drain":
                deadline = time.monotonic() + cmd.get("timeout", 60)
                while scheduler.requests and time.monotonic() < deadline:
                    engine.step()
                    time.sleep(0.02)
                emit({"event": "drained", "held": sorted(scheduler.requests)})
        except Exception as exc:  # noqa: BLE001 - reported to whoever drives the engine
            emit({"event": "error", "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]})
    llm.llm_engine.engine_core.shutdown()  # the connector unregisters from its daemon here
    # What is left is the interpreter's teardown of vLLM's and torch's modules: seconds of CPU
    # that nothing here needs (its KV cache, a memfd, goes with the process). Logs flushed, it ends.
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr, protocol):
        stream.flush()
    os._exit(0)


def start_engine(model_dir: Path, log_path: Path, *, kv: dict[str, Any] | None = None,
                 cpus: list[int] | None = None, budget: int = 256) -> JsonProc:
    """One engine process (not waited for: its first event is ``ready``). ``kv``: vLLM's
    ``kv_transfer_config`` (None: no connector); ``budget``: ``max_num_batched_tokens``, so a
    longer prompt is prefilled in chunks of it. Its own session: a terminal's Ctrl-C goes to the
    tool, which stops it. Its own interpreter, never forked from a preloaded one (see
    :func:`kvxferd.tools.launch.popen`)."""
    config = {"model_dir": str(model_dir), "kv": kv, "cpus": cpus, "max_num_batched_tokens": budget}
    return JsonProc(["-m", "kvxferd.tools.vllm_engine", json.dumps(config)], log_path, start_new_session=True,
                    preloaded=False)


# -- the rig --------------------------------------------------------------------------------

@dataclass
class Rig:
    root: Path
    cluster: Any        # kvxferd.tools.sim.Cluster: the daemons, their configs, sockets and logs in root
    pd: Any             # the prefill daemon (DaemonProc)
    dd: Any             # the decode daemon
    prefill: JsonProc
    decode: JsonProc
    single: JsonProc | None   # the engine with no connector; None once closed or when not started
    pins: tuple[list[int] | None, list[int] | None]
    #: the run dir stays when the rig closes, with its logs (it stays too when an error ends the rig)
    keep_logs: bool = False

    def close_single(self) -> None:
        """Stop the single engine once its tokens are known, its core going to the others: its input
        ends, and it shuts vLLM down (seconds) while they work; the rig waits for it when it closes."""
        if self.single is not None:
            single, self.single = self.single, None
            try:
                single.proc.stdin.close()
            except OSError:
                pass


@contextmanager
def engine_rig(root: Path, model: Path, *, tag: str, daemon_env: dict[str, str] | None = None,
               single: bool = True, prefill_model: Path | None = None) -> Iterator[Rig]:
    """Start the daemons and engines with their files in ``root`` (made if missing), wait until every
    engine is ready, yield the :class:`Rig`; stop everything however the block ends (engines, then
    daemons, side by side) and remove ``root`` unless ``rig.keep_logs`` or an error was raised.
    ``tag`` names the engines' instances (``prefill-<tag>``, ``decode-<tag>``); ``daemon_env`` is both
    daemons' environment (:data:`kvxferd.tools.sim.ONLY_NIXL`: NIXL alone); ``prefill_model``, another
    model for the prefill engine (a negative control: KV of other weights)."""
    from ..adapters.vllm.logic import kv_transfer_config
    from .sim import Cluster, in_parallel

    root.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(root=root)
    engines: list[JsonProc] = []
    rig: Rig | None = None
    failed = False
    try:
        pd = cluster.daemon("prefill-node", start=False)
        dd = cluster.daemon("decode-node", start=False)
        cpus = sorted(os.sched_getaffinity(0))
        pins = ([cpus[0]], [cpus[1]]) if len(cpus) >= 2 else (None, None)
        # the daemons first: each engine registers its KV cache with its daemon while it starts
        in_parallel(lambda: pd.start(daemon_env), lambda: dd.start(daemon_env))

        def engine(name: str, model_dir: Path, **kw: Any) -> JsonProc:
            engines.append(start_engine(model_dir, root / f"{name}.log", **kw))
            return engines[-1]

        single_engine = engine("single", model) if single else None
        prefill = engine("prefill", prefill_model or model, cpus=pins[0], budget=64,
                         kv=kv_transfer_config(instance=f"prefill-{tag}", address=pd.address,
                                               socket_path=pd.socket_path))
        decode = engine("decode", model, cpus=pins[1],
                        kv=kv_transfer_config(instance=f"decode-{tag}", address=dd.address, socket_path=dd.socket_path))
        for e in engines:
            e.next(READY_TIMEOUT_S)
        rig = Rig(root, cluster, pd, dd, prefill, decode, single_engine, pins)
        yield rig
    except Exception:
        failed = True  # its logs stay; a signal (SystemExit) stops the rig and leaves nothing
        raise
    finally:
        from ..ops.signals import deferred
        with deferred():  # a SIGTERM now ends the tool once everything is stopped, not halfway
            try:
                if engines:
                    in_parallel(*[e.close for e in engines])  # each takes seconds to shut vLLM down
                if cluster.daemons:
                    in_parallel(*[d.stop for d in cluster.daemons.values()])
            finally:
                cluster.close(keep_root=failed or (rig is not None and rig.keep_logs))  # removes root otherwise


def disaggregated(rig: Rig, prompt: list[int], max_tokens: int,
                  params_from: list[int] | None = None) -> tuple[list[int], dict[str, Any]]:
    """Prefill ``params_from`` (default: the prompt itself), then decode ``prompt`` with the
    ``kv_transfer_params`` prefill returned: decode's tokens and those params. A request vLLM
    ended otherwise than at ``max_tokens`` (e.g. ``error``: its KV load failed) raises
    :class:`RequestFailed`."""
    pre = rig.prefill.call(cmd="generate", prompt=params_from or prompt, max_tokens=1,
                           params={"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    if pre.get("finish_reason") != "length" or not params:
        raise RequestFailed(f"prefill ended {pre.get('finish_reason')!r} with kv_transfer_params {params!r}; "
                            "see the prefill engine's log")
    dec = rig.decode.call(cmd="generate", prompt=prompt, max_tokens=max_tokens, params=params)
    if dec.get("finish_reason") != "length":
        raise RequestFailed(f"decode ended {dec.get('finish_reason')!r} after {len(dec['tokens'])} of {max_tokens} "
                            "tokens (a failed KV load ends it 'error'); see the decode engine's log")
    return dec["tokens"], params


class RequestFailed(RuntimeError):
    """vLLM ended a request of :func:`disaggregated` before its last token."""


if __name__ == "__main__":
    sys.exit(main())

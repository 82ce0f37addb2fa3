"""A real vLLM engine in its own process, driven over stdin/stdout JSON lines.

``python engine_proc.py '<json>'`` builds ``vllm.LLM`` on the tiny local model (CPU,
float32, eager), optionally with kvxferd's connector, pinned to the CPUs it is given.
Commands: ``generate`` (greedy, with optional ``kv_transfer_params`` in ``extra_args``,
the way vLLM's disaggregated-serving proxy passes them) and ``drain`` (step the engine
until no finished request still holds KV blocks, as a serving loop would).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


# vLLM logs to stdout: the protocol gets its own copy of fd 1, and fd 1 goes to stderr
_PROTOCOL = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)


def emit(obj: dict[str, Any]) -> None:
    _PROTOCOL.write(json.dumps(obj) + "\n")
    _PROTOCOL.flush()


def main() -> int:
    cfg = json.loads(sys.argv[1])
    if cfg.get("cpus"):
        os.sched_setaffinity(0, set(cfg["cpus"]))
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = dict(model=cfg["model_dir"], enforce_eager=True, dtype="float32", max_model_len=256,
                                  skip_tokenizer_init=True, block_size=32, kv_cache_memory_bytes=32 << 20, seed=0,
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
                      "kv_transfer_params": out.kv_transfer_params})
            elif cmd["cmd"] == "drain":
                deadline = time.monotonic() + cmd.get("timeout", 60)
                while scheduler.requests and time.monotonic() < deadline:
                    engine.step()
                    time.sleep(0.02)
                emit({"event": "drained", "held": sorted(scheduler.requests)})
        except Exception as exc:  # noqa: BLE001 - reported to the test
            emit({"event": "error", "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]})
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

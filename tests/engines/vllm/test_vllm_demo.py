"""``make demo-vllm`` (kvxferd/tools/demo_vllm.py) as a command, at small size.

Two runs of the real command, one after the other (side by side, their six engines on two
cores took longer than both in turn): three prompts on tcp, which must pass (exit 0, every
prompt's tokens equal, the summary line, the daemons' counts of KV bytes on tcp and none on
NIXL, its run dir gone), and a negative control of one prompt (``--negative-control``: the
prefill engine runs the model with other weights) on NIXL alone, which must fail (exit 1,
decode's tokens differ) while its bytes still went over NIXL and none over tcp, and leave its
run dir with the logs. Where NIXL cannot start in this venv the negative control runs on tcp.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from transport_util import NIXL_MISSING

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = 3
SUMMARY = re.compile(r"demo-vllm: (\d+)/(\d+) prompts equal; (\d+) failed requests; (\d+) bytes of KV moved over "
                     r"(\w+); [\d.]+ s(; FAILED)?")
COUNTS = re.compile(r"prefill daemon sent tcp=(\d+) nixl=(\d+), decode daemon received tcp=(\d+) nixl=(\d+)")
NEGATIVE_TRANSPORT = "tcp" if NIXL_MISSING else "nixl"


def _run(prompts: int, *args: str) -> tuple[int, str, str]:
    """The demo as a command, from this checkout: its exit code, stdout and stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVXFERD_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    p = subprocess.Popen([sys.executable, "-m", "kvxferd.tools.demo_vllm", "--prompts", str(prompts),
                          "--max-tokens", "4", *args], cwd=ROOT, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = p.communicate(timeout=280)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, out, err


def _counts(stdout: str) -> dict[str, int]:
    (found,) = COUNTS.findall(stdout)
    return dict(zip(("sent-tcp", "sent-nixl", "received-tcp", "received-nixl"), map(int, found)))


def _run_dir(stdout: str) -> Path:
    return Path(re.search(r"\(run dir (\S+)\)", stdout).group(1))


def test_the_demo_gives_the_single_engines_tokens_with_kv_over_tcp():
    code, out, err = _run(PROMPTS, "--transport", "tcp")
    assert code == 0, out[-3000:] + err[-3000:]
    lines = out.strip().splitlines()
    summary = SUMMARY.fullmatch(lines[-1])
    assert summary and summary.groups() == (str(PROMPTS), str(PROMPTS), "0", summary[4], "tcp", None), lines[-1]
    equal = [line for line in lines if re.match(r"prompt \d+: \d+ tokens, decode == single engine", line)]
    assert len(equal) == PROMPTS, lines
    counts = _counts(out)
    assert counts["sent-tcp"] == counts["received-tcp"] == int(summary[4]) > 0, counts
    assert counts["sent-nixl"] == counts["received-nixl"] == 0, counts
    assert not _run_dir(out).exists()  # a run that passed leaves nothing


def test_the_negative_control_fails_the_demo():
    code, out, err = _run(1, "--transport", NEGATIVE_TRANSPORT, "--negative-control")
    assert code == 1, out[-3000:] + err[-3000:]
    lines = out.strip().splitlines()
    differ = [line for line in lines if re.match(r"prompt \d+: \d+ tokens, decode != single engine", line)]
    assert len(differ) == 1, out
    kept = re.search(r"^logs kept in (\S+)", out, re.M)
    summary = SUMMARY.fullmatch(lines[-2])
    assert kept and lines[-1].startswith("logs kept in"), lines[-2:]
    assert summary and summary.groups()[:3] == ("0", "1", "0") and summary[5] == NEGATIVE_TRANSPORT, lines
    assert summary[6] == "; FAILED"
    # for that reason alone: every transfer done, exactly the prompt's KV moved
    assert [line for line in lines if line.startswith("FAILED")] == \
        ["FAILED: prompt 1: decode's tokens differ from the single engine's"], lines
    # the transfers themselves went through, on the transport asked for: decode read other weights' KV
    counts = _counts(out)
    other = "tcp" if NEGATIVE_TRANSPORT == "nixl" else "nixl"
    assert counts[f"sent-{NEGATIVE_TRANSPORT}"] == counts[f"received-{NEGATIVE_TRANSPORT}"] > 0, counts
    assert counts[f"sent-{other}"] == counts[f"received-{other}"] == 0, counts
    run_dir = Path(kept[1])
    try:
        logs = {p.name for p in run_dir.iterdir()}
        assert {"prefill-node.log", "decode-node.log", "single.log", "prefill.log", "decode.log"} <= logs, logs
        assert not {"model", "model-other"} & logs and not [n for n in logs if n.endswith(".sock")], logs
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)

"""The daemon's runtime does not load the tools (simulator, oracle, demo, bench): they drive
the daemon from outside, as engines do."""

from __future__ import annotations

import subprocess
import sys


def test_serving_and_the_clients_import_no_tool_module():
    code = ("import sys, kvxferd.cli, kvxferd.control.daemon, kvxferd.sdk.client, kvxferd.adapters.vllm, "
            "kvxferd.adapters.sglang\n"
            "kvxferd.cli.build_parser()\n"
            "print(sorted(m for m in sys.modules if m.startswith('kvxferd.tools')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout

#!/usr/bin/env python3
"""Reliability figures: recorded by the fuzz, fault and load tests, rendered as Markdown.

The tests call :func:`record` when ``KVXFERD_RELIABILITY_OUT`` names a JSON file; each test
adds its own entry (messages fuzzed, faults survived, requests under load, RSS and file
descriptors before and after). This script turns that file into ``docs/RELIABILITY.md``::

    KVXFERD_RELIABILITY_OUT=reliability.json python -m pytest -q \\
        tests/test_fuzz_engine.py tests/test_fuzz_peer.py tests/test_fuzz_data.py \\
        tests/test_faults_more.py tests/test_load.py tests/test_nixl_staged.py \\
        tests/test_restart.py tests/test_auth_failures.py
    python tools/reliability_report.py reliability.json -o docs/RELIABILITY.md

The document is generated; edit this script, not the document.

The module also holds the small measurement helpers the tests share (a Prometheus scrape,
a process's RSS and open file descriptors), so that what the tests measure and what the
report says are defined in one place.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import fcntl
import json
import os
import re
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

ENV = "KVXFERD_RELIABILITY_OUT"
SECTIONS = ("fuzz", "faults", "load")


# -- helpers for the tests ---------------------------------------------------------------

def record(section: str, name: str, data: dict[str, Any]) -> None:
    """Merge ``data`` as ``results[section][name]`` into the file named by $KVXFERD_RELIABILITY_OUT."""
    path = os.environ.get(ENV)
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # tests run in parallel processes (pytest-xdist) read, merge and replace the same file: one at
    # a time, under a lock on its directory (a lock file would be left behind)
    lock = os.open(target.parent, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            results = json.loads(target.read_text())
        except (OSError, ValueError):
            results = {}
        results.setdefault(section, {})[name] = data
        results["updated"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".")
        with os.fdopen(fd, "w") as fh:
            json.dump(results, fh, indent=2, sort_keys=True, default=str)
            fh.write("\n")
        os.replace(tmp, target)
    finally:
        os.close(lock)  # and with it the lock


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')


def scrape(url: str, timeout: float = 10.0) -> dict[str, float]:
    """All samples of a Prometheus text endpoint: ``{'name{labels}': value}``."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback test endpoint
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def metric(url: str, name: str, **labels: str) -> float:
    """One sample (0 when the labelled series does not exist yet)."""
    want = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    return scrape(url).get(name + want, 0.0)


def rss_kb(pid: int) -> int:
    """VmRSS of a process, in KiB, from /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_kinds(pid: int) -> dict[str, int]:
    """Open descriptors by kind (socket, anon_inode:[eventfd], /dev/shm file, ...)."""
    kinds: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        kind = target.split(":", 1)[0] if ":" in target else ("shm" if target.startswith("/dev/shm") else "file")
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


# -- rendering ---------------------------------------------------------------------------

def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        out.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return out


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_cell(v) for v in value) if value else "none"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_cell(v)}" for k, v in sorted(value.items())) if value else "none"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _mib(kb: int | None) -> str:
    return "n/a" if kb is None else f"{kb / 1024:.1f} MiB"


def render(results: dict[str, Any]) -> str:
    lines = [
        "# kvxferd reliability figures",
        "",
        "<!-- generated by tools/reliability_report.py from a test run; do not edit by hand -->",
        "",
        f"Generated from the test run recorded at {results.get('updated', 'an unknown time')}. "
        "Every figure below was measured against real daemon processes and real simulated "
        "engine processes on loopback; to reproduce it:",
        "",
        "```",
        "KVXFERD_RELIABILITY_OUT=reliability.json .venv/bin/python -m pytest -q \\",
        "    tests/test_fuzz_engine.py tests/test_fuzz_peer.py tests/test_fuzz_data.py \\",
        "    tests/test_faults_more.py tests/test_load.py tests/test_nixl_staged.py \\",
        "    tests/test_restart.py tests/test_auth_failures.py",
        "python tools/reliability_report.py reliability.json -o docs/RELIABILITY.md",
        "```",
        "",
    ]
    fuzz = results.get("fuzz", {})
    lines += ["## Fuzzing", "",
              "Malformed and hostile messages thrown at each endpoint of a running daemon. After every "
              "run the daemon must still answer `ping`, every message that the protocol answers must "
              "have been answered, `kvxferd_invalid_messages_total{endpoint}` (scraped from the real "
              "`/metrics`) must have grown by exactly the number of schema errors answered, and the "
              "canary bytes (0xA5) filling every registered page, the unused tail of partial pages "
              "and the padding between regions must be intact everywhere except the destination "
              "rows of legitimate requests.", "",
              "*answered* counts replies. The engine endpoint answers every frame except those over "
              "`limits.max_message_bytes`, which ZeroMQ drops with the connection. The peer endpoint "
              "answers errors, pings and handshakes; a valid `expect`, `abort` or `pong` has no reply by "
              "protocol, so each batch ends with a `ping` whose `pong` proves the daemon got through it. "
              "The data port answers every header it reads; a sender that hangs up mid-payload gets none.",
              ""]
    if fuzz:
        rows = []
        for name, f in sorted(fuzz.items()):
            rows.append([f.get("endpoint", name), name, f.get("messages", 0), f.get("answered", "n/a"),
                         f.get("invalid_metric_delta", "n/a"), f.get("internal_errors", 0),
                         f.get("bytes_outside_destinations", 0), f.get("daemon_alive", False),
                         round(float(f.get("seconds", 0.0)), 1)])
        lines += _table(["endpoint", "run", "messages", "answered", "invalid metric +", "internal errors",
                         "bytes written outside destinations", "daemon alive", "seconds"], rows)
        lines.append("")
        total = {}
        for f in fuzz.values():
            total[f.get("endpoint", "?")] = total.get(f.get("endpoint", "?"), 0) + int(f.get("messages", 0))
        lines.append("Messages per endpoint in total: " + ", ".join(f"{k} {v:,}" for k, v in sorted(total.items()))
                     + ".")
        lines.append("")
        for name, f in sorted(fuzz.items()):
            cats = f.get("categories")
            if cats:
                lines.append(f"- `{name}` message kinds: " + ", ".join(f"{k} {v:,}" for k, v in sorted(cats.items())))
            codes = f.get("error_codes")
            if codes:
                lines.append(f"- `{name}` answers by error code: "
                             + ", ".join(f"{k} {v:,}" for k, v in sorted(codes.items())))
        lines.append("")
    else:
        lines += ["No fuzz results were recorded.", ""]

    faults = results.get("faults", {})
    lines += ["## Faults", "",
              "Each case runs against real processes. Survived means: every request reached a terminal "
              "state within its configured deadline, nothing was reported done unless the decode "
              "engine verified every byte, unaffected peers kept being served, and a returning peer "
              "worked again.", ""]
    if faults:
        rows = []
        for name, f in sorted(faults.items()):
            rows.append([name, f.get("survived", False), f.get("outcome", ""),
                         f.get("terminal_after_s", "n/a"), f.get("deadline_s", "n/a"),
                         round(float(f.get("seconds", 0.0)), 1)])
        lines += _table(["case", "survived", "what happened", "terminal after (s)", "deadline (s)",
                         "test seconds"], rows)
        lines.append("")
        survived = sum(1 for f in faults.values() if f.get("survived"))
        lines += [f"Faults survived: {survived} of {len(faults)}.", ""]
    else:
        lines += ["No fault results were recorded.", ""]

    load = results.get("load", {})
    lines += ["## Load", ""]
    if load:
        for name, l in sorted(load.items()):
            lines += [f"### {name}", "",
                      f"{l.get('requests', 0):,} requests ({l.get('verified', 0):,} verified byte-exact on every "
                      f"decode rank), up to {l.get('concurrency', 0)} in flight, layout {l.get('layout', '')}, "
                      f"{l.get('tokens_min', 0)} to {l.get('tokens_max', 0)} tokens each, "
                      f"{l.get('chunked', 0):,} of them chunked, in {float(l.get('seconds', 0.0)):.1f} s "
                      f"({float(l.get('requests_per_s', 0.0)):.0f} requests/s).", ""]
            rows = []
            for dname, d in sorted(l.get("daemons", {}).items()):
                rows.append([dname, _mib(d.get("rss_kb_before")), _mib(d.get("rss_kb_after")),
                             _mib((d.get("rss_kb_after") or 0) - (d.get("rss_kb_before") or 0)),
                             d.get("fds_before"), d.get("fds_after"), d.get("requests_left", {}),
                             d.get("staging_bytes_before"), d.get("staging_bytes_after")])
            lines += _table(["daemon", "RSS before", "RSS after", "RSS growth", "fds before", "fds after",
                             "requests left", "staging bytes before", "staging bytes after"], rows)
            lines.append("")
    else:
        lines += ["No load results were recorded.", ""]

    leaks: list[str] = []
    for section in SECTIONS:
        for name, entry in sorted(results.get(section, {}).items()):
            for leak in entry.get("leaks", []):
                leaks.append(f"{section}/{name}: {leak}")
    lines += ["## Leaks", ""]
    lines += ([f"- {leak}" for leak in leaks] if leaks else
              ["None found: after the runs no request entries remained, staging memory did not grow and "
               "open file descriptors stayed within a small constant of their starting count."])
    lines.append("")

    notes: list[str] = []
    for section in SECTIONS:
        for name, entry in sorted(results.get(section, {}).items()):
            for note in entry.get("notes", []):
                notes.append(f"{section}/{name}: {note}")
    if notes:
        lines += ["## Observations", "", *[f"- {n}" for n in notes], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="JSON file written by the tests (KVXFERD_RELIABILITY_OUT)")
    ap.add_argument("-o", "--output", default="-", help="Markdown file to write (default: stdout)")
    args = ap.parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    text = render(results)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

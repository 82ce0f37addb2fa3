"""What a process holds, read from /proc, and a Prometheus scrape: the figures leak checks compare.

Shared by the soak (:mod:`kvxferd.tools.soak`) and the reliability tests (through
``tools/reliability_report.py``), so that what is measured and what is reported are defined
in one place.
"""

from __future__ import annotations

import os
import re
import urllib.request
from pathlib import Path

#: what /proc/<pid>/maps shows for an engine's KV cache: a memfd, or a named file in /dev/shm
KV_MAPPING_MARKS = ("/memfd:kvxferd-", "/dev/shm/kvxferd-")

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')


def scrape(url: str, timeout: float = 10.0, missing_ok: bool = False) -> dict[str, float]:
    """All samples of a Prometheus text endpoint: ``{'name{labels}': value}``. ``missing_ok``: no
    samples, rather than an error, from an endpoint that does not answer (a daemon that died,
    which the caller reports in its own words)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - a loopback endpoint
            text = resp.read().decode()
    except OSError:
        if missing_ok:
            return {}
        raise
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def summed(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of one metric's samples whose labels include ``labels``."""
    total = 0.0
    for key, value in samples.items():
        head, _, rest = key.partition("{")
        if head == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def by_label(samples: dict[str, float], name: str, label: str, **match: str) -> dict[str, float]:
    """One metric's samples summed per value of ``label``, among those whose labels include ``match``."""
    out: dict[str, float] = {}
    for key, value in samples.items():
        head, _, rest = key.partition("{")
        if head == name and f'{label}="' in rest and all(f'{k}="{v}"' in rest for k, v in match.items()):
            v = rest.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[v] = out.get(v, 0.0) + value
    return out


def rss_kb(pid: int) -> int:
    """VmRSS of a process, in KiB, from /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


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


def mappings(pid: int) -> tuple[int, list[str]]:
    """(count of all mappings, the engine KV cache mappings' names) of a process, from /proc/PID/maps."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    kv = [line.split(maxsplit=5)[-1] for line in lines if any(m in line for m in KV_MAPPING_MARKS)]
    return len(lines), kv

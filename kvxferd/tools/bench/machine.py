"""The machine a run sees: what it is, and how much of its CPU other processes take while a
row is measured (the *others' CPU* column), so a row measured next to other work says so."""

from __future__ import annotations

import os
import platform
import resource
import time
from pathlib import Path
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) a live process has used."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def machine_busy() -> float:
    """CPU seconds all cores have spent in user and system time since boot.

    Interrupt and softirq time is left out: loopback TCP is processed there and is charged
    to no process, so it would count our own traffic as somebody else's.
    """
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return (v[0] + v[1] + v[2] + v[7]) / _TICK  # user, nice, system, steal
    except (OSError, ValueError, IndexError):
        return 0.0


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def others_pct(busy: float, ours: float, wall: float) -> float:
    """Share (%) of all cores that processes other than ours used over ``wall`` seconds."""
    return round(max(0.0, busy - ours) / (wall * (os.cpu_count() or 1)) * 100, 1) if wall > 0 else 0.0


def wait_quiet(max_wait: float, threshold_pct: float = 25.0) -> float:
    """Wait (at most ``max_wait`` s) until other processes leave the CPUs mostly idle.

    Between measurements nothing of ours runs, so the busy share of a one-second sample is
    somebody else's. Returns the seconds waited.
    """
    t0 = time.monotonic()
    while True:
        busy0, t = machine_busy(), time.perf_counter()
        time.sleep(1.0)
        pct = (machine_busy() - busy0) / ((time.perf_counter() - t) * (os.cpu_count() or 1)) * 100
        waited = time.monotonic() - t0
        if pct <= threshold_pct or waited >= max_wait:
            return round(waited, 1)


class Noise:
    """Share of the machine's CPU that processes other than ours used during a measurement."""

    pct: float = 0.0

    def __enter__(self) -> "Noise":
        self.t, self.busy, self.child, self.own = (time.perf_counter(), machine_busy(), children_cpu(),
                                                   time.process_time())
        return self

    def __exit__(self, *exc: object) -> None:
        ours = (children_cpu() - self.child) + (time.process_time() - self.own)
        self.pct = others_pct(machine_busy() - self.busy, ours, time.perf_counter() - self.t)


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        mem = None
    import torch

    from ...datapath import runcopy
    # the daemons the bench starts run from this installation: its copy path is theirs
    return {"cores": os.cpu_count(), "cpu": cpu, "memory_bytes": mem, "python": platform.python_version(),
            "torch": torch.__version__, "kernel": platform.release(), "copy_path": runcopy.copy_path()}

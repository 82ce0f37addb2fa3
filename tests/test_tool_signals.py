"""``kvxferd demo``, ``kvxferd bench`` and ``kvxferd soak`` stopped by a signal leave nothing behind.

The real commands, stopped with SIGTERM (what ``kill``, systemd and container runtimes
send) or SIGINT while their daemons and engines run: afterwards none of the processes they
started is alive, and none of the shared-memory files their engines mapped exists. A tool
SIGKILLed runs no cleanup at all: its children die with it (kvxferd/tools/launch.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import shutil
from pathlib import Path
from typing import Callable

import pytest

WAIT_S = 120.0


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (daemons run in their own sessions but stay its children)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


SHM_MARKS = ("/dev/shm/kvxferd-", "/memfd:kvxferd-")  # named files, and the memfds engine caches are


def shm_files(pids: set[int]) -> set[str]:
    """The kvxferd shared-memory files (named or memfd) these processes have mapped."""
    out: set[str] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        out.update(line.split(maxsplit=5)[-1] for line in maps.splitlines() if any(m in line for m in SHM_MARKS))
    return {p.removesuffix(" (deleted)") for p in out}


def cmdline(pid: int) -> bytes:
    """A process's command line, or nothing once it is gone (processes come and go while we look)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def still_there(name: str) -> bool:
    """A named file that still exists, or a memfd some process still maps (then its memory is kept)."""
    if not name.startswith("/memfd:"):
        return os.path.exists(name)
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            if name + " " in maps.read_text():
                return True
        except OSError:
            continue
    return False


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stop_when_busy(cmd: list[str], sig: int, want_engines: int,
                   on_busy: Callable[[int, set[int]], None] | None = None) -> tuple[int, set[int], set[str]]:
    """Start the command, wait until it runs daemons and engines with mapped caches, send ``sig``;
    return its exit code, the processes it had started and the files they had mapped. ``on_busy``
    sees the command's pid and its processes right before the signal."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVXFERD_")}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            assert proc.poll() is None, f"{cmd} ended before it was stopped"
            below = descendants(proc.pid)
            files = shm_files(below)
            daemons = [p for p in below if b"serve" in cmdline(p)]
            if daemons and len(files) >= want_engines:
                break
            assert time.monotonic() < deadline, f"{cmd} never ran daemons and {want_engines} engines"
            time.sleep(0.1)
        below |= descendants(proc.pid)
        if on_busy is not None:
            on_busy(proc.pid, below)
        proc.send_signal(sig)
        code = proc.wait(WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, below, files


def assert_clean(started: set[int], files: set[str], wait_s: float = 30) -> None:
    deadline = time.monotonic() + wait_s  # orphans reparented to init are reaped there
    while any(alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in started if alive(p)], "processes the tool started outlived it"
    assert files and not [f for f in files if still_there(f)], "shared-memory files outlived the tool"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_demo_stopped_by_a_signal_stops_its_daemons_and_removes_its_files(sig):
    code, started, files = stop_when_busy(
        [sys.executable, "-m", "kvxferd", "demo", "--requests", "100000"], sig, want_engines=3)
    assert code == 128 + sig, code
    assert_clean(started, files)


@pytest.mark.slow
def test_bench_stopped_by_sigterm_stops_its_daemons_and_removes_its_files():
    code, started, files = stop_when_busy(
        [sys.executable, "-m", "kvxferd", "bench", "--smoke", "--only", "^local direct"], signal.SIGTERM,
        want_engines=1)
    assert code == 128 + signal.SIGTERM, code
    assert_clean(started, files)


def test_soak_stopped_by_sigterm_stops_its_daemons_and_engines():
    code, started, files = stop_when_busy([sys.executable, "-m", "kvxferd", "soak", "--duration", "600"],
                                          signal.SIGTERM, want_engines=2)
    assert code == 128 + signal.SIGTERM, code
    assert_clean(started, files)


def test_soak_killed_by_sigkill_leaves_no_daemon_engine_or_file():
    """SIGKILL runs none of the soak's cleanup: its daemons and engines must end by themselves
    (they get SIGTERM when it dies), and take their shared memory with them."""
    seen: dict[str, object] = {}

    def note(pid: int, below: set[int]) -> None:
        seen["pid"] = pid
        seen["started"] = below
        configs = [arg for p in below if b"serve" in cmdline(p) for arg in cmdline(p).split(b"\0")
                   if arg.endswith(b".toml")]
        seen["run_dirs"] = {os.path.dirname(c.decode()) for c in configs}

    try:
        code, started, files = stop_when_busy([sys.executable, "-m", "kvxferd", "soak", "--duration", "600"],
                                              signal.SIGKILL, want_engines=2, on_busy=note)
        assert code == -signal.SIGKILL, code
        assert seen["run_dirs"], "the soak's daemons named no config file"
        # no fixed time is asserted: a daemon's shutdown on a loaded machine may take a while
        assert_clean(started, files, wait_s=WAIT_S)
        # nothing of the run at all, also a process started after the processes were listed
        deadline = time.monotonic() + WAIT_S
        while True:
            left = [p for p in Path("/proc").glob("[0-9]*/cmdline")
                    if any(d.encode() in cmdline(int(p.parent.name)) for d in seen["run_dirs"])
                    and alive(int(p.parent.name))]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not left, f"processes of the killed soak's run dir still running: {left}"
        named = list(Path("/dev/shm").glob(f"kvxferd-soak{seen['pid']}*")) if os.path.isdir("/dev/shm") else []
        assert not named, named
    finally:
        for pid in seen.get("started") or ():  # a failed check must not leave them running either
            if alive(pid) and any(d.encode() in cmdline(pid) for d in seen.get("run_dirs") or ()):
                os.kill(pid, signal.SIGKILL)
        # the run dir (daemon logs and configs) is the one thing a SIGKILLed soak cannot remove
        for d in seen.get("run_dirs") or ():
            if os.path.basename(d).startswith("kvxferd-"):
                shutil.rmtree(d, ignore_errors=True)


def test_a_signal_during_a_cleanup_ends_the_tool_after_the_cleanup(tmp_path):
    """A tool cleaning up on its normal way out is sent SIGTERM: the cleanup runs to its end, then
    the tool exits with 128 + SIGTERM (before, the signal cut the cleanup short)."""
    marker = tmp_path / "cleaned"
    script = (
        "import os, signal, sys\n"
        "from kvxferd.ops.signals import cleanup_on_signals, deferred\n"
        "with cleanup_on_signals():\n"
        "    with deferred():\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        for _ in range(1000):\n"
        "            pass  # the handler runs between bytecodes: here, inside the cleanup\n"
        f"        open({str(marker)!r}, 'w').write('done')\n"
        "    print('after the cleanup', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT_S)
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, proc.stderr)
    assert marker.read_text() == "done"
    assert "after the cleanup" not in proc.stdout

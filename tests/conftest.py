import os
import sys
from pathlib import Path

import pytest

# UCX (under NIXL) loads its InfiniBand module wherever libibverbs is installed, and on a
# host without an RDMA device that module crashes at process exit. The tests run UCX over
# loopback TCP only, so they leave it out; tests/test_nixl.py checks that a daemon still
# exits cleanly with every module loaded.
os.environ.setdefault("UCX_MODULES", "^ib")

# e2e helpers live beside the tests
sys.path.insert(0, str(Path(__file__).parent))

# property tests hold on a slow, busy machine: no per-example deadline (hypothesis's default
# 200 ms failed a cheap block-cutting property when another process took the CPU for 400 ms)
try:
    from hypothesis import HealthCheck, settings

    settings.register_profile("kvxferd", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("kvxferd")
except ImportError:  # an environment without hypothesis runs no property test
    pass


# -- the longest files first -------------------------------------------------------------------
# Files that run whole tools (the soak, the bench, the demo, tools stopped by signals) take
# minutes each. pytest-xdist hands files out in collection order, so at the end of the
# alphabet they would run last, alone, after the rest; first, they overlap it.
LONG_FIRST = ("test_soak.py", "test_bench_smoke.py", "test_tool_signals.py", "test_demo.py", "test_load.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))


# -- daemons and engine ranks fork from one preloaded interpreter -----------------------------
# Each would otherwise spend about 3 s of CPU importing torch, most of the suite's CPU on two
# cores. The code they run is the same (kvxferd.tools.forkserver); KVXFERD_TEST_FORKSERVER=0
# starts every child with its own interpreter.
@pytest.fixture(scope="session", autouse=True)
def _children_fork_from_a_preloaded_interpreter():
    from kvxferd.tools import launch
    if os.environ.get("KVXFERD_TEST_FORKSERVER", "1") != "0":
        launch.fork_from_preloaded()
    yield
    launch.stop_forking()


# -- nothing of kvxferd may stay in /dev/shm --------------------------------------------------
# Engine caches are memfds and leave no file; a named file (allocate_cpu / share_in_place with
# shm_dir, the bench's own buffers) must be removed by whoever made it, even when a test kills
# processes. At the end of the run, a kvxferd file that appeared during it and that no process
# maps or holds open is a leak nothing will ever remove: the run fails, naming it. New files
# some live process still uses (another test run sharing this host's /dev/shm, or a process
# this run left behind) are reported with the processes. KVXFERD_TEST_SHM_CHECK=report only
# reports.
SHM_DIR = "/dev/shm"


def _kvxferd_shm() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith("kvxferd-")}
    except FileNotFoundError:
        return set()


def _users(paths: set[str]) -> dict[str, list[int]]:
    """The pids that map or hold open each of ``paths``."""
    out: dict[str, list[int]] = {p: [] for p in paths}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps") as fh:
                seen = {p for p in paths if p in fh.read()}
            for fd in os.listdir(f"/proc/{entry}/fd"):
                try:
                    target = os.readlink(f"/proc/{entry}/fd/{fd}")
                except OSError:
                    continue
                if target in paths:
                    seen.add(target)
        except OSError:
            continue  # exited meanwhile, or not ours to read
        for p in seen:
            out[p].append(int(entry))
    return out


# Under pytest-xdist the check runs in the controller only: its session starts before the
# workers and ends after every worker's tests and fixtures are done, so it sees every file the
# run made, and no worker mistakes a file another worker still works with for a leak.
def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_sessionstart(session):
    if _is_xdist_worker(session.config):
        return
    session.config._kvxferd_shm_before = _kvxferd_shm()
    session.config._kvxferd_shm_left = {}


def pytest_sessionfinish(session, exitstatus):
    before = getattr(session.config, "_kvxferd_shm_before", None)
    if before is None:
        return
    new = {os.path.join(SHM_DIR, n) for n in _kvxferd_shm() - before}
    users = _users(new) if new else {}
    session.config._kvxferd_shm_left = users
    orphans = [p for p, pids in users.items() if not pids]
    if orphans and os.environ.get("KVXFERD_TEST_SHM_CHECK", "fail") != "report" and session.exitstatus == 0:
        session.exitstatus = 1  # pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    users = getattr(config, "_kvxferd_shm_left", {})
    if not users:
        return
    orphans = sorted(p for p, pids in users.items() if not pids)
    terminalreporter.section(f"kvxferd files new in {SHM_DIR}: {len(orphans)} left behind, "
                             f"{len(users) - len(orphans)} still in use", red=bool(orphans), bold=True)
    for path in sorted(users):
        try:
            size = os.path.getsize(path)
        except OSError:
            size = -1
        pids = users[path]
        what = f"in use by pids {pids}" if pids else "LEFT BEHIND: no process uses it"
        terminalreporter.write_line(f"{path} ({size} bytes) {what}", red=not pids)


@pytest.fixture
def cluster(request):
    """An empty loopback cluster for one test: whatever daemons and engines the test starts in
    it are stopped afterwards, and its run dir removed unless the test failed (a test module may
    define its own, e.g. module-scoped, one)."""
    from e2e_util import cluster_run

    with cluster_run(request) as c:
        yield c

import os
import sys
from pathlib import Path

# UCX (under NIXL) loads its InfiniBand module wherever libibverbs is installed, and on a
# host without an RDMA device that module crashes at process exit. The tests run UCX over
# loopback TCP only, so they leave it out; tests/test_nixl.py checks that a daemon still
# exits cleanly with every module loaded.
os.environ.setdefault("UCX_MODULES", "^ib")

# e2e helpers live beside the tests
sys.path.insert(0, str(Path(__file__).parent))


# -- nothing of kvxferd may stay in /dev/shm --------------------------------------------------
# Engine caches are memfds and leave no file; a named file (allocate_cpu / share_in_place with
# shm_dir, the bench's own buffers) must be removed by whoever made it, even when a test kills
# processes. A run that leaves new kvxferd files fails, naming them. Another test run sharing
# this host's /dev/shm at the same time can trip the check: KVXFERD_TEST_SHM_CHECK=report then
# only reports.
SHM_DIR = "/dev/shm"


def _kvxferd_shm() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith("kvxferd-")}
    except FileNotFoundError:
        return set()


def pytest_sessionstart(session):
    session.config._kvxferd_shm_before = _kvxferd_shm()
    session.config._kvxferd_shm_left = []


def pytest_sessionfinish(session, exitstatus):
    before = getattr(session.config, "_kvxferd_shm_before", None)
    if before is None:
        return
    left = sorted(_kvxferd_shm() - before)
    session.config._kvxferd_shm_left = left
    if left and os.environ.get("KVXFERD_TEST_SHM_CHECK", "fail") != "report" and session.exitstatus == 0:
        session.exitstatus = 1  # pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    left = getattr(config, "_kvxferd_shm_left", [])
    if left:
        terminalreporter.section(f"{len(left)} kvxferd file(s) left in {SHM_DIR}", red=True, bold=True)
        for name in left:
            try:
                size = os.path.getsize(os.path.join(SHM_DIR, name))
            except OSError:
                size = -1
            terminalreporter.write_line(f"{SHM_DIR}/{name} ({size} bytes)", red=True)

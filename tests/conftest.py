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

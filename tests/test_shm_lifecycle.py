"""A crashed engine's KV memory goes with it; a daemon restart keeps it registrable.

Real daemon and engine processes over their real sockets. An engine's CPU cache is a
memfd (kvxferd/datapath/shmfile.py), so the evidence is where the kernel shows memory: no file
in /dev/shm ever, and which processes map it or hold a descriptor of it
(/proc/<pid>/maps and /proc/<pid>/fd). Memory no process maps or holds is freed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from e2e_util import assert_verified, in_parallel, spec, transfer, wait_in_flight
from kvxferd.sdk.client import EngineClient
from kvxferd.tools import launch

NUM_PAGES = 16
WAIT_S = 60.0  # a bounded wait for the daemon to notice; never a speed assertion


def holders(name: str) -> dict[int, str]:
    """Every process on this host that maps the memfd ``name`` or holds a descriptor of it."""
    needle = f"/memfd:{name} "
    out: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/maps") as fh:
                if needle in fh.read():
                    out[pid] = "maps"
                    continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(needle):
                    out[pid] = f"fd {fd}"
                    break
        except OSError:
            continue  # exited meanwhile, or not ours to read
    return out


def in_dev_shm(name: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if name in n]


def wait_until(check, what, timeout: float = WAIT_S) -> None:
    """Wait for ``check``; ``what`` (a string, or a callable for the state at the end) says what failed."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"still {what() if callable(what) else what} after {timeout}s")
        time.sleep(0.05)


def ranks(d) -> list[str]:
    with EngineClient(d.socket_path, timeout=30) as client:
        return [r["rank_id"] for r in client.status()["ranks"]]


def test_sigkilled_engine_leaves_no_memory_once_its_daemon_drops_the_rank(cluster):
    d = cluster.daemon("lc-node")
    [p] = cluster.instance(d, "lc-p", "prefill", spec(), NUM_PAGES)
    decode = cluster.instance(d, "lc-d", "decode", spec(), NUM_PAGES)
    assert_verified(*transfer([p], decode, "lc-r1", 9, src_pages=[3, 1, 7], dst_pages=[2, 5, 0],
                              source_address=d.address))
    assert p.memfd and in_dev_shm(p.memfd) == []  # no name to leak, even while alive
    # both sides use the memory (the daemon moved bytes through its own mapping)
    assert set(holders(p.memfd)) == {p.proc.pid, d.proc.pid}, holders(p.memfd)

    p.kill()  # SIGKILL: no cleanup code of the engine runs
    wait_until(lambda: p.rank_id not in ranks(d), "registered (the daemon did not notice the dead engine)")
    wait_until(lambda: not holders(p.memfd), lambda: f"held by {holders(p.memfd)}")
    assert in_dev_shm(p.memfd) == []
    # the daemon keeps serving: an engine started in the dead one's place moves bytes
    [p2] = cluster.instance(d, "lc-p", "prefill", spec(), NUM_PAGES)
    assert_verified(*transfer([p2], decode, "lc-r2", 13, src_pages=[0, 4, 6, 2], dst_pages=[1, 3, 9, 8],
                              source_address=d.address))


def test_engine_killed_with_a_request_pending_leaves_no_memory(cluster):
    """The daemon still tracks a request for the rank when it dies: failing it lets go too."""
    d = cluster.daemon("lw-node")
    cluster.instance(d, "lw-p", "prefill", spec(), NUM_PAGES)
    [w] = cluster.instance(d, "lw-d", "decode", spec(), NUM_PAGES)
    w.command(cmd="expect", request_id="lw-pending", pages=[1, 2], n=6, source_instance="lw-p",
              source_address=d.address)  # the prefill never sends it
    wait_in_flight(d, "decode:waiting_for_input")
    assert d.proc.pid in holders(w.memfd)
    w.kill()
    wait_until(lambda: w.rank_id not in ranks(d), "registered (the daemon did not notice the dead engine)")
    wait_until(lambda: not holders(w.memfd), lambda: f"held by {holders(w.memfd)}")
    assert in_dev_shm(w.memfd) == []


def test_engine_registers_again_after_a_daemon_restart_and_its_memory_goes_when_it_exits(cluster):
    pd = cluster.daemon("lr-prefill")
    dd = cluster.daemon("lr-decode")
    [p] = cluster.instance(pd, "lr-p", "prefill", spec(), NUM_PAGES)
    decode = cluster.instance(dd, "lr-d", "decode", spec(), NUM_PAGES)
    assert_verified(*transfer([p], decode, "lr-r1", 10, src_pages=[5, 2, 8], dst_pages=[1, 6, 4],
                              source_address=pd.address))
    old_daemon = pd.proc.pid
    assert old_daemon in holders(p.memfd)

    pd.signal(signal.SIGKILL)
    pd.proc.wait()
    assert set(holders(p.memfd)) == {p.proc.pid}  # the engine keeps its cache; nothing else holds it
    pd.start()
    p.command(cmd="register")  # the same memory, handed over again by its descriptor
    event = p.next_event(WAIT_S)
    assert event.get("event") == "registered" and event["rank_id"] == p.rank_id, event
    assert set(holders(p.memfd)) == {p.proc.pid, pd.proc.pid}
    assert_verified(*transfer([p], decode, "lr-r2", 15, src_pages=[0, 9, 3, 12], dst_pages=[7, 2, 11, 5],
                              source_address=pd.address))

    dd.signal(signal.SIGKILL)  # a decode daemon killed: its engines' memory goes when they exit
    dd.proc.wait()
    for w in decode:
        assert set(holders(w.memfd)) == {w.proc.pid}
        w.close()
        assert holders(w.memfd) == {} and in_dev_shm(w.memfd) == []


ENGINE = """
import sys, time, torch
from kvxferd.sdk.client import EngineClient
from kvxferd.sdk.engine_memory import describe_tensors, share_in_place
from kvxferd.model.geometry import InstanceSpec, RankGeometry
s = InstanceSpec(attention="mha", num_layers=2, total_kv_heads=2, head_dim=16, dtype="bfloat16", page_size=4)
g = RankGeometry(s, 0, 0, 8)
raw = torch.zeros(4 * 8 * 4 * 2 * 16, dtype=torch.bfloat16)  # one allocation, views per layer and kind
per = raw.numel() // 4
kv = {(l, k): raw[(2 * l + i) * per:(2 * l + i + 1) * per].view(32, 2, 16)
      for l in range(2) for i, k in enumerate(("k", "v"))}
pool = share_in_place(list(kv.values()), name="lc-owned")
client = EngineClient(sys.argv[1])
print(pool.name, client.register("lc-owned", "decode", g, describe_tensors(kv)), flush=True)
time.sleep(600)
"""


def test_sigkilled_engine_with_its_own_tensors_leaves_no_memory(cluster):
    """share_in_place: an engine that allocated its KV itself, the way SGLang and vLLM do."""
    d = cluster.daemon("lo-node")
    proc = launch.popen([sys.executable, "-c", ENGINE, d.socket_path], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        name, rank = proc.stdout.readline().split()
        assert rank in ranks(d) and in_dev_shm(name) == []
        assert set(holders(name)) == {proc.pid, d.proc.pid}
    finally:
        proc.kill()
        proc.wait()
    wait_until(lambda: rank not in ranks(d), "registered (the daemon did not notice the dead engine)")
    wait_until(lambda: not holders(name), lambda: f"held by {holders(name)}")


def test_decode_engine_gone_over_tcp_leaves_no_mapping_of_its_cache(cluster):
    """Found by the soak: the decode daemon kept the last departed instance's KV cache mapped,
    because the tcp data connection that had received its chunk, idle until the next one,
    still referred to the chunk's destination (and through it to the rank's regions)."""
    pd = cluster.daemon("leave-p", start=False)
    dd = cluster.daemon("leave-d", start=False)
    in_parallel(pd.start, dd.start)
    prefill, decode = cluster.instances((pd, "lv-p", "prefill", spec(), 16), (dd, "lv-d", "decode", spec(), 16))
    assert_verified(*transfer(prefill, decode, "lv-r1", 13, src_pages=[1, 2, 3, 4], dst_pages=[5, 6, 7, 8],
                              source_address=pd.address, chunks=[[0, 5], [5, 13]]))
    [d] = decode
    assert dd.proc.pid in holders(d.memfd)  # the daemon received through its own mapping
    d.close()  # the decode engine leaves; the data connection between the daemons stays open, idle
    wait_until(lambda: d.rank_id not in ranks(dd), "registered")
    wait_until(lambda: dd.proc.pid not in holders(d.memfd), lambda: f"mapped by the decode daemon: {holders(d.memfd)}")

"""Engine memory the daemon can trust, and ranks that belong to their engine: attacks by a local
engine through real daemons.

Real ``kvxferd serve`` daemons; the victim tenant is a pair of simulated engine processes (a
prefill and a decode instance on one daemon) moving requests checked byte for byte by the
oracle, concurrently with each attack. The attacker is an engine process of its own, speaking
the engine protocol with the SDK's client, as root or as another uid (``nobody``):

- it registers a named file (by path and by descriptor) and truncates it: refused by default,
  nothing mapped, nothing crashes; a memfd it did not seal is sealed by the daemon, and its
  shrink fails;
- it registers another tenant's file, or another process's pid and descriptor: refused, naming
  both uids or both pids;
- it registers a rank id a live engine holds, and calls for that rank: refused, naming the
  holder; the holder's requests carry on, its own re-register works, and once it is gone its
  successor takes the rank at once.

After each attack the daemon answers status and metrics, serves the victim byte-exact, counts
the refusal in ``kvxferd_engine_refusals_total`` and logs ``event=engine_refused``.
"""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import threading
import urllib.request
from typing import Any

import pytest

from e2e_util import NUM_PAGES, Node, assert_verified, cluster_run, spec, start_nodes, transfer
from kvxferd.model.geometry import RankGeometry
from kvxferd.sdk.client import EngineClient
from kvxferd.sdk.kv_cache import allocate_cpu
from kvxferd.tools.sim import Worker
from nixl_util import metric

NOBODY = 65534  # uid and gid of the other tenant
AS_ROOT = os.geteuid() == 0
#: the engine socket open to the other tenant's group (the daemon's run dir is made traversable)
SHARED_SOCKET = {"KVXFERD_ENGINE_SOCKET_MODE": "0660", "KVXFERD_ENGINE_SOCKET_GROUP": "nogroup"}
SPEC = spec()

#: the attacking engine: runs the steps given as JSON, prints one JSON outcome per step
ATTACKER = r'''
import fcntl, json, os, sys
from kvxferd.datapath import shmfile
from kvxferd.sdk.client import DaemonError, EngineClient

socket_path, steps, uid = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
if uid != os.getuid():  # another tenant: its credentials from before it connects (the interpreter is root's)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
client = EngineClient(socket_path, timeout=60)
made = []  # named files this process created, removed on the way out
try:
    for step in steps:
        out = {"op": step["op"]}
        fd = None
        try:
            if step["op"] == "register":
                memory = step["memory"]
                if memory in ("named_path", "named_fd"):
                    shared = shmfile.create("attacker", step["size"], "/dev/shm")
                    made.append(shared.path)
                    fd = os.open(shared.path, os.O_RDWR | os.O_CLOEXEC)
                    where = {"path": shared.path} if memory == "named_path" else {"fd": fd}
                elif memory in ("memfd", "unsealed_memfd"):
                    fd = os.memfd_create("kvxferd-attacker", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                    os.ftruncate(fd, step["size"])
                    if memory == "memfd":
                        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
                    where = {"fd": fd}
                else:  # "given": another tenant's path or descriptor, verbatim
                    where = step["where"]
                regions = [{k: v for k, v in r.items() if k not in ("fd", "path")} | where for r in step["regions"]]
                try:
                    reply = client.call("register", instance=step["instance"], role=step["role"],
                                        geometry=step["geometry"], regions=regions,
                                        pid=step.get("pid") or os.getpid())
                    out.update(ok=True, rank_id=reply["rank_id"])
                finally:
                    if step.get("shrink") and fd is not None:  # the attack: cut the file under any mapping
                        try:
                            os.ftruncate(fd, 0)
                            out["shrunk"] = True
                        except OSError as exc:
                            out.update(shrunk=False, errno=exc.errno)
            else:  # a call as given
                client.call(step["op"], **step["fields"])
                out["ok"] = True
        except DaemonError as exc:
            out.update(ok=False, code=exc.code, field=exc.field, message=str(exc))
        print(json.dumps(out), flush=True)
finally:
    client.close()
    for path in made:
        shmfile.unlink(path)
'''


def attack(daemon, steps: list[dict[str, Any]], as_nobody: bool = False) -> list[dict[str, Any]]:
    """Run the attacking engine against ``daemon``; its outcome per step."""
    uid = NOBODY if as_nobody else os.getuid()
    out = subprocess.run([sys.executable, "-c", ATTACKER, daemon.socket_path, json.dumps(steps), str(uid)],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(steps), (out.stdout, out.stderr)
    return results


def layout(geometry: RankGeometry) -> tuple[list[dict[str, Any]], int]:
    """The regions a rank of ``geometry`` registers, and its file's size (what allocate_cpu makes)."""
    with allocate_cpu(geometry, name="iso-layout", fill=None) as cache:
        return cache.descriptors(), os.fstat(cache.fd).st_size


def register_step(worker: Worker, memory: str, **extra: Any) -> dict[str, Any]:
    """Register the rank ``worker`` holds (or, with ``instance=``, another) with the attacker's ``memory``."""
    regions, size = layout(worker.geometry)
    step = {"op": "register", "instance": worker.instance, "role": worker.role,
            "geometry": worker.geometry.to_dict(), "regions": regions, "size": size, "memory": memory}
    step.update(extra)
    return step


def memfd_of(worker: Worker) -> tuple[int, int]:
    """(pid, fd) of ``worker``'s engine process and its cache memfd: what an attacker would name."""
    link, pid = f"/memfd:{worker.memfd} (deleted)", worker.proc.pid
    for fd in sorted(os.listdir(f"/proc/{pid}/fd"), key=int):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == link:
                return pid, int(fd)
        except OSError:
            continue
    raise AssertionError(f"engine process {pid} holds no {link}")


class Traffic(threading.Thread):
    """The victim tenant's requests, one after another, each byte-exact, until stopped (at least
    ``rounds`` of them)."""

    def __init__(self, prefill: Worker, decode: Worker, tag: str, rounds: int = 3) -> None:
        super().__init__(daemon=True)
        self.prefill, self.decode, self.tag, self.rounds = prefill, decode, tag, rounds
        self.stop = threading.Event()
        self.done = 0
        self.error: BaseException | None = None
        self.rng = random.Random(tag)

    def run(self) -> None:
        try:
            while self.done < self.rounds or not self.stop.is_set():
                src, dst = self.rng.sample(range(NUM_PAGES), 3), self.rng.sample(range(NUM_PAGES), 3)
                dec, pre = transfer([self.prefill], [self.decode], f"{self.tag}-{self.done}", 12, src_pages=src,
                                    dst_pages=dst, source_address=None)
                assert_verified(dec, pre)
                self.done += 1
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            self.error = exc

    def finish(self) -> int:
        self.stop.set()
        self.join(300)
        assert not self.is_alive(), "the victim's requests never finished"
        if self.error is not None:
            raise self.error
        return self.done


def still_serving(daemon) -> dict[str, Any]:
    """The daemon is alive and answers: its process runs, status and metrics answer."""
    assert daemon.proc.poll() is None, f"daemon {daemon.name} died (rc {daemon.proc.returncode})"
    with EngineClient(daemon.socket_path, timeout=30) as client:
        status = client.status()
    assert urllib.request.urlopen(daemon.metrics_url, timeout=30).status == 200
    return status


def refusals(daemon, reason: str, call: str = "register") -> float:
    return metric(daemon, "kvxferd_engine_refusals_total", call=call, reason=reason)


def logged(daemon, reason: str) -> bool:
    return any("event=engine_refused" in line and f"reason={reason}" in line for line in daemon.log().splitlines())


def registers_again(worker: Worker) -> None:
    """The worker's engine registers its rank again, on its own connection, with the same memory."""
    worker.command(cmd="register")
    while (ev := worker.next_event(60))["event"] not in ("registered", "register_failed"):
        pass
    assert ev["event"] == "registered", ev


def victims(c, daemon, tag: str) -> tuple[Worker, Worker]:
    (p,), (d,) = c.instances((daemon, f"{tag}-p", "prefill", SPEC, NUM_PAGES),
                             (daemon, f"{tag}-d", "decode", SPEC, NUM_PAGES))
    return p, d


@pytest.fixture(scope="module")
def nodes(request):
    with cluster_run(request) as c:
        start_nodes(c, Node("strict", env=SHARED_SOCKET),
                    Node("lenient", env={**SHARED_SOCKET, "KVXFERD_ENGINE_ALLOW_NAMED_FILES": "true"}))
        os.chmod(c.root, 0o711)  # the other tenant reaches the sockets inside (their group lets it in)
        yield c


def test_a_named_file_is_refused_and_truncating_it_or_a_memfd_harms_nobody(nodes):
    d = nodes.daemons["strict"]
    p, dec = victims(nodes, d, "trunc")
    traffic = Traffic(p, dec, "trunc")
    traffic.start()
    named_before = refusals(d, "named_file")
    by_path, by_fd, unsealed, sealed_send = attack(d, [
        register_step(p, "named_path", instance="trunc-x", shrink=True),
        register_step(p, "named_fd", instance="trunc-y", shrink=True),
        register_step(p, "unsealed_memfd", instance="trunc-z", shrink=True),
        {"op": "send", "fields": {"rank_id": "trunc-x/tp0/pp0", "request_id": "cut", "pages": [0], "start": 0,
                                  "end": 4, "last": True}},
    ])
    for refused, field in ((by_path, "regions.path"), (by_fd, "regions.fd")):
        assert not refused["ok"] and refused["code"] == "registration" and refused["field"] == field, refused
        assert "engine.allow_named_files" in refused["message"] and "memfd" in refused["message"], refused
        assert refused["shrunk"], refused  # cut to nothing: the daemon never mapped it
    # a memfd the engine left unsealed is sealed by the daemon: the engine's own shrink fails
    assert unsealed["ok"], unsealed
    assert unsealed["shrunk"] is False and unsealed["errno"] == errno.EPERM, unsealed
    assert not sealed_send["ok"] and sealed_send["field"] == "rank_id", sealed_send  # never registered
    assert traffic.finish() >= 3
    status = still_serving(d)
    assert p.rank_id in {r["rank_id"] for r in status["ranks"]}
    assert refusals(d, "named_file") >= named_before + 2
    assert logged(d, "named_file")
    assert "event=memfd_sealed" in d.log()


@pytest.mark.skipif(not AS_ROOT, reason="the other tenant runs as uid 65534: the tests must run as root to switch")
def test_another_tenants_file_or_descriptor_is_refused_naming_both_sides(nodes):
    d = nodes.daemons["lenient"]  # named files allowed: still only the engine's own
    p, dec = victims(nodes, d, "owner")
    pid, fd = memfd_of(p)
    traffic = Traffic(p, dec, "owner")
    traffic.start()
    with allocate_cpu(p.geometry, name="iso-tenant", shm_dir="/dev/shm") as tenant:  # root's named file
        steps = [
            register_step(p, "given", instance="owner-x", where={"path": tenant.path}),
            register_step(p, "given", instance="owner-y", where={"fd": fd}, pid=pid),
            register_step(p, "named_path", instance="owner-z"),  # its own named file: allowed here
        ]
        foreign_file, foreign_fd, own_file = attack(d, steps, as_nobody=True)
        # root, too, may register only its own process's descriptors
        (root_fd,) = attack(d, [register_step(p, "given", instance="owner-w", where={"fd": fd}, pid=pid)])
    assert not foreign_file["ok"] and foreign_file["field"] == "regions.path", foreign_file
    assert f"uid {os.getuid()}" in foreign_file["message"] and f"uid {NOBODY}" in foreign_file["message"]
    for refused in (foreign_fd, root_fd):
        assert not refused["ok"] and refused["field"] == "pid", refused
        assert f"pid {pid}" in refused["message"], refused  # both pids named: the claim and the peer's
        assert refused["message"].count("pid ") >= 2, refused
    assert own_file["ok"], own_file
    assert traffic.finish() >= 3
    still_serving(d)
    assert refusals(d, "file_owner") >= 1 and refusals(d, "pid_mismatch") >= 2
    assert logged(d, "file_owner") and logged(d, "pid_mismatch")
    assert any(f"uid={NOBODY}" in line for line in d.log().splitlines() if "event=engine_refused" in line)


def test_a_held_rank_cannot_be_taken_over_and_its_requests_stay_byte_exact(nodes):
    d = nodes.daemons["strict"]
    p, dec = victims(nodes, d, "held")
    holder_pid, _ = memfd_of(p)
    traffic = Traffic(p, dec, "held", rounds=4)
    traffic.start()
    calls = [{"op": "send", "fields": {"rank_id": p.rank_id, "request_id": "steal", "pages": [0], "start": 0,
                                       "end": 4, "last": True}},
             {"op": "expect", "fields": {"rank_id": dec.rank_id, "request_id": "steal", "pages": [0],
                                         "source_instance": p.instance}},
             {"op": "abort", "fields": {"rank_id": p.rank_id, "request_id": "held-0"}},
             {"op": "unregister", "fields": {"rank_id": dec.rank_id}}]
    takeover, *stranger = attack(d, [register_step(p, "memfd")] + calls)
    outcomes = [takeover]
    if AS_ROOT:
        outcomes += attack(d, [register_step(dec, "memfd")], as_nobody=True)
    for refused in outcomes:
        assert not refused["ok"] and refused["field"] == "rank_id", refused
        assert f"pid {holder_pid}" in refused["message"] or "held by" in refused["message"], refused
        assert "unregister" in refused["message"], refused  # the fix
    assert f"rank {p.rank_id} is held by engine process {holder_pid}" in takeover["message"], takeover
    for refused in stranger:
        assert not refused["ok"] and refused["field"] == "rank_id", refused
        assert "not registered on this connection" in refused["message"], refused
    assert traffic.finish() >= 4  # the holder's requests went on, every one byte-exact
    status = still_serving(d)
    assert {p.rank_id, dec.rank_id} <= {r["rank_id"] for r in status["ranks"]}
    assert refusals(d, "rank_held") >= len(outcomes)
    for call in ("send", "expect", "abort", "unregister"):
        assert refusals(d, "not_holder", call=call) >= 1, call
    assert logged(d, "rank_held") and logged(d, "not_holder")

    # the holder itself registers again on its connection (what it does after a daemon restart)
    registers_again(p)
    dec_ev, pre_ev = transfer([p], [dec], "held-again", 12, src_pages=[1, 2, 3], dst_pages=[4, 5, 6],
                              source_address=None)
    assert_verified(dec_ev, pre_ev)

    # once the holder is gone, its successor takes the rank at once (no wait for the sweeper)
    p.kill()
    successor = Worker(d, p.instance, "prefill", p.geometry)
    nodes.workers.append(successor)
    assert successor.rank_id == p.rank_id
    dec_ev, pre_ev = transfer([successor], [dec], "held-successor", 12, src_pages=[7, 8, 9],
                              dst_pages=[10, 11, 12], source_address=None)
    assert_verified(dec_ev, pre_ev)
    still_serving(d)


def test_a_restarted_daemon_takes_its_engines_back(request):
    """Re-register after a daemon restart: the same processes, new connections, no holder left."""
    with cluster_run(request) as c:
        (d,) = start_nodes(c, "restart-node")
        p, dec = victims(c, d, "again")
        d.stop()
        d.start()
        for w in (p, dec):
            registers_again(w)
        dec_ev, pre_ev = transfer([p], [dec], "again-1", 12, src_pages=[1, 2, 3], dst_pages=[4, 5, 6],
                                  source_address=None)
        assert_verified(dec_ev, pre_ev)

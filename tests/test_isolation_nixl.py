"""NIXL scoped to the request (issue 43, item 4): what a decode daemon lets NIXL sources write.

With ``peer.nixl_engine_memory = "private"`` (the default) a decode daemon registers no
engine memory with its NIXL agent and describes none to a source: its handshake offer holds
its agent, the landing ring of that link and nothing else, its expects carry no page table,
and every chunk lands in the ring, where the daemon checks the header against the request
before scattering the bytes into the engine's pages. ``exposed`` is the in-place path of
old. Real daemons and engines throughout; one source is played from inside the test (its
own NIXL agent, the decode daemon's real metadata) to try what a hostile source would.

The module skips, saying why, only where NIXL or its UCX backend cannot start here.
"""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest

import digest_oracles
from e2e_util import Node, close, finished, module_cluster, spec
from e2e_util import run_case as e2e_run_case
from kvxferd.errors import ConfigError
from kvxferd.ops import config
from kvxferd.sdk.client import EngineClient
from nixl_util import NIXL_MISSING, NUM_PAGES, UCX_ENV, FakePrefillDaemon, instances, metric, needs_nixl

SLOT = 64 * 1024
#: NIXL with this daemon's defaults but small landing rings (several blocks per chunk)
PRIVATE_ENV = {**UCX_ENV, "KVXFERD_PEER_TRANSPORT": "nixl", "KVXFERD_LIMITS_NIXL_BLOCK_BYTES": str(SLOT),
               "KVXFERD_LIMITS_NIXL_LANDING_SLOTS": "2"}
EXPOSED_ENV = {**PRIVATE_ENV, "KVXFERD_PEER_NIXL_ENGINE_MEMORY": "exposed"}


@pytest.fixture(scope="module")
def cluster(request):
    if NIXL_MISSING:
        pytest.skip(f"NIXL unusable here: {NIXL_MISSING}")
    yield from module_cluster(
        request, Node("prefill-iso", env=PRIVATE_ENV), Node("decode-private", env=PRIVATE_ENV),
        Node("decode-exposed", env=EXPOSED_ENV),
        Node("decode-private-no-ring", env={**PRIVATE_ENV, "KVXFERD_LIMITS_NIXL_LANDING_SLOTS": "0"}))


def registrations(daemon) -> dict:
    with EngineClient(daemon.socket_path, timeout=5) as client:
        return client.status()["transports"]["registrations"]


def run_case(cluster, pspec, dspec, *, prefill: str, decode: str, n_tokens: int, chunks=None, check=None) -> None:
    """One byte-exact request between fresh instances (nothing strays outside its pages); ``check``
    runs while the instances are still registered."""
    e2e_run_case(cluster, pspec, dspec, prefill=prefill, decode=decode, n_tokens=n_tokens, chunks=chunks,
                 requests=1, seed=n_tokens, aux=b"first-token", tag="iso-", num_pages=NUM_PAGES, check=check)


def sent(daemon) -> dict[str, float]:
    return {m: metric(daemon, "kvxferd_sent_bytes_total", transport="nixl", mode=m) for m in ("direct", "staged")}


# -- the default: only landing memory, every chunk lands -------------------------------------

@needs_nixl
@pytest.mark.parametrize("pspec,dspec,n_tokens,chunks", [
    (spec(), spec(), 37, None),
    (spec(tp_size=2), spec(), 50, [[0, 7], [7, 30], [30, 50]]),
    (spec(), spec(tp_size=2), 33, None),
    (spec(num_layers=5, pp_size=2, layer_splits=((0, 1), (1, 5)), page_size=3), spec(num_layers=5, page_size=8),
     41, [[0, 9], [9, 41]]),
], ids=["tp-matched", "tp2-to-tp1", "tp1-to-tp2", "pp-and-page-size"])
def test_private_decode_memory_lands_byte_exact_through_the_ring(cluster, pspec, dspec, n_tokens, chunks):
    pd, dd = cluster.daemons["prefill-iso"], cluster.daemons["decode-private"]
    before, why0 = sent(pd), metric(pd, "kvxferd_chunks_total", transport="nixl", why="private_destination")
    direct0 = metric(pd, "kvxferd_chunks_total", transport="nixl", mode="direct")
    seen: list[dict] = []
    run_case(cluster, pspec, dspec, prefill="prefill-iso", decode="decode-private", n_tokens=n_tokens,
             chunks=chunks, check=lambda _workers, _moved: seen.append(registrations(dd)))
    after = sent(pd)
    assert after["direct"] == before["direct"], (before, after)  # nothing written in place
    assert after["staged"] > before["staged"]
    # a plan that stages anyway says so (plan); one that would have gone direct says why it did not
    if pspec.tp_size == dspec.tp_size:
        assert metric(pd, "kvxferd_chunks_total", transport="nixl", why="private_destination") > why0
    assert metric(pd, "kvxferd_chunks_total", transport="nixl", mode="direct") == direct0
    # what the decode daemon registered with its NIXL agent while its ranks were up: landing rings,
    # never engines' pages
    regs = seen[0]
    assert regs["engine_memory"] == "private" and regs["decode_engine_bytes"] == 0, regs
    assert regs["ranks_unexposed"] >= dspec.tp_size and regs["landing_bytes"] > 0, regs
    assert metric(dd, "kvxferd_nixl_registered_bytes", memory="decode_engine") == 0
    assert metric(dd, "kvxferd_nixl_registered_bytes", memory="landing") == registrations(dd)["landing_bytes"] > 0


@needs_nixl
def test_exposed_decode_memory_is_written_in_place_as_before(cluster):
    pd, dd = cluster.daemons["prefill-iso"], cluster.daemons["decode-exposed"]
    before = sent(pd)
    # whole pages of 64 tokens: runs long enough that auto writes them in place (short ones stage anyway)
    seen: list[dict] = []
    run_case(cluster, spec(page_size=64), spec(page_size=64), prefill="prefill-iso", decode="decode-exposed",
             n_tokens=128, check=lambda _workers, _moved: seen.append(registrations(dd)))
    after = sent(pd)
    assert after["direct"] - before["direct"] == 128 * 4 * 2 * 4 * 16 * 2  # direct WRITEs into the pages
    assert after["staged"] == before["staged"]
    regs = seen[0]  # the decode engine's pages were registered with NIXL while its rank was up
    assert regs["engine_memory"] == "exposed" and regs["decode_engine_bytes"] > 0, regs
    assert regs["ranks_unexposed"] == 0, regs
    assert metric(dd, "kvxferd_nixl_registered_bytes", memory="decode_engine") == \
        registrations(dd)["decode_engine_bytes"]


@needs_nixl
def test_a_private_decode_daemon_without_a_ring_is_served_over_tcp_saying_why(cluster):
    pd, dd = cluster.daemons["prefill-iso"], cluster.daemons["decode-private-no-ring"]
    tcp0, before = metric(pd, "kvxferd_sent_bytes_total", transport="tcp"), sent(pd)
    run_case(cluster, spec(), spec(), prefill="prefill-iso", decode="decode-private-no-ring", n_tokens=21)
    assert metric(pd, "kvxferd_sent_bytes_total", transport="tcp") > tcp0
    assert sent(pd) == before
    assert metric(pd, "kvxferd_transport_fallbacks_total", side="prefill", preferred="nixl", chosen="tcp",
                  reason="private_no_ring") >= 1
    with EngineClient(pd.socket_path, timeout=5) as client:
        pairs = [p for p in client.status()["transports"]["pairs"] if p["peer"] == dd.address]
    assert pairs and all(p["transport"] == "tcp" and p["reason"] == "private_no_ring"
                         and "peer.nixl_engine_memory" in p["detail"] for p in pairs), pairs


# -- a hostile source ------------------------------------------------------------------------

def _write(fake: FakePrefillDaemon, agent: str, address: int, nbytes: int) -> str:
    """One WRITE of ``nbytes`` from a registered local buffer to ``address`` at ``agent``: its end
    state, or why NIXL would not post it."""
    src = np.full(nbytes, 0xEE, dtype=np.uint8)
    rows = np.array([[src.ctypes.data, nbytes, 0]], dtype=np.uint64)
    reg = fake.agent.register_memory(rows, "DRAM")
    try:
        local = fake.agent.get_xfer_descs(rows, "DRAM")
        remote = fake.agent.get_xfer_descs(np.array([[address, nbytes, 0]], dtype=np.uint64), "DRAM")
        try:
            handle = fake.agent.initialize_xfer("WRITE", local, remote, agent)
        except Exception as exc:  # noqa: BLE001 - the refusal is the outcome under test
            return f"refused: {type(exc).__name__}"
        state = fake.agent.transfer(handle)
        deadline = time.monotonic() + 20
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.01)
            state = fake.agent.check_xfer_state(handle)
        handle.release()
        return state
    finally:
        fake.agent.deregister_memory(reg)


@needs_nixl
def test_a_hostile_source_writes_only_its_own_ring_and_cannot_touch_another_tenants_request(cluster, monkeypatch):
    """A stranger that handshook with the decode daemon (its own NIXL agent, the daemon's real
    metadata) cannot WRITE outside its link's ring, and its notifications naming another tenant's
    request, in its ring or "in place", are refused; that request, in flight meanwhile, ends
    byte-exact."""
    for key, value in UCX_ENV.items():
        monkeypatch.setenv(key, value)
    pd, dd = cluster.daemons["prefill-iso"], cluster.daemons["decode-private"]
    fake = FakePrefillDaemon(spec(), mode="direct")
    victim_p, victim_d, stranger_d = instances(cluster, (pd, "victim-p", "prefill", spec()),
                                               (dd, "victim-d", "decode", spec()),
                                               (dd, "stranger-d", "decode", spec()))
    try:
        # the other tenant's request: its first chunk lands, the rest waits with its engine
        victim_d[0].command(cmd="expect", request_id="victim-1", pages=[1, 2, 3, 4], n=16,
                            source_instance="victim-p", source_address=pd.address)
        victim_p[0].command(cmd="send", request_id="victim-1", pages=[9, 10, 11, 12], n=16,
                            chunks=[[0, 8], [8, 16]], hold_last=True)

        hs = fake.engage(stranger_d[0], "stranger-1", pages=[5, 6], n=8)
        # what the stranger was handed: the agent, one blob (its ring's), no engine region, no page table
        assert hs.get("nixl_private") is True and hs["nixl_regions"] == [] and len(hs["nixl_md"]) == 1, \
            {k: v for k, v in hs.items() if k != "nixl_md"}
        assert "dst_pages" not in fake.expects[0] and "nixl_md" not in fake.expects[0], fake.expects[0]
        ring, address, slot_bytes, count, _device = hs["nixl_landing"]

        # its own ring takes a WRITE; anything beside it is refused by NIXL before a byte moves
        assert _write(fake, hs["nixl_agent"], address, 4096) == "DONE"
        for outside in (address + slot_bytes * count, address - 4096, address + slot_bytes * count - 2048):
            assert _write(fake, hs["nixl_agent"], outside, 4096).startswith("refused"), hex(outside)

        refused0 = {r: metric(dd, "kvxferd_nixl_refusals_total", reason=r) for r in ("in_place_private",)}
        invalid0 = metric(dd, "kvxferd_invalid_messages_total", endpoint="data")
        victim = {"op": "data", "request_id": "victim-1", "decode_instance": "victim-d", "dst": [0, 0],
                  "src": [0, 0], "start": 8, "end": 16, "last": True, "nbytes": 8 * 4 * 2 * 4 * 16 * 2,
                  "token": hs["data_token"]}
        forged = [
            {**victim, "ring": ring, "slot": 0, "block": 0, "pack": slot_bytes},  # its ring, their request
            victim,  # "written in place" into their pages
            {**victim, "block": 0, "pack": slot_bytes},  # a block "placed" into their pages
        ]
        for header in forged:
            header = {**header, "header_digest": digest_oracles.header(header)}
            fake.agent.send_notif(hs["nixl_agent"], msgpack.packb(header, use_bin_type=True))
        deadline = time.monotonic() + 20
        while metric(dd, "kvxferd_invalid_messages_total", endpoint="data") < invalid0 + len(forged):
            assert time.monotonic() < deadline, "forged notifications were not all refused"
            time.sleep(0.05)
        assert metric(dd, "kvxferd_nixl_refusals_total", reason="in_place_private") == \
            refused0["in_place_private"] + 2
        assert "memory private (peer.nixl_engine_memory)" in dd.log()

        # the stranger's own request, "written in place": refused, and it fails (the sender is its source)
        own = {"op": "data", "request_id": "stranger-1", "decode_instance": "stranger-d", "dst": [0, 0],
               "src": [0, 0], "start": 0, "end": 8, "last": True, "nbytes": 8 * 4 * 2 * 4 * 16 * 2,
               "token": hs["data_token"]}
        own["header_digest"] = digest_oracles.header(own)
        fake.agent.send_notif(hs["nixl_agent"], msgpack.packb(own, use_bin_type=True))
        ev = finished(stranger_d[0], "stranger-1", timeout=20)
        assert ev["state"] == "failed" and ev["code"] == "peer_refused" and "landing ring" in ev["reason"], ev

        # the other tenant's request carries on and ends byte-exact on both sides
        victim_p[0].command(cmd="send_chunks", request_id="victim-1", pages=[9, 10, 11, 12], n=16,
                            chunks=[[8, 16, True]])
        ev = finished(victim_d[0], "victim-1", timeout=30)
        assert ev["state"] == "done" and ev["mismatched_bytes"] == 0, ev
        ev = finished(victim_p[0], "victim-1", timeout=30)
        assert ev["state"] == "done", ev
    finally:
        close(victim_p + victim_d + stranger_d)
        fake.close()


# -- the setting -------------------------------------------------------------------------------

def test_the_engine_memory_setting_is_checked_and_private_by_default(tmp_path):
    assert config.Config().peer.nixl_engine_memory == "private"
    path = tmp_path / "kvxferd.toml"
    path.write_text('[peer]\nnixl_engine_memory = "shared"\n')
    with pytest.raises(ConfigError) as err:
        config.load(path)
    assert err.value.field == "peer.nixl_engine_memory" and "'shared'" in str(err.value)
    assert "private" in err.value.fix and "exposed" in err.value.fix

"""A decode agent's stale NIXL metadata on the prefill side, and its reload.

NIXL keeps every descriptor it loaded of a remote agent; one from a deregistered region
that starts inside a newer, larger region hides it from NIXL's lookup, and WRITEs there fail
``NIXL_ERR_NOT_FOUND``. A long-lived decode daemon maps one engine's memory after another,
often at the same addresses, so this is what instances coming and going did (a hybrid model's
small state regions, then a larger window model's regions at the same addresses). The first
test shows it with a real agent and the transport's reload; the rest check the bookkeeping.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from kvxferd.errors import TransferError
from kvxferd.lifecycle.inbox import Inbox
from kvxferd.transport.nixl.remote import Gate, Loaded, RemoteBook, pair_blobs
from nixl_util import UCX_ENV, needs_nixl


def _write(transport, local: np.ndarray, remote: np.ndarray, agent: str) -> str:
    """Prepare (and drop) one WRITE: "ok", or the NIXL error's type."""
    try:
        handle = transport.agent.initialize_xfer("WRITE", transport.agent.get_xfer_descs(local, "DRAM"),
                                                 transport.agent.get_xfer_descs(remote, "DRAM"), agent, b"x")
    except Exception as exc:  # noqa: BLE001 - the error's type is what is checked
        return type(exc).__name__
    handle.release()
    return "ok"


@needs_nixl
def test_a_stale_region_inside_a_newer_one_is_reloaded_away(monkeypatch):
    for key, value in UCX_ENV.items():
        monkeypatch.setenv(key, value)
    from kvxferd.transport.nixl.api import load_api
    from kvxferd.transport.nixl.transport import NixlTransport
    api = load_api()
    decode = api.nixl_agent("decode-stale", api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    prefill = NixlTransport("prefill-stale", Inbox(lambda entry: None), timeout_s=5.0,
                            max_header_bytes=1 << 16)
    memory = torch.zeros(4 << 20, dtype=torch.uint8)
    src = torch.ones(4096, dtype=torch.uint8)
    src_reg = prefill.agent.register_memory(np.array([[src.data_ptr(), 4096, 0]], dtype=np.uint64), "DRAM")
    base = memory.data_ptr()

    def describe(offset: int, nbytes: int):
        reg = decode.register_memory(np.array([[base + offset, nbytes, 0]], dtype=np.uint64), "DRAM")
        md = bytes(decode.get_partial_agent_metadata(reg, True))
        prefill.load("decode-stale", [md], [[0, 0, 0, "conv.state", base + offset, nbytes, -1]])
        return reg

    local = np.array([[src.data_ptr(), 4096, 0]], dtype=np.uint64)
    past = np.array([[base + (3 << 20), 4096, 0]], dtype=np.uint64)  # inside the new region, past the stale start
    try:
        small = describe(1 << 20, 256 << 10)  # a rank's small region ...
        decode.deregister_memory(small)  # ... gone with its engine
        describe(0, 4 << 20)  # the next rank's larger region over the same addresses
        assert prefill._books["decode-stale"].due, "the overlap was not noticed"
        assert _write(prefill, local, past, "decode-stale") == "nixlNotFoundError", \
            "NIXL no longer hides a region behind a stale descriptor: the reload may be unneeded"
        gate = prefill._enter("decode-stale", time.monotonic() + 5)  # what a data thread does before its WRITEs
        assert gate is not None
        gate.leave()
        assert not prefill._books["decode-stale"].due and prefill._books["decode-stale"].reloads == 1
        assert _write(prefill, local, past, "decode-stale") == "ok"
        assert _write(prefill, local, np.array([[base + 4096, 4096, 0]], dtype=np.uint64), "decode-stale") == "ok"
    finally:
        prefill.agent.deregister_memory(src_reg)
        prefill.close()


def test_blobs_pair_with_the_ranks_they_describe_and_the_ring():
    rows = [[0, 0, 0, "k", 1000, 100, -1], [0, 0, 0, "v", 2000, 100, -1], [1, 0, 0, "k", 5000, 50, -1]]
    got = pair_blobs([b"r0", b"r1", b"ring"], rows, [7, 9000, 64, 4, -1])
    assert got == [Loaded(b"r0", ((1000, 1100), (2000, 2100))), Loaded(b"r1", ((5000, 5050),)),
                   Loaded(b"ring", ((9000, 9256),))]
    # a count that does not pair up: every blob stands for every range (a reload drops too much, never too little)
    odd = pair_blobs([b"a", b"b"], rows[:1])
    assert odd == [Loaded(b"a", ((1000, 1100),)), Loaded(b"b", ((1000, 1100),))]
    assert pair_blobs([b"conn"], []) == [Loaded(b"conn", ())]


def test_the_book_reloads_only_when_a_different_blob_overlaps():
    book = RemoteBook()
    a, b = Loaded(b"a", ((0, 100),)), Loaded(b"b", ((100, 200),))
    assert not book.add([a, b]) and not book.due
    assert not book.add([a])  # the same registration described again (an expect after the handshake)
    assert book.loaded == [a, b]
    c = Loaded(b"c", ((50, 150),))  # a new registration over both: both stale
    assert book.add([c]) and book.due and book.blobs() == [b"c"]
    d = Loaded(b"d", ((400, 500),))
    assert not book.add([d]) and book.due and book.blobs() == [b"c", b"d"]  # still due, and d goes along
    e = Loaded(b"e", ((140, 160),))
    assert book.add([e]) and book.blobs() == [b"d", b"e"]


def test_the_gate_lets_a_reload_in_only_alone_and_before_new_writers():
    gate = Gate()
    deadline = time.monotonic() + 5
    gate.enter(deadline)  # a WRITE in flight
    order: list[str] = []
    alone = threading.Thread(target=lambda: (gate.enter_alone(deadline), order.append("reload"), gate.leave_alone()))
    alone.start()
    while not gate._waiting:
        time.sleep(0.001)
    writer = threading.Thread(target=lambda: (gate.enter(deadline), order.append("writer"), gate.leave()))
    writer.start()
    time.sleep(0.05)
    assert order == []  # the reload waits for the WRITE in flight, the new writer for the reload
    gate.leave()
    alone.join(5)
    writer.join(5)
    assert order == ["reload", "writer"]
    gate.enter(deadline)
    with pytest.raises(TransferError) as info:
        gate.enter_alone(time.monotonic() + 0.1)
    assert info.value.field == "timeouts.transfer_s"
    gate.leave()

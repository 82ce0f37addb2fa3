"""The connector's pure rules: settings, params, page math, what each worker reports and when."""

from __future__ import annotations

import json

import pytest

from kvxferd.adapters.vllm.logic import (
    ConnectorSettings,
    TransferParams,
    WorkerBook,
    load_error_blocks,
    next_chunk,
    pages_for,
)
from kvxferd.errors import ConfigError


def test_next_chunk_sends_whole_pages_until_the_last_chunk():
    assert next_chunk(0, 50, 100, 32) == (0, 32, False)       # 18 tokens of page 2 wait
    assert next_chunk(32, 50, 100, 32) is None                 # nothing new on a page boundary
    assert next_chunk(32, 64, 100, 32) == (32, 64, False)
    assert next_chunk(64, 100, 100, 32) == (64, 100, True)     # the last may end inside a page
    assert next_chunk(0, 120, 100, 32) == (0, 100, True)       # tokens past the prompt never go
    assert next_chunk(100, 100, 100, 32) is None


def test_pages_for_starts_at_the_page_of_start_and_refuses_short_tables():
    assert pages_for([7, 3, 9, 4], 32, 70, 32) == [3, 9]
    assert pages_for([7, 3, 9, 4], 0, 1, 32) == [7]
    with pytest.raises(ConfigError) as err:
        pages_for([7, 3], 0, 70, 32)
    assert err.value.field == "block_ids" and "3 pages" in str(err.value)
    assert load_error_blocks([7, 3, 9, 4], 32, 70, 32) == {3, 9}


def test_transfer_params_round_trip_through_json_and_name_bad_fields():
    p = TransferParams("t1", "pre.prefill", "10.0.0.1:5557", 40)
    wire = json.loads(json.dumps(p.to_json()))
    assert TransferParams.from_request(wire) == p
    assert TransferParams.from_request({"do_remote_decode": True}) is None
    assert TransferParams.from_request(None) is None
    bad = json.loads(json.dumps(p.to_json()))
    bad["kvxferd"]["num_tokens"] = "40"
    with pytest.raises(ConfigError) as err:
        TransferParams.from_request(bad)
    assert err.value.field == "kv_transfer_params.kvxferd.num_tokens" and "'40'" in str(err.value)


def test_settings_check_every_key():
    s = ConnectorSettings.from_config({"instance": "a", "address": "h:1"}, kv_role="kv_both", engine_id="e")
    assert s.roles == ("prefill", "decode") and s.instance_for("decode") == "a.decode"
    assert ConnectorSettings.from_config({}, kv_role="kv_consumer", engine_id="e").instance == "vllm-e"
    for extra, role, field in [({"address": "nohost"}, "kv_both", "kv_connector_extra_config.address"),
                               ({}, "kv_producer", "kv_connector_extra_config.address"),
                               ({"call_timeout_s": 0}, "kv_consumer", "kv_connector_extra_config.call_timeout_s"),
                               ({"socket": "/x"}, "kv_consumer", "kv_connector_extra_config.socket"),
                               ({}, "kv_sideways", "kv_role")]:
        with pytest.raises(ConfigError) as err:
            ConnectorSettings.from_config(extra, kv_role=role, engine_id="e")
        assert err.value.field == field, (extra, role, err.value)


def test_worker_reports_a_send_once_and_only_after_vllm_finished_it():
    book = WorkerBook()
    book.send_state("t1", "r1").sent = 32
    assert book.send_terminal("t1") == "r1"
    assert book.take_finished(set()) == (set(), set())          # vLLM has not finished r1 yet
    assert book.take_finished({"r1"}) == ({"r1"}, set())
    assert book.take_finished({"r1"}) == (set(), set())         # once
    assert book.sends == {}


def test_worker_abort_of_a_send_the_daemon_never_saw_is_terminal_at_once():
    book = WorkerBook()
    book.send_state("t1", "r1")                                  # scheduled, nothing sent yet
    assert book.abort_send("r1", "t1") is False
    assert book.take_finished({"r1"}) == ({"r1"}, set())
    book.send_state("t2", "r2").sent = 32
    assert book.abort_send("r2", "t2") is True                   # the daemon holds a chunk: wait for it
    assert book.take_finished({"r2"}) == (set(), set())
    book.send_terminal("t2")
    assert book.take_finished(set()) == ({"r2"}, set())


def test_worker_failed_loads_name_their_blocks_and_are_reported_as_received():
    book = WorkerBook()
    book.load_started("t1", "d1", {4, 5})
    book.load_started("t2", "d2", {6})
    assert book.load_terminal("t1", ok=False) == "d1"
    assert book.load_terminal("t2", ok=True) == "d2"
    assert book.take_finished(set()) == (set(), {"d1", "d2"})
    assert book.take_load_errors() == {4, 5}
    assert book.take_load_errors() == set()

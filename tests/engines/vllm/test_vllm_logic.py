"""The connector's pure rules: settings, params, page math, what each worker reports and when."""

from __future__ import annotations

import json

import pytest

from kvxferd.adapters.vllm.logic import (
    ConnectorSettings,
    SchedulerBook,
    TransferParams,
    WorkerBook,
    dp_of,
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
    assert ConnectorSettings.from_config({"integrity": "full"}, kv_role="kv_consumer", engine_id="e").integrity == "full"
    for extra, role, field in [({"integrity": "strict"}, "kv_consumer", "kv_connector_extra_config.integrity"),
                               ({"integrity": True}, "kv_consumer", "kv_connector_extra_config.integrity"),({"address": "nohost"}, "kv_both", "kv_connector_extra_config.address"),
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


def test_dp_of_follows_what_vllm_keeps():
    assert dp_of(0, 1) is None  # no DP, or a dense model's independent DP engine (vLLM resets the size)
    assert dp_of(3, 1) is None
    assert dp_of(2, 4) == (2, 4)  # MoE DP: DP ranks of one engine, one KV cache each
    assert dp_of(None, 2) == (0, 2)
    with pytest.raises(ConfigError) as err:
        dp_of(4, 4)
    assert err.value.field == "parallel_config.data_parallel_rank" and "4 is not below" in str(err.value)


def test_transfer_params_carry_the_source_dp_rank():
    p = TransferParams("t1", "pre.prefill", "10.0.0.1:5557", 40, source_dp_rank=3)
    wire = json.loads(json.dumps(p.to_json()))
    assert wire["kvxferd"]["source_dp_rank"] == 3
    assert TransferParams.from_request(wire) == p
    assert "source_dp_rank" not in TransferParams("t1", "p", "h:1", 4).to_json()["kvxferd"]
    for value in (-1, "3", True):
        bad = json.loads(json.dumps(p.to_json()))
        bad["kvxferd"]["source_dp_rank"] = value
        with pytest.raises(ConfigError) as err:
            TransferParams.from_request(bad)
        assert err.value.field == "kv_transfer_params.kvxferd.source_dp_rank", value


def test_settings_rendezvous_is_the_source_address_and_is_checked():
    s = ConnectorSettings.from_config({"address": "h:1", "rendezvous": "r:2"}, kv_role="kv_producer",
                                      engine_id="e")
    assert (s.rendezvous, s.source_address) == ("r:2", "r:2")
    assert ConnectorSettings.from_config({"address": "h:1"}, kv_role="kv_producer",
                                         engine_id="e").source_address == "h:1"
    # a rendezvous alone tells decode where the instance is
    assert ConnectorSettings.from_config({"rendezvous": "r:2"}, kv_role="kv_producer",
                                         engine_id="e").source_address == "r:2"
    with pytest.raises(ConfigError) as err:
        ConnectorSettings.from_config({"rendezvous": "r"}, kv_role="kv_consumer", engine_id="e")
    assert err.value.field == "kv_connector_extra_config.rendezvous" and "'r'" in str(err.value)


def test_prefill_params_name_the_dp_rank_and_the_rendezvous():
    settings = ConnectorSettings.from_config({"instance": "moe", "address": "h:1", "rendezvous": "r:2"},
                                             kv_role="kv_producer", engine_id="e", dp=(1, 2))
    book = SchedulerBook(settings)
    book.after_alloc("req", {"do_remote_decode": True}, [5, 6], prompt_len=40, num_external=0)
    book.plan([("req", [5, 6], 40)])
    keep, params = book.finished("req", computed=40, aborted=False)
    got = TransferParams.from_request(params)
    assert keep and got is not None
    assert (got.source_instance, got.source_address, got.source_dp_rank, got.num_tokens) == (
        "moe.prefill", "r:2", 1, 40)


def test_connector_reads_the_dp_rank_from_vllm_parallel_config():
    """vLLM's own ParallelConfig: an MoE DP rank keeps rank and size (a DP rank of the
    instance); a dense DP rank after vLLM's reconfigure_for_independent_dp_rank is an engine
    of its own (its engine_id already carries ``_dp<k>``)."""
    import types

    from vllm.config import KVTransferConfig, ParallelConfig

    from kvxferd.adapters.vllm.connector import _settings

    kv = KVTransferConfig(kv_connector="KvxferdConnector", kv_role="kv_producer",
                          kv_connector_extra_config={"instance": "moe", "address": "h:1"})
    moe = ParallelConfig(data_parallel_size=2, data_parallel_rank=1)
    assert _settings(types.SimpleNamespace(kv_transfer_config=kv, parallel_config=moe)).dp == (1, 2)
    dense = ParallelConfig(data_parallel_size=2, data_parallel_rank=1)
    dense.reconfigure_for_independent_dp_rank()
    assert _settings(types.SimpleNamespace(kv_transfer_config=kv, parallel_config=dense)).dp is None
    assert _settings(types.SimpleNamespace(kv_transfer_config=kv, parallel_config=ParallelConfig())).dp is None

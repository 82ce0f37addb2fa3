"""SGLang's own plugin loading and CLI parsing pick up the kvxferd backend."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from sglang.srt.disaggregation import decode, prefill, utils
from sglang.srt.disaggregation.utils import KVClassType, get_kv_class
from sglang.srt.server_args import prepare_server_args

from kvxferd.adapters.sglang import conn


def test_entry_point_is_installed_and_loaded():
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("kvxferd") == "kvxferd.adapters.sglang.plugin:register"
    # load_plugins() (conftest) replaced the enum everywhere it was imported
    assert utils.TransferBackend("kvxferd").name == "KVXFERD"
    assert prefill.TransferBackend is utils.TransferBackend is decode.TransferBackend
    assert [m.value for m in utils.TransferBackend][:-1] == ["mooncake", "mori", "nixl", "ascend", "fake"]


def test_get_kv_class_answers_kvxferd_and_keeps_the_others():
    backend = utils.TransferBackend("kvxferd")
    assert get_kv_class(backend, KVClassType.MANAGER) is conn.KvxferdKVManager
    assert get_kv_class(backend, KVClassType.SENDER) is conn.KvxferdKVSender
    assert get_kv_class(backend, KVClassType.RECEIVER) is conn.KvxferdKVReceiver
    assert get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER) is conn.KvxferdKVBootstrapServer
    from sglang.srt.disaggregation.fake import FakeKVManager

    assert get_kv_class(utils.TransferBackend.FAKE, KVClassType.MANAGER) is FakeKVManager


def test_cli_accepts_the_backend():
    sa = prepare_server_args(["--model-path", "dummy", "--disaggregation-mode", "prefill",
                              "--disaggregation-transfer-backend", "kvxferd", "--device", "cpu"])
    assert sa.disaggregation_transfer_backend == "kvxferd"
    assert sa.disaggregation_mode == "prefill"


def test_cli_still_refuses_unknown_backends(capsys):
    with pytest.raises(SystemExit):
        prepare_server_args(["--model-path", "dummy", "--disaggregation-transfer-backend", "kvxferd2"])
    assert "invalid choice: 'kvxferd2'" in capsys.readouterr().err

"""`kvxferd plan`: the offline view of a pairing, run as a real command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvxferd.model.geometry import InstanceSpec

MODELS = Path(__file__).resolve().parent.parent / "configs" / "models"


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvxferd", "plan", *args], capture_output=True, text=True,
                          timeout=120)


def test_json_names_every_writer_with_global_head_and_layer_ranges():
    out = plan("--prefill", str(MODELS / "llama-3.1-70b.tp8.json"), "--decode",
               str(MODELS / "llama-3.1-70b.tp4.json"), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["compatible"] is True and data["mode"] == "staged"
    dests = data["destinations"]
    assert [(d["tp_rank"], d["pp_rank"]) for d in dests] == [(i, 0) for i in range(4)]
    for d in dests:
        # decode rank i holds heads [2i, 2i+2): prefill ranks 2i and 2i+1 write one head each
        i = d["tp_rank"]
        assert [(w["tp_rank"], w["pp_rank"], w["heads"], w["layers"]) for w in d["writers"]] == [
            (2 * i, 0, [2 * i, 2 * i + 1], [0, 80]), (2 * i + 1, 0, [2 * i + 1, 2 * i + 2], [0, 80])]


def test_pp_and_replication_in_the_json(tmp_path):
    p = {"attention": "mha", "num_layers": 10, "total_kv_heads": 2, "head_dim": 8, "dtype": "float16",
         "page_size": 4, "tp_size": 4, "pp_size": 2, "layer_splits": [[0, 3], [3, 10]]}
    d = {"attention": "mha", "num_layers": 10, "total_kv_heads": 2, "head_dim": 8, "dtype": "float16",
         "page_size": 8, "tp_size": 1, "pp_size": 1}
    (tmp_path / "p.json").write_text(json.dumps(p))
    (tmp_path / "d.toml").write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in d.items()))
    out = plan("--prefill", str(tmp_path / "p.json"), "--decode", str(tmp_path / "d.toml"), "--json")
    assert out.returncode == 0, out.stderr
    writers = json.loads(out.stdout)["destinations"][0]["writers"]
    # two head groups (ranks 0-1 hold head 0, ranks 2-3 head 1) x two layer ranges: four writers
    assert sorted((w["heads"][0], w["layers"][0], w["layers"][1]) for w in writers) == [
        (0, 0, 3), (0, 3, 10), (1, 0, 3), (1, 3, 10)]
    assert sorted({w["tp_rank"] for w in writers}) == [0, 2]  # one replica per head group


def test_human_table_and_refusal(tmp_path):
    out = plan("--prefill", str(MODELS / "llama-3.1-8b.tp2.json"), "--decode", str(MODELS / "llama-3.1-8b.tp1.json"))
    assert out.returncode == 0
    assert "decode rank" in out.stdout and "writer (tp,pp)" in out.stdout and "mode:" in out.stdout
    bad = json.loads((MODELS / "llama-3.1-8b.tp1.json").read_text())
    bad["head_dim"] = 64
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    out = plan("--prefill", str(MODELS / "llama-3.1-8b.tp2.json"), "--decode", str(tmp_path / "bad.json"), "--json")
    assert out.returncode == 2
    refusal = json.loads(out.stdout)
    assert refusal["compatible"] is False and refusal["field"] == "head_dim"
    assert "128" in refusal["error"] and "64" in refusal["error"]
    human = plan("--prefill", str(MODELS / "llama-3.1-8b.tp2.json"), "--decode", str(tmp_path / "bad.json"))
    assert human.returncode == 2 and "head_dim" in human.stdout


def test_unresolvable_heads_and_usage_errors(tmp_path):
    geo = {"attention": "mha", "num_layers": 4, "head_dim": 8, "dtype": "bfloat16", "page_size": 4}
    (tmp_path / "g.json").write_text(json.dumps(geo))
    out = plan("--prefill", str(tmp_path / "g.json"), "--decode", str(tmp_path / "g.json"), "--json")
    assert out.returncode == 2
    assert json.loads(out.stdout)["field"] == "total_kv_heads"
    assert "Cannot resolve total_kv_heads" in json.loads(out.stdout)["error"]
    assert plan("--prefill", str(tmp_path / "missing.json"), "--decode", str(tmp_path / "g.json")).returncode == 1
    assert plan("--prefill").returncode == 1


@pytest.mark.parametrize("path", sorted(MODELS.glob("*.json")), ids=lambda p: p.name)
def test_shipped_model_geometries_load(path):
    InstanceSpec.from_dict(json.loads(path.read_text()))


def test_packed_page_pairings(tmp_path):
    """vLLM's CPU layout: compatible with itself at one page size (text names bytes per page),
    refused against NHD and across page sizes, naming the field and both values."""
    base = {"attention": "mha", "num_layers": 2, "total_kv_heads": 2, "head_dim": 32, "dtype": "float32",
            "page_size": 32, "layout": "packed_page"}
    (tmp_path / "p.json").write_text(json.dumps({**base, "tp_size": 2}))
    (tmp_path / "d.json").write_text(json.dumps(base))
    (tmp_path / "d16.json").write_text(json.dumps({**base, "page_size": 16}))
    (tmp_path / "nhd.json").write_text(json.dumps({**base, "layout": "NHD"}))
    out = plan("--prefill", str(tmp_path / "p.json"), "--decode", str(tmp_path / "d.json"))
    assert out.returncode == 0, out.stderr
    assert "bytes/page" in out.stdout and "layout=packed_page" in out.stdout and "8192 B head slice" in out.stdout
    out = plan("--prefill", str(tmp_path / "p.json"), "--decode", str(tmp_path / "d16.json"), "--json")
    assert out.returncode == 2
    data = json.loads(out.stdout)
    assert (data["field"], data["prefill"], data["decode"]) == ("page_size", 32, 16)
    out = plan("--prefill", str(tmp_path / "p.json"), "--decode", str(tmp_path / "nhd.json"))
    assert out.returncode == 2
    assert "layout differs: prefill has 'packed_page', decode has 'NHD'" in out.stdout and "field: layout" in out.stdout

"""`kvxferd plan` with cache groups: per-group bytes and writers, refusals naming the group."""

from __future__ import annotations

import json

from test_cli_plan import MODELS, plan


def test_hybrid_state_groups_in_the_json():
    out = plan("--prefill", str(MODELS / "qwen3-next-80b-a3b.tp4.json"), "--decode",
               str(MODELS / "qwen3-next-80b-a3b.tp2.json"), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["bytes_per_token"] == 12 * 2 * 2 * 256 * 2  # full-attention layers x (k, v) x heads x dim x bf16
    conv, ssm = data["groups"]
    assert (conv["name"], conv["kind"], conv["bytes_per_request"]) == ("conv", "state", 36 * 8192 * 3 * 2)
    assert ssm["bytes_per_request"] == 36 * 32 * 128 * 128 * 4
    # decode rank 0 (TP 2) holds q, k and v channels [0, 1024), [2048, 3072), [4096, 6144): from prefill ranks 0, 1
    writers = conv["destinations"][0]["writers"]
    assert [(w["tp_rank"], w["heads"], w.get("part", 0)) for w in writers] == [
        (0, [0, 512], 0), (1, [512, 1024], 0), (0, [2048, 2560], 1), (1, [2560, 3072], 1),
        (0, [4096, 5120], 2), (1, [5120, 6144], 2)]
    assert data["mode"] == "direct"  # 3 KiB and larger slices


def test_window_group_in_the_table_and_a_refusal(tmp_path):
    out = plan("--prefill", str(MODELS / "gpt-oss-120b.tp4.json"), "--decode", str(MODELS / "gpt-oss-120b.tp2.json"))
    assert out.returncode == 0, out.stderr
    assert "group swa (window): 36864 bytes/token, the last 128 tokens only" in out.stdout
    assert out.stdout.count("256 B head slice") == 8 and "mode: staged" in out.stdout  # 4 full, 4 window writers
    other = json.loads((MODELS / "gpt-oss-120b.tp2.json").read_text())
    other["groups"][0]["window"] = 4096
    (tmp_path / "d.json").write_text(json.dumps(other))
    out = plan("--prefill", str(MODELS / "gpt-oss-120b.tp4.json"), "--decode", str(tmp_path / "d.json"), "--json")
    assert out.returncode == 2
    refused = json.loads(out.stdout)
    assert refused["field"] == "groups.swa.window" and refused["prefill"] == 128 and refused["decode"] == 4096


def test_draft_group_pairs_with_tp_mismatch():
    out = plan("--prefill", str(MODELS / "llama-3.1-8b-eagle3.tp2.json"), "--decode",
               str(MODELS / "llama-3.1-8b-eagle3.tp1.json"), "--json")
    assert out.returncode == 0, out.stderr
    (draft,) = json.loads(out.stdout)["groups"]
    assert draft["kind"] == "draft" and draft["bytes_per_token"] == 1 * 2 * 8 * 128 * 2
    assert [w["tp_rank"] for w in draft["destinations"][0]["writers"]] == [0, 1]

"""``kvxferd bench --smoke --only qos --json``: the QoS scenario end to end through real daemons,
QoS on and off, every byte checked. Only the shape is read, never a speed (payloads are far
below anything a figure would mean): every row verified, the fifo and qos rows of each transport,
the deadline probe failed ``deadline``, and the QoS goals reported as targets."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def report() -> dict:
    proc = subprocess.run([sys.executable, "-m", "kvxferd", "bench", "--smoke", "--only", "qos", "--json"],
                          capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, f"bench exited {proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_qos_row_moved_verified_bytes_for_both_policies_on_each_transport(report):
    rows = {r["name"]: r for r in report["rows"] if r["group"] == "qos"}
    for transport in ("local", "tcp"):
        for policy in ("fifo", "qos"):
            for what in ("chat idle", "chat under bulk"):
                row = rows[f"qos {transport} {policy} {what}"]
                assert row["verified"] is True and row["p50_ms"] > 0 and row["p99_ms"] >= row["p50_ms"], row
        assert rows[f"qos {transport} qos bulk weights 3:1"]["verified"] is True
        assert rows[f"qos {transport} qos bulk under a latency flood"]["verified"] is True
    assert report["verified"] is True


def test_the_deadline_probe_fails_deadline_and_names_its_estimate(report):
    for r in report["rows"]:
        if r["group"] == "qos" and r["name"].endswith("chat under bulk"):
            probe = r["extra"]["deadline"]
            assert (probe["state"], probe["code"]) == ("failed", "deadline"), probe
            assert "deadline" in probe["reason"] and probe["ms"] > 0, probe


def test_the_qos_goals_are_reported_for_the_qos_rows_only(report):
    names = [t["target"] for t in report["targets"] if t["target"].startswith("qos_")]
    for transport in ("local", "tcp"):
        for goal in ("qos_p99_vs_idle", "qos_p99_over_idle_ms", "qos_deadline_fail_ms", "qos_weights_3_to_1_error",
                     "qos_flood_bulk_vs_floor"):
            assert f"{goal} ({transport})" in names, names

"""Same-daemon (local) copies are direct by nature: peer.mode, the demo, config checks and the
metrics agree on it.

A local copy moves page runs region to region in one index copy per (layer, kind); staging
would only add a copy. ``peer.mode`` therefore governs links between daemons, and the daemon
says so at start-up when it is set to ``staged``.
"""

from __future__ import annotations

import os
import subprocess
import sys

from ops_support import NUM_PAGES, Scrape, kv_bytes, pages, spec, transfer


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVXFERD_")}


def test_demo_local_staged_is_refused_with_the_fix():
    out = subprocess.run([sys.executable, "-m", "kvxferd", "demo", "--requests", "2", "--transport", "local",
                          "--mode", "staged", "--json"], capture_output=True, text=True, timeout=120,
                         env=clean_env())
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "local copies are always direct" in out.stderr
    assert "--transport tcp" in out.stderr  # the fix
    assert out.stdout == ""  # refused before any daemon started


def test_check_config_says_staged_applies_between_daemons(tmp_path):
    path = tmp_path / "k.toml"
    path.write_text('[peer]\nmode = "staged"\n')
    out = subprocess.run([sys.executable, "-m", "kvxferd", "serve", "--check-config", str(path)],
                         capture_output=True, text=True, timeout=60, env=clean_env())
    assert out.returncode == 0, out.stderr
    assert "peer.mode = staged applies to links between daemons" in out.stdout
    assert "same-daemon (local) copies are always direct" in out.stdout


def test_staged_daemon_serves_local_requests_direct_and_says_so(cluster):
    d = cluster.daemon("node", extra_toml="", start=False)
    d.start({"KVXFERD_PEER_MODE": "staged"})
    pw = cluster.instance(d, "prefill-a", "prefill", spec(), NUM_PAGES)[0]
    dw = cluster.instance(d, "decode-a", "decode", spec(), NUM_PAGES)[0]
    n = 40
    dec, pre = transfer(pw, dw, "local-1", n, pages(0, n), pages(10, n), None)
    assert dec["state"] == "done" and dec["mismatched_bytes"] == 0, dec
    assert pre["state"] == "done", pre
    scrape = Scrape(d)
    assert scrape.value("kvxferd_sent_bytes_total", transport="local", mode="direct") == kv_bytes(n)
    assert scrape.value("kvxferd_sent_bytes_total", mode="staged") == 0
    assert scrape.value("kvxferd_transfers_total", side="decode", outcome="done", mode="direct",
                        transport="local") == 1
    notes = [line for line in d.log().splitlines() if "event=mode_scope" in line]
    assert notes and "mode=staged" in notes[0] and "local=direct" in notes[0], d.log()[-2000:]

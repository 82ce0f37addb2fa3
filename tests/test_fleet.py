"""The fleet simulator speaks the real peer protocol: real daemons hand-shake with its fake peers,
plan with them, expect from them and keep their links up on heartbeats; dead addresses end as
unreachable peers. (What the fleet costs a daemon is measured by ``kvxferd bench``, not here.)"""

from __future__ import annotations

from kvxferd.tools import fleet


def test_real_daemons_take_fake_peers_for_real_ones():
    # each idle reading outlasts the peer timeout: links still up after it are kept up by heartbeats
    report = fleet.measure(links=6, idle_s=1.5, heartbeat_s=0.25, timeout_s=1.0)
    assert report.errors == []
    # the decode daemon dialled every fake source, handshook, sent its expect: each answered with an abort
    assert report.ends.get("peer_aborted") == 6
    dead = {k: v for k, v in report.ends.items() if k.startswith("dead:")}
    assert sum(dead.values()) == 6 and set(dead) <= {"dead:peer_unreachable", "dead:peer_dead"}
    assert report.live_sources is not None and report.live_sources.peers_listed == 6
    assert report.dead_sources is not None and report.dead_sources.peers_listed == 6  # listed down
    # the prefill daemon answered every fake decode daemon's hello with a plan it accepted
    assert report.storm_answers == {"handshake_ok": 6}
    assert report.live_decodes is not None and report.live_decodes.peers_listed == 6
    assert report.baseline["decode"].peers_listed == 0

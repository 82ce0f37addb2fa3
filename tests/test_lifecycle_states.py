"""The transition tables, and random interleavings of a request's calls and jobs (hypothesis)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from kvxferd.lifecycle import events, states

from lifecycle_util import Cluster, nbytes_of, pages, spec


def test_tables_reach_a_terminal_state_from_every_active_state_and_leave_none():
    for table in (states.DEST, states.SRC):
        for state in states.ACTIVE:
            assert table[(state, "complete")] == states.DONE and table[(state, "failed")] == states.FAILED
        assert not any(state in states.TERMINAL for state, _event in table)


def test_advance_refuses_a_transition_the_tables_do_not_list():
    entry = SimpleNamespace(state=states.DONE, phase_since=1.0)
    with pytest.raises(states.TransitionError):
        states.advance(entry, states.DEST, "failed", 2.0)
    assert (entry.state, entry.phase_since) == (states.DONE, 1.0)
    entry.state = states.BOOTSTRAPPING
    assert states.advance(entry, states.SRC, "bound", 3.0) == states.WAITING and entry.phase_since == 3.0


@settings(max_examples=60, deadline=None)
@given(data=st.data(), p_tp=st.sampled_from([1, 2]), remote=st.booleans(), cuts=st.lists(
    st.sampled_from([4, 8, 12]), unique=True, max_size=3))
def test_any_interleaving_of_calls_and_jobs_completes_every_rank_once(data, p_tp, remote, cuts):
    """Expect, chunks from every prefill rank and job completions in any order: every rank is told
    ``done`` exactly once, with every byte of the request."""
    c = Cluster("P", "D") if remote else Cluster("P")
    pn = c.node("P")
    dn = c.node("D") if remote else pn
    prefill = [pn.rank("p", "prefill", spec(p_tp), tp=t) for t in range(p_tp)]
    d = dn.rank("d", "decode", spec(1))
    bounds = [0, *sorted(cuts), 16]
    steps: list[tuple[str, int, int]] = [("expect", 0, 0)]
    steps += [("send", t, i) for t in range(p_tp) for i in range(len(bounds) - 1)]
    c.hold_jobs = True
    sent = {t: 0 for t in range(p_tp)}
    pending = list(steps)
    while pending or any(n.jobs for n in c.nodes.values()) or c.queue:
        choices = [s for s in pending if s[0] == "expect" or s[2] == sent[s[1]]]  # chunks of a rank in order
        jobs = [n for n in c.nodes.values() if n.jobs]
        pick = data.draw(st.integers(0, len(choices) + len(jobs)))
        if pick < len(choices):
            step = choices[pick]
            pending.remove(step)
            if step[0] == "expect":
                dn.expect(d, "r", pages(4), "p", num_tokens=16, source_node=pn)
            else:
                t, i = step[1], step[2]
                lo, hi = bounds[i], bounds[i + 1]
                pn.send(prefill[t], "r", pages((hi - lo + 3) // 4, 20 + lo // 4), lo, hi, hi == 16)
                sent[t] += 1
        elif pick < len(choices) + len(jobs):
            node = jobs[pick - len(choices)]
            c.run_job(node, node.jobs.pop(data.draw(st.integers(0, len(node.jobs) - 1))))
        c.run()
    assert dn.outcome("r", d).state == "done" and dn.outcome("r", d).bytes == nbytes_of(spec(1), 16)
    assert [pn.outcome("r", p).state for p in prefill] == ["done"] * p_tp
    assert not dn.inbox.all() and not pn.life.sources


def test_tick_without_requests_does_nothing():
    c = Cluster("P")
    c.tick(1e6)
    assert c.node("P").handle(events.Tick()) is None and not c.node("P").told

"""An announcement to a rendezvous that stopped answering waits out its backoff like any link."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvxferd.control.decode_links import DecodeLinks
from kvxferd.lifecycle.links import DOWN, Links
from kvxferd.wire import messages


def test_a_backed_off_daemon_is_not_asked_and_its_link_not_reopened():
    book = Links("decode", backoff_s=30.0, backoff_max_s=60.0)
    now = time.monotonic()
    link = book.open("10.0.0.9:5000", "10.0.0.9:5000", now)
    book.move(link, "silent", now)  # the rendezvous went silent: down, tried again in 15-30 s
    assert link.state == DOWN and link.retry_at > now
    opened = []
    links = DecodeLinks.__new__(DecodeLinks)  # only what ask reads of a backed-off daemon
    links.book, links.links, links.dispatch = book, {}, opened.append
    msg = messages.Announce("10.0.0.1:5000", "inc", "p", "prefill", {}, [[0, 0]], None)
    with pytest.raises(TimeoutError, match="backed off"):
        asyncio.run(links.ask("10.0.0.9:5000", msg, 1.0))
    assert not links.links and not opened and link.state == DOWN  # no socket, no LinkOpened: backoff kept

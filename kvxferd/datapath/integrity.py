"""The destination's integrity check: a landed chunk's bytes against its source's digests.

Every transport hands a landed chunk to :meth:`~kvxferd.lifecycle.inbox.Inbox.finish`, which
asks this check before the chunk counts as received: one place, so a socket, a NIXL WRITE, a
landing ring or a local copy are checked alike, after the bytes are where the engine will
read them. A chunk that fails is never counted, and its request fails with code
``integrity`` (the inbox tells the lifecycle).

The header is checked too, earlier: :meth:`LandedCheck.header` takes its own digest
(:func:`~.digest.header_digest`: aux, token range, last and every other field the decode side acts
on) as :meth:`~kvxferd.lifecycle.inbox.Inbox.begin` reads it, before any of those fields is used. A
mismatch fails the request ``integrity`` there, naming the header rather than the pages.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Mapping

import numpy as np

from ..ops.config import HEADER_FAULTS
from ..ops.logutil import q
from ..ops.metrics import Metrics
from ..model.sampling import chosen, granule, granules_of
from .digest import RunningDigests, header_digest, region_digests

log = logging.getLogger("kvxferd.integrity")

#: pages a mismatch names at most (the chunk's first ones)
NAMED_PAGES = 8


class LandedCheck:
    """Callable on a landed sink: None when its bytes are as the source read them, else why not."""

    def __init__(self, metrics: Metrics, corrupt_every: int = 0, corrupt_header: str = "") -> None:
        self.metrics = metrics
        self.corrupt_every = corrupt_every  # fault injection for tests (integrity.corrupt_landed_every)
        assert corrupt_header in HEADER_FAULTS, f"integrity.corrupt_header {corrupt_header!r}: the config refuses it"
        self.corrupt_header = corrupt_header  # ... and integrity.corrupt_header
        self._seen = itertools.count(1)
        if corrupt_every:
            log.warning("event=integrity_fault_injection every=%d note=%s", corrupt_every,
                        q("one landed byte of every Nth chunk with digests is flipped before it is checked: "
                          "a test setting, never for production"))
        if corrupt_header:
            log.warning("event=integrity_fault_injection header_field=%s note=%s", corrupt_header,
                        q(f"{corrupt_header} is flipped in every data header with digests as it arrives, before "
                          "the inbox reads it: a test setting, never for production"))

    def header(self, entry: Any, writer: Any, header: Mapping[str, Any], transport: str) -> str | None:
        """None when a data header's fields are those its source sent (or it carries no digests,
        so nothing was sent to check it by), else why not: counted and logged like a page mismatch."""
        if header.get("digests") is None and not header.get("trailer"):
            return None  # no digests at all: the landed check refuses that where they were asked for
        sent = header.get("header_digest")
        peer = entry.daemon_of(writer.src) or "local"
        span = (header["start"], header["end"])
        if sent is None:
            self.metrics.integrity_failures.labels(peer, transport).inc()
            return self._say_of(entry, writer, span, transport, peer, "header", "carries digests of its pages but "
                                "none of its header", "run the same kvxferd on both sides")
        own = header_digest(header)
        if own == sent:
            return None
        self.metrics.integrity_failures.labels(peer, transport).inc()
        return self._say_of(entry, writer, span, transport, peer, "header",
                            f"came with a header other than the one its source sent (header digest {own:#018x}, "
                            f"source's {sent:#018x}): one of its aux, token range, last, byte count, rank, group "
                            "or digest fields changed on the way, so none of them is used",
                            "the request must be sent again; if it recurs, suspect the network or the transport "
                            "between these daemons")

    def tamper(self, header: dict[str, Any]) -> dict[str, Any]:
        """Fault injection for tests (``integrity.corrupt_header``): a copy of a header with digests
        whose field is flipped, as a bit changed in flight would leave it (``last`` negated, the
        first byte of ``aux`` inverted, for a header that carries aux); any other header as it is."""
        field = self.corrupt_header
        if not field or (header.get("digests") is None and not header.get("trailer")):
            return header
        if field == "last":
            return {**header, "last": not header["last"]}
        aux = header.get("aux")
        if not aux:
            return header
        return {**header, "aux": bytes([aux[0] ^ 0x01]) + bytes(aux[1:])}

    def __call__(self, sink: Any, transport: str) -> str | None:
        entry, w = sink.entry, sink.writer
        asked, sent = entry.integrity, sink.sample
        if sent is None and asked is None:
            return None
        peer = entry.daemon_of(w.src) or "local"
        if sent is None:
            self.metrics.integrity_failures.labels(peer, transport).inc()
            return self._say(sink, transport, peer, f"came without digests, which this daemon asks for "
                             f"({asked.describe()})", "run a kvxferd that sends them on the source side")
        grain = granule(entry.plan, w.group)
        span = np.arange(*granules_of(sink.start, sink.end, grain)) if grain else None
        if asked is not None and grain and not sent.covers(asked, w.group, span):
            self.metrics.integrity_failures.labels(peer, transport).inc()
            return self._say(sink, transport, peer, f"carries digests of {sent.describe()}, which do not cover "
                             f"what this daemon asked for ({asked.describe()})",
                             "check both sides run the same kvxferd")
        regions = sink.regions()
        if sink.digests is None:  # said they would trail the payload, and never came
            self.metrics.integrity_failures.labels(peer, transport).inc()
            return self._say(sink, transport, peer, "said its digests would follow its bytes, and they never came",
                             "check both sides run the same kvxferd")
        if len(sink.digests) != len(regions):
            self.metrics.integrity_failures.labels(peer, transport).inc()
            return self._say(sink, transport, peer, f"carries {len(sink.digests)} digests for its {len(regions)} "
                             "regions", "check both sides run the same kvxferd")
        if sink.landed is not None:  # hashed as the bytes landed (a byte flipped there, if due)
            landed = sink.landed
        else:
            slots = chosen(sink.dst_slots, sink.slot_tokens, sink.start, grain, sent, w.group)
            if slots.size and self._fault_due():
                self._corrupt(sink, regions[0], int(slots[0]))
            landed = region_digests([r.flat for r in regions], slots, w.dst_row_bytes, sink.head_offset,
                                    w.slice_bytes, sink.hash)
        self.metrics.integrity_checked.labels(transport, sink.hash).inc()
        bad = [i for i, (a, b) in enumerate(zip(landed, sink.digests)) if a != b]
        if not bad:
            return None
        self.metrics.integrity_failures.labels(peer, transport).inc()
        first = regions[bad[0]]
        return self._say(sink, transport, peer,
                         f"landed with bytes that differ from what the source read in {len(bad)} of its "
                         f"{len(regions)} regions, first layer {first.layer} kind {first.kind!r} (digest "
                         f"{landed[bad[0]]:#018x}, source's {sink.digests[bad[0]]:#018x})",
                         "the request must be sent again; if it recurs, suspect the memory or the transport "
                         "between these daemons")

    def running(self, sink: Any) -> RunningDigests:
        """Digests a transport feeds as a chunk's bytes land in the engine's pages (every slot,
        in wire order); the check then reads them instead of hashing the pages again."""
        return RunningDigests(len(sink.regions()), flip_first=self.flip_due(sink))

    def flip_due(self, sink: Any) -> bool:
        """A landed byte of this chunk is to be flipped before it is hashed (fault injection)."""
        return sink.nbytes > 0 and self._fault_due()

    def _fault_due(self) -> bool:
        return bool(self.corrupt_every) and next(self._seen) % self.corrupt_every == 0

    @staticmethod
    def _corrupt(sink: Any, region: Any, slot: int) -> None:
        at = slot * sink.writer.dst_row_bytes + sink.head_offset
        region.flat[at] = int(region.flat[at]) ^ 0xFF

    @classmethod
    def _say(cls, sink: Any, transport: str, peer: str, what: str, fix: str) -> str:
        return cls._say_of(sink.entry, sink.writer, (sink.start, sink.end), transport, peer, "pages", what, fix)

    @staticmethod
    def _say_of(entry: Any, w: Any, span: tuple[int, int], transport: str, peer: str, scope: str, what: str,
                fix: str) -> str:
        """The failure's message and log line; ``scope``: what differs, the chunk's ``header`` or its ``pages``
        (``span``: the token range as its header says, which a changed header may not be)."""
        start, end = span
        group = w.group
        pages = entry.groups.get(group) if group else entry.pages
        page_size = entry.rank.geometry.group(group).spec.page_size
        named = ""
        if pages is not None and end > start and scope == "pages":
            first, last = start // page_size, (end - 1) // page_size
            listed = [int(p) for p in pages[first:min(last + 1, first + NAMED_PAGES)]]
            named = f" on destination pages {listed}{' ...' if last + 1 - first > NAMED_PAGES else ''}"
        text = (f"request {entry.request_id!r}: chunk of tokens [{start}, {end}){named} from writer "
                f"{list(w.src)}{f' (group {group!r})' if group else ''} at {peer} over {transport} {what}; fix: {fix}")
        log.warning("event=integrity_failed request=%s rank=%s writer=%s peer=%s transport=%s tokens=%d-%d "
                    "scope=%s msg=%s", q(entry.request_id), entry.rank.id, list(w.src), peer, transport, start, end,
                    scope, q(text))
        return text

"""Decode side: the destinations this daemon expects bytes for, shared with data threads.

A peer's data header names only (request, destination rank, writer, token range). The
inbox checks it against what the local decode engine asked for and computes every write
offset from the engine's own page table, so no peer-supplied offset ever reaches memory.
A chunk is accepted at most once per (writer, token): overlapping or replayed ranges are
refused before a byte is written.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Protocol

import numpy as np

from ..datapath.digest import XXH3
from ..errors import IntegrityError, ProtocolError, RequestError
from ..model.group_requests import group_origin
from ..model.plan import Destination, Plan, Writer, group_key
from ..model.sampling import FULL, Picks, Sample
from ..model.segments import check_whole_pages, chunk_bytes, head_offset_bytes, slot_count, unit_slots
from ..ops.hops import TRACE
from . import states
from .registry import Rank


@dataclass
class DestEntry:
    """One request at one decode rank."""

    request_id: str
    rank: Rank
    source_instance: str
    pages: np.ndarray
    num_tokens: int | None
    start: int = 0  # tokens before it are already in the decode pages (a prefix hit): only the rest moves
    created: float = field(default_factory=time.monotonic)
    state: str = states.BOOTSTRAPPING
    phase_since: float = field(default_factory=time.monotonic)
    plan: Plan | None = None
    dest: Destination | None = None
    writers: dict[tuple[int, int], Writer] = field(default_factory=dict)
    received: dict[tuple[int, int], list[tuple[int, int]]] = field(default_factory=dict)
    pending: dict[tuple[int, int], list[tuple[int, int]]] = field(default_factory=dict)
    last_end: dict[tuple[int, int], int] = field(default_factory=dict)
    inflight: int = 0
    #: a data thread admitted a chunk of it (set under the inbox lock; the core moves the state
    #: when it hears of it, on its own clock)
    admitted: bool = False
    closed: bool = False
    aux: bytes | None = None
    bytes_received: int = 0
    failure: tuple[str, str] | None = None
    transport: str = ""
    source_address: str = ""  # empty: the source instance is on this daemon
    data_token: bytes | None = None  # data headers for this entry must carry it (remote sources)
    fence_until: float = 0.0  # failed over NIXL direct: wait (until then) for the source to say no WRITE is left
    rehandshakes: int = 0  # times a source answered no_handshake and the request handshook again
    #: per source daemon, when this entry's expect last left for it: a restarted source fails only
    #: the entries whose expect may have reached its old process (see ``SourceLost.sent_before``)
    expects_sent: dict[str, float] = field(default_factory=dict)
    groups: dict[str, np.ndarray] = field(default_factory=dict)  # cache groups: page tables, [state slot]
    origins: dict[tuple[Any, ...], int] = field(default_factory=dict)  # per writer key: its first token that moves
    #: a source instance over several daemons: daemon address -> the writers of this rank it holds
    source_daemons: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    #: and the link token each writer's data headers must carry (that of its daemon's link)
    writer_tokens: dict[tuple[int, int], bytes] = field(default_factory=dict)
    fence_waiting: set[str] = field(default_factory=set)  # source daemons yet to answer "fenced"
    waiting_for: str = ""  # what bootstrap waits on (a source's "retry later"), named if the phase times out
    #: its failure went to a source daemon as ``ended`` (its expect had not reached it): said once
    #: more when its bootstrap returns, which puts the handshake ahead of it on the link
    end_told: bool = False
    #: what of its chunks must carry its source's digests, checked over the landed bytes
    #: (integrity.mode, or its instance's ask; None: nothing asked)
    integrity: Sample | None = None

    def source_addresses(self) -> list[str]:
        """Every source daemon of this destination (none: the source instance is on this daemon)."""
        if self.source_daemons:
            return list(self.source_daemons)
        return [self.source_address] if self.source_address else []

    def from_source(self, address: str) -> bool:
        return address in self.source_addresses()

    def daemon_of(self, src: tuple[int, int]) -> str:
        """The source daemon holding prefill rank ``src``: one of a spread instance's, else the one."""
        for address, writers in self.source_daemons.items():
            if src in writers:
                return address
        return self.source_address

    @property
    def capacity(self) -> int:
        return int(self.pages.size) * self.rank.geometry.spec.page_size

    def bind(self, plan: Plan) -> None:
        self.plan = plan
        self.dest = plan.destination(*self.rank.coords)
        # a cache group's writers are keyed (tp, pp, group): one rank writes several groups
        self.writers = {w.key: w for w in plan.writers_of(*self.rank.coords)}
        self.received = {src: [] for src in self.writers}
        self.pending = {src: [] for src in self.writers}
        spec = self.rank.geometry.spec
        self.origins = {key: group_origin(spec, w.group, self.start, self.num_tokens)
                        for key, w in self.writers.items()}

    def complete(self) -> bool:
        if not self.writers or self.inflight:
            return False
        ends = set()
        for src, w in self.writers.items():
            end = self.last_end.get(src)
            if end is None or _covered(self.received[src], self.origins.get(src, self.start)) != end:
                return False
            if not (w.group and self.rank.geometry.spec.group(w.group).per_request):
                ends.add(end)  # every token group ends at the request's last token; a state at its rows
        return len(ends) == 1


def _covered(ranges: list[tuple[int, int]], origin: int = 0) -> int:
    """End of the gap-free range [origin, n) covered by ``ranges``."""
    reach = origin
    for start, end in sorted(ranges):
        if start > reach:
            break
        reach = max(reach, end)
    return reach


def _overlaps(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    return any(s < end and start < e for s, e in ranges)


@dataclass
class Sink:
    """A validated, reserved chunk: everything a data thread needs to write it."""

    entry: DestEntry
    writer: Writer
    start: int
    end: int
    last: bool
    nbytes: int
    dst_slots: np.ndarray
    head_offset: int
    aux: bytes | None
    digests: list[int] | None = None  # the source's, one per region (integrity); None: not sent (yet)
    sample: Sample | None = None  # which granules those digests cover (FULL: every slot); None: not sent
    #: the source's digests come after the payload: the transport puts them in ``digests`` (tcp: the
    #: frame after it; a local copy: what it hashed as it copied)
    trailer: bool = False
    #: digests of the landed bytes, taken as they landed (:meth:`Inbox.running_digests`); None: the
    #: check hashes the landed pages in a pass of its own
    landed: list[int] | None = None
    #: which digest ``digests`` are (the header's ``hash``): the check takes the same over the landed bytes
    hash: str = XXH3

    def regions(self) -> list[Any]:
        return list(self._regions)  # a fresh list each time: callers may keep or change theirs

    @property
    def slot_tokens(self) -> int:
        """Tokens one of ``dst_slots`` holds (1: token rows; a page: packed)."""
        return self.entry.rank.geometry.spec.group_spec(self.writer.group).slot_tokens

    @cached_property
    def _regions(self) -> tuple[Any, ...]:
        """Derived once: a transport asks for them more than once per chunk."""
        rank = self.entry.rank
        kinds = rank.geometry.kinds_of(self.writer.group)
        region = rank.region
        return tuple(region(layer, kind) for layer in range(*self.writer.layers) for kind in kinds)


class Check(Protocol):
    """What the inbox asks of a landed chunk (:class:`~kvxferd.datapath.integrity.LandedCheck`)."""

    def __call__(self, sink: Sink, transport: str) -> str | None:
        """None when the chunk's bytes are as its source read them, else why not."""

    def running(self, sink: Sink) -> Any:
        """Digests to feed the chunk's bytes as they land, in wire order (``add(region, view)``,
        ``digests()``), for a transport that lands them in place."""

    def flip_due(self, sink: Sink) -> bool:
        """Fault injection: a transport hashing landed bytes itself flips one first."""

    def header(self, entry: DestEntry, writer: Writer, header: dict[str, Any], transport: str) -> str | None:
        """None when a data header is as its source sent it (its own digest), else why not."""

    def tamper(self, header: dict[str, Any]) -> dict[str, Any]:
        """Fault injection: the header with a field changed as in flight, when one is to be."""


class Inbox:
    """Thread-safe table of destinations; data threads call begin/finish."""

    def __init__(self, on_change: Callable[[DestEntry], None], *,
                 check: Check | None = None,
                 on_refused: Callable[[DestEntry, str, str], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str], DestEntry] = {}
        self._by_request: dict[str, list[DestEntry]] = {}
        self._on_change = on_change  # called from any thread; must be thread-safe
        #: a landed chunk's bytes against its source's digests (:class:`~kvxferd.datapath.integrity.LandedCheck`):
        #: None, or why they differ; and who hears that the chunk failed its request (thread-safe too)
        self._check = check
        self._on_refused = on_refused

    def add(self, entry: DestEntry) -> None:
        key = (entry.request_id, entry.rank.id)
        with self._lock:
            if key in self._entries:
                raise RequestError(f"request {entry.request_id!r} is already expected at rank {entry.rank.id}",
                                   field="request_id", fix="use a new request id per request")
            self._entries[key] = entry
            self._by_request.setdefault(entry.request_id, []).append(entry)

    def get(self, request_id: str, rank_id: str) -> DestEntry | None:
        with self._lock:
            return self._entries.get((request_id, rank_id))

    def for_request(self, request_id: str) -> list[DestEntry]:
        with self._lock:
            return list(self._by_request.get(request_id, ()))

    def all(self) -> list[DestEntry]:
        with self._lock:
            return list(self._entries.values())

    def remove(self, entry: DestEntry) -> None:
        with self._lock:
            self._entries.pop((entry.request_id, entry.rank.id), None)
            lst = self._by_request.get(entry.request_id)
            if lst is not None:
                # by identity: ``in``/``remove`` would compare entries field by field, page tables included
                for i, other in enumerate(lst):
                    if other is entry:
                        del lst[i]
                        break
                if not lst:
                    del self._by_request[entry.request_id]

    def __len__(self) -> int:
        return len(self._entries)  # one atomic read of a dict's size: no lock needed

    def begin(self, header: dict[str, Any], dest_rank: str, transport: str = "") -> Sink:
        """Validate a chunk header and reserve its token range; raise RequestError if bad, and
        IntegrityError (having failed the request) if the header differs from what its source sent.

        Every check runs under the lock that also guards the reservation, so two data
        threads cannot both admit overlapping ranges of one writer.
        """
        TRACE.mark(header["request_id"], "chunk_in")
        if self._check is not None:
            header = self._check.tamper(header)  # fault injection for tests; else the header as it came
        sample = _sample_of(header)
        src = group_key(tuple(header["src"]), header.get("group") or "", header.get("part") or 0)
        start, end = header["start"], header["end"]
        with self._lock:
            entry, writer = self._writer_of(header, dest_rank, src)
            # the sender proved its link (the token, where the request has one): now the header's own
            # digest, before any of its fields (token range, last, aux) is acted on
            forged = self._check.header(entry, writer, header, transport) if self._check is not None else None
            if forged is None:
                expected, dst_slots, first = self._admit(entry, writer, src, header)
        if forged is not None:
            if self._on_refused is not None:
                self._on_refused(entry, IntegrityError.code, forged)
            raise IntegrityError(forged, field="header_digest")
        if first:  # the core hears of it and moves the destination to transferring
            self._on_change(entry)
        return Sink(entry, writer, start, end, header["last"], expected, dst_slots,
                    head_offset_bytes(writer, "dst"), header.get("aux"), header.get("digests"),
                    sample, bool(header.get("trailer")), hash=header.get("hash", XXH3))

    def _admit(self, entry: DestEntry, writer: Writer, src: tuple, header: dict[str, Any]
               ) -> tuple[int, np.ndarray, bool]:
        """A chunk's range checked and reserved (lock held): its bytes, its destination slots, and
        whether it is the entry's first."""
        start, end = header["start"], header["end"]
        part = entry.rank.geometry.group(writer.group)
        pages = entry.groups[writer.group] if writer.group else entry.pages
        per_request = bool(writer.group) and entry.rank.geometry.spec.group(writer.group).per_request
        self._check_range(entry, writer, src, header, int(pages.size) * part.spec.page_size, per_request)
        spec = part.spec
        check_whole_pages(spec, start, end, header["last"])
        expected = chunk_bytes(writer, len(spec.region_kinds), slot_count(spec, start, end))
        if header["nbytes"] != expected:
            raise RequestError(f"chunk carries {header['nbytes']} bytes, geometry says {expected}",
                               field="nbytes", fix="check both sides use the same geometry")
        dst_slots = unit_slots(spec, pages, start, end, 0, part.slot_pitch)
        entry.pending[src].append((start, end))
        entry.inflight += 1
        if header["last"]:
            entry.last_end[src] = end
        first, entry.admitted = not entry.admitted, True
        return expected, dst_slots, first

    def same_header(self, sink: Sink, header: dict[str, Any], admitted: int, transport: str) -> None:
        """A further header of a chunk already admitted (a NIXL block's, from the chunk's sender):
        raise IntegrityError, having failed the request, where a field its digest covers differs from
        the admitted header's (digest ``admitted``); an unchanged header passes, whatever its own
        ``header_digest`` says."""
        if self._check is None:
            return
        forged = self._check.header(sink.entry, sink.writer, {**header, "header_digest": admitted}, transport)
        if forged is None:
            return
        if self._on_refused is not None:
            self._on_refused(sink.entry, IntegrityError.code, forged)
        raise IntegrityError(forged, field="header_digest")

    def running_digests(self, sink: Sink) -> Any:
        """Where a transport that lands a chunk's bytes in place, in wire order, feeds them as they
        land: a chunk whose digests trail its payload is then checked without a pass of its own
        over its pages. None: nothing to feed (the check, if any, hashes the landed pages)."""
        if not sink.trailer or self._check is None or sink.sample is None or not sink.sample.full:
            return None  # a sample's slots are not the wire order's every byte: hashed where they landed
        if sink.hash != XXH3:
            return None  # the device digest is taken over the landed pages, where they lie
        return self._check.running(sink)

    def flip_due(self, sink: Sink) -> bool:
        """Fault injection (``integrity.corrupt_landed_every``): a transport that hashes a chunk's
        landed bytes itself flips the first one it hashes before it does."""
        return self._check is not None and self._check.flip_due(sink)

    def _writer_of(self, header: dict[str, Any], dest_rank: str, src: tuple) -> tuple[DestEntry, Writer]:
        """The open entry a chunk is for and the plan's writer it claims to be (lock held)."""
        entry = self._entries.get((header["request_id"], dest_rank))
        if entry is None or entry.closed:
            raise RequestError(f"request {header['request_id']!r} is not expected at rank {dest_rank}",
                               field="request_id", code="not_expected",
                               fix="send only requests the decode side expects")
        if entry.plan is None:
            raise RequestError("destination is not bound to a plan yet", field="request_id",
                               fix="wait for the expect message before sending")
        token = entry.writer_tokens.get(src, entry.data_token)
        if token is not None and header.get("token") != token:
            raise RequestError("data header does not carry the token of the peer link this request "
                               "expects bytes from", field="token",
                               fix="send data only for requests handshaken over this peer link")
        writer = entry.writers.get(src)
        if writer is None:
            raise RequestError(f"rank {list(src)} is not a writer of {dest_rank}; the plan names "
                               f"{[list(s) for s in entry.writers]}", field="src",
                               fix="send from the prefill ranks the plan assigns")
        return entry, writer

    @staticmethod
    def _check_range(entry: DestEntry, writer: Writer, src: tuple, header: dict[str, Any], capacity: int,
                     per_request: bool) -> None:
        """A chunk's token range fits the pages, the expect's start, the request and what came before."""
        start, end, last = header["start"], header["end"], header["last"]
        origin = entry.origins.get(src, entry.start)
        if not 0 <= start <= end or end > capacity:
            raise RequestError(f"token range [{start}, {end}) exceeds the {capacity} tokens of "
                               f"the destination pages", field="end",
                               fix="send only tokens the decode side allocated pages for")
        if start < origin:
            raise RequestError(f"chunk [{start}, {end}) starts before token {origin}, the first "
                               "token the decode side expects"
                               + (f" of group {writer.group!r}" if writer.group else ""),
                               field="start", fix="send only tokens at or after the expect's start")
        rows = entry.rank.geometry.group(writer.group).spec.page_size
        if per_request and (start, end, last) != (0, rows, True):
            raise RequestError(f"state group {writer.group!r} moves its {rows} rows once, as "
                               f"[0, {rows}) with last; got [{start}, {end})", field="end",
                               fix="send a state group's slot whole with the last chunk")
        if not per_request and entry.num_tokens is not None and end > entry.num_tokens:
            raise RequestError(f"token range ends at {end}, request has {entry.num_tokens} tokens",
                               field="end", fix="send only the request's tokens")
        final = entry.last_end.get(src)
        if final is not None and end > final:
            raise RequestError(f"chunk [{start}, {end}) after the last chunk ending at {final}",
                               field="end", fix="send the last chunk last")
        if _overlaps(entry.received[src], start, end) or _overlaps(entry.pending[src], start, end):
            raise RequestError(f"token range [{start}, {end}) from {list(src)} was already received",
                               field="start", fix="send each token range once")
        if last and not per_request and entry.num_tokens is not None and end != entry.num_tokens:
            raise RequestError(f"last chunk ends at {end}, request has {entry.num_tokens} tokens",
                               field="end", fix="end the last chunk at the request's length")

    def finish(self, sink: Sink, ok: bool, transport: str = "") -> IntegrityError | None:
        """A chunk ``begin`` admitted has landed (``ok``) or failed. A landed chunk counts only once
        its bytes match its source's digests, where the inbox has a check; one that does not fails
        its request with code ``integrity`` and is returned, for the transport to tell its sender."""
        entry = sink.entry
        TRACE.mark(entry.request_id, "landed")
        failed = None
        if ok and self._check is not None:
            why = self._check(sink, transport)
            if why is not None:
                ok, failed = False, IntegrityError(why, field="digests")
                if self._on_refused is not None:
                    self._on_refused(entry, failed.code, why)
        src = sink.writer.key
        with self._lock:
            entry.inflight -= 1
            entry.pending[src].remove((sink.start, sink.end))
            if ok:
                entry.received[src].append((sink.start, sink.end))
                entry.bytes_received += sink.nbytes
                if sink.aux:
                    entry.aux = sink.aux
            elif sink.last:
                entry.last_end.pop(src, None)
        self._on_change(entry)
        return failed


def _sample_of(header: dict[str, Any]) -> Sample | None:
    """Which granules a data header's digests (in it, or trailing the payload) cover: what its
    ``sample`` (and ``picks``, the chunk's chosen granules) says, every one without it."""
    if "picks" in header and "sample" not in header:
        raise ProtocolError("a data header carries picks without a sample", field="picks",
                            fix="send picks only beside the sample they choose granules for")
    if header.get("trailer"):
        if "digests" in header:
            raise ProtocolError("a data header with trailer also carries digests: trailing digests come after "
                                "the payload", field="trailer",
                                fix="send either digests in the header, or trailer (and the digests after the payload)")
    elif header.get("digests") is None:
        return None
    if "sample" not in header:
        return FULL
    sample = Sample.from_wire(header["sample"])
    if "picks" in header:
        sample = Sample(sample.period, sample.offset, {header.get("group") or "": Picks.from_wire(header["picks"])})
    return sample

"""A chunk job: one chunk of one request from one prefill rank (a writer) to one decode rank, as
the core starts it (:class:`~.effects.StartJob`) and a transport moves it
(:class:`~kvxferd.transport.base.Transport`); and what the transport reports back."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterator

import numpy as np

from ..datapath.digest import XXH3, header_digest, region_digests
from ..datapath.regions import MappedRegion
from ..model.plan import Writer
from ..model.qos import Qos
from ..model.sampling import Sample, chosen, granules_of
from ..model.segments import chunk_bytes, head_offset_bytes, slot_count
from .registry import Rank


@dataclass
class ChunkJob:
    request_id: str
    decode_instance: str
    dst: tuple[int, int]
    rank: Rank  # the source (prefill) rank
    writer: Writer
    start: int
    end: int
    last: bool
    aux: bytes | None
    src_slots: np.ndarray
    mode: str  # "direct" or "staged"
    data_address: tuple[str, int] | None  # None: destination is on this daemon
    token: bytes | None = None  # proves the data connection belongs to an authenticated link
    dst_pages: np.ndarray | None = None  # nixl: the destination's page table (one-sided writes need it)
    remote: Any = None  # nixl: the destination daemon's agent (transport.nixl.NixlPeer)
    group: str = ""  # a cache group's chunk: its regions, slots and writer are the group's
    #: the header carries the digests of the bytes of these granules (integrity: either side asked;
    #: None: no digests), each granule ``granule`` tokens (0: the chunk is one state slot)
    digests: Sample | None = None
    granule: int = 0
    source: int = 0  # the sending entry's serial (:attr:`~.outbox.SrcEntry.serial`): what a stop names
    #: the pair asked ``mode`` outright (``peer.mode``), not ``auto``: a transport honours it for host
    #: memory (:func:`kvxferd.transport.chunk_modes.pick`)
    pinned: bool = False
    #: its request's class, instance, weight and deadline: where the data plane's scheduler puts it
    qos: Qos = Qos()

    # derived once per job (a job's fields are never reassigned): transports ask for them
    # several times per chunk, and for a small chunk deriving them cost more than moving it

    @cached_property
    def kinds(self) -> tuple[str, ...]:
        """Region kinds in wire order, as registered (a cache group's are ``<group>.<kind>``)."""
        return self.rank.geometry.kinds_of(self.group)

    @cached_property
    def nbytes(self) -> int:
        spec = self.rank.geometry.spec.group_spec(self.group)
        return chunk_bytes(self.writer, len(self.kinds), slot_count(spec, self.start, self.end))

    @cached_property
    def slot_tokens(self) -> int:
        """Tokens one of ``src_slots`` holds (1: token rows; a page: packed)."""
        return self.rank.geometry.spec.group_spec(self.group).slot_tokens

    @cached_property
    def head_offset(self) -> int:
        return head_offset_bytes(self.writer, "src")

    @cached_property
    def _regions(self) -> tuple[MappedRegion, ...]:
        region = self.rank.region
        return tuple(region(layer, kind) for layer in range(*self.writer.layers) for kind in self.kinds)

    def regions(self) -> Iterator[MappedRegion]:
        """Source regions in wire order: layers ascending, then kinds."""
        return iter(self._regions)

    @cached_property
    def hash(self) -> str:
        """The digest its bytes are checked with: the device's where any source region asks for it
        (pages on a GPU, summed where they lie), else XXH3."""
        return next((r.digest for r in self._regions if r.digest != XXH3), XXH3)

    @property
    def can_trail(self) -> bool:
        """Its digests cover every slot of host pages, so a socket sender may hash the bytes with
        XXH3 as they leave, in wire order, and send the digests after them
        (``header(trailer=True)``); a sample's, and the device digest's, are taken before."""
        return self.digests is not None and self.digests.full and self.hash == XXH3

    def header(self, trailer: bool = False) -> dict[str, Any]:
        """The data header; ``trailer``: the digests come after the payload (a job with digests:
        over tcp, one that :attr:`can_trail`; a local copy, any). A job with digests also sends
        the header's own (``header_digest``), taken last, over the fields as they leave."""
        head: dict[str, Any] = {
            "op": "data", "request_id": self.request_id, "decode_instance": self.decode_instance,
            "dst": list(self.dst), "src": list(self.writer.src), "start": self.start,
            "end": self.end, "last": self.last, "nbytes": self.nbytes}
        if self.aux:
            head["aux"] = self.aux
        if self.token:
            head["token"] = self.token
        if self.group:
            head["group"] = self.group
        if self.writer.part:
            head["part"] = self.writer.part
        if trailer:
            assert self.digests is not None, "only a job that carries digests has them trail its payload"
            head["trailer"] = True
        elif self.digests is not None:
            head["digests"] = self.region_digests
        if self.digests is not None:
            if self.hash != XXH3:
                head["hash"] = self.hash
            sample = self.sample
            if not sample.full:
                head["sample"] = [sample.period, sample.offset]
                if sample.picks:
                    head["picks"] = sample.picks[self.group].to_wire()
            # the fields the decode side acts on are checked too, not only the pages: a changed aux,
            # token range or last fails the chunk ``integrity`` instead of passing or stalling it
            head["header_digest"] = header_digest(head)
        return head

    @cached_property
    def sample(self) -> Sample:
        """The granules of this chunk its digests cover (picks: this chunk's own only)."""
        assert self.digests is not None, "a sample is read only for a job that carries digests"
        if self.granule == 0:
            return self.digests
        return self.digests.for_chunk(self.group, *granules_of(self.start, self.end, self.granule))

    @cached_property
    def region_digests(self) -> list[int]:
        """The chunk's bytes in each source region as they are now (read once: a job's header may
        be built more than once, and the pages do not change while the request moves)."""
        w = self.writer
        slots = chosen(self.src_slots, self.slot_tokens, self.start, self.granule, self.sample, self.group)
        return region_digests([r.flat for r in self._regions], slots, w.src_row_bytes, self.head_offset,
                              w.slice_bytes, self.hash)


@dataclass
class Moved:
    """What a transport reports back for metrics."""

    nbytes: int
    fragments: int
    mode: str
    #: why the chunk took ``mode`` (:data:`kvxferd.transport.chunk_modes.WHYS`)
    why: str = "plan"

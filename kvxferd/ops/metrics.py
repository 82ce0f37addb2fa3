"""Prometheus metrics of one daemon.

Each daemon owns its own :class:`CollectorRegistry` (tests run several daemons, and the
process-global default registry would mix them). Labels are bounded: outcome, mode,
transport, reason code, field, endpoint, peer state, phase; never request ids.
"""

from __future__ import annotations

import re
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0)
FRAGMENT_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
PARTS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
SIZE_BUCKETS = tuple(float(4 ** k) * 1024 for k in range(1, 13))

#: a failure code used as a label: a peer chooses the codes it sends, so only code-like tokens are
#: kept, and only so many distinct ones; anything else counts as "other"
_CODE_LABEL = re.compile(r"^[a-z][a-z0-9_]{0,47}$")
MAX_CODE_LABELS = 64


class _BoundChildren:
    """``labels(...)`` answered from a plain dict once a label tuple has been seen.

    prometheus_client checks the label count, converts every value with ``str`` and takes a
    lock on each call; the daemon asks for the same few children on every chunk. A child
    found here is the very object prometheus_client made for that tuple, so names, labels
    and values are exactly as without the cache. Only tuples of plain ``str`` are kept (what
    ``str`` would return unchanged), and a ``remove`` or ``clear`` forgets them all.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bound: dict[tuple[Any, ...], Any] = {}

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> Any:
        if not labelkwargs:
            child = self._bound.get(labelvalues)
            if child is not None:
                return child
        child = super().labels(*labelvalues, **labelkwargs)  # type: ignore[misc]
        if not labelkwargs and all(type(v) is str for v in labelvalues):
            self._bound[labelvalues] = child
        return child

    def remove(self, *labelvalues: Any) -> None:
        super().remove(*labelvalues)  # type: ignore[misc]
        self._bound.clear()

    def clear(self) -> None:
        super().clear()  # type: ignore[misc]
        self._bound.clear()


class Counter(_BoundChildren, prometheus_client.Counter):
    pass


class Gauge(_BoundChildren, prometheus_client.Gauge):
    pass


class Histogram(_BoundChildren, prometheus_client.Histogram):
    pass


class Metrics:
    """All metric objects of one daemon, created on one private registry.

    ``__init__`` is the catalogue of every metric the daemon exports, one declaration after
    another: longer than a function should be, kept whole so an operator reads it in one place.
    """

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.transfers = Counter(
            "kvxferd_transfers", "Requests finished on this daemon, by side, outcome, mode and transport.",
            ["side", "outcome", "mode", "transport"], registry=r)
        self.failures = Counter(
            "kvxferd_transfer_failures", "Failed requests by bounded reason code and side.",
            ["side", "reason"], registry=r)
        self.peer_ends = Counter(
            "kvxferd_peer_ends", "Requests failed here because the other side of the request ended it, by side "
            "(prefill: a decode side's refusal at the handshake, abort, timeout, dead rank or daemon; decode: a "
            "source's) and the code the other side gave.", ["side", "code"], registry=r)
        self._code_labels: set[str] = set()
        self.bytes_sent = Counter(
            "kvxferd_sent_bytes", "KV bytes sent to destinations, by transport and mode.",
            ["transport", "mode"], registry=r)
        self.bytes_received = Counter(
            "kvxferd_received_bytes", "KV bytes written into local destination pages, by transport.",
            ["transport"], registry=r)
        self.group_bytes = Counter(
            "kvxferd_group_sent_bytes", "Bytes sent to destination ranks by cache group kind (full, window, "
            "draft, state); counted for instances that have cache groups.", ["group"], registry=r)
        self.chunks = Counter(
            "kvxferd_chunks", "Chunks moved (one writer to one destination), by transport, the mode each took "
            "and why (plan, short_runs, device_memory, no_landing_ring, private_destination).",
            ["transport", "mode", "why"], registry=r)
        self.latency = Histogram(
            "kvxferd_request_duration_seconds", "Decode-side request latency, expect to done.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.phase_latency = Histogram(
            "kvxferd_phase_duration_seconds",
            "Time spent per phase: bootstrap (handshake/matching), queue (chunk ready to start), "
            "transfer (decode side: a request's first byte in to its last), chunk (source side: one chunk "
            "moved to one destination, start to acknowledged).", ["phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.chunk_bytes = Histogram(
            "kvxferd_chunk_size_bytes", "Bytes per moved chunk.", buckets=SIZE_BUCKETS, registry=r)
        self.fragments = Histogram(
            "kvxferd_chunk_fragments", "Contiguous fragments per moved chunk (all layers and kinds).",
            buckets=FRAGMENT_BUCKETS, registry=r)
        self.inflight = Gauge(
            "kvxferd_inflight_requests", "Requests not yet terminal, by side and state.",
            ["side", "state"], registry=r)
        self.ranks = Gauge(
            "kvxferd_registered_ranks", "Engine ranks registered with this daemon, by role.",
            ["role"], registry=r)
        self.peers = Gauge(
            "kvxferd_peers", "Peer daemons known to this daemon, by state.", ["state"], registry=r)
        self.handshakes = Counter(
            "kvxferd_handshakes", "Handshakes with peer daemons, by result.", ["result"], registry=r)
        self.transport_fallbacks = Counter(
            "kvxferd_transport_fallbacks", "Instance pairs that run on another transport than this daemon's "
            "first preference, by side, transports and reason code.",
            ["side", "preferred", "chosen", "reason"], registry=r)
        self.refusals = Counter(
            "kvxferd_compat_refusals", "Incompatible instance pairs refused, by geometry field.",
            ["field"], registry=r)
        self.heartbeat_misses = Counter(
            "kvxferd_heartbeat_misses", "Peers declared unresponsive after missing heartbeats.",
            registry=r)
        self.integrity_checked = Counter(
            "kvxferd_integrity_checked_chunks", "Chunks whose landed bytes this daemon checked against their "
            "source's digests (integrity), by transport and digest (xxh3; wsum: the device's word sums).",
            ["transport", "digest"], registry=r)
        self.integrity_failures = Counter(
            "kvxferd_integrity_failures", "Chunks whose landed bytes differ from their source's digests, or "
            "that came without the digests this daemon asked for; each fails its request with code "
            "integrity. By source daemon (\"local\": this one) and transport.", ["peer", "transport"], registry=r)
        self.invalid_messages = Counter(
            "kvxferd_invalid_messages", "Messages rejected by validation, by endpoint.",
            ["endpoint"], registry=r)
        self.engine_refusals = Counter(
            "kvxferd_engine_refusals", "Engine calls refused because the engine named memory or a rank it cannot "
            "show to be its own (checked against its connection's peer credentials), by call and reason.",
            ["call", "reason"], registry=r)
        self.connections_refused = Counter(
            "kvxferd_connections_refused", "Connections refused or closed unserved, by endpoint (data: the tcp data "
            "port; http: the metrics port) and reason (data: no_hello, unknown_link, bad_proof, proof_deadline, "
            "frame_deadline, unproven_cap, too_many_connections, per_host_cap; http: max_connections, timeout).",
            ["endpoint", "reason"], registry=r)
        self.accept_errors = Counter(
            "kvxferd_accept_errors", "Errors of an accept loop (it pauses briefly and goes on), by endpoint.",
            ["endpoint"], registry=r)
        self.peer_send_dropped = Counter(
            "kvxferd_peer_send_dropped", "Messages to a source daemon dropped because its link held "
            "decode_links.MAX_BACKLOG messages it would not take (past SNDHWM): a peer that reads nothing; "
            "its silence then ends the link.", registry=r)
        self.oversized_messages = Counter(
            "kvxferd_oversized_messages", "ZeroMQ multipart messages dropped unread past their bound (reason bytes: "
            "limits.max_batch_bytes; parts: twice the endpoint's parts limit), their sender dropped for "
            "limits.drop_sender_s; by endpoint (engine, peer; source: a source daemon's message to this decode "
            "daemon, whose rest is dropped) and reason.", ["endpoint", "reason"], registry=r)
        self.dropped_sender_messages = Counter(
            "kvxferd_dropped_sender_messages", "Messages dropped unread because their sender (a ZeroMQ routing id) "
            "was dropped for an oversized message, by endpoint.", ["endpoint"], registry=r)
        self.directory_values = Counter(
            "kvxferd_directory_values", "Directory values (etcd keys, embedded announces) this daemon parsed, by "
            "source (etcd, announce) and outcome (ok, refused); an unchanged etcd value is parsed once.",
            ["source", "outcome"], registry=r)
        self.peer_claims_refused = Counter(
            "kvxferd_peer_claims_refused", "Peer messages refused for what they claim, by op (handshake, expect, "
            "announce, withdraw) and reason (key: outside auth.key_claims of the sender's key; unconfirmed: the "
            "claimed daemon address did not confirm the handshake; instance_held: another live decode daemon "
            "holds the instance's ranks; not_owner: ranks announced over another live link; quota: the peer's "
            "share of limits.max_inflight_requests or limits.max_peer_pairs).", ["op", "reason"], registry=r)
        self.peer_parts = Histogram(
            "kvxferd_peer_message_parts", "Peer control messages per ZeroMQ multipart message between daemons "
            "(sent: leaving this daemon; received: read by it); above 1, messages of one loop turn left together.",
            ["direction"], buckets=PARTS_BUCKETS, registry=r)
        self.qos_queue_seconds = Histogram(
            "kvxferd_transfer_queue_seconds", "Time a chunk job waited for a data thread, by transfer class "
            "(latency, bulk; qos.instances).", ["class"], buckets=LATENCY_BUCKETS, registry=r)
        self.qos_bytes = Counter(
            "kvxferd_transfer_class_bytes", "Bytes of chunk jobs the data threads ran, by transfer class.",
            ["class"], registry=r)
        self.qos_deadline_failures = Counter(
            "kvxferd_deadline_failures", "Chunk jobs failed with code deadline by the data plane, by class and "
            "when: admission (it could not land in time given what was queued ahead), queue (its deadline "
            "passed before its turn).", ["class", "when"], registry=r)
        self.handoff_jobs = Histogram(
            "kvxferd_data_handoff_chunks", "Chunk jobs a data thread took in one hand-off (small chunks for one "
            "peer go together: over tcp, back to back on one connection with one round trip).",
            buckets=PARTS_BUCKETS, registry=r)
        self.staging_slots = Gauge(
            "kvxferd_staging_slots_in_use", "Staging (bounce) slots currently held.", registry=r)
        self.staging_bytes = Gauge(
            "kvxferd_staging_bytes_in_use", "Bytes of staging (bounce) memory currently held.",
            registry=r)
        self.nixl_registered = Gauge(
            "kvxferd_nixl_registered_bytes", "Memory registered with this daemon's NIXL agent, by what it is "
            "(prefill_engine: engines' pages read by this daemon's own WRITEs, never described to a peer; "
            "decode_engine: engines' pages NIXL sources may write in place, 0 unless peer.nixl_engine_memory is "
            "exposed; landing: landing rings, each described only to its own link).", ["memory"], registry=r)
        self.nixl_refusals = Counter(
            "kvxferd_nixl_refusals", "NIXL notifications refused because they claim bytes this daemon never let "
            "their sender write (reason in_place_private: an in-place chunk or block while engines' memory is "
            "private; foreign_ring: a landing ring or slot that is not the sender's link's).", ["reason"],
            registry=r)
        self.fences = Counter(
            "kvxferd_fences", "Failed NIXL requests held back until the source confirmed that no WRITE of theirs "
            "was left in flight, by outcome (confirmed, or unconfirmed: timeout or source unresponsive).",
            ["outcome"], registry=r)
        self.staging_waits = Counter(
            "kvxferd_staging_waits", "Times a data thread had to wait for a free staging slot.", registry=r)
        self.auth_denied = Counter(
            "kvxferd_auth_denied", "Peer connections refused by the CURVE allow-list.", registry=r)
        self.peer_auth_failures = Counter(
            "kvxferd_peer_auth_failures", "Handshakes with a peer daemon that failed authentication (the peer "
            "refused this daemon's CURVE key, or its server key did not match auth.peer_keys).", registry=r)
        self.peer_restarts = Counter(
            "kvxferd_peer_restarts", "Peer daemons seen restarted (a new incarnation on the same address), by the "
            "side the peer serves (prefill: a source daemon; decode: a decode daemon).", ["side"], registry=r)
        self.directory_errors = Counter(
            "kvxferd_directory_errors", "Rounds with the etcd rank directory that failed (no endpoint answered, or "
            "etcd refused a call); directory.backend = etcd only.", registry=r)
        self.up = Gauge("kvxferd_up", "1 while the daemon serves.", registry=r)
        self.copy_path = Gauge(
            "kvxferd_copy_path", "1 for the path CPU page copies take: native (the C run copy built with the "
            "package) or torch (several times slower; the start-up log says why).", ["path"], registry=r)
        self.start_time = Gauge("kvxferd_start_time_seconds", "Unix time the daemon started.",
                                registry=r)

    def chunk_modes(self) -> dict[str, int]:
        """Chunks sent so far per ``transport/mode/why`` (``status``: how each chunk actually moved)."""
        return {f"{s.labels['transport']}/{s.labels['mode']}/{s.labels['why']}": int(s.value)
                for family in self.chunks.collect() for s in family.samples
                if s.name.endswith("_total") and s.value}

    def code_label(self, code: str) -> str:
        """``code`` as a bounded label value (see ``MAX_CODE_LABELS``)."""
        if code in self._code_labels:
            return code
        if not _CODE_LABEL.match(code) or len(self._code_labels) >= MAX_CODE_LABELS:
            return "other"
        self._code_labels.add(code)
        return code

    def peer_end(self, side: str, code: str) -> None:
        """A request failed on ``side`` because the other side of it ended it with ``code``."""
        self.peer_ends.labels(side, self.code_label(code)).inc()

"""Daemon configuration: embedded defaults, a TOML file, ``KVXFERD_*`` environment overrides.

Precedence: defaults < file < environment. Environment keys are
``KVXFERD_<SECTION>_<KEY>`` in upper case (``KVXFERD_PEER_CONTROL_PORT=6000``; lists are
comma-separated). Every value is type-checked on load and a bad one names its key;
unknown sections and keys in a file are errors, and ``KVXFERD_*`` variables that name no
key are reported by :func:`unknown_env` (``serve`` logs them). ``configs/kvxferd.toml``
documents every setting with its default.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError
from ..model import sampling
from ..model.qos import QosPolicy
from . import hops

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10 fallback
    import tomli as tomllib  # type: ignore[no-redef]

ENV_PREFIX = "KVXFERD_"


def default_runtime_dir() -> Path:
    """Where the engine socket lives when no path is configured.

    In order: ``$RUNTIME_DIRECTORY`` (set by systemd's ``RuntimeDirectory=``, and in the
    container image), ``$XDG_RUNTIME_DIR/kvxferd`` (per-user sessions, systemd user
    units), ``/run/kvxferd`` for root, else a per-user directory under ``/tmp``.
    """
    runtime = os.environ.get("RUNTIME_DIRECTORY", "")
    if runtime.strip(":"):
        # systemd joins several RuntimeDirectory= entries with ':'; the first is ours
        return Path(next(p for p in runtime.split(":") if p))
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "kvxferd"
    if os.geteuid() == 0:
        return Path("/run/kvxferd")
    return Path(f"/tmp/kvxferd-{os.getuid()}")


def default_socket_path() -> str:
    return str(default_runtime_dir() / "engine.sock")


SYSTEM_CONFIG = "/etc/kvxferd/kvxferd.toml"


def candidate_socket_paths() -> list[str]:
    """Where a running daemon's engine socket may be, most likely first (``kvxferd status``).

    The socket ``serve`` would bind with this environment (``KVXFERD_ENGINE_SOCKET_PATH``,
    ``$RUNTIME_DIRECTORY``, ``$XDG_RUNTIME_DIR``), then the one named by the system config
    file, then the runtime directories of a system service and of this user: a shell that
    asks a systemd-managed daemon has none of the service's environment.
    """
    env = os.environ
    out: list[str] = []
    try:
        out.append(load(None).socket_path)
    except ConfigError:
        pass
    if os.path.exists(SYSTEM_CONFIG):
        try:
            out.append(load(SYSTEM_CONFIG).socket_path)
        except ConfigError:
            pass
    out.append("/run/kvxferd/engine.sock")
    if env.get("XDG_RUNTIME_DIR"):
        out.append(str(Path(env["XDG_RUNTIME_DIR"]) / "kvxferd" / "engine.sock"))
    out.append(f"/tmp/kvxferd-{os.getuid()}/engine.sock")
    return list(dict.fromkeys(out))


@dataclass
class DaemonSection:
    instance_name: str = ""
    log_level: str = "info"
    log_format: str = "logfmt"  # or "json"
    data_threads: int = 2
    data_batch_chunks: int = 64
    hop_trace: int = 0  # requests whose per-hop times status lists (0: off); kvxferd bench sets it


@dataclass
class EngineSection:
    socket_path: str = ""  # empty: default_socket_path()
    socket_mode: str = "0660"
    socket_group: str = ""
    shm_dirs: list[str] = field(default_factory=lambda: ["/dev/shm"])
    #: named shared-memory files (by path, or a descriptor of one) as KV memory: they cannot be
    #: sealed, so an engine could shrink one under the daemon's mapping and kill it (SIGBUS); off,
    #: engines register sealed memfds. On: such engines are trusted not to shrink their files
    allow_named_files: bool = False


@dataclass
class PeerSection:
    bind_host: str = "127.0.0.1"
    advertise_host: str = ""
    control_port: int = 5557
    data_port: int = 5558
    heartbeat_interval_s: float = 1.0
    peer_timeout_s: float = 5.0
    #: a source daemon found silent is tried again after heartbeat_interval_s, doubling with each
    #: silent try up to this; meanwhile requests naming it fail at once (peer_unreachable)
    unreachable_backoff_max_s: float = 60.0
    data_connections: int = 2
    transport: str = "tcp"  # "tcp", or "nixl": offer NIXL first, fall back to tcp
    transports: list[str] = field(default_factory=list)  # preference order; empty: from `transport`
    mode: str = "auto"
    require_same_page_size: bool = False
    #: what NIXL sources may write on this daemon. "private": only the landing ring of their own
    #: link (this daemon scatters each block into the engine's pages after checking its header
    #: against the request; decode engines' memory is never registered with NIXL). "exposed": the
    #: decode engines' KV memory too, written in place (faster; trusts every NIXL source that
    #: handshook with every page of every engine here, outside CURVE): single-tenant nodes only
    nixl_engine_memory: str = "private"
    #: with auth off, a decode daemon's handshake names its control address: confirm it by a call
    #: back there (one ping per decode daemon link, cached) before accepting, so a peer that only
    #: claims another daemon's address is refused. false trusts the claim (test rigs only)
    confirm_claims: bool = True


#: transports between daemons that peer.transport(s) may name
TRANSPORTS = ("tcp", "nixl")
#: what peer.nixl_engine_memory may say
NIXL_ENGINE_MEMORY = ("private", "exposed")


#: a local copy moves page runs region to region in one index copy per (layer, kind); staging
#: would only add a copy, so peer.mode governs links between daemons and local plans are direct
LOCAL_MODE_NOTE = ("peer.mode = staged applies to links between daemons; "
                   "same-daemon (local) copies are always direct")


def mode_notes(peer: PeerSection) -> list[str]:
    """What an operator should know about where peer.mode applies (printed by --check-config, logged at start)."""
    return [LOCAL_MODE_NOTE] if peer.mode == "staged" else []


def transport_preference(peer: PeerSection) -> list[str]:
    """Transports this daemon offers and accepts, most preferred first."""
    if peer.transports:
        return list(peer.transports)
    return ["nixl", "tcp"] if peer.transport == "nixl" else ["tcp"]


@dataclass
class MetricsSection:
    bind: str = "127.0.0.1:9400"  # empty disables the HTTP server
    #: HTTP connections served at once (one thread each); more are closed at once, unanswered
    max_connections: int = 16
    #: an HTTP connection's whole request (headers and body) and answer, or it is closed
    timeout_s: float = 10.0


@dataclass
class LimitsSection:
    max_message_bytes: int = 16 * 1024 * 1024
    max_batch_calls: int = 1024  # calls one multipart message from an engine may carry
    #: peer control messages one multipart message between daemons carries, sent or read (1: none batched)
    max_peer_batch_parts: int = 256
    #: bytes one multipart message (engine batch or peer batch) may carry in all its parts; past it
    #: the rest is dropped unread and the sender is dropped for drop_sender_s (at least max_message_bytes)
    max_batch_bytes: int = 64 * 1024 * 1024
    #: seconds a sender whose message passed max_batch_bytes, or twice its parts limit, is ignored
    drop_sender_s: float = 30.0
    max_inflight_requests: int = 4096
    max_pending_chunks: int = 65536
    max_ranks: int = 256
    max_pages_per_request: int = 1 << 20
    staging_bytes: int = 64 * 1024 * 1024  # bound on staging memory (slots are allocated on first use)
    staging_slot_bytes: int = 4 * 1024 * 1024  # one staged block; a token's head slice must fit
    nixl_landing_slots: int = 4  # per source daemon: staged NIXL blocks in flight to this daemon (0: none)
    #: one staged NIXL block: landing slots and NIXL's own staging slots have this size. Larger
    #: than a tcp block because each block costs a WRITE, a notification and a slot hand-back
    nixl_block_bytes: int = 16 * 1024 * 1024
    nixl_landing_bytes: int = 256 * 1024 * 1024  # all landing rings together
    #: a sliced NIXL chunk reads its source or writes its destination in place where that side's
    #: runs average at least this many bytes; shorter runs are copied through a staging slot
    nixl_in_place_bytes: int = 256 * 1024
    recent_failures: int = 32
    #: proven tcp data connections this daemon serves at once (a quarter of them per peer host)
    max_data_connections: int = 64
    #: tcp data connections not proven yet (no hello with a link's token): a cap of their own, the
    #: oldest closed past it, so strangers never take a proven peer's slot
    max_unproven_connections: int = 16
    #: the slowest a tcp data frame may arrive: each frame gets timeouts.data_frame_s plus its size at this rate
    data_min_bytes_per_s: int = 1024 * 1024
    #: the share of max_inflight_requests (expects in flight) and of max_peer_pairs one decode daemon's
    #: link may hold: past it that peer is told busy, and the others keep the rest (0.5: half each at most)
    peer_share: float = 0.5
    #: instance pairs (handshakes, each a plan and a route) all decode daemons' links hold together
    max_peer_pairs: int = 1024


@dataclass
class TimeoutsSection:
    bootstrap_s: float = 30.0
    waiting_for_input_s: float = 60.0
    transfer_s: float = 60.0
    drain_grace_s: float = 30.0
    fence_s: float = 5.0  # a failed NIXL request waits this long for its source to confirm no WRITE is left
    handshake_retry_s: float = 0.5
    cut_reason_s: float = 2.0  # a source the decode daemon hung up on waits this long for its reason
    #: a new tcp data connection proves its link (challenge and hello) within this, or it is closed
    data_proof_s: float = 5.0
    #: a tcp data frame (header, payload, digests) arrives whole within this plus its size at
    #: limits.data_min_bytes_per_s from its first byte, or its connection is closed
    data_frame_s: float = 30.0


@dataclass
class AuthSection:
    enabled: bool = False
    secret_key_file: str = ""  # from `kvxferd keygen`
    allowed_keys: list[str] = field(default_factory=list)  # client public keys admitted to this daemon
    peer_keys: list[str] = field(default_factory=list)  # "host:port=KEY": server key of each peer daemon
    #: what each allowed key may speak for: "KEY=host:port[,host:port...];instance[,instance...]"
    #: (globs allowed). A handshake, expect, announce or withdrawal naming another daemon address
    #: or instance is refused. A key with no entry may speak for any (logged at start)
    key_claims: list[str] = field(default_factory=list)


@dataclass
class DirectorySection:
    backend: str = "embedded"  # or "etcd": every daemon keeps its ranks in etcd (see docs/ARCHITECTURE.md)
    etcd_endpoints: list[str] = field(default_factory=lambda: ["http://127.0.0.1:2379"])
    cluster: str = "default"  # key namespace: /kvxferd/<cluster>/ranks/...
    lease_ttl_s: float = 0.0  # 0: peer.peer_timeout_s rounded up (etcd leases are whole seconds, at least 2)
    etcd_timeout_s: float = 2.0  # one etcd call, per endpoint
    #: an etcd user (etcd with auth enabled): the daemon authenticates and sends its token with every call
    etcd_username: str = ""
    etcd_password_file: str = ""  # the user's password, the file's first line (set with etcd_username)
    etcd_ca_file: str = ""  # https:// endpoints: the CA that signed etcd's certificate (empty: the system's)
    etcd_cert_file: str = ""  # https:// endpoints: a client certificate, where etcd asks for one
    etcd_key_file: str = ""  # its private key (empty: in etcd_cert_file)


#: directory.backend values
DIRECTORY_BACKENDS = ("embedded", "etcd")


@dataclass
class IntegritySection:
    #: "full": every chunk carries digests of its bytes, which the destination checks over the
    #: bytes that landed before the request can be done; "sampled": the same over a share of
    #: each request's pages (sample_share), chosen page by page so that every page is checked on
    #: at least one of every 1 / share writes into it; "off": none asked for (a peer or an
    #: instance that asks still gets them: the stricter side wins)
    mode: str = "off"
    #: sampled: the share of each request's pages checked (0.05: one page in 20; every page
    #: is checked on at least one of every 20 writes into it)
    sample_share: float = 0.05
    #: fault injection for tests: flip one landed byte of every Nth chunk that carries a digest,
    #: before it is checked (0: never). Logged loudly at start; never set it in production.
    corrupt_landed_every: int = 0
    #: fault injection for tests: flip this field ("aux" or "last") of every data header that
    #: carries digests as it arrives, before the inbox reads it, as a bit changed in flight would
    #: ("": never). Logged loudly at start; never set it in production.
    corrupt_header: str = ""
    #: test setting: host pages are checked with the digest of pages on a GPU (word sums, taken
    #: with torch where the pages lie), so its whole path runs on a machine without one. Slower
    #: than XXH3 on a CPU; never set it in production.
    device_digest_on_cpu: bool = False


#: integrity.mode values
INTEGRITY_MODES = sampling.MODES
#: integrity.corrupt_header values: the data header fields the test-only fault injection flips
HEADER_FAULTS = ("", "aux", "last")


@dataclass
class QosSection:
    #: false: one queue in arrival order for every tenant (what the daemon did before QoS)
    enabled: bool = True
    #: the class of an instance qos.instances does not name ("latency" or "bulk")
    default_class: str = "bulk"
    #: "instance=class[:weight]" (instance may be a glob): an instance's class, the highest its
    #: requests may ask, and its weight inside the class (bytes shared in its ratio while backlogged)
    instances: list[str] = field(default_factory=list)
    #: the share of the data threads' time bulk keeps while latency work waits
    bulk_floor: float = 0.1
    #: data threads of their own for latency work, on top of daemon.data_threads (0: none): a
    #: latency chunk never waits behind a bulk chunk already running
    latency_threads: int = 1
    #: the nice value of the shared data threads where latency threads exist (0..19; 0: none): a
    #: latency copy then gets the core over bulk copies running beside it
    bulk_nice: int = 10
    #: the most bytes of a bulk chunk put on a shared link at once (NIXL: one WRITE; 0: the whole
    #: chunk): a latency chunk posted behind it waits for at most this much (plus the one block
    #: more in flight). tcp sends latency chunks on connections of their own and needs no cut
    bulk_block_bytes: int = 4 * 1024 * 1024


def lease_ttl(cfg: "Config") -> int:
    """The etcd lease of a daemon's ranks, in whole seconds (etcd's unit; it grants no less than 2)."""
    return max(2, math.ceil(cfg.directory.lease_ttl_s or cfg.peer.peer_timeout_s))


@dataclass
class Config:
    daemon: DaemonSection = field(default_factory=DaemonSection)
    engine: EngineSection = field(default_factory=EngineSection)
    peer: PeerSection = field(default_factory=PeerSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    timeouts: TimeoutsSection = field(default_factory=TimeoutsSection)
    auth: AuthSection = field(default_factory=AuthSection)
    directory: DirectorySection = field(default_factory=DirectorySection)
    integrity: IntegritySection = field(default_factory=IntegritySection)
    qos: QosSection = field(default_factory=QosSection)

    def __post_init__(self) -> None:
        # not settings, so not fields: where each setting that is not a default came from (the
        # file's path, or the variable's name), and those a ``KVXFERD_*`` variable set over the
        # file's own value (key -> (file value, file))
        self.sources: dict[str, str] = {}
        self.overridden: dict[str, tuple[Any, str]] = {}

    @property
    def socket_path(self) -> str:
        return self.engine.socket_path or default_socket_path()

    @property
    def advertise_host(self) -> str:
        if self.peer.advertise_host:
            return self.peer.advertise_host
        if self.peer.bind_host in ("0.0.0.0", "::", "*"):
            import socket
            return socket.gethostname()
        return self.peer.bind_host

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def value_of(self, key: str) -> Any:
        """A setting's value by its ``section.key`` name."""
        section, _, name = key.partition(".")
        return getattr(getattr(self, section), name)

    def source_of(self, key: str) -> str:
        """Where a setting's value came from (``section.key``): a file, a variable, or the default."""
        return self.sources.get(key, "default")


def _coerce(key: str, value: Any, default: Any) -> Any:
    kind = type(default)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value, 0)
            except ValueError:
                pass
    elif kind is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and math.isfinite(number):  # nan would never time out, nor compare
            return number
    elif kind is str:
        if isinstance(value, str):
            return value
    elif kind is list:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
    raise ConfigError(f"{key} must be a {kind.__name__}, got {value!r}", field=key,
                      fix=f"set {key} to a {kind.__name__} (default {default!r})")


def _apply(cfg: Config, data: Mapping[str, Any], origin: str) -> None:
    """Set the values ``data`` holds by section; ``origin`` is a file's path or ``environment``."""
    sections = SECTIONS
    for section_name, values in data.items():
        if section_name not in sections:
            raise ConfigError(f"unknown section [{section_name}] in {origin}", field=section_name,
                              fix=f"use one of {sections}")
        section = getattr(cfg, section_name)
        if not isinstance(values, Mapping):
            raise ConfigError(f"[{section_name}] in {origin} must be a table", field=section_name,
                              fix="write it as a TOML table")
        names = {f.name for f in dataclasses.fields(section)}
        for key, value in values.items():
            full = f"{section_name}.{key}"
            if key not in names:
                raise ConfigError(f"unknown key {full} in {origin}", field=full,
                                  fix=f"use one of {sorted(names)}")
            before = getattr(section, key)
            setattr(section, key, _coerce(full, value, before))
            source = env_name(full) if origin == "environment" else origin
            previous = cfg.sources.get(full)
            if origin == "environment" and previous is not None and getattr(section, key) != before:
                cfg.overridden[full] = (before, previous)
            cfg.sources[full] = source


def env_name(key: str) -> str:
    """The variable that overrides a setting: ``engine.socket_path`` -> ``KVXFERD_ENGINE_SOCKET_PATH``."""
    return ENV_PREFIX + key.replace(".", "_").upper()


#: the config's sections, in file order (every field of Config is one)
SECTIONS = tuple(f.name for f in dataclasses.fields(Config))


#: ``KVXFERD_*`` variables read outside the config: the copy path's switch, and the SGLang
#: adapter's settings (a prefix); a daemon's environment may hold them, and they are not misspellings
READ_ELSEWHERE = ("KVXFERD_RUNCOPY", "KVXFERD_SGLANG_")


def _env_overrides(environ: Mapping[str, str], cfg: Config) -> tuple[dict[str, dict[str, str]], list[str]]:
    """``KVXFERD_<SECTION>_<KEY>`` variables by section, and the ``KVXFERD_*`` names that match no key."""
    out: dict[str, dict[str, str]] = {}
    unknown: list[str] = []
    sections = {name: {g.name for g in dataclasses.fields(getattr(cfg, name))} for name in SECTIONS}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name.startswith(READ_ELSEWHERE):
            continue
        rest = name[len(ENV_PREFIX):].lower()
        for section, keys in sections.items():
            if rest.startswith(section + "_") and rest[len(section) + 1:] in keys:
                out.setdefault(section, {})[rest[len(section) + 1:]] = value
                break
        else:
            unknown.append(name)
    return out, sorted(unknown)


def unknown_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """``KVXFERD_*`` environment variables that name no setting (and so change nothing).

    ``kvxferd serve`` logs a warning for each: a misspelt override such as
    ``KVXFERD_LOG_FORMAT`` (the setting is ``KVXFERD_DAEMON_LOG_FORMAT``) must not pass
    silently.
    """
    return _env_overrides(os.environ if environ is None else environ, Config())[1]


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{key} must be > 0, got {value}", field=key, fix=f"set {key} to a positive value")


def validate(cfg: Config) -> Config:
    """Refuse a bad setting at start, naming it, rather than failing on the first request."""
    _check_limits(cfg)
    _check_peer(cfg)
    _check_daemon(cfg)
    _check_engine(cfg)
    _check_metrics_and_auth(cfg)
    _check_directory(cfg)
    _check_integrity(cfg.integrity)
    _check_qos(cfg.qos)
    return cfg


def _check_qos(qos: QosSection) -> None:
    QosPolicy.parse(qos.default_class, qos.instances)  # raises naming the entry
    if not 0.0 < qos.bulk_floor < 1.0:
        raise ConfigError(f"qos.bulk_floor must lie strictly between 0 and 1, got {qos.bulk_floor}",
                          field="qos.bulk_floor", fix="set it to the share bulk keeps, e.g. 0.1")
    if not 0 <= qos.bulk_nice <= 19:
        raise ConfigError(f"qos.bulk_nice must lie in 0..19, got {qos.bulk_nice}", field="qos.bulk_nice",
                          fix="set it to a nice value, e.g. 10, or 0 for none")
    if qos.latency_threads < 0:
        raise ConfigError(f"qos.latency_threads must be 0 or more, got {qos.latency_threads}",
                          field="qos.latency_threads", fix="set it to 0 (none) or a small count, e.g. 1")
    if qos.bulk_block_bytes < 0:
        raise ConfigError(f"qos.bulk_block_bytes must be 0 or more, got {qos.bulk_block_bytes}",
                          field="qos.bulk_block_bytes", fix="set it to 0 (never cut) or a size, e.g. 4194304")


def _check_integrity(integrity: IntegritySection) -> None:
    if integrity.mode not in INTEGRITY_MODES:
        raise ConfigError(f"integrity.mode {integrity.mode!r} is not one of {', '.join(INTEGRITY_MODES)}",
                          field="integrity.mode", fix="use off, sampled or full")
    if not 0 < integrity.sample_share <= 1:
        raise ConfigError(f"integrity.sample_share must be in (0, 1], got {integrity.sample_share}",
                          field="integrity.sample_share", fix="use a share such as 0.05 (one page in 20)")
    if integrity.corrupt_landed_every < 0:
        raise ConfigError(f"integrity.corrupt_landed_every must be >= 0, got {integrity.corrupt_landed_every}",
                          field="integrity.corrupt_landed_every", fix="leave it 0 outside tests")
    if integrity.corrupt_header not in HEADER_FAULTS:
        raise ConfigError(f"integrity.corrupt_header {integrity.corrupt_header!r} is not one of "
                          f"{', '.join(repr(f) for f in HEADER_FAULTS)}", field="integrity.corrupt_header",
                          fix='leave it "" outside tests')


def _check_limits(cfg: Config) -> None:
    for section in ("timeouts", "limits"):
        for f in dataclasses.fields(getattr(cfg, section)):
            if f.name != "nixl_landing_slots":  # 0 turns staged NIXL off
                _positive(f"{section}.{f.name}", getattr(getattr(cfg, section), f.name))
    lim = cfg.limits
    if lim.max_batch_bytes < lim.max_message_bytes:
        raise ConfigError(f"limits.max_batch_bytes {lim.max_batch_bytes} is below limits.max_message_bytes "
                          f"{lim.max_message_bytes}: one message of the largest size would drop its sender",
                          field="limits.max_batch_bytes",
                          fix=f"raise limits.max_batch_bytes to at least {lim.max_message_bytes}")
    if lim.peer_share > 1:
        raise ConfigError(f"limits.peer_share must be in (0, 1], got {lim.peer_share}", field="limits.peer_share",
                          fix="use a share such as 0.5 (one decode daemon holds at most half)")
    if lim.nixl_landing_slots < 0:
        raise ConfigError(f"limits.nixl_landing_slots must be >= 0, got {lim.nixl_landing_slots}",
                          field="limits.nixl_landing_slots", fix="set 0 (no staged NIXL) or a slot count")
    ring = lim.nixl_landing_slots * lim.nixl_block_bytes
    if ring > lim.nixl_landing_bytes:
        raise ConfigError(f"one landing ring (limits.nixl_landing_slots {lim.nixl_landing_slots} x "
                          f"limits.nixl_block_bytes {lim.nixl_block_bytes} = {ring}) exceeds "
                          f"limits.nixl_landing_bytes {lim.nixl_landing_bytes}", field="limits.nixl_landing_bytes",
                          fix=f"raise limits.nixl_landing_bytes to at least {ring} (one ring per source daemon)")


def _check_peer(cfg: Config) -> None:
    peer = cfg.peer
    for key in ("control_port", "data_port"):
        port = getattr(peer, key)
        if not 0 <= port <= 65535:
            raise ConfigError(f"peer.{key} must be in [0, 65535], got {port}", field=f"peer.{key}",
                              fix="pick a free TCP port (0 lets the OS choose)")
    _positive("peer.heartbeat_interval_s", peer.heartbeat_interval_s)
    _positive("peer.peer_timeout_s", peer.peer_timeout_s)
    _positive("peer.data_connections", peer.data_connections)
    if peer.peer_timeout_s <= peer.heartbeat_interval_s:
        raise ConfigError(
            f"peer.peer_timeout_s ({peer.peer_timeout_s}) must exceed peer.heartbeat_interval_s "
            f"({peer.heartbeat_interval_s})", field="peer.peer_timeout_s",
            fix="allow at least two heartbeats before a peer is declared dead")
    if peer.transport not in TRANSPORTS:
        raise ConfigError(f"peer.transport {peer.transport!r} is not available", field="peer.transport",
                          fix="use 'tcp', or 'nixl' (NIXL first, tcp as the fallback)")
    if peer.transports:
        bad = [t for t in peer.transports if t not in TRANSPORTS]
        if bad or len(set(peer.transports)) != len(peer.transports):
            raise ConfigError(f"peer.transports {peer.transports!r} must list distinct entries of {TRANSPORTS}",
                              field="peer.transports", fix='e.g. ["nixl", "tcp"]: NIXL first, tcp as the fallback')
        if peer.transport != "tcp" and peer.transport not in peer.transports:
            raise ConfigError(f"peer.transport {peer.transport!r} is not in peer.transports "
                              f"{peer.transports!r}", field="peer.transports",
                              fix="set one of them, or list peer.transport in peer.transports")
    if peer.mode not in ("auto", "direct", "staged"):
        raise ConfigError(f"peer.mode {peer.mode!r} is not one of auto, direct, staged",
                          field="peer.mode", fix="use auto, direct or staged")
    if peer.nixl_engine_memory not in NIXL_ENGINE_MEMORY:
        raise ConfigError(f"peer.nixl_engine_memory {peer.nixl_engine_memory!r} is not one of "
                          f"{', '.join(NIXL_ENGINE_MEMORY)}", field="peer.nixl_engine_memory",
                          fix="use private (NIXL sources write only their link's landing ring) or exposed "
                              "(in-place WRITEs into engines' pages: single-tenant nodes)")
    if not peer.bind_host:
        raise ConfigError("peer.bind_host is empty", field="peer.bind_host",
                          fix="set an address to listen on, e.g. 127.0.0.1 or 0.0.0.0")


def _check_daemon(cfg: Config) -> None:
    _positive("daemon.data_threads", cfg.daemon.data_threads)
    _positive("daemon.data_batch_chunks", cfg.daemon.data_batch_chunks)
    if not 0 <= cfg.daemon.hop_trace <= hops.MAX_KEEP:
        raise ConfigError(f"daemon.hop_trace {cfg.daemon.hop_trace} is outside 0..{hops.MAX_KEEP}",
                          field="daemon.hop_trace",
                          fix="use 0 (off) or the number of recent requests whose hop times status lists")
    if cfg.daemon.log_format not in ("logfmt", "json"):
        raise ConfigError(f"daemon.log_format {cfg.daemon.log_format!r} is not logfmt or json",
                          field="daemon.log_format", fix="use logfmt or json")
    if cfg.daemon.log_level.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"daemon.log_level {cfg.daemon.log_level!r} is not a level",
                          field="daemon.log_level", fix="use debug, info, warning or error")


def _check_engine(cfg: Config) -> None:
    try:
        mode = int(cfg.engine.socket_mode, 8)
    except ValueError:
        raise ConfigError(f"engine.socket_mode {cfg.engine.socket_mode!r} is not octal",
                          field="engine.socket_mode", fix="write it like \"0660\"") from None
    if mode & 0o007:
        raise ConfigError(f"engine.socket_mode {cfg.engine.socket_mode} lets every local user in",
                          field="engine.socket_mode", fix="use owner/group-only modes such as 0600 or 0660")
    if not cfg.engine.shm_dirs:
        raise ConfigError("engine.shm_dirs is empty: no shared-memory region could be mapped",
                          field="engine.shm_dirs", fix='list at least one directory, e.g. ["/dev/shm"]')
    if cfg.engine.socket_group:
        import grp
        try:
            grp.getgrnam(cfg.engine.socket_group)
        except KeyError:
            raise ConfigError(f"engine.socket_group {cfg.engine.socket_group!r} is not a group on this host",
                              field="engine.socket_group",
                              fix="create the group, or leave socket_group empty to keep the daemon's group") from None


def _check_metrics_and_auth(cfg: Config) -> None:
    _positive("metrics.max_connections", cfg.metrics.max_connections)
    _positive("metrics.timeout_s", cfg.metrics.timeout_s)
    if cfg.metrics.bind:
        _host, sep, port = cfg.metrics.bind.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ConfigError(f"metrics.bind {cfg.metrics.bind!r} is not host:port", field="metrics.bind",
                              fix="write it like 127.0.0.1:9400 ([::1]:9400 for IPv6), or empty to disable")
    if cfg.auth.enabled:
        from ..wire import auth
        if not cfg.auth.secret_key_file:
            raise ConfigError("auth.enabled needs auth.secret_key_file", field="auth.secret_key_file",
                              fix="generate a key pair with `kvxferd keygen` and point secret_key_file at it")
        for key in cfg.auth.allowed_keys:
            auth.check_key("auth.allowed_keys", key)
        auth.parse_peer_keys(cfg.auth.peer_keys)
        auth.parse_key_claims(cfg.auth.key_claims, cfg.auth.allowed_keys)


def _check_directory(cfg: Config) -> None:
    d = cfg.directory
    if d.backend not in DIRECTORY_BACKENDS:
        raise ConfigError(f"directory.backend {d.backend!r} is not one of {', '.join(DIRECTORY_BACKENDS)}",
                          field="directory.backend", fix='use "embedded" (the default) or "etcd"')
    if not d.cluster or not all(c.isalnum() or c in "-_." for c in d.cluster):
        raise ConfigError(f"directory.cluster {d.cluster!r} is not a name of letters, digits, '-', '_', '.'",
                          field="directory.cluster", fix='name the fleet, e.g. "default" or "prod-a"')
    _positive("directory.etcd_timeout_s", d.etcd_timeout_s)
    if d.lease_ttl_s < 0:
        raise ConfigError(f"directory.lease_ttl_s must be >= 0, got {d.lease_ttl_s}", field="directory.lease_ttl_s",
                          fix="set 0 (peer.peer_timeout_s) or a lease in seconds")
    if d.lease_ttl_s and d.lease_ttl_s <= cfg.peer.heartbeat_interval_s:
        raise ConfigError(f"directory.lease_ttl_s ({d.lease_ttl_s}) must exceed peer.heartbeat_interval_s "
                          f"({cfg.peer.heartbeat_interval_s}): the lease is renewed every heartbeat",
                          field="directory.lease_ttl_s", fix="allow at least two heartbeats per lease, or set 0")
    if d.backend == "etcd":
        if not d.etcd_endpoints:
            raise ConfigError("directory.etcd_endpoints is empty but directory.backend is etcd",
                              field="directory.etcd_endpoints", fix='list them, e.g. ["http://127.0.0.1:2379"]')
        from ..directory.etcd_client import parse_endpoint
        for url in d.etcd_endpoints:
            try:
                parse_endpoint(url)
            except ValueError as exc:
                raise ConfigError(f"directory.etcd_endpoints entry {exc}", field="directory.etcd_endpoints",
                                  fix='write each as http://host:port, e.g. "http://127.0.0.1:2379"') from None
    _check_etcd_access(d)


def _check_etcd_access(d: DirectorySection) -> None:
    """etcd user and TLS files: given together, readable, and TLS files only for https:// endpoints."""
    if bool(d.etcd_username) != bool(d.etcd_password_file):
        given, missing = (("etcd_username", "etcd_password_file") if d.etcd_username
                          else ("etcd_password_file", "etcd_username"))
        raise ConfigError(f"directory.{given} is set but directory.{missing} is empty", field=f"directory.{missing}",
                          fix="set both (an etcd user and the file holding its password), or neither")
    if d.etcd_key_file and not d.etcd_cert_file:
        raise ConfigError("directory.etcd_key_file is set but directory.etcd_cert_file is empty",
                          field="directory.etcd_cert_file", fix="set the client certificate too, or neither")
    tls_files = [k for k in ("etcd_ca_file", "etcd_cert_file", "etcd_key_file") if getattr(d, k)]
    if tls_files and d.backend == "etcd" and not any(e.startswith("https://") for e in d.etcd_endpoints):
        raise ConfigError(f"directory.{tls_files[0]} is set but no directory.etcd_endpoints entry is https://",
                          field="directory.etcd_endpoints", fix="write the endpoints as https://host:port")
    for key in ("etcd_password_file", *tls_files):
        path = getattr(d, key)
        if path and d.backend == "etcd" and not os.access(path, os.R_OK):
            raise ConfigError(f"directory.{key} {path!r} is not a readable file", field=f"directory.{key}",
                              fix="point it at a file the daemon's user can read")


def load(path: str | os.PathLike[str] | None = None,
         environ: Mapping[str, str] | None = None) -> Config:
    cfg = Config()
    if path is not None:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}", field="config",
                              fix="pass an existing, readable TOML file") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config {path} is not valid TOML: {exc}", field="config",
                              fix="fix the TOML syntax") from None
        _apply(cfg, data, str(path))
    _apply(cfg, _env_overrides(os.environ if environ is None else environ, cfg)[0], "environment")
    return validate(cfg)

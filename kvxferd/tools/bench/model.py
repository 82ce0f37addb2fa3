"""What the bench measures: model shapes, workloads, scenarios, result rows and targets."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

MiB = 1 << 20
GiB = 1 << 30

#: model shapes (the KV cache only) modelled on public checkpoints
MODELS: dict[str, dict[str, Any]] = {
    # Llama-3-8B class: 32 layers, 8 KV heads (GQA), head_dim 128
    "8B": dict(attention="mha", num_layers=32, total_kv_heads=8, head_dim=128, dtype="bfloat16",
               model="gqa-8b"),
    # Llama-3-70B class: 80 layers, 8 KV heads
    "70B": dict(attention="mha", num_layers=80, total_kv_heads=8, head_dim=128, dtype="bfloat16",
                model="gqa-70b"),
    # DeepSeek-V3 class MLA: 61 layers, one 576-wide latent (512 + 64 rope) per token
    "MLA": dict(attention="mla", num_layers=61, head_dim=576, dtype="bfloat16", model="mla-61l"),
    # control-plane probe: as small as a page gets
    "tiny": dict(attention="mha", num_layers=2, total_kv_heads=1, head_dim=64, dtype="bfloat16",
                 model="tiny"),
}


@dataclass(frozen=True)
class Target:
    """A goal one figure of a run is read against (reported and drawn, never asserted)."""

    name: str
    goal: float
    higher_is_better: bool
    unit: str = "x"

    def met(self, value: float | None) -> bool | None:
        if value is None:
            return None
        return value >= self.goal if self.higher_is_better else value <= self.goal

    def describe(self) -> str:
        unit = self.unit if self.unit == "x" else f" {self.unit}" if self.unit else ""
        return f"{'>=' if self.higher_is_better else '<='} {self.goal:g}{unit}"


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("tcp_vs_socket", 0.90, True),
    Target("tcp_vs_socket_streams", 0.90, True),
    Target("local_vs_memcpy", 0.85, True),
    Target("tp_mismatch_vs_matched", 0.80, True),
    Target("nixl_sliced_vs_matched", 0.80, True),
    # one small request: its p50 beyond what the raw socket's round trip of the same bytes
    # takes (nothing for a local row), and how far its p99 strays from its p50
    Target("one_page_p50_over_wire_ms", 0.5, False, "ms"),
    Target("one_page_p99_over_p50", 3.0, False),
    Target("small_requests_per_s_pair", 5000.0, True, "req/s"),
    Target("small_requests_per_s_local", 10000.0, True, "req/s"),
    # every daemon's CPU (both of a pair) over the requests a small-request row moved
    Target("daemon_cpu_us_per_request", 200.0, False, "us"),
    Target("plan_128k_ms", 5.0, False, "ms"),
    # a throughput row with integrity.mode = "sampled" (the default share) or "full" over the same
    # row with it off
    Target("integrity_sampled_vs_off", 0.95, True),
    Target("integrity_full_vs_off", 0.75, True),
    # one daemon among many peer daemons (kvxferd.tools.fleet)
    Target("fleet_idle_cpu_pct", 5.0, False, "% core"),
    Target("fleet_dead_cpu_pct", 1.0, False, "% core"),
    Target("fleet_status_p99_ms", 5.0, False, "ms"),
    Target("fleet_fds_per_link", 1.0, False, ""),
    Target("fleet_rss_growth_mib", 20.0, False, "MiB"),
    Target("fleet_storm_s", 10.0, False, "s"),
    # transfer QoS (kvxferd.tools.bench.qos): a latency instance's one-page p99 under a bulk
    # stream against its idle p99, the bulk stream's throughput meanwhile, shares by weight, the
    # bulk floor under a latency flood, and how fast a deadline that cannot be met fails
    Target("qos_p99_vs_idle", 2.0, False),
    Target("qos_p99_over_idle_ms", 2.0, False, "ms"),
    Target("qos_bulk_vs_alone", 0.9, True),
    Target("qos_weights_3_to_1_error", 0.1, False),
    Target("qos_flood_bulk_vs_floor", 0.9, True),
    Target("qos_deadline_fail_ms", 1.0, False, "ms"),
)}

#: a throughput row below this payload gives no ratio to a limit: per-request costs (the
#: control messages, the first chunk's wake-ups) are then a visible share of its time, so
#: the ratio reads the payload size, not the transfer path (32 MiB requests read 0.59x of a
#: socket where 128 MiB and up read 1.0x)
STEADY_BYTES = 128 * MiB
#: the multi-stream socket limit is compared from this payload up (issue: 512 MiB and up)
STREAMS_BYTES = 512 * MiB


def token_bytes(model: str) -> int:
    m = MODELS[model]
    kinds = 1 if m["attention"] == "mla" else 2
    heads = 1 if m["attention"] == "mla" else m["total_kv_heads"]
    return m["num_layers"] * kinds * heads * m["head_dim"] * 2


def size_label(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v >= 10 or v == int(v) else f"{v:.1f} {unit}"
    return f"{int(n)} B"


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


@dataclass(frozen=True)
class Workload:
    model: str
    tokens: int
    p_tp: int = 1
    d_tp: int = 1
    p_page: int = 16
    d_page: int = 16
    layout: str = "NHD"  # both sides' (vLLM's GPU views: NHD_kv = LBNHC, HND_kv = LBHNC)

    @property
    def label(self) -> str:
        parts = [self.model, _tokens(self.tokens)] + ([self.layout] if self.layout != "NHD" else [])
        if (self.p_tp, self.d_tp) != (1, 1) or self.model == "70B":
            parts.append(f"tp{self.p_tp}>{self.d_tp}")
        if self.p_page != self.d_page:
            parts.append(f"page{self.p_page}>{self.d_page}")
        elif self.p_page != 16:
            parts.append(f"page{self.p_page}")
        return " ".join(parts)

    @property
    def nbytes(self) -> int:
        """Bytes of one request's KV cache (what lands on the decode side, all ranks)."""
        return self.tokens * token_bytes(self.model)

    def specs(self) -> tuple[Any, Any]:
        from ...model.geometry import InstanceSpec
        m = MODELS[self.model]
        return (InstanceSpec(tp_size=self.p_tp, page_size=self.p_page, layout=self.layout, **m),
                InstanceSpec(tp_size=self.d_tp, page_size=self.d_page, layout=self.layout, **m))


@dataclass
class Scenario:
    name: str
    kind: str  # throughput | latency | rate
    transport: str  # local | tcp | nixl
    mode: str  # direct | staged
    workload: Workload
    requests: int
    window: int
    verify: int = 2
    order: int = 0
    client: str = "sync"  # sync: EngineClient, one call at a time; async: AsyncEngineClient
    #: "sampled" or "full": a checked decode instance asks it at register, its rounds alternating with
    #: the same requests to a plain one ("off": neither)
    integrity: str = "off"
    rounds: int = 3  # the timed requests in this many rounds: the row's figure is its best round
    #: NIXL rows: the decode daemon's peer.nixl_engine_memory. "exposed" measures in-place WRITEs into
    #: the decode pages; "private" (the daemon's default) lands every chunk in the ring and scatters it
    engine_memory: str = "exposed"

    @property
    def gate(self) -> bool:
        return self.kind == "latency"


@dataclass
class Row:
    name: str
    group: str  # limit | kvxferd | latency | rate | peer | planner | fleet | qos
    bytes: int | None = None
    gbps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    requests_per_s: float | None = None
    ms: float | None = None
    vs_limit: float | None = None
    limit: str | None = None
    vs_peer: float | None = None
    verified: bool | None = None
    skipped: str | None = None
    error: str | None = None
    transport: str | None = None
    mode: str | None = None
    moved_as: str | None = None
    workload: str | None = None
    requests: int | None = None
    seconds: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not d["extra"]:
            d.pop("extra")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Row":
        """A row of a saved run (``--json``); keys this version does not know are kept in ``extra``."""
        known = {f for f in cls.__dataclass_fields__}
        row = cls(**{k: v for k, v in d.items() if k in known})
        row.extra = {**row.extra, **{k: v for k, v in d.items() if k not in known}}
        return row


def say(msg: str) -> None:
    """A progress line (stderr: stdout carries the table or the JSON)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]

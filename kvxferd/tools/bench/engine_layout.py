"""One scenario inside the bench's engine process: its ranks, its page tables, and what the
result says (throughput of the rounds, the byte check), shared by the sync and async drivers
(:mod:`.engine_sync`, :mod:`.engine_async`) that :mod:`.engine` runs.
"""

from __future__ import annotations

import time
from typing import Any

from ..oracle import CANARY, check_rank, fill_rank, reset_pages, untouched
from .model import Workload, pct


class Rank:
    def __init__(self, role: str, geometry: Any, cache: Any, checked: bool = False) -> None:
        self.role, self.geometry, self.cache = role, geometry, cache
        #: a decode rank of the checked instance (an integrity row's second decode instance)
        self.checked = checked
        self.client: Any = None
        self.rid = ""


class Layout:
    """Page tables of one scenario: one prefill source set, rotating and checked decode sets.

    Every request of a scenario carries the same bytes (the prefill pages are filled once),
    so the oracle's key is the scenario's, not the request's.

    An integrity row (``cfg["integrity"]``) has two decode instances on the same daemons with
    integrity off: the plain one, and a checked one that asks the row's mode at register. Its
    rounds alternate between them, so the cost of checking is read against the same daemons,
    the same source pages and the same minute of the machine.
    """

    def __init__(self, cfg: dict[str, Any]) -> None:
        import numpy as np
        self.cfg = cfg
        self.wl = Workload(**cfg["workload"])
        self.pspec, self.dspec = self.wl.specs()
        self.n = self.wl.tokens
        self.window, self.total, self.n_verify = cfg["window"], cfg["requests"], cfg["verify"]
        self.tag = cfg["tag"]
        self.key = f"bench-{cfg['seed']}-{self.wl.label}"
        rng = np.random.default_rng(cfg["seed"])
        p_need = -(-self.n // self.pspec.page_size)
        d_need = -(-self.n // self.dspec.page_size)
        self.p_pages = p_need + 4
        self.sets_n = self.window + self.n_verify
        self.d_pages = self.sets_n * d_need + 8
        self.src_pages = rng.permutation(self.p_pages)[:p_need].tolist()
        perm = rng.permutation(self.d_pages)
        self.sets = [perm[i * d_need:(i + 1) * d_need].tolist() for i in range(self.sets_n)]
        self.spare = perm[self.sets_n * d_need:].tolist()
        self.pinst, self.dinst = f"{self.tag}-prefill", f"{self.tag}-decode"
        self.integrity: str | None = cfg.get("integrity")
        self.source_address = cfg.get("source_address")
        checked = {0, self.total - 1, *(self.total * (j + 1) // (self.n_verify + 1) for j in range(self.n_verify))}
        self.fixed = {i: self.window + j for j, i in enumerate(sorted(checked)[:self.n_verify])}

    def warmup_plan(self) -> list[tuple[str, int | None]]:
        return [(f"{self.tag}-warm-{k}", k) for k in range(self.sets_n)]

    def timed_plan(self) -> list[tuple[str, int | None]]:
        return [(f"{self.tag}-{i}", self.fixed.get(i)) for i in range(self.total)]

    def allocate(self) -> list[Rank]:
        from ...model.geometry import RankGeometry
        from ...sdk.kv_cache import allocate_cpu
        ranks = []
        sides = [("prefill", self.pspec, self.p_pages, False), ("decode", self.dspec, self.d_pages, False)]
        if self.integrity:
            sides.append(("decode", self.dspec, self.d_pages, True))
        for role, spec, num_pages, checked in sides:
            for tp in range(spec.tp_size):
                g = RankGeometry(spec, tp, 0, num_pages)
                cache = allocate_cpu(g, name=f"bench-{self.tag}-{role[0]}{'c' if checked else ''}{tp}",
                                     fill=CANARY if role == "decode" else None)
                ranks.append(Rank(role, g, cache, checked))
        for r in ranks:
            if r.role == "prefill":
                fill_rank(r.cache, r.geometry, self.key, self.src_pages, self.n)
        return ranks

    def reset_checked(self, ranks: list[Rank]) -> None:
        for k in range(self.window, self.sets_n):
            for r in ranks:
                if r.role == "decode":
                    reset_pages(r.cache, r.geometry, self.sets[k], CANARY)

    def check(self, ranks: list[Rank]) -> int:
        bad = 0
        for r in ranks:
            if r.role != "decode":
                continue
            for k in range(self.window, self.sets_n):
                bad += check_rank(r.cache, r.geometry, self.key, self.sets[k], self.n)
            bad += untouched(r.cache, r.geometry, self.spare)
        return bad

    def socket_of(self, rank: Rank) -> str:
        return self.cfg["prefill_socket" if rank.role == "prefill" else "decode_socket"]

    def instance_of(self, rank: Rank) -> str:
        return self.pinst if rank.role == "prefill" else f"{self.dinst}-checked" if rank.checked else self.dinst

    def integrity_of(self, rank: Rank) -> str | None:
        """What a rank asks at register: the row's mode for the checked instance, else nothing."""
        return self.integrity if rank.checked else None

    def checked_plan(self, plan: list[tuple[str, int | None]]) -> list[tuple[str, int | None]]:
        """The same requests for the checked instance (ids of their own)."""
        return [(f"{req}-c", fixed) for req, fixed in plan]


def interleaved(lay: Layout, plain: list[tuple[int, float]], checked: list[tuple[int, float]]) -> dict[str, Any]:
    """An integrity row's plain rounds, run between its checked ones: the plain figures, each
    checked round over the plain round before it, and the checked rounds' throughput over the
    plain rounds' taken whole (``vs_off``: every round counts, so one round disturbed by the
    machine weighs no more than its share of the time)."""
    per = lay.wl.nbytes
    pairs = [(p, c) for p, c in zip(plain, checked) if p[1] > 0 and c[1] > 0]
    rates = [n / sec for n, sec in plain if sec > 0]
    whole = None
    if pairs:
        n_p, s_p = sum(p[0] for p, _ in pairs), sum(p[1] for p, _ in pairs)
        n_c, s_c = sum(c[0] for _, c in pairs), sum(c[1] for _, c in pairs)
        whole = round((n_c / s_c) / (n_p / s_p), 3)
    return {"gbps_off": round(max(rates) * per / 1e9, 3) if rates else None,
            "gbps_rounds_off": [round(r * per / 1e9, 3) for r in rates],
            "vs_off_rounds": [round((c[0] / c[1]) / (p[0] / p[1]), 3) for p, c in pairs],
            "vs_off": whole}


def summary(lay: Layout, rounds: list[tuple[int, float]], lat: list[float]) -> dict[str, Any]:
    """Throughput of the best round (others on the machine only ever slow a round down) and overall."""
    per = lay.wl.nbytes
    rates = [n / sec for n, sec in rounds if sec > 0]
    total_n = sum(n for n, _ in rounds)
    total_s = sum(sec for _, sec in rounds)
    best = max(rates) if rates else None
    return {"requests": total_n, "seconds": total_s, "bytes": total_n * per,
            "gbps": best * per / 1e9 if best else None, "requests_per_s": best,
            "gbps_overall": total_n * per / total_s / 1e9 if total_s > 0 else None,
            "gbps_rounds": [round(r * per / 1e9, 3) for r in rates], "rps_rounds": [round(r, 1) for r in rates],
            "p50_ms": pct(lat, 0.50) * 1e3 if lat else None, "p99_ms": pct(lat, 0.99) * 1e3 if lat else None}


def split_rounds(plan: list[Any], k: int) -> list[list[Any]]:
    k = max(1, min(k, len(plan)))
    return [plan[len(plan) * i // k:len(plan) * (i + 1) // k] for i in range(k)]


def failure(ev: dict[str, Any]) -> dict[str, Any]:
    return {k: ev.get(k) for k in ("rank_id", "request_id", "state", "code", "reason")}


def finish(lay: Layout, ranks: list[Rank], result: dict[str, Any], missing_prefill: int) -> None:
    """Check the bytes of the checked requests and the pages nobody should have written."""
    t_check = time.perf_counter()
    bad = lay.check(ranks)
    result["check_s"] = round(time.perf_counter() - t_check, 3)
    failures = result["failures"]
    result.update(bad_bytes=bad, checked_requests=lay.n_verify, missing_prefill_events=missing_prefill,
                  verified=bad == 0 and not failures and missing_prefill == 0)

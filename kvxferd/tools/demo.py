"""``kvxferd demo``: two daemons, a TP-2 prefill instance and a TP-1 decode instance.

Everything runs as separate processes on loopback: a prefill daemon and a decode daemon
(or one daemon with ``--transport local``; ``--transport nixl`` moves the bytes with NIXL),
two prefill engine ranks and one decode rank of a small GQA model, shared-memory KV caches. A stream of requests of varied lengths,
some chunked, goes through; every destination byte is checked against the oracle.

Two sets of figures come out, apart: the daemons' own (from the decode daemon's metrics:
time from a request's first byte arriving to its last, and the bytes written), and the
whole run's, which includes the simulated engines filling and checking every byte (the
oracle's time, which each engine reports).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..model.geometry import InstanceSpec
from ..transport import chunk_modes
from .sim import Cluster

DEMO_SPEC = dict(attention="mha", num_layers=8, total_kv_heads=4, head_dim=64, dtype="bfloat16", page_size=16,
                 model="demo-gqa")


@dataclass
class _Stream:
    """A stream of requests of varied lengths, some chunked, ``window`` in flight, each with its
    own prefill and decode pages (prefill pages are reused; decode pages stay to be checked)."""

    prefill: list[Any]
    decode: list[Any]
    source: str
    per_token: int
    rng: random.Random
    free: list[int]
    window: int = 8
    sent_at: dict[str, float] = field(default_factory=dict)
    in_use: dict[str, list[int]] = field(default_factory=dict)
    lat: list[float] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)
    oracle: dict[str, float] = field(default_factory=lambda: {"fill_s": 0.0, "check_s": 0.0})
    total_bytes: int = 0
    issued: int = 0

    def issue(self) -> bool:
        """Start the next request on every rank; False when the pages for it are not free yet."""
        n = self.rng.choice([1, 15, 16, 17, 100, 333, 512, 1000])
        pages_needed = -(-n // 16)
        if len(self.free) < 2 * pages_needed:
            return False
        src_pages = [self.free.pop() for _ in range(pages_needed)]
        dst_pages = [self.free.pop() for _ in range(pages_needed)]
        rid = f"demo-{self.issued}"
        self.in_use[rid] = src_pages
        chunks = None
        if n > 64 and self.rng.random() < 0.5:
            cut = self.rng.randrange(1, pages_needed) * 16 if pages_needed > 1 else n
            chunks = [[0, min(cut, n)], [min(cut, n), n]] if cut < n else None
        self.sent_at[rid] = time.perf_counter()
        for w in self.decode:
            w.command(cmd="expect", request_id=rid, pages=dst_pages, n=n, source_instance="prefill-a",
                      source_address=self.source or None)
        for w in self.prefill:
            w.command(cmd="send", request_id=rid, pages=src_pages, n=n, chunks=chunks, aux=b"first-token".hex())
        self.total_bytes += n * self.per_token
        self.issued += 1
        return True

    def landed(self, event: dict[str, Any], progress: Any) -> bool:
        """Account for one decode-side event; True when it ends a request (done, failed or refused)."""
        if event.get("event") == "error":
            self.failed.append(event)
            return True
        if event.get("event") != "finished":
            return False
        rid = event["request_id"]
        self.lat.append(time.perf_counter() - self.sent_at[rid])
        self.oracle["check_s"] += event.get("check_s") or 0.0
        if not (event["state"] == "done" and event.get("mismatched_bytes") == 0):
            self.failed.append(event)
        self.free.extend(self.in_use.pop(rid))
        if progress:
            progress(f"  request {rid:<10} {event['state']:<6} mismatched={event.get('mismatched_bytes')}")
        return True

    def run(self, requests: int, progress: Any) -> None:
        done = outstanding = 0
        while done < requests:
            while self.issued < requests and outstanding < self.window and self.issue():
                outstanding += 1
            if self.landed(self.decode[0].next_event(120), progress):
                done += 1
                outstanding -= 1

    def drain_prefill(self, requests: int) -> None:
        """Every prefill rank must have reported its pages free as well."""
        for w in self.prefill:
            seen = 0
            deadline = time.monotonic() + 30
            while seen < requests and time.monotonic() < deadline:
                ev = w.next_event(30)
                if ev.get("event") == "finished":
                    seen += 1
                    self.oracle["fill_s"] += ev.get("fill_s") or 0.0
                    if ev["state"] != "done":
                        self.failed.append(ev)
            if seen < requests:
                self.failed.append({"event": "missing", "reason": f"a prefill rank reported {seen} of {requests}"})


def _start(cluster: Cluster, transport: str, mode: str) -> tuple[Any, Any]:
    """The prefill and decode daemons (one daemon for ``local``)."""
    env = {"KVXFERD_PEER_MODE": mode}
    if transport == "nixl":  # both daemons offer NIXL; UCX stays on loopback unless told otherwise
        env.update(KVXFERD_PEER_TRANSPORT="nixl", UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"),
                   UCX_TLS=os.environ.get("UCX_TLS", "tcp"),
                   # one tenant, the demo's own: the mode asked is shown as asked, in-place WRITEs included
                   # (the daemon's default, private, lands every chunk in its ring)
                   KVXFERD_PEER_NIXL_ENGINE_MEMORY=os.environ.get("KVXFERD_PEER_NIXL_ENGINE_MEMORY", "exposed"))
    if transport == "local":
        pd = cluster.daemon("node", env=env)
        return pd, pd
    return cluster.daemon("prefill-node", env=env), cluster.daemon("decode-node", env=env)


#: why a chunk may leave in another mode than the one asked outright: not the daemon's choice
#: (:mod:`kvxferd.transport.chunk_modes`)
_NOT_CHOSEN = (chunk_modes.DEVICE_MEMORY, chunk_modes.NO_LANDING_RING, chunk_modes.PRIVATE_DESTINATION)


def _moved_as_asked(pd: Any, transport: str, mode: str, failed: list[dict[str, Any]]) -> dict[str, Any]:
    """The bytes the prefill daemon sent per transport and mode, and its chunks per transport, mode
    and why; a run that did not move them as asked (NIXL fell back to tcp; under an explicit mode,
    a chunk in another mode for a reason the daemon chose) fails instead of passing for what it was not."""
    moved = _counted(pd.metrics_url, "kvxferd_sent_bytes_total", "transport")
    by_mode = _counted(pd.metrics_url, "kvxferd_sent_bytes_total", "transport", "mode")
    chunks = _counted(pd.metrics_url, "kvxferd_chunks_total", "transport", "mode", "why")
    if transport == "nixl" and not moved.get("nixl"):
        failed.append({"event": "fallback", "reason": f"no byte moved over NIXL ({moved}); see "
                                                      f"{pd.log_path} for event=nixl_unavailable"})
    if mode != "auto":
        if not any(k.endswith("/" + mode) and v for k, v in by_mode.items()):
            failed.append({"event": "mode", "reason": f"no byte moved in mode {mode} ({by_mode})"})
        other = {k: v for k, v in chunks.items()
                 if v and k.split("/")[1] != mode and k.split("/")[2] not in _NOT_CHOSEN}
        if other:
            failed.append({"event": "mode", "reason": f"mode {mode} was asked, but chunks moved otherwise "
                                                      f"by the daemon's choice ({other})"})
    return {"bytes_by_transport": moved, "bytes_by_transport_mode": by_mode, "chunks_by_transport_mode_why": chunks}


def run_demo(requests: int = 24, transport: str = "tcp", mode: str = "auto", seed: int = 1,
             progress: Any = None) -> dict[str, Any]:
    if transport == "local" and mode == "staged":
        raise ConfigError("local copies are always direct; mode staged needs a link between daemons",
                          field="mode", fix="use mode direct or auto with transport local, or transport tcp or nixl")
    rng = random.Random(seed)
    cluster = Cluster()
    keep_logs = False
    try:
        pd, dd = _start(cluster, transport, mode)
        pspec = InstanceSpec(tp_size=2, **DEMO_SPEC)
        num_pages = 512
        prefill = cluster.instance(pd, "prefill-a", "prefill", pspec, num_pages)
        decode = cluster.instance(dd, "decode-a", "decode", InstanceSpec(tp_size=1, **DEMO_SPEC), num_pages)
        free = list(range(num_pages))
        rng.shuffle(free)
        stream = _Stream(prefill, decode, "" if dd is pd else pd.address,
                         pspec.num_layers * 2 * pspec.kv_heads * pspec.head_dim * 2, rng, free)
        started = time.perf_counter()
        stream.run(requests, progress)
        seconds = time.perf_counter() - started
        stream.drain_prefill(requests)
        moved = _moved_as_asked(pd, transport, mode, stream.failed)
        keep_logs = bool(stream.failed)  # the daemons' logs of a failed run stay for a look
        lat = sorted(stream.lat)
        return {"requests": requests, "failed": len(stream.failed), "verified": not stream.failed,
                "bytes": stream.total_bytes, "seconds": round(seconds, 4),
                "gbps": round(stream.total_bytes / seconds / 1e9, 4) if seconds else 0.0,
                "p50_ms": round(lat[len(lat) // 2] * 1e3, 3) if lat else None,
                "p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3, 3) if lat else None,
                "daemon": daemon_figures(pd.metrics_url, dd.metrics_url),
                "oracle": {k: round(v, 4) for k, v in stream.oracle.items()},
                "transport": transport, "mode": mode, **moved, "failures": stream.failed[:5]}
    finally:
        from ..ops.signals import deferred
        with deferred():  # a SIGTERM now ends the demo once its daemons are stopped, not halfway
            cluster.close(keep_root=keep_logs)


def _families(metrics_url: str) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families
    try:
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except OSError:
        return {}
    return {f.name: f for f in text_string_to_metric_families(text)}


def _histogram(family: Any, **labels: str) -> tuple[float, float, list[tuple[float, float]]]:
    """(sum, count, [(upper bound, cumulative count)]) of one histogram's series."""
    total = count = 0.0
    buckets = []
    for sample in family.samples if family is not None else ():
        if any(sample.labels.get(k) != v for k, v in labels.items()):
            continue
        if sample.name.endswith("_sum"):
            total = sample.value
        elif sample.name.endswith("_count"):
            count = sample.value
        elif sample.name.endswith("_bucket"):
            buckets.append((float(sample.labels["le"]), sample.value))
    return total, count, sorted(buckets)


def bucket_quantile(buckets: list[tuple[float, float]], count: float, q: float) -> float | None:
    """The upper bound of the histogram bucket holding quantile ``q`` (a bound, not an estimate)."""
    for le, cumulative in buckets:
        if count and cumulative >= q * count:
            return le
    return None


def daemon_figures(source_url: str, dest_url: str) -> dict[str, Any]:
    """The daemons' own view, no engine time in it: chunk moves (source daemon: one chunk to one
    destination, start to acknowledged) and the bytes they moved, and request latency (decode
    daemon: expect to done, which includes waiting for the engines' sends)."""
    src, dst = _families(source_url), _families(dest_url)
    c_sum, c_count, c_buckets = _histogram(src.get("kvxferd_phase_duration_seconds"), phase="chunk")
    r_sum, r_count, r_buckets = _histogram(dst.get("kvxferd_request_duration_seconds"))
    sent = sum(s.value for s in src["kvxferd_sent_bytes"].samples
               if s.name.endswith("_total")) if "kvxferd_sent_bytes" in src else 0.0

    def ms(v: float | None) -> float | None:
        return None if v is None or v == float("inf") else round(v * 1e3, 3)

    return {"chunks": int(c_count), "sent_bytes": sent, "chunk_s": round(c_sum, 6),
            "chunk_mean_ms": ms(c_sum / c_count) if c_count else None,
            "chunk_p50_ms_le": ms(bucket_quantile(c_buckets, c_count, 0.5)),
            "chunk_p99_ms_le": ms(bucket_quantile(c_buckets, c_count, 0.99)),
            # what one data thread moves per second while it moves (threads run side by side)
            "gbps_per_thread": round(sent / c_sum / 1e9, 4) if c_sum else None,
            "requests": int(r_count), "request_mean_ms": ms(r_sum / r_count) if r_count else None,
            "request_p50_ms_le": ms(bucket_quantile(r_buckets, r_count, 0.5)),
            "request_p99_ms_le": ms(bucket_quantile(r_buckets, r_count, 0.99))}


def _counted(metrics_url: str, counter: str, *labels: str) -> dict[str, float]:
    """One counter of the prefill daemon (``kvxferd_sent_bytes_total``, ``kvxferd_chunks_total``), per
    value of ``labels`` joined by '/' (from its Prometheus endpoint)."""
    out: dict[str, float] = {}
    try:
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except OSError:
        return out
    for line in text.splitlines():
        if line.startswith(counter + "{"):
            name = "/".join(line.split(f'{label}="', 1)[1].split('"', 1)[0] for label in labels)
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def main(args: Any) -> int:
    progress = None if args.json else (lambda line: print(line, flush=True))
    if args.transport == "local" and args.mode == "staged":
        print("kvxferd demo: --transport local --mode staged: local copies are always direct (one index copy "
              "per layer and kind, region to region; staging would only add a copy)\n"
              "  use --mode direct or auto with --transport local, or --mode staged with --transport tcp or nixl",
              file=sys.stderr)
        return 2
    if args.transport == "nixl":
        from ..transport.nixl.api import available
        ok, why = available()
        if not ok:
            print(f"kvxferd demo: --transport nixl needs the NIXL package: {why}\n"
                  "  install it with: pip install --no-deps nixl-cu12==1.5.1 (make venv does)", file=sys.stderr)
            return 2
    if not args.json:
        print(f"kvxferd demo: {args.requests} requests, transport={args.transport}, mode={args.mode}")
    from ..ops.signals import cleanup_on_signals
    with cleanup_on_signals():  # SIGTERM/SIGINT/SIGHUP: stop the daemons and engines, remove their files
        summary = run_demo(args.requests, args.transport, args.mode, args.seed, progress)
    if args.json:
        print(json.dumps(summary))
    else:
        d, o = summary["daemon"], summary["oracle"]
        print(f"\nrequests {summary['requests']}  failed {summary['failed']}  verified {summary['verified']}")
        print(f"daemons  {d['chunks']} chunk moves: mean {d['chunk_mean_ms']} ms, p50 <= {d['chunk_p50_ms_le']} ms, "
              f"p99 <= {d['chunk_p99_ms_le']} ms (histogram buckets)")
        print(f"         requests, expect to done (waiting for the engines' sends included): mean "
              f"{d['request_mean_ms']} ms, p50 <= {d['request_p50_ms_le']} ms")
        print(f"oracle   engines filled for {o['fill_s']} s and checked for {o['check_s']} s (summed over ranks)")
        print(f"run      bytes {summary['bytes']}  seconds {summary['seconds']}  latency p50 {summary['p50_ms']} ms  "
              f"p99 {summary['p99_ms']} ms (oracle and simulated engines included)")
        print("moved   " + "  ".join(f"{k} {int(v)}" for k, v in sorted(summary["bytes_by_transport_mode"].items())
                                     if v) + " bytes")
        print("chunks  " + "  ".join(f"{k} {int(v)}" for k, v in sorted(summary["chunks_by_transport_mode_why"].items())
                                     if v) + " (transport/mode/why)")
        print(f"\nThe demo checks bytes, it does not measure speed: its {summary['bytes'] / 2**20:.0f} MiB travel as "
              "small chunks between engines that fill and check every byte, so its timings are mostly per-chunk "
              "costs and the oracle. `kvxferd bench` measures throughput and latency against this machine's "
              "memcpy and raw sockets.")
    return 0 if summary["verified"] else 1


if __name__ == "__main__":
    sys.exit(1)

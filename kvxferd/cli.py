"""``kvxferd serve | demo | plan | status``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from .errors import KvxferError, PlanRefusal


def _load_geometry(path: str) -> dict[str, Any]:
    text = Path(path).read_text()
    if path.endswith(".toml"):
        import tomllib
        return tomllib.loads(text)
    return json.loads(text)


def cmd_plan(args: argparse.Namespace) -> int:
    from .geometry import InstanceSpec
    from .planner import make_plan

    try:
        prefill = InstanceSpec.from_dict(_load_geometry(args.prefill))
        decode = InstanceSpec.from_dict(_load_geometry(args.decode))
    except (OSError, ValueError) as exc:
        if isinstance(exc, KvxferError):
            return _refused(args, exc)
        print(f"kvxferd plan: cannot read geometry: {exc}", file=sys.stderr)
        return 1
    try:
        plan = make_plan(prefill, decode, mode=args.mode, require_same_page_size=args.same_page_size)
    except PlanRefusal as refusal:
        return _refused(args, refusal)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        return 0
    kinds = prefill.region_kinds
    print(f"prefill: {_describe(prefill)}")
    print(f"decode:  {_describe(decode)}")
    print(f"mode: {plan.mode}   fragments per decode page (per layer and kind): {plan.fragments_per_page()}")
    rows = [("decode rank", "writer (tp,pp)", "heads", "layers", "bytes/token", "slice")]
    for dest in plan.destinations:
        for i, w in enumerate(dest.writers):
            per_token = (w.layers[1] - w.layers[0]) * len(kinds) * w.slice_bytes
            rows.append((f"tp{dest.tp_rank} pp{dest.pp_rank}" if i == 0 else "",
                         f"({w.tp_rank},{w.pp_rank})", f"[{w.heads[0]},{w.heads[1]})",
                         f"[{w.layers[0]},{w.layers[1]})", str(per_token),
                         "whole rows" if w.whole_rows else f"{w.slice_bytes} B head slice"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for n, row in enumerate(rows):
        print("  ".join(cell.ljust(widths[c]) for c, cell in enumerate(row)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
    return 0


def _describe(spec: Any) -> str:
    return (f"{spec.attention} layers={spec.num_layers} kv_heads={spec.kv_heads} head_dim={spec.head_dim} "
            f"dtype={spec.dtype} page_size={spec.page_size} tp={spec.tp_size} pp={spec.pp_size}")


def _refused(args: argparse.Namespace, exc: KvxferError) -> int:
    if args.json:
        out = {"compatible": False, "field": exc.field, "error": str(exc)}
        if isinstance(exc, PlanRefusal):
            out.update(prefill=exc.to_wire()["prefill"], decode=exc.to_wire()["decode"])
        print(json.dumps(out, indent=2))
    else:
        print(f"incompatible: {exc}")
        print(f"field: {exc.field}")
    return 2


def cmd_serve(args: argparse.Namespace) -> int:
    from . import config, logutil
    try:
        cfg = config.load(args.config)
    except KvxferError as exc:
        print(f"kvxferd: config error: {exc}", file=sys.stderr)
        return 2
    if args.check_config:
        print(f"config ok: {args.config or '(embedded defaults)'}")
        return 0
    logutil.setup(cfg.daemon.log_level, cfg.daemon.log_format)
    from .daemon import run
    try:
        return run(cfg)
    except KvxferError as exc:
        print(f"kvxferd: {exc}", file=sys.stderr)
        return 1


def cmd_status(args: argparse.Namespace) -> int:
    from . import config
    from .client import EngineClient
    socket_path = args.socket or config.load(args.config).socket_path
    client = EngineClient(socket_path, timeout=args.timeout)
    try:
        status = client.status()
    except KvxferError as exc:
        print(f"kvxferd status: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if args.json:
        print(json.dumps(status, indent=2, default=str))
        return 0
    print(f"kvxferd {status['version']}  pid {status['pid']}  up {status['uptime_s']:.0f}s  "
          f"{'ready' if status['ready'] else 'not ready'}{'  draining' if status['draining'] else ''}")
    print(f"engine {status['engine_endpoint']}  peer {status['peer_endpoint']}  data {status['data_endpoint']}"
          f"  metrics {status['metrics_url'] or '-'}")
    print(f"\nranks ({len(status['ranks'])})")
    for r in status["ranks"]:
        g = r["geometry"]
        print(f"  {r['rank_id']:<32} {r['role']:<8} {g['attention']} L{g['num_layers']} H{g['total_kv_heads']} "
              f"d{g['head_dim']} {g['dtype']} ps{g['page_size']} tp{g['tp_rank']}/{g['tp_size']} "
              f"pp{g['pp_rank']}/{g['pp_size']} pages={g['num_pages']}")
    print(f"\npeers ({len(status['peers'])})")
    for p in status["peers"]:
        print(f"  {p['address']:<28} {p['state']:<10} {p['side']:<8} last seen {p['last_seen_s']:.1f}s ago")
    print("\nrequests in flight")
    for state, n in sorted(status["requests"].items()) or [("none", 0)]:
        print(f"  {state:<32} {n}")
    print(f"\nrecent failures ({len(status['recent_failures'])})")
    for f in status["recent_failures"][-10:]:
        print(f"  {f['side']:<8} {f['request_id']:<24} {f['code']:<20} {f['reason'][:80]}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import main as demo_main
    return demo_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvxferd", description="KV-cache transfer daemon")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="show how a prefill instance maps onto a decode instance")
    p.add_argument("--prefill", required=True, help="prefill instance geometry (JSON or TOML)")
    p.add_argument("--decode", required=True, help="decode instance geometry (JSON or TOML)")
    p.add_argument("--mode", default="auto", choices=("auto", "direct", "staged"))
    p.add_argument("--same-page-size", action="store_true", help="refuse differing page sizes")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    s = sub.add_parser("serve", help="run the daemon")
    s.add_argument("--config", help="TOML config file (default: embedded defaults)")
    s.add_argument("--check-config", action="store_true", help="validate the config and exit")
    s.set_defaults(func=cmd_serve)

    st = sub.add_parser("status", help="ask a running daemon for its state")
    st.add_argument("--socket", help="engine socket path (default: as `serve` chooses it)")
    st.add_argument("--config", help="read the socket path from this config")
    st.add_argument("--timeout", type=float, default=5.0)
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    d = sub.add_parser("demo", help="run daemons and engines on loopback and verify every byte")
    d.add_argument("--requests", type=int, default=24)
    d.add_argument("--transport", default="tcp", choices=("tcp", "local"))
    d.add_argument("--mode", default="auto", choices=("auto", "direct", "staged"))
    d.add_argument("--json", action="store_true")
    d.add_argument("--seed", type=int, default=1)
    d.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) if exc.code in (0, None) else 1
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

"""``kvxferd serve | demo | bench | soak | plan | status``."""

from __future__ import annotations

import argparse
import json
import os
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


def _live_ranks(args: argparse.Namespace) -> dict[str, Any] | int:
    """``--rendezvous``: the rendezvous's answer for ``--instance`` (or an exit code, said why)."""
    from .directory.lookup import lookup
    try:
        return lookup(args.rendezvous, args.instance, args.role, args.timeout)
    except KvxferError as exc:
        print(f"kvxferd plan: {exc}", file=sys.stderr)
        return 1


def cmd_plan(args: argparse.Namespace) -> int:
    from .directory.lookup import daemons_of, format_ranks
    from .model.geometry import InstanceSpec
    from .model.planner import make_plan

    live: dict[str, Any] | None = None
    if args.rendezvous:
        if not args.instance:
            print("kvxferd plan: --rendezvous needs --instance", file=sys.stderr)
            return 2
        found = _live_ranks(args)
        if isinstance(found, int):
            return found
        live = found
        if not args.decode or live.get("dp_size"):  # the rank map only (a DP rank: --instance NAME@dp<k>)
            print(json.dumps(live, indent=2, default=str) if args.json else "\n".join(format_ranks(live)))
            return 0
    elif not (args.prefill and args.decode):
        print("kvxferd plan: give --prefill and --decode geometry files, or --rendezvous and --instance",
              file=sys.stderr)
        return 2
    try:
        prefill = InstanceSpec.from_dict(live["spec"] if live else _load_geometry(args.prefill))
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
    held = daemons_of(live) if live else {}
    if args.json:
        out = plan.to_dict()
        if live:
            out["ranks"] = live["ranks"]
        print(json.dumps(out, indent=2))
        return 0
    if live:
        print("\n".join(format_ranks(live)))
    kinds = prefill.region_kinds
    print(f"prefill: {_describe(prefill)}")
    print(f"decode:  {_describe(decode)}")
    print(f"mode: {plan.mode}   fragments per decode page (per layer and kind): {plan.fragments_per_page()}")
    unit = "page" if prefill.slot_tokens > 1 else "token"  # packed_page moves whole pages
    rows = [("decode rank", "writer (tp,pp)", "heads", "layers", f"bytes/{unit}", "slice")
            + (("writer's daemon",) if held else ())]
    for dest in plan.destinations:
        for i, w in enumerate(dest.writers):
            per_token = (w.layers[1] - w.layers[0]) * len(kinds) * w.slice_bytes
            rows.append((f"tp{dest.tp_rank} pp{dest.pp_rank}" if i == 0 else "",
                         f"({w.tp_rank},{w.pp_rank})", f"[{w.heads[0]},{w.heads[1]})",
                         f"[{w.layers[0]},{w.layers[1]})", str(per_token),
                         "whole rows" if w.whole_rows else f"{w.slice_bytes} B head slice")
                        + ((held.get((w.tp_rank, w.pp_rank), "?"),) if held else ()))
    _table(rows)
    if plan.groups:
        _print_groups(plan)
    return 0


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for n, row in enumerate(rows):
        print("  ".join(cell.ljust(widths[c]) for c, cell in enumerate(row)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _print_groups(plan: Any) -> None:
    """Per cache group: what it moves per token (or per request) and its writers."""
    data = plan.to_dict()
    print(f"\ncache groups (full-attention KV: {data['bytes_per_token']} bytes/token):")
    for g, gd in zip(plan.groups, data["groups"]):
        if g.kind == "state":
            amount = f"{gd['bytes_per_request']} bytes/request (the state after the last token)"
        elif g.kind == "window":
            amount = (f"{gd['bytes_per_token']} bytes/token, the last {g.window} tokens only "
                      f"(at most {gd['max_bytes_per_request']} bytes/request)")
        else:
            amount = f"{gd['bytes_per_token']} bytes/token"
        print(f"group {g.name} ({g.kind}): {amount}")
        kinds = len(g.plan.decode.region_kinds)
        rows = [("decode rank", "writer (tp,pp)", "heads", "layers", "bytes/row", "slice")]
        for dest in g.plan.destinations:
            for i, w in enumerate(dest.writers):
                rows.append((f"tp{dest.tp_rank}" if i == 0 else "", f"({w.tp_rank},{w.pp_rank})",
                             f"[{w.heads[0]},{w.heads[1]})", f"[{w.layers[0]},{w.layers[1]})",
                             str((w.layers[1] - w.layers[0]) * kinds * w.slice_bytes),
                             "whole rows" if w.whole_rows else f"{w.slice_bytes} B head slice"))
        _table(rows)


def _describe(spec: Any) -> str:
    return (f"{spec.attention} layers={spec.num_layers} kv_heads={spec.kv_heads} head_dim={spec.head_dim} "
            f"dtype={spec.dtype} page_size={spec.page_size} tp={spec.tp_size} pp={spec.pp_size}"
            + (f" layout={spec.layout}" if spec.layout != "NHD" else "")
            + (f" groups={[g.name for g in spec.groups]}" if spec.groups else ""))


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
    from .ops import config, logutil
    path = args.check_config if isinstance(args.check_config, str) else args.config
    if isinstance(args.check_config, str) and args.config and args.config != args.check_config:
        print("kvxferd: give the file once: --check-config FILE, or --config FILE --check-config",
              file=sys.stderr)
        return 2
    try:
        cfg = config.load(path)
    except KvxferError as exc:
        print(f"kvxferd: config error: {exc}", file=sys.stderr)
        return 2
    ignored = config.unknown_env()
    if args.check_config:
        for name in ignored:
            print(f"warning: {name} names no setting and is ignored (overrides are "
                  f"KVXFERD_<SECTION>_<KEY>, e.g. KVXFERD_DAEMON_LOG_FORMAT)", file=sys.stderr)
        print(f"config ok: {path or '(embedded defaults)'}")
        for note in config.mode_notes(cfg.peer):
            print(f"note: {note}")
        print(f"engine socket {cfg.socket_path}  peer {cfg.peer.bind_host}:{cfg.peer.control_port}  "
              f"data {cfg.peer.bind_host}:{cfg.peer.data_port}  metrics {cfg.metrics.bind or '-'}")
        print("settings a file or a variable set, and where each came from:")
        for line in _config_sources(cfg):
            print(f"  {line}")
        return 0
    logutil.setup(cfg.daemon.log_level, cfg.daemon.log_format)
    import logging
    for name in ignored:
        logging.getLogger("kvxferd.config").warning(
            "event=config_env_ignored var=%s hint=%s", name, "overrides_are_KVXFERD_<SECTION>_<KEY>")
    for key, (file_value, file) in sorted(cfg.overridden.items()):
        # an engine's environment shares KVXFERD_ENGINE_SOCKET_PATH with the daemon: say who won
        logging.getLogger("kvxferd.config").warning(
            "event=config_env_override key=%s var=%s value=%s file=%s file_value=%s", key, cfg.source_of(key),
            logutil.q(str(cfg.value_of(key))), logutil.q(file), logutil.q(str(file_value)))
    from .control.daemon import run
    try:
        code = run(cfg)
    except KvxferError as exc:
        logging.getLogger("kvxferd").error("event=fatal code=%s field=%s msg=%s", exc.code, exc.field,
                                           logutil.q(str(exc)))
        code = 1
    except Exception as exc:  # noqa: BLE001 - e.g. a port in use: one log line, not a bare traceback
        logging.getLogger("kvxferd").exception("event=fatal msg=%s", logutil.q(repr(exc)[:300]))
        code = 1
    return _exit_after_nixl(code)


def _config_sources(cfg: Any) -> list[str]:
    """``key = value  (source)`` for every setting a file or a variable set; a variable that set
    one over the file's own value says so (an engine's environment can shadow the daemon's file)."""
    out = []
    for key in sorted(cfg.sources):
        line = f"{key} = {cfg.value_of(key)!r}  ({cfg.source_of(key)})"
        if key in cfg.overridden:
            file_value, file = cfg.overridden[key]
            line += f", over {file_value!r} from {file}"
        out.append(line)
    return out or ["(none: every setting is the embedded default)"]


def _exit_after_nixl(code: int) -> int:
    """Leave without running native static destructors once NIXL has been loaded.

    The daemon has shut down and released everything by now. UCX (under NIXL) can crash in
    its own teardown at process exit, e.g. its InfiniBand module on a host that has
    libibverbs but no RDMA device, which would turn a clean stop into a SIGSEGV status.
    """
    from .transport.nixl.api import loaded
    if not loaded():
        return code
    import logging
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _find_socket(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """The engine socket of the daemon to ask: as given, else where `serve` would bind it."""
    from .ops import config
    if args.socket:
        return args.socket, [args.socket]
    if args.config:
        path = config.load(args.config).socket_path
        return path, [path]
    tried = config.candidate_socket_paths()
    for path in tried:
        if Path(path).exists():
            return path, tried
    return None, tried


def cmd_status(args: argparse.Namespace) -> int:
    from .sdk.client import EngineClient
    try:
        socket_path, tried = _find_socket(args)
    except KvxferError as exc:
        print(f"kvxferd status: config error: {exc}", file=sys.stderr)
        return 2
    if socket_path is None or not Path(socket_path).exists():
        print(f"kvxferd status: no daemon socket at {', '.join(tried)}; is kvxferd running? "
              f"(pass --socket PATH or --config FILE)", file=sys.stderr)
        return 1
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
    print(format_status(status))
    return 0


def _age(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_status(status: dict[str, Any]) -> str:
    """``kvxferd status`` for people: one header, then ranks, peers, requests, failures."""
    import time
    name = f"  {status['name']}" if status.get("name") else ""
    out = [f"kvxferd {status['version']}{name}  pid {status['pid']}  up {_age(status['uptime_s'])}  "
           f"{'ready' if status['ready'] else 'not ready'}{'  draining' if status['draining'] else ''}",
           f"  engine  {status['engine_endpoint']}",
           f"  peer    {status['peer_endpoint']}",
           f"  data    {status['data_endpoint']}",
           f"  metrics {status['metrics_url'] or '(disabled)'}",
           f"  copies  {_copy_path(status.get('copy_path') or {})}",
           "", f"ranks ({len(status['ranks'])})"]
    for r in status["ranks"]:
        g = r["geometry"]
        out.append(f"  {r['rank_id']:<28} {r['role']:<8} {g['attention']} layers={g['num_layers']} "
                   f"kv_heads={g['total_kv_heads']} head_dim={g['head_dim']} {g['dtype']} "
                   f"page_size={g['page_size']} tp={g['tp_rank']}/{g['tp_size']} pp={g['pp_rank']}/{g['pp_size']} "
                   f"pages={g['num_pages']}" + (f" dp_size={r['dp_size']}" if r.get("dp_size") else ""))
    out += _format_rank_maps(status.get("rendezvous") or {})
    out += ["", f"peers ({len(status['peers'])})"]
    for p in status["peers"]:
        out.append(f"  {p['address']:<24} {p['state']:<10} {p['side']:<8} last seen {p['last_seen_s']:.1f}s ago")
    out += _format_transports(status.get("transports") or {})
    requests = status["requests"]
    out += ["", f"requests in flight ({sum(requests.values())})"]
    for state, n in sorted(requests.items()):
        out.append(f"  {state:<32} {n}")
    refusals = status.get("auth") or {}
    if refusals.get("refused_here") or refusals.get("refused_by_peers"):
        out += ["", "authentication"]
        for r in refusals.get("refused_here", []):
            out.append(f"  refused here: key {r['key']} from {r['address']} ({r['reason']}) x{r['count']}, "
                       f"last {time.strftime('%H:%M:%S', time.localtime(r['last']))}")
        for r in refusals.get("refused_by_peers", []):
            out.append(f"  refused by {r['address']} x{r['count']}, last "
                       f"{time.strftime('%H:%M:%S', time.localtime(r['last']))}: {r['reason']}")
    failures = status["recent_failures"]
    out += ["", f"recent failures ({len(failures)}, newest last)"]
    for f in failures[-10:]:
        when = time.strftime("%H:%M:%S", time.localtime(f["time"])) if isinstance(f.get("time"), (int, float)) else "-"
        out.append(f"  {when}  {f['side']:<8} {f['request_id']:<20} {f['code']:<20} {f['reason'][:80]}")
    return "\n".join(out)


def _copy_path(copy: dict[str, Any]) -> str:
    if copy.get("path") == "native":
        return f"native ({copy.get('library')})"
    return f"torch, several times slower: {copy.get('reason', '?')}"


def _format_transports(transports: dict[str, Any]) -> list[str]:
    """The transport each instance pair runs on; a pair passed over this daemon's first
    preference says why (a fallback is never silent)."""
    pairs = transports.get("pairs") or []
    out = ["", f"transports (preference {', '.join(transports.get('preference') or [])}; nixl: "
               f"{transports.get('nixl', '-')})"]
    for p in pairs:
        why = f"  instead of {p['preferred']}: {p['reason']}: {p['detail'][:160]}" if p.get("reason") else ""
        out.append(f"  {p['prefill']} -> {p['decode']} via {p['peer']} ({p['side']} side): {p['transport']}{why}")
    return out


def _format_rank_maps(rendezvous: dict[str, Any]) -> list[str]:
    """Instances over several daemons: which daemon holds which rank (where this daemon is the
    rendezvous), where this daemon's ranks are announced, and refused announcements."""
    maps, announcing, refused = (rendezvous.get(k) or {} for k in ("rank_map", "announcing", "refused"))
    etcd = rendezvous.get("directory") or {}
    if not (maps or announcing or refused or etcd):
        return []
    out = ["", "instances over several daemons"]
    if etcd:
        out.append(f"  rank directory in etcd {etcd.get('endpoint')} (cluster {etcd.get('cluster')}): lease "
                   f"{etcd.get('lease') or '-'}, {etcd.get('keys', 0)} keys of ranks here"
                   + (f"; ERROR {etcd['error'][:200]}" if etcd.get("error") else ""))
    for key, where in sorted(maps.items()):
        out.append(f"  {key}: rendezvous here, {len(where)} ranks")
        by_daemon: dict[str, list[str]] = {}
        for coords, address in where.items():
            tp, _, pp = coords.partition(".")
            by_daemon.setdefault(address, []).append(f"tp{tp}/pp{pp}")
        for address, ranks in sorted(by_daemon.items()):
            out.append(f"    {address:<24} {' '.join(ranks)}")
    for key, address in sorted(announcing.items()):
        how = "in etcd for" if etcd else "announced to"
        out.append(f"  {key}: ranks here {how} rendezvous {address}")
    for key, why in sorted(refused.items()):
        out.append(f"  {key}: refused by its rendezvous: {why[:200]}")
    return out


def cmd_keygen(args: argparse.Namespace) -> int:
    from .wire import auth
    pair = auth.generate()
    try:
        path = auth.write_keypair(args.out, pair)
    except FileExistsError:
        print(f"kvxferd keygen: {args.out} exists; refusing to overwrite a key", file=sys.stderr)
        return 1
    print(f"secret key file: {path} (mode 0600)\npublic key:      {pair.public}")
    print("add the public key to the peers' auth.allowed_keys and auth.peer_keys")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .tools.demo import main as demo_main
    return demo_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvxferd", description="KV-cache transfer daemon")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="show how a prefill instance maps onto a decode instance")
    p.add_argument("--prefill", help="prefill instance geometry (JSON or TOML)")
    p.add_argument("--decode", help="decode instance geometry (JSON or TOML)")
    p.add_argument("--rendezvous", metavar="HOST:PORT",
                   help="ask this daemon (an instance's rendezvous) which daemon holds which rank of --instance; "
                        "with --decode, plan against the live instance and name each writer's daemon")
    p.add_argument("--instance", help="the instance to look up (a DP rank of a data-parallel one: NAME@dp<k>)")
    p.add_argument("--role", default="prefill", choices=("prefill", "decode"))
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--mode", default="auto", choices=("auto", "direct", "staged"))
    p.add_argument("--same-page-size", action="store_true", help="refuse differing page sizes")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    s = sub.add_parser("serve", help="run the daemon")
    s.add_argument("--config", metavar="FILE", help="TOML config file (default: embedded defaults)")
    s.add_argument("--check-config", nargs="?", const=True, default=False, metavar="FILE",
                   help="validate the config (FILE, or --config's, plus KVXFERD_* overrides) and exit: "
                        "0 when valid, 2 with the offending key otherwise")
    s.set_defaults(func=cmd_serve)

    st = sub.add_parser("status", help="ask a running daemon for its state")
    st.add_argument("--socket", help="engine socket path (default: found where `serve` binds it)")
    st.add_argument("--config", metavar="FILE", help="read the socket path from this config")
    st.add_argument("--timeout", type=float, default=5.0)
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    k = sub.add_parser("keygen", help="generate a CURVE key pair for authenticated peer links")
    k.add_argument("--out", default="kvxferd.key", help="secret key file to create (public key beside it, .pub)")
    k.set_defaults(func=cmd_keygen)

    d = sub.add_parser("demo", help="run daemons and engines on loopback and verify every byte")
    d.add_argument("--requests", type=int, default=24)
    d.add_argument("--transport", default="tcp", choices=("tcp", "local", "nixl"))
    d.add_argument("--mode", default="auto", choices=("auto", "direct", "staged"))
    d.add_argument("--json", action="store_true")
    d.add_argument("--seed", type=int, default=1)
    d.set_defaults(func=cmd_demo)

    def cmd_bench(args: argparse.Namespace) -> int:
        from .tools.bench.cli import main as bench_main
        return bench_main(args)

    b = sub.add_parser("bench", help="measure throughput, latency and limits on loopback; verify every byte")
    size = b.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="only the rows the ratios and targets read, at payloads big enough for them")
    size.add_argument("--smoke", action="store_true",
                      help="the machinery only: one row of each kind, tiny payloads, no ratios (what the tests run)")
    b.add_argument("--json", action="store_true", help="print one JSON object instead of the table (save it "
                   "to draw or print it again with --from-json)")
    b.add_argument("--plot", metavar="FILE.svg", help="also draw every target against its goal, as SVG")
    b.add_argument("--from-json", metavar="FILE", help="run nothing: read a run saved with --json, and print "
                   "or draw it (ratios and targets computed again)")
    b.add_argument("--only", metavar="REGEX", help="run only the kvxferd scenarios whose name matches, with "
                   "the limits they read (peer engines only beside throughput rows; the planner row only if "
                   "'planner' matches)")
    b.add_argument("--seed", type=int, default=1)
    b.set_defaults(func=cmd_bench)

    def cmd_soak(args: argparse.Namespace) -> int:
        from .tools.soak import main as soak_main
        return soak_main(args)

    so = sub.add_parser("soak", help="a long mixed run with churn, killed engines and a restarted daemon; checks "
                                     "every byte and that the daemons come back to their baseline")
    so.add_argument("--duration", type=float, default=1800.0, help="seconds in all, warm-up included")
    so.add_argument("--warmup", type=float, default=None,
                    help="seconds of traffic before the baseline is taken (default 15%% of the duration, 20 to 120)")
    so.add_argument("--transports", default="", help="comma-separated, of tcp,nixl (default both; NIXL is "
                                                     "skipped, and the summary says so, where it cannot start)")
    so.add_argument("--pairs", type=int, default=2, help="instance pairs at a time per transport")
    so.add_argument("--kill-rate", type=float, default=0.3,
                    help="share of instance pairs that lose an engine rank mid-request")
    so.add_argument("--seed", type=int, default=1)
    so.add_argument("--out", metavar="FILE.json",
                    help="also write the summary there (tools/reliability_report.py --soak reads it)")
    so.add_argument("--json", action="store_true", help="print one JSON line and no progress")
    so.set_defaults(func=cmd_soak)
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

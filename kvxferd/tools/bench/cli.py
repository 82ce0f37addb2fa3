"""``kvxferd bench``: run (or load a saved run), print the table or the JSON, draw the plot."""

from __future__ import annotations

import json
import sys
from typing import Any

from .model import say


def _size(args: Any) -> str:
    if getattr(args, "smoke", False):
        return "smoke"
    return "quick" if getattr(args, "quick", False) else "full"


def main(args: Any) -> int:
    plot_path = getattr(args, "plot", None)
    saved = getattr(args, "from_json", None)
    if plot_path and not plot_path.endswith(".svg"):
        print(f"kvxferd bench: --plot writes SVG; {plot_path!r} does not end in .svg (use e.g. --plot bench.svg)",
              file=sys.stderr)
        return 2
    if saved:
        from .run import load_report
        try:
            report, rows = load_report(saved)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"kvxferd bench: --from-json {saved}: cannot read a saved run ({type(exc).__name__}: {exc}); "
                  "save one with `kvxferd bench --json > FILE`", file=sys.stderr)
            return 2
    else:
        from ...ops.signals import cleanup_on_signals
        from .run import run_all
        with cleanup_on_signals():  # SIGTERM/SIGINT/SIGHUP: stop the daemons and engines, remove their files
            report, rows = run_all(_size(args), getattr(args, "only", None), int(getattr(args, "seed", 1) or 1))
    if plot_path:
        from .plot import write_svg
        write_svg(report, plot_path)
        say(f"wrote {plot_path}")
    if getattr(args, "json", False):
        print(json.dumps(report, default=str))
    else:
        from .report import render_text
        print(render_text(report, rows))
    return 0 if report["verified"] else 1

"""``kvxferd bench --plot FILE.svg``: every target of a run as a bar against its goal.

Figures have different units (ratios, milliseconds, requests per second), so each bar is
the figure as a share of its goal, oriented so that longer is better: value / goal where
higher is better, goal / value where lower is better. The goal is the line at 1.0; a bar
that reaches it met its target. The figure itself and the goal are written beside each
bar. The SVG is written by hand (no plotting library), and the same report always gives
the same bytes.
"""

from __future__ import annotations

from html import escape
from typing import Any

WIDTH = 1060
LABEL_W = 330
BAR_W = 380
ROW_H = 22
TOP = 64
SCALE_MAX = 2.0  # bars longer than twice the goal are clipped (and say so)
COLORS = {True: "#2e7d32", False: "#c62828", None: "#9e9e9e"}


def share_of_goal(target: dict[str, Any]) -> float | None:
    """The figure as a share of its goal, longer is better; None when there is no figure."""
    value, goal = target.get("value"), target.get("goal_value")
    if value is None or goal is None:
        return None
    if target.get("higher_is_better", True):
        return value / goal if goal else None
    return goal / value if value > 0 else SCALE_MAX


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _row(i: int, t: dict[str, Any]) -> list[str]:
    y = TOP + i * ROW_H
    share = share_of_goal(t)
    unit = "x" if t.get("unit") == "x" else f" {t.get('unit', '')}"
    out = [f'<text x="{LABEL_W - 8}" y="{y + 15}" text-anchor="end">{escape(t["target"])}</text>']
    if share is None:
        note = t.get("note") or "not measured in this run"
        out.append(f'<text x="{LABEL_W + 4}" y="{y + 15}" fill="{COLORS[None]}">n/a: {escape(note)}</text>')
        return out
    w = min(share, SCALE_MAX) / SCALE_MAX * BAR_W
    color = COLORS[t.get("met")]
    out.append(f'<rect x="{LABEL_W}" y="{y + 4}" width="{w:.1f}" height="{ROW_H - 8}" fill="{color}">'
               f'<title>{escape(t["target"])}: {share:.2f} of goal</title></rect>')
    clipped = " (clipped)" if share > SCALE_MAX else ""
    out.append(f'<text x="{LABEL_W + BAR_W + 8}" y="{y + 15}">{_fmt(t["value"])}{escape(unit)}, goal '
               f'{escape(t["goal"])}: {"met" if t.get("met") else "missed"}{clipped}</text>')
    return out


def _axis(height: int) -> list[str]:
    goal_x = LABEL_W + BAR_W / SCALE_MAX
    bottom = height - 40
    out = [f'<line x1="{LABEL_W}" y1="{TOP - 4}" x2="{LABEL_W}" y2="{bottom}" stroke="#444"/>',
           f'<line x1="{goal_x:.1f}" y1="{TOP - 4}" x2="{goal_x:.1f}" y2="{bottom}" stroke="#000" '
           'stroke-dasharray="4 3"/>',
           f'<text x="{goal_x:.1f}" y="{TOP - 8}" text-anchor="middle">goal</text>']
    for tick in (0.0, 0.5, 1.0, 1.5, 2.0):
        x = LABEL_W + BAR_W * tick / SCALE_MAX
        out.append(f'<text x="{x:.1f}" y="{bottom + 14}" text-anchor="middle" fill="#666">{tick:g}</text>')
    out.append(f'<text x="{LABEL_W + BAR_W / 2:.1f}" y="{bottom + 32}" text-anchor="middle" fill="#666">'
               'share of goal (1 = goal met exactly; longer is better)</text>')
    return out


def render_svg(report: dict[str, Any]) -> str:
    """The SVG document for a bench report (live or loaded from ``--json``)."""
    targets = report.get("targets") or []
    height = TOP + ROW_H * max(1, len(targets)) + 48
    m = report.get("machine") or {}
    size = report.get("size") or ("quick" if report.get("quick") else "full")
    title = f"kvxferd bench ({size} run): figures against their targets"
    sub = (f"{m.get('cores', '?')} cores, {m.get('cpu', '')}; bytes verified: "
           f"{'yes' if report.get('verified') else 'NO'}; green met, red missed, grey not measured")
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
             f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">',
             f'<rect width="{WIDTH}" height="{height}" fill="#fff"/>',
             f'<text x="12" y="22" font-size="15" font-weight="bold">{escape(title)}</text>',
             f'<text x="12" y="40" fill="#444">{escape(sub)}</text>']
    for i, t in enumerate(targets):
        parts += _row(i, t)
    parts += _axis(height)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write_svg(report: dict[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_svg(report))

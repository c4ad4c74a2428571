"""|Δ logprob| against prompt length, one line per target, as a self-contained SVG (no dependencies).

x: prompt length (log scale); y: max |Δ logprob| per prompt (solid) and mean (dashed), log scale.
A log scale has no zero: exact zeros (bit-identical logprobs, common for the base model) are drawn
as open circles in a strip of their own below the axis, labelled "0 (exact)", and the lines break
there instead of diving to the bottom. The tolerance on the max is a dashed red line. A failing
prompt has a red ring. Prompts with NaN, errors or runs of token 0 have no |Δ| to plot: they are
marked × in a band above the plot, one row per target.
"""

from __future__ import annotations

import math
from html import escape

from hylora.doctor.compare import Diff, Tolerance
from hylora.doctor.sweep import TargetSweep, label

COLORS = ["#555555", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
W, H_PLOT = 800, 320  # width; height of the plot area (the log axis)
LEFT, RIGHT, TITLE, BOTTOM, ROW = 74, 150, 26, 46, 13
ZERO_GAP, ZERO_H = 8, 18  # the strip for exact zeros, below the log axis
RED = "#d62728"


def _bad(d: Diff) -> str | None:
    if d.error:
        return "error"
    if d.non_finite:
        return "NaN"
    if d.token0_run >= 3:
        return "token 0 run"
    return None


class _Axes:
    """Log-log mapping of (length, |Δ|) into the plot area."""

    def __init__(self, lengths: list[int], values: list[float], tol: Tolerance, top: float):
        self.x_lo, self.x_hi = math.log2(lengths[0]), math.log2(max(lengths[-1], lengths[0] * 2))
        self.y_lo = math.floor(math.log10(min([*values, tol.mean / 10])))  # positive values only: 0 has its strip
        self.y_hi = math.ceil(math.log10(max([*values, tol.max * 3])))
        self.top, self.width = top, W - LEFT - RIGHT
        self.zero_y = top + H_PLOT + ZERO_GAP + ZERO_H / 2  # the middle of the exact-zero strip

    def x(self, n: int) -> float:
        return LEFT + (math.log2(n) - self.x_lo) / (self.x_hi - self.x_lo) * self.width

    def y(self, v: float) -> float:
        if v <= 0.0:
            return self.zero_y
        v = max(v, 10.0**self.y_lo)
        return self.top + (self.y_hi - math.log10(v)) / (self.y_hi - self.y_lo) * H_PLOT


def sweep_svg(sweeps: list[TargetSweep], tol: Tolerance, title: str = "|Δ logprob| vs the merged reference") -> str:
    diffs = [d for s in sweeps for d in s.diffs]
    if not diffs:
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="30"><text y="20">no sweep data</text></svg>'
        )
    band = ROW * len(sweeps) + 6  # the NaN / error rows
    top = TITLE + band + 8
    height = top + H_PLOT + ZERO_GAP + ZERO_H + BOTTOM
    values = [v for d in diffs if not _bad(d) for v in (d.max_abs, d.mean_abs) if v > 0]
    ax = _Axes(sorted({d.length for d in diffs}), values, tol, top)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" viewBox="0 0 {W} {height}" '
        'font-family="sans-serif" font-size="11">',
        f'<text x="{LEFT}" y="16" font-size="13" font-weight="bold">{escape(title)}</text>',
        f'<rect x="{LEFT}" y="{TITLE}" width="{ax.width}" height="{band}" fill="#fdecea"/>',
        f'<text x="{LEFT - 6}" y="{TITLE + band / 2 + 4}" text-anchor="end" fill="#b00">NaN / error</text>',
        f'<rect x="{LEFT}" y="{top}" width="{ax.width}" height="{H_PLOT}" fill="#fafafa" stroke="#999"/>',
        f'<rect x="{LEFT}" y="{top + H_PLOT + ZERO_GAP}" width="{ax.width}" height="{ZERO_H}" fill="#f0f0f0" '
        'stroke="#999" stroke-dasharray="2 2"/>',
        f'<text x="{LEFT - 6}" y="{top + H_PLOT + ZERO_GAP + ZERO_H / 2 + 4}" text-anchor="end">0 (exact)</text>',
    ]
    out += _grid(ax)
    ty = ax.y(tol.max)
    out += [
        f'<line x1="{LEFT}" x2="{LEFT + ax.width}" y1="{ty:.1f}" y2="{ty:.1f}" stroke="{RED}" stroke-dasharray="6 4"/>',
        f'<text x="{LEFT + ax.width - 4}" y="{ty - 4:.1f}" text-anchor="end" fill="{RED}">'
        f"max tolerance {tol.max:g}</text>",
        f'<text x="{LEFT + ax.width / 2}" y="{height - 10}" text-anchor="middle">'
        "prompt length (tokens, log scale)</text>",
        f'<text transform="translate(16 {top + H_PLOT / 2}) rotate(-90)" text-anchor="middle">'
        "|Δ logprob| per prompt (log scale)</text>",
    ]
    for i, s in enumerate(sweeps):
        out += _series(ax, s, COLORS[i % len(COLORS)], TITLE + 3 + ROW * i + ROW / 2, tol)
    out += _legend(sweeps, LEFT + ax.width + 14, top + 10)
    out.append("</svg>")
    return "\n".join(out)


def _grid(ax: _Axes) -> list[str]:
    out = []
    for e in range(ax.y_lo, ax.y_hi + 1):
        yy = ax.y(10.0**e)
        out.append(f'<line x1="{LEFT}" x2="{LEFT + ax.width}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#e3e3e3"/>')
        out.append(f'<text x="{LEFT - 6}" y="{yy + 4:.1f}" text-anchor="end">1e{e}</text>')
    step = 2 if ax.x_hi - ax.x_lo > 8 else 1
    for k in range(math.ceil(ax.x_lo), math.floor(ax.x_hi) + 1, step):
        xx = ax.x(2**k)
        out.append(f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{ax.top}" y2="{ax.top + H_PLOT}" stroke="#eee"/>')
        out.append(
            f'<text x="{xx:.1f}" y="{ax.top + H_PLOT + ZERO_GAP + ZERO_H + 15}" text-anchor="middle">{2**k}</text>'
        )
    return out


def _runs(ax: _Axes, diffs: list[Diff], attr: str) -> list[list[tuple[float, float]]]:
    """Consecutive plottable points with |Δ| > 0: a line joins them; a zero or a NaN breaks it."""
    runs: list[list[tuple[float, float]]] = [[]]
    for d in diffs:
        v = getattr(d, attr)
        if _bad(d) or v <= 0.0:
            runs.append([])
        else:
            runs[-1].append((ax.x(d.length), ax.y(v)))
    return [r for r in runs if r]


def _series(ax: _Axes, s: TargetSweep, color: str, band_y: float, tol: Tolerance) -> list[str]:
    out = []
    name = label(s.target)
    for attr, dash, width in (("max_abs", "", 2), ("mean_abs", ' stroke-dasharray="3 3"', 1.2)):
        for run in _runs(ax, s.diffs, attr):
            if len(run) > 1:
                path = " ".join(f"{px:.1f},{py:.1f}" for px, py in run)
                out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="{width}"{dash}/>')
            elif attr == "mean_abs":  # a lone mean between zeros: a short tick, so that it shows
                (px, py) = run[0]
                out.append(f'<line x1="{px - 4:.1f}" x2="{px + 4:.1f}" y1="{py:.1f}" y2="{py:.1f}" stroke="{color}"/>')
    for d in s.diffs:
        xx, bad = ax.x(d.length), _bad(d)
        if bad:
            tip = escape(f"{name} {d.length} tokens: {'; '.join(d.problems(tol))}")
            out.append(
                f'<text x="{xx:.1f}" y="{band_y + 4:.1f}" text-anchor="middle" fill="{color}" font-size="13" '
                f'font-weight="bold">×<title>{tip}</title></text>'
            )
            continue
        yy = ax.y(d.max_abs)
        zero = d.max_abs <= 0.0
        what = f"max {d.max_abs:.2e}, mean {d.mean_abs:.2e}"
        if zero:
            what = "exactly 0 (bit-identical)" if d.positions else "no logprob compared"
        tip = escape(f"{name} {d.length} tokens: {'; '.join([what, *d.problems(tol)])}")
        fill = "white" if zero else color
        out.append(
            f'<circle cx="{xx:.1f}" cy="{yy:.1f}" r="3" fill="{fill}" stroke="{color}"><title>{tip}</title></circle>'
        )
        if not d.ok(tol):
            out.append(f'<circle cx="{xx:.1f}" cy="{yy:.1f}" r="7" fill="none" stroke="{RED}" stroke-width="2"/>')
    return out


def _legend(sweeps: list[TargetSweep], lx: float, ly: float) -> list[str]:
    out = []
    for i, s in enumerate(sweeps):
        y = ly + 18 * i
        color = COLORS[i % len(COLORS)]
        out.append(f'<line x1="{lx}" x2="{lx + 22}" y1="{y}" y2="{y}" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{lx + 28}" y="{y + 4}">{escape(label(s.target))}</text>')
    y = ly + 18 * len(sweeps) + 10
    return out + [
        f'<line x1="{lx}" x2="{lx + 22}" y1="{y}" y2="{y}" stroke="#333" stroke-width="2"/>',
        f'<text x="{lx + 28}" y="{y + 4}">max</text>',
        f'<line x1="{lx}" x2="{lx + 22}" y1="{y + 16}" y2="{y + 16}" stroke="#333" stroke-dasharray="3 3"/>',
        f'<text x="{lx + 28}" y="{y + 20}">mean</text>',
        f'<circle cx="{lx + 11}" cy="{y + 34}" r="6" fill="none" stroke="{RED}" stroke-width="2"/>',
        f'<text x="{lx + 28}" y="{y + 38}">fails</text>',
        f'<text x="{lx + 5}" y="{y + 56}" fill="#b00" font-weight="bold" font-size="13">×</text>',
        f'<text x="{lx + 28}" y="{y + 55}">NaN / error</text>',
        f'<circle cx="{lx + 11}" cy="{y + 70}" r="3" fill="white" stroke="#333"/>',
        f'<text x="{lx + 28}" y="{y + 74}">exactly 0</text>',
    ]

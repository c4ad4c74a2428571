"""`--report FILE.html`: one self-contained page (inline CSS and SVG, no scripts, nothing fetched)."""

from __future__ import annotations

from html import escape
from pathlib import Path

from hylora.doctor.doctor import Report
from hylora.doctor.plot import sweep_svg
from hylora.doctor.report import cell, tolerance_text
from hylora.doctor.result import Status
from hylora.doctor.sweep import label

CSS = """
body { font-family: -apple-system, 'Segoe UI', sans-serif; margin: 24px; color: #222; max-width: 1100px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; }
.meta { color: #555; font-size: 13px; line-height: 1.5; }
.verdict { display: inline-block; padding: 6px 14px; border-radius: 4px; font-weight: bold; color: white; }
.pass { background: #2e7d32; } .fail { background: #c62828; } .skip { background: #757575; }
table { border-collapse: collapse; font-size: 13px; margin-top: 8px; }
td, th { border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num { text-align: right; font-family: monospace; }
td.bad { background: #fdecea; color: #b00; font-weight: bold; }
.status { font-weight: bold; text-transform: uppercase; font-size: 12px; padding: 2px 6px; border-radius: 3px;
  color: white; }
ul.failures li { color: #b00; margin: 2px 0; font-size: 13px; } ul.notes li { color: #555; font-size: 13px; }
"""


def render_html(report: Report) -> str:
    verdict = "pass" if report.passed else "fail"
    failed = [c.name for c in report.checks if c.status is Status.FAIL]
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><title>hylora doctor</title>',
        f"<style>{CSS}</style></head><body>",
        "<h1>hylora doctor</h1>",
        f'<div class="verdict {verdict}">'
        + ("PASSED" if report.passed else "FAILED: " + escape(", ".join(failed) or "no check passed"))
        + f" (exit {report.exit_code})</div>",
        '<p class="meta">'
        f"<b>checked</b> {escape(report.deployment)}<br>"
        f"<b>reference</b> {escape(report.reference)}<br>"
        f"<b>targets</b> {escape(', '.join(report.targets))}; "
        f"<b>prompt lengths</b> {escape(', '.join(map(str, report.lengths)))}<br>"
        f"<b>tolerance</b> {escape(tolerance_text(report.tolerance))}: {escape(report.tolerance_why)}<br>"
        f"<b>measured noise</b> {escape(report.noise.text())}<br>"
        f"<b>took</b> {report.elapsed_s:.0f} s</p>",
        "<h2>Checks</h2><table><tr><th>check</th><th>result</th><th>details</th></tr>",
    ]
    for c in report.checks:
        parts.append(
            f'<tr><td>{escape(c.name)}</td><td><span class="status {c.status.value}">{c.status.value}</span></td>'
            f"<td>{escape(c.summary)}</td></tr>"
        )
    parts.append("</table>")
    parts.append("<h2>Fidelity sweep</h2>")
    parts.append(sweep_svg(report.sweeps, report.tolerance))
    parts.append(_sweep_table(report))
    failing = [(c.name, f) for c in report.checks for f in c.failures]
    if failing:
        parts.append("<h2>Failing cases</h2><ul class='failures'>")
        parts += [f"<li><b>{escape(name)}</b>: {escape(f)}</li>" for name, f in failing]
        parts.append("</ul>")
    notes = [(c.name, n) for c in report.checks for n in c.notes] + [("limits", x) for x in report.limits]
    if notes:
        parts.append("<h2>Notes and what could not be checked</h2><ul class='notes'>")
        parts += [f"<li><b>{escape(name)}</b>: {escape(n)}</li>" for name, n in notes]
        parts.append("</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _sweep_table(report: Report) -> str:
    sweeps, tol = report.sweeps, report.tolerance
    if not sweeps:
        return ""
    lengths = sorted({d.length for s in sweeps for d in s.diffs})
    by = {(label(s.target), d.length): d for s in sweeps for d in s.diffs}
    names = [label(s.target) for s in sweeps]
    rows = ["<table><tr><th>tokens</th>" + "".join(f"<th>{escape(n)} max / mean / top-1</th>" for n in names) + "</tr>"]
    for n in lengths:
        cells = []
        for name in names:
            d = by.get((name, n))
            if d is None:
                cells.append("<td>-</td>")
                continue
            bad = not d.ok(tol)
            rate = d.top1_rate
            text = (
                cell(d, tol)
                if bad and (d.error or d.non_finite or d.token0_run >= 3)
                else (f"{d.max_abs:.1e} / {d.mean_abs:.1e} / " + ("-" if rate is None else f"{rate:.0%}"))
            )
            title = escape("; ".join(d.problems(tol)), quote=True)
            cells.append(f'<td class="num{" bad" if bad else ""}" title="{title}">{escape(text)}</td>')
        rows.append(f"<tr><td class='num'>{n}</td>{''.join(cells)}</tr>")
    rows.append("</table>")
    return "\n".join(rows)


def write_html(report: Report, path: str | Path) -> None:
    Path(path).write_text(render_html(report), encoding="utf-8")

"""The report as terminal text and as JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

from hylora.doctor.compare import Diff, Tolerance
from hylora.doctor.doctor import Report
from hylora.doctor.result import Status
from hylora.doctor.sweep import TargetSweep, label

SHOWN_FAILURES = 10


def tolerance_text(tol: Tolerance) -> str:
    top1 = f"top-1 agreement ≥ {tol.top1:.0%} (ties within {tol.tie:g})"
    return f"|Δ logprob| mean ≤ {tol.mean:g}, max ≤ {tol.max:g}; {top1}"


def cell(d: Diff, tol: Tolerance) -> str:
    """One sweep result in a few characters: max |Δ|, or what went wrong; `*` marks a failure."""
    if d.error:
        text = "error"
    elif d.non_finite:
        text = "NaN"
    elif d.token0_run >= 3:
        text = "!!!"
    else:
        text = f"{d.max_abs:.1e}" if d.max_abs else "0"
    return text + ("*" if not d.ok(tol) else "")


def sweep_table(sweeps: list[TargetSweep], tol: Tolerance) -> list[str]:
    if not sweeps:
        return []
    lengths = sorted({d.length for s in sweeps for d in s.diffs})
    by = {(label(s.target), d.length): d for s in sweeps for d in s.diffs}
    names = [label(s.target) for s in sweeps]
    lines = ["max |Δ logprob| per prompt length (* = fails)", f"{'tokens':>7}  " + "".join(f"{n:>10}" for n in names)]
    for n in lengths:
        row = "".join(f"{cell(by[(name, n)], tol) if (name, n) in by else '-':>10}" for name in names)
        lines.append(f"{n:>7}  {row}")
    cliffs = [f"{label(s.target)}: " + ("refused" if s.refused else f"cliff at {s.cliff}") for s in sweeps if s.cliff]
    if cliffs:
        lines.append("first failing length — " + ", ".join(cliffs))
    return lines


def render_text(report: Report) -> str:
    lines = [
        f"hylora doctor — {report.deployment}",
        f"reference: {report.reference}",
        f"targets: {', '.join(report.targets)}; prompt lengths {report.lengths[0]}…{report.lengths[-1]}",
        f"tolerance: {tolerance_text(report.tolerance)}",
        *([f"           {report.tolerance_why}"] if report.tolerance_why else []),
        f"noise: {report.noise.text()}",
        "",
    ]
    for c in report.checks:
        lines.append(f"{c.name:<15} {c.status.value.upper():<5} {c.summary}")
        for f in c.failures[:SHOWN_FAILURES]:
            lines.append(f"{'':<22}✗ {f}")
        if len(c.failures) > SHOWN_FAILURES:
            lines.append(f"{'':<22}… and {len(c.failures) - SHOWN_FAILURES} more (--json / --report)")
    lines += [""] + sweep_table(report.sweeps, report.tolerance)
    if report.limits:
        lines += ["", "could not be checked on this deployment:"] + [f"  - {x}" for x in report.limits]
    failed = [c.name for c in report.checks if c.status is Status.FAIL]
    verdict = "PASSED" if report.passed else "FAILED: " + (", ".join(failed) or "no check passed")
    lines += ["", f"{verdict} (exit {report.exit_code}) in {report.elapsed_s:.0f} s"]
    return "\n".join(lines)


def write_json(report: Report, path: str | Path) -> None:
    data = report.as_dict()
    data["sweep"] = [s.as_dict() for s in report.sweeps]
    Path(path).write_text(json.dumps(_finite(data), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _finite(value):
    """JSON has no NaN / Infinity: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value

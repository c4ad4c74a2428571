"""Check 1: the fast kernels the engine chose at start-up, from the verdicts it recorded
(`engine.kernels`: one `hylora.kernels.KernelVerdict` per kernel).

A fast kernel in use passes with the error of its start-up check (the largest over the boundary
sizes it was checked at); a kernel whose check failed, so that the engine fell back to the
reference, is a failure here (a silent fallback hides a broken kernel and costs speed); the
reference alone is not a check (skipped, with the reason the engine gave).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from hylora.doctor.result import CheckResult, Status
from hylora.kernels import KernelVerdict


def check_kernels(kernels: Mapping[str, KernelVerdict] | None) -> CheckResult:
    """One short summary line; the per-kernel record goes to the notes and the data."""
    if kernels is None:
        return CheckResult(
            "kernels", Status.SKIP, "in-process only: a server's kernels are checked through its outputs (sweep)"
        )
    verdicts = [kernels[name] for name in sorted(kernels)]
    failures, passed, reference = [], [], []
    for v in verdicts:
        if v.check_failed:
            failures.append(f"{v.kernel}: the fast kernel failed its start-up check, serving the reference: {v.reason}")
        elif v.fast and v.error is None:
            failures.append(f"{v.kernel}: {v.implementation} is in use but the engine recorded no check of it")
        elif v.fast:
            passed.append(f"{v.kernel} {v.implementation} {v.error:.0e}")
        else:
            reference.append(v)
    data = {v.kernel: v.as_dict() for v in verdicts}
    on_reference = _reference_text(reference)
    notes = passed + [f"reference: {v.kernel}" + (f" ({v.reason})" if v.reason else "") for v in reference]
    if not failures and not passed:
        return CheckResult("kernels", Status.SKIP, f"no fast kernels in use: {on_reference}", notes=notes, data=data)
    if failures:
        names = ", ".join(f.split(":", 1)[0] for f in failures)
        summary = f"{len(failures)} of {len(verdicts)} kernels failed: {names}"
    else:
        summary = f"{len(passed)} fast kernels passed their start-up checks"
        summary += f"; {on_reference}" if reference else ""
    return CheckResult.judged("kernels", summary, len(passed), failures, notes=notes, data=data)


def _reference_text(reference: list[KernelVerdict]) -> str:
    """E.g. '9 on the reference (8: no CUDA or no triton)': the kernels by reason, counted."""
    reasons = Counter(v.reason for v in reference if v.reason)
    why = "; ".join(f"{n}: {r}" if n > 1 else r for r, n in reasons.most_common())
    return f"{len(reference)} on the reference" + (f" ({why})" if why else "")

"""Check 1: the fast kernels the engine chose at start-up, from what it recorded (`engine.kernels`).

The engine records one verdict per kernel as text, `"<implementation> (<why>)"`: e.g.
`"fla (max rel. error 3.1e-03 vs the reference)"`, `"triton (max rel. error ...)"`, `"reference"`,
`"reference (fla not installed)"`, `"reference (rel. error 4.00e-01 > 2e-02)"`. A fast kernel in use
passes with the error of its start-up check (the largest over the boundary sizes it was checked
at); a kernel whose check failed, so that the engine fell back to the reference, is a failure here
(a silent fallback hides a broken kernel and costs speed); the reference alone is not a check
(skipped, with the reason the engine gave).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hylora.doctor.result import CheckResult, Status

ERROR = re.compile(r"error\s+(?:of\s+)?([-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|inf|nan))", re.IGNORECASE)
CHECK_FAILED = re.compile(r"disagree|fail|>|mismatch|nan\b|inf\b", re.IGNORECASE)


@dataclass(frozen=True)
class KernelVerdict:
    kernel: str
    implementation: str
    why: str
    error: float | None  # the start-up check's error, when recorded

    @property
    def fast(self) -> bool:
        return not self.implementation.startswith("reference")

    @property
    def check_failed(self) -> bool:
        """The engine fell back to the reference because the fast kernel failed its check."""
        return not self.fast and (self.error is not None or bool(CHECK_FAILED.search(self.why)))


def parse_verdict(kernel: str, text: str) -> KernelVerdict:
    implementation, _, rest = str(text).partition(" (")
    why = rest[:-1] if rest.endswith(")") else rest
    m = ERROR.search(why)
    return KernelVerdict(kernel, implementation.strip(), why, float(m.group(1)) if m else None)


def check_kernels(kernels: dict[str, str] | None) -> CheckResult:
    if kernels is None:
        return CheckResult(
            "kernels", Status.SKIP, "in-process only: a server's kernels are checked through its outputs (sweep)"
        )
    verdicts = [parse_verdict(k, v) for k, v in sorted(kernels.items())]
    failures, passed, reference = [], [], []
    for v in verdicts:
        if v.check_failed:
            failures.append(f"{v.kernel}: the fast kernel failed its start-up check, serving the reference: {v.why}")
        elif v.fast and v.error is None:
            failures.append(f"{v.kernel}: {v.implementation} is in use but the engine recorded no check of it")
        elif v.fast:
            passed.append(f"{v.kernel}: {v.implementation}, start-up check error {v.error:.1e}")
        else:
            reference.append(f"{v.kernel}: reference" + (f" ({v.why})" if v.why else ""))
    data = {v.kernel: {"implementation": v.implementation, "why": v.why, "error": v.error} for v in verdicts}
    if not failures and not passed:
        return CheckResult(
            "kernels", Status.SKIP, "no fast kernels in use: " + "; ".join(reference), notes=reference, data=data
        )
    summary = "; ".join(failures or passed)
    return CheckResult.judged("kernels", summary, len(passed), failures, notes=passed + reference, data=data)

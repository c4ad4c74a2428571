"""The order doctor runs things in, and the report it hands back.

0. the reference for every target (first: in-process it folds adapters into the served weights);
1. the sweep's short prompts (≤ `short_max` tokens), one at a time;
2. mixed batches (short prompts, all targets at once);
3. pollution: probe, burst of long requests (+ a video, + an injected NaN in-process), probe;
4. the sweep's long prompts;
5. load, when asked for.
Short prompts go before the long burst so that a server whose long requests poison later ones is
caught by the pollution check, not mistaken for a length cliff at every length.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hylora.doctor.batches import check_mixed, judge_pollution, run_pollution
from hylora.doctor.compare import Tolerance
from hylora.doctor.deployment import Deployment
from hylora.doctor.effect import check_adapter_effect
from hylora.doctor.kernels import check_kernels
from hylora.doctor.load import check_load
from hylora.doctor.prompts import SHORT_MAX, mixed_windows
from hylora.doctor.reference import Reference
from hylora.doctor.result import CheckResult, Status
from hylora.doctor.scores import TokenTexts
from hylora.doctor.sweep import SweepData, TargetSweep, check_fidelity, label
from hylora.kernels import KernelVerdict

log = logging.getLogger(__name__)


@dataclass
class DoctorOptions:
    lengths: list[int]  # the sweep's prompt lengths; the longest is also the burst's
    tolerance: Tolerance
    short_max: int = SHORT_MAX
    burst_size: int = 2
    load_seconds: float = 0.0  # 0: no load check
    load_streams: int = 8
    load_max_tokens: int = 16
    video: Path | None = None  # a video for the pollution burst


@dataclass
class Report:
    deployment: str
    reference: str
    targets: list[str]
    lengths: list[int]
    tolerance: Tolerance
    checks: list[CheckResult]
    sweeps: list[TargetSweep]
    limits: list[str] = field(default_factory=list)  # what could not be checked on this deployment
    elapsed_s: float = 0.0

    @property
    def passed(self) -> bool:
        return all(c.status is not Status.FAIL for c in self.checks) and any(
            c.status is Status.PASS for c in self.checks
        )

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "exit_code": self.exit_code,
            "deployment": self.deployment,
            "reference": self.reference,
            "targets": self.targets,
            "lengths": self.lengths,
            "tolerance": vars(self.tolerance),
            "limits": self.limits,
            "elapsed_s": round(self.elapsed_s, 1),
            "checks": [c.as_dict() for c in self.checks],
        }


def run_doctor(
    deployment: Deployment,
    reference: Reference,
    adapters: list[str],
    options: DoctorOptions,
    texts: TokenTexts,
    kernels: Mapping[str, KernelVerdict] | None = None,
) -> Report:
    """Run every check on `deployment` (kernels: the engine's record, in-process only)."""
    started = time.monotonic()
    targets: list[str | None] = [None, *adapters]
    tol = options.tolerance
    longest = options.lengths[-1]
    for t in targets:
        reference.scores(t)

    sweep = SweepData()
    short = [n for n in options.lengths if n <= options.short_max]
    log.info("doctor: sweep of %d short prompt lengths × %d targets", len(short), len(targets))
    sweep.run(deployment, targets, short)
    log.info("doctor: mixed batches")
    mixed = check_mixed(deployment, targets, mixed_windows(len(reference.sequence), longest), texts, tol)
    log.info(
        "doctor: pollution%s",
        " (the numerical fault logged next is injected on purpose)" if kernels is not None else "",
    )
    pollution_run = run_pollution(
        deployment, targets, longest, options.burst_size, inject_fault=kernels is not None, video=options.video
    )
    long = [n for n in options.lengths if n > options.short_max]
    log.info("doctor: sweep of %d long prompt lengths × %d targets", len(long), len(targets))
    sweep.run(deployment, targets, long)
    pollution = judge_pollution(pollution_run, sweep, texts, tol, exact=kernels is not None)
    effect = check_adapter_effect(sweep, adapters, reference.scores, texts, tol)
    fidelity, sweeps = check_fidelity(sweep, targets, reference.scores, texts, tol)
    fidelity.notes += [f"reference for {k}: {v}" for k, v in reference.notes.items()]
    load = check_load(deployment, options.load_seconds, options.load_streams, options.load_max_tokens)
    checks = [check_kernels(kernels), effect, fidelity, mixed, pollution, load]
    return Report(
        deployment=deployment.description,
        reference=reference.description,
        targets=[label(t) for t in targets],
        lengths=options.lengths,
        tolerance=tol,
        checks=checks,
        sweeps=sweeps,
        limits=list(deployment.limits),
        elapsed_s=time.monotonic() - started,
    )

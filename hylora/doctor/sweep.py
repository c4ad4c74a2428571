"""Check 3, the fidelity sweep: per target (each adapter and the base), prompts of every boundary
length sent one at a time, per-token prompt logprobs compared with the merged-weights reference.

Per (target, length): max and mean |Δ logprob|, top-1 agreement, non-finite values and runs of
token 0. Per target: the cliff (the first length that fails) and the biggest jump (the length whose
max |Δ| is the largest multiple of the median at shorter lengths).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from hylora.doctor.compare import Diff, Tolerance, diff_reference, pooled
from hylora.doctor.deployment import Deployment
from hylora.doctor.prompts import Probe, Window
from hylora.doctor.result import CheckResult
from hylora.doctor.scores import ReferenceScores, Scores, TokenTexts

Target = str | None


def label(target: Target) -> str:
    return "base" if target is None else target


@dataclass
class SweepData:
    """Served scores of the sweep prompts, by target and length, in the order they were sent."""

    results: dict[tuple[Target, int], Scores] = field(default_factory=dict)

    def run(self, deployment: Deployment, targets: list[Target], lengths: list[int], tick=None) -> None:
        """Ascending lengths; at each length every target, one request at a time."""
        for n in lengths:
            for t in targets:
                self.results[(t, n)] = deployment.score([Probe(t, Window(0, n))])[0]
                if tick is not None:
                    tick(1)

    def lengths(self, target: Target) -> list[int]:
        return sorted(n for t, n in self.results if t == target)


@dataclass
class TargetSweep:
    target: Target
    diffs: list[Diff]
    cliff: int | None  # first length that fails
    jump: tuple[int, float] | None  # (length, max |Δ| / median max |Δ| of the shorter lengths)

    @property
    def refused(self) -> bool:
        """Every length answered with an error (e.g. an adapter the server does not have): no cliff."""
        return bool(self.diffs) and all(d.error is not None for d in self.diffs)

    def headline(self) -> str | None:
        """'relic fails from 65 tokens' / 'ghost: every request refused', or None when it passes."""
        if self.refused:
            return f"{label(self.target)}: every request refused"
        if self.cliff:
            return f"{label(self.target)} fails from {self.cliff} token{'s' * (self.cliff > 1)}"
        return None

    def as_dict(self) -> dict:
        return {
            "target": label(self.target),
            "cliff": self.cliff,
            "refused": self.refused,
            "jump": None if self.jump is None else {"length": self.jump[0], "ratio": self.jump[1]},
            "lengths": [d.as_dict() for d in self.diffs],
        }


def evaluate_target(
    data: SweepData, target: Target, ref: ReferenceScores, texts: TokenTexts, tol: Tolerance
) -> TargetSweep:
    diffs = [diff_reference(data.results[(target, n)], ref, n, texts, tol) for n in data.lengths(target)]
    cliff = next((d.length for d in diffs if not d.ok(tol)), None)
    jump, floor = None, tol.max * 1e-3
    for i, d in enumerate(diffs[1:], start=1):
        shorter = [x.max_abs for x in diffs[:i] if x.ok(tol)]
        if shorter and d.error is None:
            ratio = d.max_abs / max(statistics.median(shorter), floor) if d.non_finite == 0 else float("inf")
            if jump is None or ratio > jump[1]:
                jump = (d.length, ratio)
    return TargetSweep(target, diffs, cliff, jump)


def check_fidelity(
    data: SweepData,
    targets: list[Target],
    reference: Callable[[Target], ReferenceScores],
    texts: TokenTexts,
    tol: Tolerance,
) -> tuple[CheckResult, list[TargetSweep]]:
    sweeps = [evaluate_target(data, t, reference(t), texts, tol) for t in targets]
    failures = []
    for s in sweeps:
        for d in s.diffs:
            problems = d.problems(tol)
            if problems:
                failures.append(f"{label(s.target)} at {d.length} tokens: {'; '.join(problems)}")
    every = [d for s in sweeps for d in s.diffs]
    total = pooled(every)
    lengths = sorted({d.length for d in every})
    cliffs = [line for s in sweeps if (line := s.headline())]
    rate = total.top1_rate
    summary = "no prompts were sent"
    if lengths:
        summary = (
            f"{len(every)} prompts ({len(targets)} targets × {len(lengths)} lengths, {lengths[0]}…{lengths[-1]} "
            f"tokens): max |Δ logprob| {total.max_abs:.2g}, mean {total.mean_abs:.2g}"
            + (f", top-1 agreement {rate:.1%}" if rate is not None else "")
            + ("; " + "; ".join(cliffs) if cliffs else "; no cliff")
        )
    data_out = {"tolerance": vars(tol), "targets": [s.as_dict() for s in sweeps]}
    compared = sum(d.compared for d in every if d.error is None)
    return CheckResult.judged("fidelity", summary, compared, failures, data=data_out), sweeps

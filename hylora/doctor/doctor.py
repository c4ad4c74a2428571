"""The order doctor runs things in, and the report it hands back.

0. the reference for every target (first: in-process it folds adapters into the served weights);
1. the sweep's short prompts (≤ `short_max` tokens), one at a time;
2. mixed batches (short prompts, all targets: alone, alone again, all at once);
3. pollution: probe, burst of long requests (+ a video, + an injected NaN in-process), probe;
4. the sweep's long prompts;
5. decode against prefill (decode.py; skipped where speculation is on), then the fast paths: prefix
   caching, speculative decoding (fastpaths.py; skipped where off);
6. load, when asked for;
then the deployment's noise is measured from what came back (noise.py), the tolerance chosen, and
every check judged. Short prompts go before the long burst so that a server whose long requests
poison later ones is caught by the pollution check, not mistaken for a length cliff at every length.
Each phase writes a progress line (what, how many of how many, elapsed) when given a `Progress`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hylora.doctor.batches import check_mixed, judge_pollution, run_mixed, run_pollution
from hylora.doctor.compare import PRESETS, Tolerance, diff_reference
from hylora.doctor.decode import judge_decode, run_decode
from hylora.doctor.deployment import Deployment, Features
from hylora.doctor.effect import check_adapter_effect
from hylora.doctor.fastpaths import (
    FP8_TOLERANCE,
    PrefixRun,
    SpecRun,
    check_fp8,
    features_of,
    judge_prefix_cache,
    judge_speculation,
    run_prefix_cache,
    run_speculation,
)
from hylora.doctor.kernels import check_kernels
from hylora.doctor.load import check_load
from hylora.doctor.noise import Noise, ToleranceChoice, TolerancePolicy
from hylora.doctor.progress import Progress
from hylora.doctor.prompts import SHORT_MAX, mixed_windows
from hylora.doctor.reference import Reference
from hylora.doctor.result import CheckResult, Status
from hylora.doctor.scores import TokenTexts
from hylora.doctor.sweep import SweepData, TargetSweep, check_fidelity, label
from hylora.kernels import KernelVerdict

log = logging.getLogger(__name__)
PHASES = 7  # references, short sweep, mixed, pollution, long sweep, decode + fast paths, load


@dataclass
class DoctorOptions:
    lengths: list[int]  # the sweep's prompt lengths; the longest is also the burst's
    # how the tolerance is chosen: a Tolerance is used as given; None measures the deployment's
    # noise (noise.py) between the presets for the reference's precision and bfloat16
    tolerance: Tolerance | TolerancePolicy | None = None
    short_max: int = SHORT_MAX
    burst_size: int = 2
    load_seconds: float = 0.0  # 0: no load check
    load_streams: int = 8
    load_max_tokens: int = 16
    video: Path | None = None  # a video for the pollution burst
    fast_paths: bool = True  # the prefix-cache and speculation checks (skipped where off)


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
    tolerance_why: str = ""  # which tolerance, and why
    noise: Noise = field(default_factory=Noise)
    features: Features = field(default_factory=Features)

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
            "tolerance": vars(self.tolerance) | {"why": self.tolerance_why},
            "noise": self.noise.as_dict(),
            "features": self.features.as_dict(),
            "limits": self.limits,
            "elapsed_s": round(self.elapsed_s, 1),
            "checks": [c.as_dict() for c in self.checks],
        }


def _policy(options: DoctorOptions, reference: Reference, features: Features) -> TolerancePolicy:
    tol = options.tolerance
    if isinstance(tol, Tolerance):
        return TolerancePolicy.of(tol)
    policy = tol or TolerancePolicy.measured(getattr(reference, "dtype", "float32"))
    quantization_error = features.quantization and features.quantized_activations is not False  # weight-only: none
    if quantization_error and policy.fixed is None and policy.ceiling.max < FP8_TOLERANCE.max:
        policy = replace(policy, ceiling=FP8_TOLERANCE, ceiling_name=str(features.quantization))
    bf16 = PRESETS["bfloat16"]
    if features.split_activations and policy.fixed is None and policy.ceiling.max < bf16.max:
        policy = replace(policy, ceiling=bf16, ceiling_name="bfloat16")
    return policy


def run_doctor(
    deployment: Deployment,
    reference: Reference,
    adapters: list[str],
    options: DoctorOptions,
    texts: TokenTexts,
    kernels: Mapping[str, KernelVerdict] | None = None,
    progress: Progress | None = None,
) -> Report:
    """Run every check on `deployment` (kernels: the engine's record, in-process only)."""
    started = time.monotonic()
    progress = progress or Progress(PHASES)  # (silent without a stream)
    targets: list[str | None] = [None, *adapters]
    longest = options.lengths[-1]
    features = features_of(deployment)

    progress.phase("references (merged weights, one prompt per target)", len(targets), "targets")
    for t in targets:
        reference.scores(t)
        progress.tick()
    sweep = SweepData()
    short = [n for n in options.lengths if n <= options.short_max]
    progress.phase(f"sweep, {len(short)} short lengths × {len(targets)} targets", len(short) * len(targets))
    sweep.run(deployment, targets, short, progress.tick)
    windows = mixed_windows(len(reference.sequence), longest)
    progress.phase("mixed batches (alone, alone again, all at once)", 3 * len(windows) * len(targets))
    mixed_run = run_mixed(deployment, targets, windows, progress.tick)
    burst = options.burst_size + (options.video is not None) + (kernels is not None)
    progress.phase(f"pollution (probes, {burst} long requests at once, probes)", 2 * min(2, len(targets)) + burst)
    if kernels is not None:
        log.info("doctor: the numerical fault logged next is injected on purpose (pollution check)")
    pollution_run = run_pollution(
        deployment, targets, longest, options.burst_size, inject_fault=kernels is not None, video=options.video,
        tick=progress.tick,
    )  # fmt: skip
    long = [n for n in options.lengths if n > options.short_max]
    progress.phase(f"sweep, {len(long)} long lengths × {len(targets)} targets", len(long) * len(targets))
    sweep.run(deployment, targets, long, progress.tick)

    paths = (("prefix cache", features.prefix_caching), ("speculative decoding", features.speculative))
    on = [name for name, f in paths if f is not False and options.fast_paths]
    total = (5 if "prefix cache" in on else 0) + (2 * len(targets) if "speculative decoding" in on else 0)
    decoding = features.speculative is not True
    total += 2 * len(targets) if decoding else 0
    progress.phase(f"decode vs prefill{'' if decoding else ' (speculation on)'}, fast paths "
                   f"({', '.join(on) or 'none on'})", total)  # fmt: skip
    decode_run = run_decode(deployment, targets, reference.sequence, progress.tick)
    if options.fast_paths:
        prefix_run = run_prefix_cache(deployment, targets, len(reference.sequence), progress.tick)
        spec_run = run_speculation(deployment, targets, reference.sequence, progress.tick)
    else:
        prefix_run, spec_run = PrefixRun(skip="not run (asked not to)"), SpecRun(skip="not run (asked not to)")
    if progress.done < progress.total:
        progress.tick(progress.total - progress.done)
    elif progress.total == 0:
        progress.tick(0)

    progress.phase("load" if options.load_seconds > 0 else "load (not requested)", 1, "runs")
    load = check_load(deployment, options.load_seconds, options.load_streams, options.load_max_tokens)
    progress.tick()

    # the deployment's noise, and the tolerance from it
    base_ref = reference.scores(None)
    base_diffs = {n: diff_reference(sweep.results[(None, n)], base_ref, n, texts, _LOOSE) for n in sweep.lengths(None)}
    noise = Noise()
    noise.add_pooled("repeat", mixed_run.repeats(texts))
    noise.add_median("batch", mixed_run.batched(texts))
    noise.add_median("base vs reference", list(base_diffs.values()))
    choice: ToleranceChoice = _policy(options, reference, features).choose(noise)
    tol = choice.tolerance
    fp8_diffs, fp8_tol = [], FP8_TOLERANCE if features.quantized_activations is not False else tol
    if features.quantization:
        fp8_diffs = [diff_reference(sweep.results[(None, n)], base_ref, n, texts, fp8_tol) for n in base_diffs]

    mixed = check_mixed(mixed_run, texts, tol)
    pollution = judge_pollution(pollution_run, sweep, texts, tol, exact=kernels is not None)
    effect = check_adapter_effect(sweep, adapters, reference.scores, texts, tol, noise, base_diffs)
    fidelity, sweeps = check_fidelity(sweep, targets, reference.scores, texts, tol)
    fidelity.notes += [f"reference for {k}: {v}" for k, v in reference.notes.items()]
    fidelity.notes.append(f"tolerance: {choice.why}; measured noise: {noise.text()}")
    fidelity.data["tolerance"] = choice.as_dict()
    checks = [
        check_kernels(kernels), effect, fidelity, mixed, pollution, judge_decode(decode_run, texts, tol),
        judge_prefix_cache(prefix_run, texts, tol), judge_speculation(spec_run, texts, tol),
        check_fp8(features, reference, fp8_diffs, fp8_tol), load,
    ]  # fmt: skip
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
        tolerance_why=choice.why,
        noise=noise,
        features=features,
    )


_LOOSE = Tolerance(mean=float("inf"), max=float("inf"), top1=0.0)  # for measuring only: nothing is judged with it

"""The deployment's noise, measured rather than assumed, and the tolerance derived from it.

Noise is how far the deployment's answers move when nothing that matters changes. Three
measurements, from requests doctor sends anyway (or nearly):

- repeat: the mixed-batch prompts of every target, sent alone twice (nondeterminism);
- batch: the same prompts sent all at once vs alone (the median request, so that one target broken
  in batches — which the mixed-batch check reports — does not pass for noise);
- base vs its reference: the base model's sweep (no LoRA involved) against hylora's base
  reference, the median over the sweep's lengths (a cliff at a few lengths is not noise): the
  difference between the deployment's kernels and precision and the reference's.

The noise is the largest of the three (mean and max |Δ logprob| per prompt). It decides which
precision the deployment behaves like, and so the tolerance: the preset for the reference's
precision (the floor: float32 for an fp32 reference) when the noise is under a `NOISE_HEADROOM`th
of it, else the preset for the loosest precision the deployment may have (the ceiling: bfloat16,
or FP8 for a quantised deployment). The presets, not a multiple of the measured noise, because
the base model's noise does not show what a precision does to the adapters' path: against an fp32
reference a bf16 server moves the base by 0.017 on average (max 0.37) and the demo adapters by
0.02-0.06 (max 1.05). A deployment noisier than the ceiling is judged at the ceiling, and its
failures show where. `--endpoint-dtype` picks the preset instead of measuring; `--tolerance-*`
override single values either way.

The adapter-effect check uses the measured noise itself (not the tolerance): an adapter is told
from the base model by which reference the served answers are closer to (effect.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from hylora.doctor.compare import PRESETS, Diff, Tolerance, dtype_name

NOISE_HEADROOM = 10.0  # a deployment is as precise as the floor when its noise is under this fraction of it


def clean(d: Diff) -> bool:
    """A comparison that measured noise: it ran, compared something, and found nothing non-finite."""
    return d.error is None and d.non_finite == 0 and d.positions > 0


@dataclass
class Noise:
    """Mean and max |Δ logprob| per prompt from each source; the noise is the largest of them."""

    sources: dict[str, tuple[float, float]] = field(default_factory=dict)  # name → (mean, max)
    counts: dict[str, int] = field(default_factory=dict)  # name → comparisons behind it

    @property
    def measured(self) -> bool:
        return bool(self.sources)

    @property
    def mean(self) -> float:
        return max((m for m, _ in self.sources.values()), default=0.0)

    @property
    def max(self) -> float:
        return max((x for _, x in self.sources.values()), default=0.0)

    def add_median(self, name: str, diffs: list[Diff]) -> None:
        """The median comparison's mean and max (robust to a minority of broken ones)."""
        ok = [d for d in diffs if clean(d)]
        if ok:
            self.sources[name] = (statistics.median(d.mean_abs for d in ok), statistics.median(d.max_abs for d in ok))
            self.counts[name] = len(ok)

    def add_pooled(self, name: str, diffs: list[Diff]) -> None:
        """The pooled mean and the largest max (every comparison counts: e.g. repeats, which no
        fault doctor looks for changes)."""
        ok = [d for d in diffs if clean(d)]
        positions = sum(d.positions for d in ok)
        if ok:
            mean = sum(d.mean_abs * d.positions for d in ok) / positions
            self.sources[name] = (mean, max(d.max_abs for d in ok))
            self.counts[name] = len(ok)

    def text(self) -> str:
        if not self.sources:
            return "not measured (no clean comparison)"
        parts = [f"{name} {m:.2g} / {x:.2g} ({self.counts[name]})" for name, (m, x) in self.sources.items()]
        return f"mean {self.mean:.2g}, max {self.max:.2g} (mean / max per source, with comparisons: {'; '.join(parts)})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "mean": self.mean,
            "max": self.max,
            "sources": {k: {"mean": m, "max": x, "comparisons": self.counts[k]} for k, (m, x) in self.sources.items()},
        }


@dataclass(frozen=True)
class TolerancePolicy:
    """How the tolerance is chosen: `fixed` (a preset picked by --endpoint-dtype, or given by a
    test) as is, else measured between `floor` and `ceiling`; `overrides` (--tolerance-mean,
    --tolerance-max, --min-top1) replace single values either way."""

    floor: Tolerance = PRESETS["float32"]
    ceiling: Tolerance = PRESETS["bfloat16"]
    floor_name: str = "float32"
    ceiling_name: str = "bfloat16"
    fixed: Tolerance | None = None
    fixed_why: str = ""
    overrides: tuple[float | None, float | None, float | None] = (None, None, None)

    @classmethod
    def measured(cls, reference_dtype: str, deployment: str = "bfloat16") -> TolerancePolicy:
        """Floor: the reference's precision; ceiling: the loosest of it and `deployment`'s."""
        floor_name, other = dtype_name(reference_dtype), dtype_name(deployment)
        ceiling_name = max((floor_name, other), key=lambda n: PRESETS[n].max)
        return cls(PRESETS[floor_name], PRESETS[ceiling_name], floor_name, ceiling_name)

    @classmethod
    def of(cls, tolerance: Tolerance, why: str = "given") -> TolerancePolicy:
        return cls(fixed=tolerance, fixed_why=why)

    def with_overrides(self, mean: float | None, max_: float | None, top1: float | None) -> TolerancePolicy:
        return replace(self, overrides=(mean, max_, top1))

    def choose(self, noise: Noise) -> ToleranceChoice:
        if self.fixed is not None:
            tol, source, why = self.fixed, "preset", self.fixed_why
        elif not noise.measured:
            tol, source = self.ceiling, "ceiling"
            why = f"the {self.ceiling_name} preset: the deployment's noise could not be measured"
        elif NOISE_HEADROOM * noise.mean <= self.floor.mean and NOISE_HEADROOM * noise.max <= self.floor.max:
            tol, source = self.floor, "measured"
            why = (
                f"the {self.floor_name} preset: the measured noise ({noise.mean:.2g} mean / {noise.max:.2g} max) is "
                f"under a {NOISE_HEADROOM:g}th of it, a {self.floor_name} deployment"
            )
        else:
            tol, source = self.ceiling, "measured"
            beyond = noise.mean > self.ceiling.mean or noise.max > self.ceiling.max
            why = (
                f"the {self.ceiling_name} preset: the measured noise ({noise.mean:.2g} mean / {noise.max:.2g} max) is "
                + (
                    f"beyond even {self.ceiling_name}'s; failures below show where"
                    if beyond
                    else f"more than {self.floor_name} explains (a {self.ceiling_name}-like deployment)"
                )
            )
        mean, max_, top1 = self.overrides
        if any(v is not None for v in self.overrides):
            tol = tol.with_overrides(mean, max_, top1)
            why += "; overridden by --tolerance-mean / --tolerance-max / --min-top1"
            source += "+given"
        return ToleranceChoice(tol, source, why, noise)


@dataclass
class ToleranceChoice:
    tolerance: Tolerance
    source: str  # "measured", "preset" (--endpoint-dtype or given), "ceiling" (noise not measurable)
    why: str
    noise: Noise

    def as_dict(self) -> dict[str, Any]:
        return {**vars(self.tolerance), "source": self.source, "why": self.why, "noise": self.noise.as_dict()}

"""Check 2, adapter effect: what is served under an adapter's name must be the adapter, not the base
model — decided from evidence, at every sweep length, by which reference the served answers are
closer to.

Per adapter and prompt length, over the positions where the served logprob is finite:
d_adapter = mean |served − adapter's reference|, d_base = mean |served − base's reference|, and the
adapter's own effect there, e = mean |adapter's reference − base's reference|. The noise ν is the
deployment's measured noise (noise.py) or, when larger, the base model's own distance to its
reference at this length (same positions).

- e < `SEPARATION` × ν: the two references are closer than the noise: this length cannot tell the
  adapter from the base model;
- d_base + m ≤ d_adapter: closer to the base: **the base model served under the adapter's name**;
- d_adapter + m ≤ d_base, or (from `MIN_MEAN_POSITIONS` positions on) within the fidelity tolerance
  of the adapter's reference: the adapter;
- else neither (a cliff, NaN, a different adapter: the fidelity check names it).

The margin m = max(ν, min(d_adapter, d_base)): the served answers must be closer to one reference
by the noise and by their distance to the nearer one (twice as close). With served = base + noise
and e ≥ 5ν, d_adapter ≥ 4ν and d_base ≈ ν, so an ignored adapter is caught even when its effect is
small; a correct server is symmetric. The fraction of the adapter's effect the served answers carry,
β = Σ(s−b)(a−b) / Σ(a−b)² (1: all of it, 0: none: the base), is reported with the verdict.

An adapter fails when every length cannot tell it from the base ("cannot be told apart" — its
effect is within the noise, so doctor cannot verify it), when any length was the base model, or
when no length matched the adapter.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from hylora.doctor.compare import MIN_MEAN_POSITIONS, Diff, Tolerance, diff_reference
from hylora.doctor.noise import Noise, clean
from hylora.doctor.result import CheckResult, Status
from hylora.doctor.scores import ReferenceScores, Scores, TokenTexts
from hylora.doctor.sweep import SweepData, Target

SEPARATION = 2.0  # an adapter whose effect at a length is under this many noises cannot be told from the base there
VERDICTS = ("adapter", "base", "neither", "indistinct", "failed", "empty")  # empty: no position both references rank


@dataclass
class Distances:
    """One served prompt against the adapter's and the base's references, position by position."""

    positions: int = 0
    d_adapter: float = 0.0
    d_base: float = 0.0
    effect: float = 0.0  # mean |adapter's reference − base's|
    effect_max: float = 0.0
    dot: float = 0.0  # Σ (s − b)(a − b)
    norm: float = 0.0  # Σ (a − b)²


def distances(served: Scores, adapter: ReferenceScores, base: ReferenceScores, n: int, texts: TokenTexts) -> Distances:
    """Over the positions 1..n where the served logprob is finite and both references have one."""
    out = Distances()
    triples = []
    for p in range(1, n + 1):
        s = served.logprobs[p - 1]
        if not math.isfinite(s):
            continue
        if p < n:
            a, b = adapter.logprobs[p - 1], base.logprobs[p - 1]
        else:  # the generated token: where both references rank it in their top-k
            ta, tb = adapter.top[p - 1], base.top[p - 1]
            t = texts.resolve(served.tokens[p - 1], ta)
            t = texts.resolve(served.tokens[p - 1], tb) if t is None else t
            if t not in ta or t not in tb:
                continue
            a, b = ta[t], tb[t]
        triples.append((s, a, b))
    if not triples:
        return out
    k = len(triples)
    out.positions = k
    out.d_adapter = sum(abs(s - a) for s, a, _ in triples) / k
    out.d_base = sum(abs(s - b) for s, _, b in triples) / k
    out.effect = sum(abs(a - b) for _, a, b in triples) / k
    out.effect_max = max(abs(a - b) for _, a, b in triples)
    out.dot = sum((s - b) * (a - b) for s, a, b in triples)
    out.norm = sum((a - b) ** 2 for _, a, b in triples)
    return out


@dataclass
class LengthVerdict:
    length: int
    verdict: str  # one of VERDICTS
    noise: float
    dist: Distances = field(default_factory=Distances)

    def as_dict(self) -> dict:
        d = self.dist
        return {
            "length": self.length, "verdict": self.verdict, "noise": self.noise, "positions": d.positions,
            "d_adapter": d.d_adapter, "d_base": d.d_base, "effect": d.effect, "effect_max": d.effect_max,
        }  # fmt: skip


def judge_length(
    served: Scores,
    n: int,
    adapter: ReferenceScores,
    base: ReferenceScores,
    noise: float,
    texts: TokenTexts,
    tol: Tolerance,
) -> LengthVerdict:
    if served.error or len(served.logprobs) != n:
        return LengthVerdict(n, "failed", noise)
    d = distances(served, adapter, base, n, texts)
    if any(not math.isfinite(v) for v in served.logprobs):
        return LengthVerdict(n, "failed", noise, d)  # NaN: the fidelity check's business
    if d.positions == 0:  # a 1-token prompt whose generated token one reference does not rank
        return LengthVerdict(n, "empty", noise, d)
    if d.effect < SEPARATION * noise or d.effect == 0.0:
        return LengthVerdict(n, "indistinct", noise, d)
    margin = max(noise, min(d.d_adapter, d.d_base))
    if d.d_base + margin <= d.d_adapter:
        verdict = "base"
    elif d.d_adapter + margin <= d.d_base or (
        d.positions >= MIN_MEAN_POSITIONS and diff_reference(served, adapter, n, texts, tol).ok(tol)
    ):
        verdict = "adapter"
    else:
        verdict = "neither"
    return LengthVerdict(n, verdict, noise, d)


def check_adapter_effect(
    data: SweepData,
    adapters: list[str],
    reference: Callable[[Target], ReferenceScores],
    texts: TokenTexts,
    tol: Tolerance,
    noise: Noise,
    base_diffs: dict[int, Diff] | None = None,
) -> CheckResult:
    """`noise`: the deployment's measured noise; `base_diffs`: the base sweep against its reference
    by length (its distance there is the noise at that length, when larger)."""
    if not adapters:
        return CheckResult("adapter_effect", Status.SKIP, "no adapters given (--lora-modules)")
    failures, lines, compared = [], [], 0
    per_adapter = {}
    base_ref = reference(None)
    base_diffs = base_diffs or {}
    for name in adapters:
        ref = reference(name)
        verdicts = []
        for n in data.lengths(name):
            b = base_diffs.get(n)
            nu = max(noise.mean, b.mean_abs if b is not None and clean(b) else 0.0)
            v = judge_length(data.results[(name, n)], n, ref, base_ref, nu, texts, tol)
            compared += v.dist.positions
            verdicts.append(v)
        by = {k: [v.length for v in verdicts if v.verdict == k] for k in VERDICTS}
        told = [v for v in verdicts if v.verdict in ("adapter", "base", "neither")]
        judged = [v for v in verdicts if v.verdict not in ("failed", "empty")]
        positions = sum(v.dist.positions for v in judged)
        effect = sum(v.dist.effect * v.dist.positions for v in judged) / positions if positions else 0.0
        effect_max = max((v.dist.effect_max for v in judged), default=0.0)
        norm = sum(v.dist.norm for v in told)
        beta = sum(v.dist.dot for v in told) / norm if norm > 0 else None
        nu = max((v.noise for v in judged), default=noise.mean)
        per_adapter[name] = {
            "effect_mean": effect, "effect_max": effect_max, "noise": nu, "carried": beta,
            **by, "lengths": [v.as_dict() for v in verdicts],
        }  # fmt: skip
        carried = f"; the served answers carry {beta:.2f} of its effect (1 = all, 0 = none)" if beta is not None else ""
        if judged and not told:
            failures.append(
                f"{name}: cannot be told apart from the base model: its effect (mean |Δ logprob| vs base "
                f"{effect:.2g}, max {effect_max:.2g}) is within {SEPARATION:g}× the deployment's measured noise "
                f"({nu:.2g}) at every length, so doctor cannot verify it is served (an adapter that changes "
                "nothing: untrained, or the wrong files?)"
            )
        elif by["base"]:
            failures.append(
                f"{name}: served the base model under the name {name!r} at {_lengths(by['base'])} tokens (the served "
                f"logprobs are closer to the base's reference than to the adapter's, which moves them by {effect:.2g} "
                f"on average; noise {nu:.2g}{carried}): the adapter is silently ignored"
            )
        elif told and not by["adapter"]:
            failures.append(
                f"{name}: at no length are the served logprobs closer to the adapter's reference than to the "
                f"base's ({_lengths(by['neither'] + by['failed'])} tokens match neither or failed{carried}; "
                "see fidelity)"
            )
        elif not judged:
            error = next((e for n in data.lengths(name) if (e := data.results[(name, n)].error)), None)
            failures.append(
                f"{name}: no length could be compared ({_lengths(by['failed'] + by['empty'])} tokens)"
                + (f": {error}" if error else "")
            )
        carries = f", carries {beta:.2f}" if beta is not None else ""
        lines.append(f"{name} {len(by['adapter'])}/{len(told)} (effect {effect:.2g}, noise {nu:.2g}{carries})")
    summary = "served closer to the adapter than to the base model at: " + "; ".join(lines)
    return CheckResult.judged("adapter_effect", summary, compared, failures, data=per_adapter)


def _lengths(lengths: list[int]) -> str:
    return ", ".join(map(str, lengths)) if len(lengths) <= 8 else f"{lengths[0]}…{lengths[-1]} ({len(lengths)} lengths)"

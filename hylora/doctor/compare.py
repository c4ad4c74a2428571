"""|Δ logprob|, top-1 agreement, non-finite values and runs of token 0, with the tolerances they are
held to.

Tolerances are on the logprob of the scored tokens. They depend on the precision of the weights:
in fp32 dynamic LoRA and the merged weights differ by rounding (measured on the demo: max 4e-4,
mean 5e-6 over 1…1100 tokens), in bf16 the merged weight itself rounds the adapter's delta to 8
bits of mantissa (measured on the demo: mean 0.02-0.05, single positions up to 1.2). The failures
doctor looks for are far larger: an ignored adapter moves logprobs by its whole effect (mean ≈ 1
on the demo adapters), NaN / token 0 are flagged on their own, whatever their size. Which preset
applies is decided from the deployment's measured noise (noise.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from hylora.doctor.scores import ReferenceScores, Scores, TokenTexts

TOKEN0_RUN = 3  # this many positions in a row predicting token 0 ('!') where the reference does not: flagged
MIN_TOP1_POSITIONS = 32  # top-1 agreement is judged per length only from this many positions
MIN_MEAN_POSITIONS = 32  # so is the mean |Δ|: the mean of a few positions is a max, and the max tolerance judges it


@dataclass(frozen=True)
class Tolerance:
    mean: float  # mean |Δ logprob| over a prompt's positions
    max: float  # |Δ logprob| at any one position
    top1: float  # fraction of positions whose top-1 token agrees (ties within `tie` agree)

    @property
    def tie(self) -> float:
        """Tokens whose reference logprobs are this close count as tied for top-1."""
        return min(self.max, 5 * self.mean)

    @classmethod
    def for_dtypes(cls, *dtypes: str) -> Tolerance:
        """The loosest preset among the precisions involved (served and reference)."""
        presets = [PRESETS[dtype_name(d)] for d in dtypes]
        return max(presets, key=lambda t: t.max)

    def with_overrides(self, mean: float | None, max_: float | None, top1: float | None) -> Tolerance:
        return replace(
            self,
            mean=self.mean if mean is None else mean,
            max=self.max if max_ is None else max_,
            top1=self.top1 if top1 is None else top1,
        )


PRESETS = {
    "float32": Tolerance(mean=1e-3, max=1e-2, top1=0.99),
    "bfloat16": Tolerance(mean=0.1, max=2.0, top1=0.9),
    "float16": Tolerance(mean=0.1, max=2.0, top1=0.9),
}
EXACT = Tolerance(mean=0.0, max=0.0, top1=1.0)


def dtype_name(dtype: str) -> str:
    name = str(dtype).removeprefix("torch.")
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
    name = aliases.get(name, name)
    if name not in PRESETS:
        raise ValueError(f"unknown precision {dtype!r}; use one of {', '.join(PRESETS)}")
    return name


@dataclass
class Diff:
    """One served prompt against a reference (or against another served result of the same prompt)."""

    length: int
    positions: int = 0  # positions whose logprobs were compared
    max_abs: float = 0.0
    mean_abs: float = 0.0
    top1_compared: int = 0
    top1_agree: int = 0
    top1_misses: int = 0  # positions whose top-1 the reference ranks more than `tol.max` below its best
    first_top1_miss: int | None = None
    non_finite: int = 0  # positions where the served logprob is missing or not finite
    first_non_finite: int | None = None
    token0_run: int = 0  # longest run of top-1 = token 0 where the other side's is not
    token0_from: int | None = None
    error: str | None = None  # the request failed (or could not be compared)

    @property
    def compared(self) -> int:
        return self.positions + self.top1_compared

    @property
    def top1_rate(self) -> float | None:
        return self.top1_agree / self.top1_compared if self.top1_compared else None

    @property
    def bit_identical(self) -> bool:
        exact = self.max_abs == 0.0 and self.non_finite == 0 and self.top1_agree == self.top1_compared
        return self.error is None and exact

    def problems(self, tol: Tolerance) -> list[str]:
        """Why this comparison fails under `tol` (empty: it passes)."""
        if self.error:
            return [self.error]
        out = []
        if self.compared == 0:
            out.append("nothing could be compared")
        if self.non_finite:
            out.append(f"{self.non_finite} non-finite logprobs (NaN/Inf/missing) from position {self.first_non_finite}")
        if self.token0_run >= TOKEN0_RUN:
            out.append(f"token 0 ('!') predicted {self.token0_run} times in a row from position {self.token0_from}")
        if self.max_abs > tol.max:
            out.append(f"max |Δ logprob| {self.max_abs:.3g} > {tol.max:g}")
        if self.mean_abs > tol.mean and self.positions >= MIN_MEAN_POSITIONS:
            out.append(f"mean |Δ logprob| {self.mean_abs:.3g} > {tol.mean:g}")
        if self.top1_misses:
            out.append(
                f"{self.top1_misses} top-1 tokens the reference ranks more than {tol.max:g} below its best "
                f"(first at position {self.first_top1_miss})"
            )
        rate = self.top1_rate
        if rate is not None and self.top1_compared >= MIN_TOP1_POSITIONS and rate < tol.top1:
            out.append(f"top-1 agreement {rate:.1%} < {tol.top1:.0%}")
        return out

    def ok(self, tol: Tolerance) -> bool:
        return not self.problems(tol)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["top1_rate"] = self.top1_rate
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


class _Accumulator:
    def __init__(self, length: int):
        self.d = Diff(length)
        self._sum = 0.0
        self._run = 0

    def logprob(self, p: int, served: float, other: float) -> None:
        if not math.isfinite(served):
            self.d.non_finite += 1
            self.d.first_non_finite = self.d.first_non_finite or p
            return
        delta = abs(served - other)
        self.d.positions += 1
        self._sum += delta
        self.d.max_abs = max(self.d.max_abs, delta)

    def top1(self, p: int, agree: bool, miss: bool = False) -> None:
        self.d.top1_compared += 1
        self.d.top1_agree += agree
        if miss:
            self.d.top1_misses += 1
            self.d.first_top1_miss = self.d.first_top1_miss or p

    def token0(self, p: int, is_zero: bool) -> None:
        self._run = self._run + 1 if is_zero else 0
        if self._run > self.d.token0_run:
            self.d.token0_run = self._run
            self.d.token0_from = p - self._run + 1

    def result(self) -> Diff:
        self.d.mean_abs = self._sum / self.d.positions if self.d.positions else 0.0
        return self.d


def diff_reference(served: Scores, ref: ReferenceScores, length: int, texts: TokenTexts, tol: Tolerance) -> Diff:
    """A served prefix of `length` tokens of the doctor's sequence against the reference. A served
    top-1 agrees when the reference ranks it within `tol.tie` of its best, and misses when the
    reference ranks it more than `tol.max` below (or outside its top-k, all of which are that far)."""
    if served.error:
        return Diff(length, error=served.error)
    if len(served.tokens) != length or len(served.logprobs) != length:
        return Diff(length, error=f"the server scored {len(served.tokens)} positions, expected {length}")
    if length > ref.length:
        return Diff(length, error=f"the reference covers {ref.length} tokens, not {length}")
    acc = _Accumulator(length)
    for p in range(1, length + 1):
        top = ref.top[p - 1]
        best = max(top, key=top.__getitem__) if top else None
        if p < length:
            acc.logprob(p, served.logprobs[p - 1], ref.logprobs[p - 1])
        else:  # the generated token: compared when the reference ranks it in its top-k
            generated = texts.resolve(served.tokens[p - 1], top)
            if generated in top:
                acc.logprob(p, served.logprobs[p - 1], top[generated])
            elif not math.isfinite(served.logprobs[p - 1]):
                acc.logprob(p, served.logprobs[p - 1], math.nan)
            acc.token0(p, texts.is_token0(served.tokens[p - 1]) and best != 0)
        if served.top1[p - 1] is not None and best is not None:
            t = texts.resolve(served.top1[p - 1], top)
            gap = top[best] - (top[t] if t in top else min(top.values()))  # (a lower bound outside the top-k)
            acc.top1(p, agree=t in top and gap <= tol.tie, miss=gap > tol.max)
            if p < length:
                acc.token0(p, texts.is_token0(served.top1[p - 1]) and best != 0)
    return acc.result()


def diff_served(served: Scores, other: Scores, texts: TokenTexts, tie: float = 0.0) -> Diff:
    """Two served results of the same prompt (e.g. in a mixed batch and alone): `served` is judged.
    Their top-1 tokens agree when equal or, given a `tie` (`Tolerance.tie`), when `other` ranks
    served's top-1 within `tie` of its own, as diff_reference judges a top-1 against the reference:
    a near-tie that a kernel's rounding flips is not a leak between requests."""
    length = len(other.tokens)
    if served.error or other.error:
        return Diff(length, error=served.error or f"the result it is compared with failed: {other.error}")
    if len(served.tokens) != length:
        return Diff(length, error=f"{len(served.tokens)} positions scored, the other result has {length}")
    acc = _Accumulator(length)
    for p in range(1, length + 1):
        if texts.same(served.tokens[p - 1], other.tokens[p - 1]):  # (generated tokens may differ: top-1 shows it)
            acc.logprob(p, served.logprobs[p - 1], other.logprobs[p - 1])
        if served.top1[p - 1] is not None and other.top1[p - 1] is not None:
            acc.top1(p, texts.same(served.top1[p - 1], other.top1[p - 1]) or _near_tie(served, other, p, texts, tie))
            acc.token0(p, texts.is_token0(served.top1[p - 1]) and not texts.is_token0(other.top1[p - 1]))
    return acc.result()


def _near_tie(served: Scores, other: Scores, p: int, texts: TokenTexts, tie: float) -> bool:
    """`other` ranks served's top-1 at p within `tie` of its own top-1 (unknown: no)."""
    if tie <= 0.0 or p > len(other.top1_logprobs):
        return False
    lp = other.logprob_of(p, served.top1[p - 1], texts)
    best = other.top1_logprobs[p - 1]
    return lp is not None and math.isfinite(lp) and math.isfinite(best) and best - lp <= tie


def pooled(diffs: list[Diff]) -> Diff:
    """Several comparisons as one (means weighted by positions)."""
    out = Diff(sum(d.length for d in diffs))
    total = 0.0
    for d in diffs:
        if d.error:
            continue
        out.positions += d.positions
        total += d.mean_abs * d.positions
        out.max_abs = max(out.max_abs, d.max_abs)
        out.top1_compared += d.top1_compared
        out.top1_agree += d.top1_agree
        out.top1_misses += d.top1_misses
        out.non_finite += d.non_finite
        out.token0_run = max(out.token0_run, d.token0_run)
    out.mean_abs = total / out.positions if out.positions else 0.0
    return out

"""Checks 7-9: the fast paths a deployment may serve with — prefix caching, speculative decoding,
FP8 weights — each against the same deployment's plain path (or the dequantised reference), each
skipped, with the reason, where the path is off.

What a deployment offers for them (all optional; `features_of` reads them, off when absent):

- `features() -> Features`: prefix_caching / speculative (True, False, or None: not known, found
  out from the answers) and quantization (e.g. "fp8");
- `generate(probes, max_tokens, prompt_logprobs=False) -> list[Generation]`: greedy continuations
  with the top-1 logprob of each generated token and the prompt tokens served from the prefix cache
  (`Generation.cached_tokens`; None: not reported); decode.py's check uses it too (with `together`
  where the deployment takes it);
- `speculation_counter() -> float | None`: draft tokens proposed so far (None: not reported).

**prefix_cache**: a prompt no other phase sends (a window at its own offset), for the base model and
the first adapter: (1) the base, cold (with prompt logprobs: deployments do not look those up in the
cache, vLLM's rule and hylora's, but do fill it); (2) the adapter, when only the base has sent the
prompt: it must not reuse the base's cached prefix (cached tokens 0) and must equal (3) the adapter,
cold; then (4) the base and (5) the adapter again, warm: they must reuse the cache (cached tokens > 0,
where reported) and give the same tokens and logprobs as cold. Skipped when prefix caching is off or,
for a server that does not say, when no request reported cached tokens (and warm equals cold).

**speculative**: per target, `SPEC_TOKENS` tokens generated greedily (speculation, if on, proposes
and verifies drafts) and then the prompt plus those tokens scored in one plain prefill (which does
not speculate): every generated token must be the prefill's top-1 there (ties within the tolerance
agree) with the same logprob. Skipped when speculation is off, or when the deployment's draft counter
shows no drafts during the check.

**fp8**: a deployment serving FP8 weights is judged against the reference computed from the same
weights dequantised (the reference must say so: `Reference.dequantised`), the base model's sweep
with `FP8_TOLERANCE`; a weight-only deployment (activations unquantised, `--fp8-activations none`)
with the tolerance an unquantised one gets, as its only error is the GEMM's summation order; so is a
split one (`--fp8-activations split`: its activations within a bf16 rounding of their values).
Skipped for unquantised weights, and — with the reason in the report — when the reference is not
the dequantised model (then only the fidelity check's measured tolerance judges the FP8 error).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hylora.doctor.compare import Diff, Tolerance, pooled
from hylora.doctor.deployment import Deployment, Features
from hylora.doctor.prompts import Probe, Window
from hylora.doctor.result import CheckResult, Status
from hylora.doctor.scores import Generation, Scores, TokenTexts
from hylora.doctor.sweep import Target, label

PREFIX_LENGTH = 300  # the prefix-cache prompt: crosses several cache blocks, ends mid-block
PREFIX_OFFSET = 433  # where it starts in the doctor's sequence: no other phase's prompt starts there
PREFIX_TOKENS = 8  # generated per prefix-cache request (decode resumes from the cached state)
SPEC_LENGTH = 129
SPEC_TOKENS = 16
# FP8 weights (and activations) against the dequantised weights. Measured on the demo (H200, bf16,
# docs/FP8.md): mean |Δ logprob| 0.07-0.16, single positions up to ~2.2; not yet on trained 27B weights
FP8_TOLERANCE = Tolerance(mean=0.2, max=4.0, top1=0.85)


def features_of(deployment: Deployment) -> Features:
    f = getattr(deployment, "features", None)
    return f() if f is not None else Features(prefix_caching=False, speculative=False, source="not offered")


def _can_generate(deployment: Deployment) -> bool:
    return callable(getattr(deployment, "generate", None))


# --- comparing two continuations -------------------------------------------------------------------


@dataclass
class GenDiff:
    compared: int = 0
    max_abs: float = 0.0
    mean_abs: float = 0.0
    problems: list[str] = field(default_factory=list)


def diff_generations(served: Generation, other: Generation, texts: TokenTexts, tol: Tolerance) -> GenDiff:
    """Two greedy continuations of the same prompt, token by token, up to the first tie that both
    broke differently (their logprobs within the tie margin: the continuations may then differ)."""
    out = GenDiff()
    if served.error or other.error:
        out.problems.append(served.error or f"the request it is compared with failed: {other.error}")
        return out
    deltas = []
    for j, (a, b) in enumerate(zip(served.tokens, other.tokens, strict=False)):
        la, lb = served.logprobs[j], other.logprobs[j]
        if not math.isfinite(la):
            out.problems.append(f"non-finite logprob at generated token {j}")
            break
        if texts.same(a, b):
            deltas.append(abs(la - lb))
            continue
        if math.isfinite(lb) and abs(la - lb) <= tol.tie:
            break  # a near-tie broken the other way: what follows may differ
        out.problems.append(
            f"generated token {j} is {texts.text(a) if isinstance(a, int) else a!r} instead of "
            f"{texts.text(b) if isinstance(b, int) else b!r} (logprob {la:.3g} vs {lb:.3g})"
        )
        break
    if (
        len(served.tokens) != len(other.tokens)
        and not out.problems
        and len(deltas) == min(len(served.tokens), len(other.tokens))
    ):
        out.problems.append(f"{len(served.tokens)} tokens generated instead of {len(other.tokens)}")
    out.compared = len(deltas)
    if deltas:
        out.max_abs, out.mean_abs = max(deltas), sum(deltas) / len(deltas)
        if out.max_abs > tol.max:
            out.problems.append(f"max |Δ logprob| {out.max_abs:.3g} > {tol.max:g}")
        if out.mean_abs > tol.mean:
            out.problems.append(f"mean |Δ logprob| {out.mean_abs:.3g} > {tol.mean:g}")
    return out


# --- prefix caching --------------------------------------------------------------------------------


@dataclass
class PrefixRun:
    skip: str | None = None
    features: Features = field(default_factory=Features)
    window: Window | None = None
    results: dict[str, Generation] = field(default_factory=dict)  # step name → continuation
    targets: tuple[Target, Target | None] = (None, None)


def prefix_window(sequence_len: int) -> Window:
    length = min(PREFIX_LENGTH, max(1, sequence_len // 2))
    offset = min(PREFIX_OFFSET, sequence_len - length)
    return Window(offset if offset not in (0, 1) else 2, length)


def run_prefix_cache(deployment: Deployment, targets: list[Target], sequence_len: int, tick=None) -> PrefixRun:
    f = features_of(deployment)
    if f.prefix_caching is False:
        return PrefixRun(skip="prefix caching is off on this deployment", features=f)
    if not _can_generate(deployment):
        return PrefixRun(skip="this deployment cannot generate continuations for doctor", features=f)
    window = prefix_window(sequence_len)
    base, adapter = targets[0], (targets[1] if len(targets) > 1 else None)
    steps: list[tuple[str, Target, bool]] = [("base cold", base, True)]
    if len(targets) > 1:
        steps += [("adapter after base", adapter, False), ("adapter cold", adapter, True)]
    steps += [("base warm", base, False)] + ([("adapter warm", adapter, False)] if len(targets) > 1 else [])
    results = {}
    for name, target, cold in steps:
        results[name] = deployment.generate([Probe(target, window)], PREFIX_TOKENS, prompt_logprobs=cold)[0]
        if tick is not None:
            tick(1)
    return PrefixRun(None, f, window, results, (base, adapter))


def judge_prefix_cache(run: PrefixRun, texts: TokenTexts, tol: Tolerance) -> CheckResult:
    if run.skip:
        return CheckResult("prefix_cache", Status.SKIP, run.skip)
    r, (base, adapter) = run.results, run.targets
    n = run.window.length if run.window else 0
    pairs = [("base warm", "base cold", f"{label(base)}, its prefix cached")]
    if "adapter warm" in r:
        pairs += [
            ("adapter warm", "adapter cold", f"{label(adapter)}, its prefix cached"),
            ("adapter after base", "adapter cold", f"{label(adapter)}, only the base model's prefix cached"),
        ]
    failures, notes, diffs = [], [], []
    for warm, cold, what in pairs:
        d = diff_generations(r[warm], r[cold], texts, tol)
        diffs.append(d)
        if d.problems:
            verb = "could not be compared with" if r[warm].error or r[cold].error else "differs from"
            failures.append(f"{what} ({n}-token prompt) {verb} the same prompt cold: {'; '.join(d.problems)}")
    hits = {k: g.cached_tokens for k, g in r.items() if g.cached_tokens is not None}
    leaked = hits.get("adapter after base") or 0
    if leaked > 0:
        failures.append(
            f"{label(adapter)} reused {leaked} cached prompt tokens when only {label(base)} had sent the prompt: "
            "the prefix cache is not keyed by the adapter"
        )
    warm_hits = [hits.get(k) for k in ("base warm", "adapter warm") if k in r]
    compared = sum(d.compared for d in diffs)
    mx = max((d.max_abs for d in diffs), default=0.0)
    if not hits:
        if run.features.prefix_caching is None and not failures:
            return CheckResult(
                "prefix_cache", Status.SKIP,
                "the server reported no cached prompt tokens (prefix caching off, or not reported: vLLM needs "
                "--enable-prefix-caching and --enable-prompt-tokens-details); warm equalled cold",
                compared, data={"max_abs": mx},
            )  # fmt: skip
        notes.append("the deployment does not report cached tokens: the warm requests' cache hits are not confirmed")
    elif not any(warm_hits) and not failures:
        return CheckResult(
            "prefix_cache", Status.SKIP,
            f"the prefix cache was not used: the warm requests reused {warm_hits} prompt tokens (nothing to compare)",
            compared, data={"cached_tokens": hits},
        )  # fmt: skip
    summary = (
        f"{len(pairs)} warm vs cold continuations of a {n}-token prompt ({PREFIX_TOKENS} tokens each; cached prompt "
        f"tokens {', '.join(f'{k}: {v}' for k, v in hits.items()) or 'not reported'}): max |Δ logprob| {mx:.2g}"
    )
    return CheckResult.judged(
        "prefix_cache", summary, compared, failures, notes=notes, data={"cached_tokens": hits, "max_abs": mx}
    )


# --- speculative decoding --------------------------------------------------------------------------


@dataclass
class SpecRun:
    skip: str | None = None
    features: Features = field(default_factory=Features)
    drafts: float | None = None  # draft tokens proposed during the check (None: not reported)
    rows: list[tuple[Target, Generation, Scores | None]] = field(default_factory=list)
    length: int = SPEC_LENGTH


def run_speculation(deployment: Deployment, targets: list[Target], sequence: list[int], tick=None) -> SpecRun:
    f = features_of(deployment)
    if f.speculative is False:
        return SpecRun(skip="speculative decoding is off on this deployment", features=f)
    if not _can_generate(deployment):
        return SpecRun(skip="this deployment cannot generate continuations for doctor", features=f)
    counter = getattr(deployment, "speculation_counter", None)
    before = counter() if counter else None
    if f.speculative is None and before is None:  # a server that does not say, and counts no drafts
        return SpecRun(skip="the deployment reports no speculative decoding (no draft-token count)", features=f)
    window = Window(0, min(SPEC_LENGTH, len(sequence)))
    rows: list[tuple[Target, Generation, Scores | None]] = []
    for t in targets:
        gen = deployment.generate([Probe(t, window)], SPEC_TOKENS)[0]
        if tick is not None:
            tick(1)
        rows.append((t, gen, None))
    after = counter() if counter else None
    drafts = after - before if before is not None and after is not None else None
    if drafts == 0 or (f.speculative is None and drafts is None):
        why = "no draft tokens during the check" if drafts == 0 else "the deployment reports no draft tokens"
        return SpecRun(skip=f"speculative decoding did not run ({why})", features=f, drafts=drafts)
    scored = score_continuations(deployment, [(t, gen) for t, gen, _ in rows], window, sequence, tick)
    return SpecRun(None, f, drafts, scored, window.length)


def score_continuations(
    deployment: Deployment, rows: list[tuple[Target, Generation]], window: Window, sequence: list[int], tick=None
) -> list[tuple[Target, Generation, Scores | None]]:
    """Each target's prompt plus its generated tokens, scored by one plain prefill (None where the
    generation failed or came back as text)."""
    scored = []
    for t, gen in rows:
        out = None
        if gen.error is None and gen.tokens and all(isinstance(x, int) for x in gen.tokens):
            prompt = tuple(window.ids(sequence)) + tuple(gen.tokens[:-1])  # type: ignore[arg-type]
            out = deployment.score([Probe(t, Window(0, len(prompt)), prompt=prompt)])[0]
        if tick is not None:
            tick(1)
        scored.append((t, gen, out))
    return scored


@dataclass
class ContinuationDiff:
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    compared: int = 0
    deltas: list[float] = field(default_factory=list)  # |Δ logprob| of every compared token


def compare_continuations(
    rows: list[tuple[Target, Generation, Scores | None]], length: int, texts: TokenTexts, tol: Tolerance, wrong: str
) -> ContinuationDiff:
    """Generated tokens against the plain prefill of prompt + those tokens (`length`: the prompt's):
    each must be the prefill's greedy choice there (ties within the tolerance agree) with the same
    logprob within the tolerance's max. `wrong` ends the message of a token ranked below the top-1."""
    out = ContinuationDiff()
    for t, gen, scored in rows:
        name, deltas = label(t), []
        if gen.error:
            out.failures.append(f"{name}: the generation failed: {gen.error}")
            continue
        if scored is None:
            out.notes.append(f"{name}: the generated tokens came back as text: they cannot be scored by id")
            continue
        if scored.error:
            out.failures.append(f"{name}: scoring the continuation failed: {scored.error}")
            continue
        for j, token in enumerate(gen.tokens):
            p = length + j  # the position (1-based) predicting generated token j in the scoring request
            if p > len(scored.logprobs):
                break
            lg, ls = gen.logprobs[j], scored.logprobs[p - 1]
            top, top_lp = scored.top1[p - 1], (scored.top1_logprobs or [math.nan] * p)[p - 1]
            if not math.isfinite(lg) or not math.isfinite(ls):
                out.failures.append(f"{name}: non-finite logprob at generated token {j}")
                break
            if not texts.same(scored.tokens[p - 1], token):
                if abs(lg - ls) > tol.tie:  # the scorer's own greedy pick (last position) is another token
                    out.failures.append(f"{name}: generated token {j} is not the plain prefill's greedy choice there")
                    break
                continue
            out.compared += 1
            deltas.append(abs(lg - ls))
            if top is not None and not texts.same(top, token):
                gap = top_lp - ls if math.isfinite(top_lp) else math.inf
                if gap > tol.tie:
                    out.failures.append(
                        f"{name}: generated token {j} ({texts.text(token) if isinstance(token, int) else token!r}) is "
                        f"ranked {gap:.3g} below the plain prefill's top-1 there: {wrong}"
                    )
                    break
        if deltas and max(deltas) > tol.max:
            out.failures.append(f"{name}: max |Δ logprob| {max(deltas):.3g} > {tol.max:g} between decode and prefill")
        out.deltas += deltas
    return out


def judge_speculation(run: SpecRun, texts: TokenTexts, tol: Tolerance) -> CheckResult:
    if run.skip:
        return CheckResult("speculative", Status.SKIP, run.skip)
    diff = compare_continuations(run.rows, run.length, texts, tol, "a draft token was accepted wrongly")
    if run.drafts is None:
        diff.notes.append("the deployment does not count draft tokens: that speculation ran is not confirmed")
    mx = max(diff.deltas, default=0.0)
    summary = (
        f"{len(run.rows)} targets × {SPEC_TOKENS} tokens generated vs the same tokens scored by a plain prefill"
        f" ({'draft tokens: ' + format(run.drafts, 'g') if run.drafts is not None else 'drafts not reported'}): "
        f"max |Δ logprob| {mx:.2g}"
    )
    return CheckResult.judged("speculative", summary, diff.compared, diff.failures, notes=diff.notes,
                              data={"max_abs": mx})  # fmt: skip


# --- FP8 -------------------------------------------------------------------------------------------


def check_fp8(
    features: Features, reference, base_diffs: list[Diff], tolerance: Tolerance = FP8_TOLERANCE
) -> CheckResult:
    """The base model's sweep (no LoRA) against the dequantised reference, with `tolerance`:
    FP8_TOLERANCE, or for weight-only or split FP8 (activations unquantised or split) the unquantised
    deployment's."""
    if not features.quantization:
        return CheckResult("fp8", Status.SKIP, "the deployment serves unquantised weights")
    if not getattr(reference, "dequantised", False):
        return CheckResult(
            "fp8", Status.SKIP,
            f"the deployment serves {features.quantization} weights but the reference is not computed from the same "
            "weights dequantised: the quantisation error is judged only by the fidelity check's tolerance",
        )  # fmt: skip
    failures = [f"base at {d.length} tokens: {'; '.join(d.problems(tolerance))}" for d in base_diffs
                if d.problems(tolerance)]  # fmt: skip
    total = pooled(base_diffs)
    unquantised = features.quantized_activations is False
    served = features.quantization + (" with unquantised or split activations" if unquantised else "")
    summary = (
        f"{served} vs the dequantised reference, base model at {len(base_diffs)} lengths: "
        f"max |Δ logprob| {total.max_abs:.2g}, mean {total.mean_abs:.2g} (tolerance mean {tolerance.mean:g}, "
        f"max {tolerance.max:g})"
    )
    compared = sum(d.compared for d in base_diffs if d.error is None)
    return CheckResult.judged("fp8", summary, compared, failures, data={"tolerance": vars(tolerance)})

"""Check 2, adapter effect: each adapter must change the logits, and what is served under its name
must be the adapter's, not the base model's.

From the sweep's data: per adapter and prompt length, the served logprobs are compared with the
adapter's reference and with the base's. A length whose result passes against the base reference
and not against the adapter's is "the base model served under the adapter's name". A length that
matches neither is the fidelity check's business (a cliff, NaN), not counted here. The adapter's own
effect (its reference against the base's) must stand clear of the tolerance, or doctor could not
tell the two apart.
"""

from __future__ import annotations

from collections.abc import Callable

from hylora.doctor.compare import Tolerance, diff_reference
from hylora.doctor.result import CheckResult, Status
from hylora.doctor.scores import ReferenceScores, TokenTexts
from hylora.doctor.sweep import SweepData, Target

EFFECT_MARGIN = 3.0  # an adapter's mean |Δ logprob| against the base must exceed this many mean tolerances


def reference_effect(adapter: ReferenceScores, base: ReferenceScores) -> tuple[float, float]:
    """(mean, max) |Δ logprob| between two references over the positions both cover."""
    deltas = [abs(a - b) for a, b in zip(adapter.logprobs, base.logprobs, strict=False)]
    return (sum(deltas) / len(deltas), max(deltas)) if deltas else (0.0, 0.0)


def check_adapter_effect(
    data: SweepData,
    adapters: list[str],
    reference: Callable[[Target], ReferenceScores],
    texts: TokenTexts,
    tol: Tolerance,
) -> CheckResult:
    if not adapters:
        return CheckResult("adapter_effect", Status.SKIP, "no adapters given (--lora-modules)")
    failures, lines, compared = [], [], 0
    per_adapter = {}
    base_ref = reference(None)
    for name in adapters:
        ref = reference(name)
        effect_mean, effect_max = reference_effect(ref, base_ref)
        matches: dict[str, list[int]] = {"adapter": [], "base": [], "neither": [], "failed": []}
        for n in data.lengths(name):
            served = data.results[(name, n)]
            if served.error:
                matches["failed"].append(n)
                continue
            vs_adapter = diff_reference(served, ref, n, texts, tol)
            vs_base = diff_reference(served, base_ref, n, texts, tol)
            compared += vs_adapter.compared + vs_base.compared
            if vs_adapter.ok(tol):
                matches["adapter"].append(n)
            elif vs_base.ok(tol):
                matches["base"].append(n)
            else:
                matches["neither"].append(n)
        per_adapter[name] = {"effect_mean": effect_mean, "effect_max": effect_max, **matches}
        if effect_mean <= EFFECT_MARGIN * tol.mean:
            failures.append(
                f"{name}: the adapter barely changes the model (mean |Δ logprob| vs base {effect_mean:.2g}, "
                f"max {effect_max:.2g}, within {EFFECT_MARGIN:g}× the tolerance {tol.mean:g}): it cannot be "
                "told from the base model (an adapter that changes nothing is served as the base)"
            )
        elif matches["base"]:
            failures.append(
                f"{name}: served the base model under the name {name!r} at {_lengths(matches['base'])} tokens "
                f"(the served logprobs match the base reference, not the adapter's; the adapter moves them by "
                f"{effect_mean:.2g} on average): the adapter is silently ignored"
            )
        elif not matches["adapter"]:
            failures.append(
                f"{name}: at no length do the served logprobs match the adapter's reference "
                f"({_lengths(matches['neither'] + matches['failed'])} tokens match neither or failed; see fidelity)"
            )
        lines.append(
            f"{name} moves logprobs by {effect_mean:.2g} (mean) vs base; served matches it at "
            f"{len(matches['adapter'])}/{len(data.lengths(name))} lengths"
        )
    return CheckResult.judged("adapter_effect", "; ".join(lines), compared, failures, data=per_adapter)


def _lengths(lengths: list[int]) -> str:
    return ", ".join(map(str, lengths)) if len(lengths) <= 8 else f"{lengths[0]}…{lengths[-1]} ({len(lengths)} lengths)"

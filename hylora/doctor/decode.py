"""Check "decode": the decode path against the prefill path that the fidelity check judges.

The sweep scores prompts (prefill); tokens a user reads come from decode steps, which run other code:
one token a sequence, CUDA graphs captured per batch size, the decode kernels, LoRA applied to a
batch that mixes adapters token by token. A deployment can pass every prefill check and still serve
the base model under an adapter's name only when decoding (a graph captured without adapters, a
slot table filled late), or decode from a stale graph buffer.

Every target generates `DECODE_TOKENS` greedy tokens after the same prompt, all targets at once where
the deployment can send them together (decode steps then mix every adapter with the base model);
then each target's prompt plus its tokens is scored by one plain prefill. Each generated token must
be the prefill's greedy choice there (ties within the tolerance agree) with the same logprob, within
the tolerance's max. Since the fidelity check holds the prefill to the reference, decode is then held
to it too. Skipped when speculative decoding is on: the speculative check compares the same things
(its tokens come from verify steps, not plain decode steps).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from hylora.doctor.compare import Tolerance
from hylora.doctor.deployment import Deployment
from hylora.doctor.fastpaths import compare_continuations, features_of, score_continuations
from hylora.doctor.prompts import Probe, Window
from hylora.doctor.result import CheckResult, Status
from hylora.doctor.scores import Generation, Scores, TokenTexts
from hylora.doctor.sweep import Target

DECODE_LENGTH = 97  # the prompt: a window at offset 0 (no other phase generates after this length)
DECODE_TOKENS = 16


@dataclass
class DecodeRun:
    skip: str | None = None
    rows: list[tuple[Target, Generation, Scores | None]] = field(default_factory=list)
    length: int = DECODE_LENGTH
    together: bool = False  # the targets' requests were in flight at once (mixed decode steps)


def run_decode(deployment: Deployment, targets: list[Target], sequence: list[int], tick=None) -> DecodeRun:
    if features_of(deployment).speculative is True:
        return DecodeRun(skip="speculative decoding is on: the speculative check compares its decode with a prefill")
    generate = getattr(deployment, "generate", None)
    if not callable(generate):
        return DecodeRun(skip="this deployment cannot generate continuations for doctor")
    window = Window(0, min(DECODE_LENGTH, len(sequence)))
    probes = [Probe(t, window) for t in targets]
    together = "together" in inspect.signature(generate).parameters
    gens = generate(probes, DECODE_TOKENS, together=True) if together else generate(probes, DECODE_TOKENS)
    if tick is not None:
        tick(len(targets))
    if any(g.error is None and g.tokens for g in gens) and not any(_by_id(g) for g in gens):
        return DecodeRun(skip="the deployment returns generated tokens as text (vLLM: return_tokens_as_token_ids): "
                         "they cannot be scored by id")  # fmt: skip
    rows = score_continuations(deployment, list(zip(targets, gens, strict=True)), window, sequence, tick)
    return DecodeRun(None, rows, window.length, together)


def judge_decode(run: DecodeRun, texts: TokenTexts, tol: Tolerance) -> CheckResult:
    if run.skip:
        return CheckResult("decode", Status.SKIP, run.skip)
    diff = compare_continuations(run.rows, run.length, texts, tol, "the decode path computes another model")
    if not run.together:
        diff.notes.append("the deployment generates one request at a time: no decode step mixed the targets")
    mx = max(diff.deltas, default=0.0)
    how = "in one batch" if run.together else "one at a time"
    summary = (
        f"{len(run.rows)} targets × {DECODE_TOKENS} tokens decoded {how} vs the same tokens scored by a plain "
        f"prefill: max |Δ logprob| {mx:.2g}"
    )
    return CheckResult.judged("decode", summary, diff.compared, diff.failures, notes=diff.notes,
                              data={"max_abs": mx, "together": run.together})  # fmt: skip


def _by_id(gen: Generation) -> bool:
    return gen.error is None and bool(gen.tokens) and all(isinstance(x, int) for x in gen.tokens)

"""Checks 4 and 5: results must not depend on the neighbours of a request.

Mixed batches: the same prompts for every target (adapters and base), sent one at a time, again
one at a time, and then all at once, must give the same results (catches base requests that get an
adapter in a mixed batch, and leaks between requests; the repeat and the batch also measure the
deployment's noise, noise.py). Pollution: a short probe must give the same result before and
after a burst of long requests (with a video and, in-process, an injected NaN fault), and the same
as when the sweep sent it earlier; in-process, the requests next to the NaN must equal themselves
sent alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hylora.doctor.compare import EXACT, Diff, Tolerance, diff_served, pooled
from hylora.doctor.deployment import Deployment
from hylora.doctor.prompts import PROBE_LENGTH, Probe, Window
from hylora.doctor.result import CheckResult
from hylora.doctor.scores import Scores, TokenTexts
from hylora.doctor.sweep import SweepData, Target, label

FAULT_LENGTH = 257  # the request that gets the injected NaN (in-process)


@dataclass
class MixedRun:
    """The mixed-batch prompts of every target: alone, alone again (the repeat: noise), all at once."""

    probes: list[Probe]
    alone: list[Scores]
    again: list[Scores]
    together: list[Scores]

    def repeats(self, texts: TokenTexts, tie: float = 0.0) -> list[Diff]:
        return [diff_served(b, a, texts, tie) for a, b in zip(self.alone, self.again, strict=True)]

    def batched(self, texts: TokenTexts, tie: float = 0.0) -> list[Diff]:
        return [diff_served(b, a, texts, tie) for a, b in zip(self.alone, self.together, strict=True)]


def run_mixed(deployment: Deployment, targets: list[Target], windows: list[Window], tick=None) -> MixedRun:
    probes = [Probe(t, w) for w in windows for t in targets]
    alone = deployment.score(probes)
    _tick(tick, len(probes))
    again = deployment.score(probes)
    _tick(tick, len(probes))
    together = deployment.score(probes, concurrent=True)
    _tick(tick, len(probes))
    return MixedRun(probes, alone, again, together)


def _tick(tick, n: int) -> None:
    if tick is not None:
        tick(n)


def check_mixed(run: MixedRun, texts: TokenTexts, tol: Tolerance) -> CheckResult:
    probes, alone = run.probes, run.alone
    failures, diffs = [], run.batched(texts, tol.tie)
    for i, (probe, b, d) in enumerate(zip(probes, run.together, diffs, strict=True)):
        problems = d.problems(tol)
        if not problems:
            continue
        looks_like = [
            label(other.target)
            for j, other in enumerate(probes)
            if j != i and other.window == probe.window and diff_served(b, alone[j], texts, tol.tie).ok(tol)
        ]
        hint = f"; it matches {' / '.join(looks_like)} sent alone" if looks_like else ""
        verb = "could not be compared with" if d.error else "differs from"
        failures.append(
            f"{label(probe.target)}, {probe.window.length}-token prompt, sent with {len(probes) - 1} others "
            f"(adapters and base) {verb} the same request alone: {'; '.join(problems)}{hint}"
        )
    repeats = run.repeats(texts, tol.tie)
    for probe, d in zip(probes, repeats, strict=True):
        if d.error is None and d.problems(tol):
            failures.append(
                f"{label(probe.target)}, {probe.window.length}-token prompt, sent alone twice, differs from itself: "
                f"{'; '.join(d.problems(tol))} (nondeterministic beyond the tolerance)"
            )
    total, again = pooled(diffs), pooled(repeats)
    identical = sum(d.bit_identical for d in diffs)
    windows = list(dict.fromkeys(p.window for p in probes))
    summary = (
        f"{len(probes)} requests ({len(probes) // max(1, len(windows))} targets × prompts of "
        f"{', '.join(str(w.length) for w in windows)} tokens) at once vs one at a time: max |Δ logprob| "
        f"{total.max_abs:.2g}, {identical}/{len(diffs)} bit-identical; sent alone twice: max |Δ logprob| "
        f"{again.max_abs:.2g}"
    )
    return CheckResult.judged(
        "mixed_batches",
        summary,
        sum(d.compared for d in diffs if d.error is None),
        failures,
        data={
            "requests": [{"target": label(p.target), **d.as_dict()} for p, d in zip(probes, diffs, strict=True)],
            "repeat_max_abs": again.max_abs,
        },
    )


@dataclass
class PollutionRun:
    """What the pollution phase sent and got; judged once the sweep has the same long prompts alone."""

    probes: list[Probe]
    before: list[Scores]
    after: list[Scores]
    burst: list[Probe]  # the long requests
    burst_out: list[Scores]
    video: Path | None
    video_out: Scores | None
    fault_out: Scores | None  # in-process: the request with the injected NaN

    @property
    def what(self) -> str:
        n, length = len(self.burst), self.burst[0].window.length if self.burst else 0
        extras = (", a video" if self.video else "") + (" and an injected NaN fault" if self.fault_out else "")
        return f"a burst of {n} × {length}-token requests{extras}"


def run_pollution(
    deployment: Deployment,
    targets: list[Target],
    burst_length: int,
    burst_size: int,
    inject_fault: bool,
    video: Path | None = None,
    tick=None,
) -> PollutionRun:
    """Probe; a burst of long requests for the targets in turn, with the video (for the first
    adapter) and the injected NaN (for the last target) all at once; probe again."""
    probe_len = min(PROBE_LENGTH, burst_length)
    probes = [Probe(t, Window(0, probe_len)) for t in targets[:2]]
    before = deployment.score(probes)
    _tick(tick, len(probes))
    burst = [Probe(targets[i % len(targets)], Window(0, burst_length)) for i in range(burst_size)]
    extra = [Probe(targets[min(1, len(targets) - 1)], Window(0, 0), video=video)] if video is not None else []
    if inject_fault:
        extra.append(Probe(targets[-1], Window(0, min(FAULT_LENGTH, burst_length)), fault="nan"))
    out = deployment.score(burst + extra, concurrent=True)
    _tick(tick, len(burst) + len(extra))
    after = deployment.score(probes)
    _tick(tick, len(probes))
    rest = out[burst_size:]
    video_out = rest.pop(0) if video is not None else None
    fault_out = rest.pop(0) if inject_fault else None
    return PollutionRun(probes, before, after, burst, out[:burst_size], video, video_out, fault_out)


def judge_pollution(run: PollutionRun, sweep: SweepData, texts: TokenTexts, tol: Tolerance, exact: bool) -> CheckResult:
    """Probes must not change (`exact`: bit for bit, in-process; else within `tol`); in-process the
    burst's requests next to the injected NaN must equal the same requests sent alone (the sweep)."""
    same = EXACT if exact else tol
    failures, notes, diffs, neighbours = [], [], [], []
    if run.video_out is not None and run.video is not None:
        if run.video_out.error:
            failures.append(f"the video request in the burst ({run.video.name}) failed: {run.video_out.error}")
        else:
            notes.append(f"the video request in the burst ({run.video.name}) was served")
    for probe, before, after in zip(run.probes, run.before, run.after, strict=True):
        name = f"probe {label(probe.target)} ({probe.window.length} tokens)"
        if before.error:  # refused (e.g. an adapter the server does not have): nothing to compare, no pollution
            failures.append(f"{name} failed before the burst: {before.error}")
            continue
        earlier = sweep.results.get((probe.target, probe.window.length))
        if earlier is not None:
            diffs.append(d := diff_served(before, earlier, texts, same.tie))
            if d.problems(same):
                failures.append(
                    f"{name} already differed before the burst from the same request earlier in this run "
                    f"(requests sent in between poisoned it): {'; '.join(d.problems(same))}"
                )
        diffs.append(d := diff_served(after, before, texts, same.tie))
        if d.problems(same):
            problems = "; ".join(d.problems(same))
            failures.append(f"{name} changed after {run.what}: {problems} (earlier requests poison later ones)")
    if run.fault_out is not None:
        if run.fault_out.error is None or "numerical" not in run.fault_out.error:
            failures.append(
                "the request with an injected NaN was not stopped as a numerical fault "
                f"({run.fault_out.error or 'it finished normally'}): the NaN guard missed it"
            )
        else:
            notes.append("the request with the injected NaN failed alone: " + run.fault_out.error)
        for probe, out in zip(run.burst, run.burst_out, strict=True):
            alone = sweep.results.get((probe.target, probe.window.length))
            if alone is None:
                continue
            neighbours.append(d := diff_served(out, alone, texts, tol.tie))
            if d.problems(tol):
                failures.append(
                    f"{label(probe.target)} ({probe.window.length} tokens) next to the request with the injected "
                    f"NaN differs from the same request alone: {'; '.join(d.problems(tol))}"
                )
    else:
        notes.append("no fault injected: a server's faults cannot be triggered from outside (in-process only)")
    total = pooled(diffs)
    identical = all(d.bit_identical for d in diffs)
    summary = f"{len(run.probes)} probes before and after {run.what}: " + (
        "bit-identical" if identical else f"max |Δ logprob| {total.max_abs:.2g}"
    )
    if neighbours:
        summary += f"; the fault's neighbours vs alone: max |Δ logprob| {pooled(neighbours).max_abs:.2g}"
    compared = sum(d.compared for d in diffs + neighbours if d.error is None)
    data = {"probes_max_abs": total.max_abs, "bit_identical": identical}
    return CheckResult.judged("pollution", summary, compared, failures, notes=notes, data=data)

"""doctor's pieces without a model: comparisons, parsing servers' answers, kernel verdicts, the rule
that no check passes without comparing something, and the whole run on stand-in deployments."""

from __future__ import annotations

import json
import math
import random

import pytest

from hylora.doctor import CheckResult, DoctorOptions, Status, Tolerance, run_doctor
from hylora.doctor.compare import EXACT, diff_reference, diff_served
from hylora.doctor.deployment import LoadStats
from hylora.doctor.endpoint import ECHO, PROMPT_LOGPROBS, Budget, BudgetExhausted, Endpoint
from hylora.doctor.html import render_html
from hylora.doctor.kernels import check_kernels
from hylora.doctor.prompts import Probe, sweep_lengths
from hylora.doctor.report import render_text, write_json
from hylora.doctor.scores import ReferenceScores, Scores, TokenTexts
from hylora.kernels import KernelVerdict

FP32 = Tolerance.for_dtypes("float32")
VOCAB = 50


class Tokenizer:
    """Token i is the text "t<i>"; token 0 is "!"."""

    def decode(self, ids: list[int]) -> str:
        return "".join("!" if i == 0 else f"t{i}" for i in ids)


TEXTS = TokenTexts(Tokenizer())


def reference(n: int, seed: int, shift: float = 0.0) -> ReferenceScores:
    """A reference for a sequence whose token p is p % 7 + 1; the top-1 at every position is token 1."""
    rng = random.Random(seed)
    top = []
    for _ in range(n):
        values = sorted((-rng.uniform(0.5, 6.0) - shift for _ in range(VOCAB - 1)), reverse=True)
        top.append({t: v for t, v in zip(range(1, VOCAB), values, strict=True)})
    sequence = [p % 7 + 1 for p in range(n)]
    return ReferenceScores(logprobs=[top[p - 1][sequence[p]] for p in range(1, n)], top=top)


def served_like(ref: ReferenceScores, length: int, noise: float = 0.0) -> Scores:
    """What a correct server would answer for the first `length` tokens."""
    tokens = [p % 7 + 1 for p in range(1, length)] + [1]  # greedy: the top-1, token 1
    logprobs = [*ref.logprobs[: length - 1], ref.top[length - 1][1]]
    return Scores(tokens=tokens, logprobs=[v + noise for v in logprobs], top1=[1] * length)


# --- comparisons --------------------------------------------------------------------------------


def test_a_correct_answer_passes_and_noise_beyond_the_tolerance_fails():
    ref = reference(200, seed=1)
    assert diff_reference(served_like(ref, 129), ref, 129, TEXTS, FP32).ok(FP32)
    d = diff_reference(served_like(ref, 129, noise=5e-4), ref, 129, TEXTS, FP32)
    assert d.ok(FP32) and d.positions == 129 and math.isclose(d.mean_abs, 5e-4, rel_tol=1e-6)
    d = diff_reference(served_like(ref, 129, noise=0.02), ref, 129, TEXTS, FP32)
    assert d.problems(FP32) == ["max |Δ logprob| 0.02 > 0.01", "mean |Δ logprob| 0.02 > 0.001"]


def test_nan_and_runs_of_token_0_are_flagged_with_where_they_start():
    ref = reference(200, seed=2)
    served = served_like(ref, 150)
    for p in range(100, 151):
        served.logprobs[p - 1], served.top1[p - 1] = math.nan, 0
    served.tokens[-1] = 0
    d = diff_reference(served, ref, 150, TEXTS, FP32)
    assert d.non_finite == 51 and d.first_non_finite == 100
    assert d.token0_run == 51 and d.token0_from == 100
    problems = " ".join(d.problems(FP32))
    assert "51 non-finite logprobs (NaN/Inf/missing) from position 100" in problems
    assert "token 0 ('!') predicted 51 times in a row from position 100" in problems


def test_top1_ties_agree_and_clear_misses_fail_even_on_one_position():
    ref = reference(10, seed=3)
    ref.top[0] = {1: -1.0, 2: -1.002, 3: -4.0}
    tie = Scores(tokens=[2], logprobs=[-1.002], top1=[2])
    assert diff_reference(tie, ref, 1, TEXTS, FP32).ok(FP32)  # within the tie margin
    miss = Scores(tokens=[3], logprobs=[-4.0], top1=[3])
    d = diff_reference(miss, ref, 1, TEXTS, FP32)
    assert d.top1_misses == 1 and not d.ok(FP32)
    outside = Scores(tokens=[40], logprobs=[-9.0], top1=[40])  # not in the reference's top-k at all
    assert not diff_reference(outside, ref, 1, TEXTS, FP32).ok(FP32)


def test_tokens_rendered_as_text_or_token_id_match_the_reference():
    ref = reference(20, seed=4)
    served = served_like(ref, 10)
    served.top1 = ["t1"] * 9 + ["token_id:1"]
    served.tokens[-1] = "t1"
    d = diff_reference(served, ref, 10, TEXTS, FP32)
    assert d.ok(FP32) and d.top1_agree == 10 and d.positions == 10


def test_served_against_served_exactly():
    ref = reference(50, seed=5)
    a, b = served_like(ref, 40), served_like(ref, 40)
    assert diff_served(a, b, TEXTS).bit_identical
    b.logprobs[3] += 1e-7
    assert diff_served(a, b, TEXTS).ok(FP32) and not diff_served(a, b, TEXTS).ok(EXACT)
    assert diff_served(Scores.failed("HTTP 500: boom"), b, TEXTS).problems(FP32) == ["HTTP 500: boom"]


def test_tolerance_is_the_loosest_of_the_precisions_involved():
    assert Tolerance.for_dtypes("float32", "bfloat16") == Tolerance.for_dtypes("bf16")
    assert Tolerance.for_dtypes("torch.float32") == FP32
    with pytest.raises(ValueError, match="unknown precision"):
        Tolerance.for_dtypes("int8")


def test_sweep_lengths_straddle_the_boundaries_and_end_at_the_longest():
    assert sweep_lengths(1) == [1]
    assert sweep_lengths(130) == [1, 63, 64, 65, 127, 128, 129, 130]
    assert sweep_lengths(4096)[-4:] == [513, 1024, 2048, 4096]
    assert sweep_lengths(20000)[-4:] == [4096, 8192, 16384, 20000]


# --- what servers answer ------------------------------------------------------------------------


def endpoint(mode: str, token_ids: bool = False) -> Endpoint:
    e = Endpoint("http://127.0.0.1:1/v1", sequence=[5, 6, 7, 8], adapters=[])
    e.mode, e.token_ids = mode, token_ids
    return e


def test_vllm_prompt_logprobs_with_null_and_nan():
    choice = json.loads(
        '{"prompt_logprobs": [null, {"6": {"logprob": -1.5, "rank": 2}, "9": {"logprob": -0.5, "rank": 1}},'
        ' {"7": {"logprob": null, "rank": 1}}, {"8": {"logprob": NaN, "rank": 3}, "0": {"logprob": NaN, "rank": 1}}],'
        ' "logprobs": {"tokens": ["token_id:0"], "token_logprobs": [-9999.0],'
        ' "top_logprobs": [{"token_id:0": -9999.0}]}}'
    )
    s = endpoint(PROMPT_LOGPROBS, token_ids=True)._parse([5, 6, 7, 8], choice)
    assert s.tokens == [6, 7, 8, 0] and s.top1 == [9, 7, 0, 0]
    assert s.logprobs[0] == -1.5 and all(math.isnan(v) for v in s.logprobs[1:])  # null, NaN, -9999 (= -inf)


def test_echo_logprobs_with_text_tokens():
    choice = {
        "logprobs": {
            "tokens": ["t5", "t6", "t7", "t8", "t1"],
            "token_logprobs": [None, -1.0, -2.0, -3.0, -0.5],
            "top_logprobs": [None, {"t9": -0.4}, {"t7": -2.0}, {"t2": -1.0}, {"t1": -0.5}],
        }
    }
    s = endpoint(ECHO)._parse([5, 6, 7, 8], choice)
    assert s.tokens == [6, 7, 8, "t1"] and s.logprobs == [-1.0, -2.0, -3.0, -0.5] and s.top1 == ["t9", "t7", "t2", "t1"]
    with pytest.raises(ValueError, match="echoed logprobs"):
        endpoint(ECHO)._parse([5, 6, 7], choice)


def test_requests_are_bounded_in_count_and_time():
    budget = Budget(max_requests=2, seconds=60)
    budget.take()
    budget.take()
    with pytest.raises(BudgetExhausted, match="2 requests"):
        budget.take()
    late = Budget(max_requests=10, seconds=0.0)
    with pytest.raises(BudgetExhausted, match="time budget"):
        late.take()


# --- kernels ------------------------------------------------------------------------------------


def test_kernel_verdicts():
    fla = KernelVerdict("gated_delta_rule", "fla", error=3.1e-3, tolerance=2e-2)
    failed = KernelVerdict("lora", "reference", "rel. error 4.00e-01 > 2e-02", 0.4, 2e-2, check_failed=True)
    absent = KernelVerdict("gdn_decode", "reference", "no CUDA or no triton")
    assert check_kernels(None).status is Status.SKIP
    assert check_kernels({"gdn_decode": absent}).status is Status.SKIP
    ok = check_kernels({"gated_delta_rule": fla, "gdn_decode": absent})
    assert ok.status is Status.PASS and ok.compared == 1
    assert ok.data["gated_delta_rule"]["error"] == 3.1e-3  # the record, as data
    bad = check_kernels({"gated_delta_rule": fla, "lora": failed})
    assert bad.status is Status.FAIL and bad.failures[0].startswith("lora: the fast kernel failed its start-up check")
    unchecked = check_kernels({"paged_decode_attention": KernelVerdict("paged_decode_attention", "triton")})
    assert unchecked.status is Status.FAIL and "recorded no check" in unchecked.failures[0]


def test_no_check_passes_without_having_compared_something():
    with pytest.raises(ValueError, match="without having compared"):
        CheckResult("x", Status.PASS, "nothing", compared=0)
    assert CheckResult.judged("x", "nothing", 0, []).status is Status.FAIL
    assert CheckResult.judged("x", "ok", 3, []).status is Status.PASS


# --- the whole run on stand-ins -----------------------------------------------------------------


class StubReference:
    def __init__(self, n: int, adapters: list[str]):
        self.sequence = [p % 7 + 1 for p in range(n)]
        self.description, self.notes = "stub reference", {}
        self._refs = {None: reference(n, seed=0)}
        for i, name in enumerate(adapters):  # an adapter lowers every logprob by 0.5
            self._refs[name] = reference(n, seed=0, shift=0.5 * (i + 1))

    def scores(self, target):
        return self._refs[target]


class PerfectServer:
    """Answers exactly what the reference says (the doctor's sequence is a prefix property)."""

    description, limits = "perfect stand-in", []

    def __init__(self, ref: StubReference, ignore: str | None = None, silent: bool = False):
        self.ref, self.ignore, self.silent = ref, ignore, silent

    def score(self, probes: list[Probe], concurrent: bool = False) -> list[Scores]:
        out = []
        for p in probes:
            if self.silent:
                out.append(Scores.failed("the server returns no prompt logprobs"))
                continue
            target = None if p.target == self.ignore else p.target
            if p.window.offset == 0:
                out.append(served_like(self.ref.scores(target), p.window.length))
            else:  # mixed-batch windows: any consistent answer
                out.append(served_like(self.ref.scores(target), p.window.length, noise=p.window.offset))
        return out

    def load(self, streams: int, seconds: float, max_tokens: int) -> LoadStats:
        return LoadStats(streams, seconds, started=0 if self.silent else 4, completed=0 if self.silent else 4)


def run(server: PerfectServer, ref: StubReference, adapters: list[str]):
    options = DoctorOptions(lengths=[1, 65, 129, 300], tolerance=FP32, short_max=129, load_seconds=1.0)
    return run_doctor(server, ref, adapters, options, TEXTS)  # type: ignore[arg-type]


def test_a_perfect_server_passes_and_the_report_renders(tmp_path):
    ref = StubReference(600, ["relic", "tomb"])
    report = run(PerfectServer(ref), ref, ["relic", "tomb"])
    status = {c.name: c.status for c in report.checks}
    assert status == {
        "kernels": Status.SKIP, "adapter_effect": Status.PASS, "fidelity": Status.PASS,
        "mixed_batches": Status.PASS, "pollution": Status.PASS, "load": Status.PASS,
    }  # fmt: skip
    assert report.exit_code == 0 and "PASSED (exit 0)" in render_text(report)
    write_json(report, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["passed"] is True
    assert "<svg" in render_html(report)


def test_an_ignored_adapter_fails_and_shows_in_the_report():
    ref = StubReference(600, ["relic", "tomb"])
    report = run(PerfectServer(ref, ignore="tomb"), ref, ["relic", "tomb"])
    failed = {c.name for c in report.checks if c.status is Status.FAIL}
    assert failed == {"adapter_effect", "fidelity"} and report.exit_code == 1
    html = render_html(report)
    assert "served the base model under the name &#x27;tomb&#x27;" in html and "FAILED" in html


def test_a_server_that_returns_nothing_comparable_passes_nothing():
    ref = StubReference(600, ["relic"])
    report = run(PerfectServer(ref, silent=True), ref, ["relic"])
    assert not any(c.status is Status.PASS for c in report.checks)
    assert report.exit_code == 1

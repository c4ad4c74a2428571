"""doctor's pieces without a model: comparisons, parsing servers' answers, kernel verdicts, the rule
that no check passes without comparing something, and the whole run on stand-in deployments."""

from __future__ import annotations

import io
import json
import math
import random
import re

import pytest

from hylora.doctor import CheckResult, DoctorOptions, Status, Tolerance, run_doctor
from hylora.doctor.compare import EXACT, PRESETS, Diff, diff_reference, diff_served
from hylora.doctor.decode import DECODE_TOKENS
from hylora.doctor.deployment import Features, LoadStats
from hylora.doctor.effect import check_adapter_effect
from hylora.doctor.endpoint import ECHO, PROMPT_LOGPROBS, Budget, BudgetExhausted, Endpoint, _error_text, draft_tokens
from hylora.doctor.fastpaths import check_fp8
from hylora.doctor.html import render_html
from hylora.doctor.kernels import check_kernels
from hylora.doctor.noise import Noise, TolerancePolicy
from hylora.doctor.plot import sweep_svg
from hylora.doctor.progress import Progress
from hylora.doctor.prompts import Probe, sweep_lengths
from hylora.doctor.report import render_text, write_json
from hylora.doctor.scores import Generation, ReferenceScores, Scores, TokenTexts
from hylora.doctor.sweep import SweepData, TargetSweep
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


def two_served(n: int, flips: dict[int, float]) -> tuple[Scores, Scores]:
    """A result (top-1 token 1, runner-up 2 at every position) and the same prompt served again with
    the top-1 swapped at positions p in `flips`, where that second result ranks token 1 `flips[p]`
    below its new top-1 token 2."""
    tokens = [3] * n
    alone = Scores(tokens, [-3.0] * n, [1] * n, top1_logprobs=[-1.0] * n, tops=[{1: -1.0, 2: -1.2}] * n)
    again = Scores(tokens, [-3.0] * n, [1] * n, top1_logprobs=[-1.0] * n, tops=[{1: -1.0, 2: -1.2}] * n)
    for p, gap in flips.items():
        again.top1[p - 1], again.top1_logprobs[p - 1] = 2, -1.0
        again.tops[p - 1] = {2: -1.0, 1: -1.0 - gap}
    return alone, again


def test_a_near_tie_flipped_between_two_served_results_agrees_within_the_tie_only():
    bf16 = Tolerance.for_dtypes("bfloat16")  # tie 0.5
    alone, again = two_served(100, {p: 0.01 for p in range(1, 21)})  # 20 % of the top-1s swapped, near-ties
    d = diff_served(alone, again, TEXTS, bf16.tie)
    assert d.top1_agree == 100 and d.ok(bf16)
    strict = diff_served(alone, again, TEXTS)  # no tie given: the exact comparison of before
    assert strict.top1_agree == 80 and "top-1 agreement 80.0% < 90%" in strict.problems(bf16)
    alone, again = two_served(100, {p: 1.5 for p in range(1, 21)})  # the other result ranks it far below
    d = diff_served(alone, again, TEXTS, bf16.tie)
    assert d.top1_agree == 80 and not d.ok(bf16)
    alone, again = two_served(100, {p: 0.01 for p in range(1, 21)})
    for top in again.tops[:20]:
        top.pop(1)  # the server did not say how it ranks served's top-1: no tie can be shown
    assert diff_served(alone, again, TEXTS, bf16.tie).top1_agree == 80


def test_servers_top_k_is_kept_per_position():
    choice = json.loads(
        '{"prompt_logprobs": [null, {"6": {"logprob": -1.5, "rank": 2}, "9": {"logprob": -0.5, "rank": 1}},'
        ' {"7": {"logprob": -0.1, "rank": 1}, "2": {"logprob": -2.5, "rank": 2}},'
        ' {"8": {"logprob": -3.0, "rank": 5}, "0": {"logprob": -0.2, "rank": 1}, "4": {"logprob": -1.9, "rank": 2}}],'
        ' "logprobs": {"tokens": ["token_id:4"], "token_logprobs": [-0.7],'
        ' "top_logprobs": [{"token_id:4": -0.7, "token_id:5": -0.9}]}}'
    )
    s = endpoint(PROMPT_LOGPROBS, token_ids=True)._parse([5, 6, 7, 8], choice)
    assert s.tops == [{6: -1.5, 9: -0.5}, {7: -0.1, 2: -2.5}, {8: -3.0, 0: -0.2, 4: -1.9}, {4: -0.7, 5: -0.9}]
    assert s.logprob_of(3, 4, TEXTS) == -1.9 and s.logprob_of(3, 8, TEXTS) == -3.0 and s.logprob_of(3, 9, TEXTS) is None
    echo = {
        "logprobs": {
            "tokens": ["t5", "t6", "t7"],
            "token_logprobs": [None, -1.0, -0.5],
            "top_logprobs": [None, {"t9": -0.4, "t6": -1.0}, {"t7": -0.5, "t3": -0.6}],
        }
    }
    s = endpoint(ECHO)._parse([5, 6], echo)
    assert s.tops == [{"t9": -0.4, "t6": -1.0}, {"t7": -0.5, "t3": -0.6}]
    assert s.logprob_of(2, 3, TEXTS) == -0.6  # an id found among text-keyed tokens


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


def test_draft_tokens_from_a_metrics_page():
    page = (
        "# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.\n"
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0\n'
        'vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 2.0\n'
        'vllm:spec_decode_num_draft_tokens_created{engine="0",model_name="m"} 1.7e9\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 30.0\n'
    )
    assert draft_tokens(page) == 42.0
    assert draft_tokens("vllm:num_requests_running 3.0\n") is None


def test_a_servers_error_message_is_read_from_its_body():
    """OpenAI's {"error": {"message"}}, vLLM's {"object": "error", "message"} and FastAPI's {"detail"}."""
    openai = {"error": {"message": "The model `x` does not exist.", "type": "invalid_request_error"}}
    vllm = {"object": "error", "message": "The model `x` does not exist.", "type": "NotFoundError", "code": 404}
    assert _error_text(openai) == _error_text(vllm) == "The model `x` does not exist."
    assert _error_text({"detail": "Not Found"}) == "Not Found"


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


def test_kernels_row_is_short_and_the_record_is_in_the_notes():
    absent = {k: KernelVerdict(k, "reference", "no CUDA or no triton") for k in ("a", "b", "c")}
    absent["gated_delta_rule"] = KernelVerdict("gated_delta_rule", "reference")
    skip = check_kernels(absent)
    assert skip.summary == "no fast kernels in use: 4 on the reference (3: no CUDA or no triton)"
    assert "reference: a (no CUDA or no triton)" in skip.notes and len(skip.notes) == 4
    fla = KernelVerdict("gated_delta_rule", "fla", error=3.1e-3, tolerance=2e-2)
    failed = KernelVerdict("lora", "reference", "rel. error 4.00e-01 > 2e-02", 0.4, 2e-2, check_failed=True)
    bad = check_kernels({"gated_delta_rule": fla, "lora": failed})
    assert bad.summary == "1 of 2 kernels failed: lora" and "rel. error 4.00e-01" in bad.failures[0]


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
        "mixed_batches": Status.PASS, "pollution": Status.PASS, "decode": Status.SKIP, "prefix_cache": Status.SKIP,
        "speculative": Status.SKIP, "fp8": Status.SKIP, "load": Status.PASS,
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


class NearTieServer(PerfectServer):
    """A perfect stand-in whose mixed-batch prompts, sent together, swap the top-1 with the runner-up
    at every 5th position, the two `gap` apart there (small: a kernel's rounding flipping a near-tie;
    large: the batch changed the answer)."""

    def __init__(self, ref: StubReference, gap: float):
        super().__init__(ref)
        self.gap = gap

    def score(self, probes: list[Probe], concurrent: bool = False) -> list[Scores]:
        out = super().score(probes, concurrent)
        for p, s in zip(probes, out, strict=True):
            if p.window.offset == 0:
                continue
            n = len(s.tokens)
            s.top1_logprobs, s.tops = [-1.0] * n, [{1: -1.0, 2: -1.0 - self.gap} for _ in range(n)]
            for i in range(0, n, 5) if concurrent else ():
                s.top1[i], s.tops[i] = 2, {2: -1.0, 1: -1.0 - self.gap}
        return out


def test_mixed_batches_tell_a_flipped_near_tie_from_a_changed_answer():
    ref = StubReference(600, ["relic"])
    checks = {c.name: c for c in run(NearTieServer(ref, gap=0.001), ref, ["relic"]).checks}
    assert checks["mixed_batches"].status is Status.PASS  # FP32's tie: 0.005
    checks = {c.name: c for c in run(NearTieServer(ref, gap=0.5), ref, ["relic"]).checks}
    assert checks["mixed_batches"].status is Status.FAIL
    assert "differs from the same request alone: top-1 agreement 79.4% < 99%" in checks["mixed_batches"].failures[0]


def test_a_server_that_returns_nothing_comparable_passes_nothing():
    ref = StubReference(600, ["relic"])
    report = run(PerfectServer(ref, silent=True), ref, ["relic"])
    assert not any(c.status is Status.PASS for c in report.checks)
    assert report.exit_code == 1


# --- measured noise and the tolerance from it ---------------------------------------------------


def noisy(d_mean: float, d_max: float, n: int = 200) -> Diff:
    return Diff(n, positions=n, mean_abs=d_mean, max_abs=d_max)


def test_the_tolerance_is_chosen_from_the_measured_noise():
    policy = TolerancePolicy.measured("float32")  # floor float32, ceiling bfloat16
    quiet = Noise()
    quiet.add_median("base vs reference", [noisy(3e-6, 4e-5), noisy(1e-6, 2e-5), noisy(9.0, 9.0)])  # one cliff
    choice = policy.choose(quiet)
    assert choice.tolerance == FP32 and "float32 preset" in choice.why and quiet.mean == 3e-6
    loud = Noise()
    loud.add_pooled("repeat", [noisy(0.02, 0.3)])
    choice = policy.choose(loud)
    assert choice.tolerance == Tolerance.for_dtypes("bfloat16") and "more than float32 explains" in choice.why
    wild = Noise()
    wild.add_median("batch", [noisy(0.5, 5.0)])
    assert "beyond even bfloat16" in policy.choose(wild).why
    assert policy.choose(Noise()).source == "ceiling"  # nothing measured: the loosest
    fixed = TolerancePolicy.of(FP32, "--endpoint-dtype float32").with_overrides(None, 0.05, None)
    choice = fixed.choose(loud)
    assert choice.tolerance == Tolerance(mean=1e-3, max=0.05, top1=0.99) and "--endpoint-dtype" in choice.why
    # a comparison with NaN or nothing compared is not noise
    assert not Noise().measured and noisy(0.0, 0.0, n=0).positions == 0
    nan = Noise()
    nan.add_median("base vs reference", [Diff(10, positions=9, non_finite=1), Diff(10, error="HTTP 500")])
    assert not nan.measured


def test_the_mean_of_a_few_positions_is_judged_as_a_max():
    few = Diff(1, positions=1, mean_abs=0.15, max_abs=0.15)
    assert few.ok(Tolerance.for_dtypes("bfloat16"))  # one position: 0.15 is within the max tolerance (2)
    assert not Diff(64, positions=64, mean_abs=0.15, max_abs=0.15).ok(Tolerance.for_dtypes("bfloat16"))


# --- adapter verdicts from evidence -------------------------------------------------------------


def shifted(ref: ReferenceScores, deltas: list[float]) -> ReferenceScores:
    """`ref` with every logprob at position p moved by deltas[p - 1] (the ranking stays)."""
    top = [{t: v + deltas[p] for t, v in ref.top[p].items()} for p in range(ref.length)]
    return ReferenceScores(logprobs=[v + deltas[p] for p, v in enumerate(ref.logprobs)], top=top)


class EffectCase:
    """A base reference, an adapter whose effect at each position is ±`effect` (random sign), and
    served answers with per-position noise N(0, σ²): the adapter's or — ignored — the base's."""

    def __init__(self, effect: float, sigma: float, carried: float = 1.0, n: int = 300, seed: int = 7):
        rng = random.Random(seed)
        self.base = reference(n + 1, seed=seed)
        self.adapter = shifted(self.base, [rng.choice((-1, 1)) * effect for _ in range(n + 1)])
        self.served_ref = shifted(self.base, [(a - b) * carried for a, b in zip(
            [*self.adapter.logprobs, 0.0], [*self.base.logprobs, 0.0], strict=True)])  # fmt: skip
        self.sigma, self.rng = sigma, rng

    def served(self, n: int) -> Scores:
        s = served_like(self.served_ref, n)
        s.logprobs = [v + self.rng.gauss(0.0, self.sigma) for v in s.logprobs]
        return s

    def check(self, lengths=(1, 65, 129, 300)):
        data = SweepData()
        base_diffs = {}
        for n in lengths:
            data.results[("a", n)] = self.served(n)
            base_served = served_like(self.base, n)
            base_served.logprobs = [v + self.rng.gauss(0.0, self.sigma) for v in base_served.logprobs]
            base_diffs[n] = diff_reference(base_served, self.base, n, TEXTS, FP32)
        noise = Noise()
        noise.add_median("base vs reference", list(base_diffs.values()))
        refs = {None: self.base, "a": self.adapter}
        return check_adapter_effect(data, ["a"], refs.__getitem__, TEXTS, BF16, noise, base_diffs), noise


BF16 = Tolerance.for_dtypes("bfloat16")


def test_a_small_effect_served_right_passes_through_noise():
    """Effect 0.2 (like the held-out adapters), a noisy server: its tolerance (bfloat16) is half the
    effect, which no longer matters — the served answers are closer to the adapter's reference."""
    result, noise = EffectCase(effect=0.2, sigma=0.02).check()
    assert result.status is Status.PASS, result.failures
    data = result.data["a"]
    assert data["adapter"] == [1, 65, 129, 300] and abs(data["carried"] - 1.0) < 0.05 and 0.01 < noise.mean < 0.03


def test_an_ignored_adapter_fails_with_an_effect_of_5_noises():
    case = EffectCase(effect=0.09, sigma=0.02, carried=0.0)  # noise (mean |N(0, 0.02²)|) ≈ 0.016: effect ≈ 5.6×
    result, noise = case.check()
    assert result.status is Status.FAIL
    data = result.data["a"]
    assert 4.5 < data["effect_mean"] / data["noise"] < 7, data
    assert result.failures[0].startswith("a: served the base model under the name 'a' at 1, 65, 129, 300 tokens")
    assert abs(data["carried"]) < 0.1


def test_an_adapter_within_the_noise_cannot_be_told_apart():
    result, _ = EffectCase(effect=0.01, sigma=0.02).check()
    assert result.status is Status.FAIL
    assert result.failures[0].startswith("a: cannot be told apart from the base model")
    assert result.data["a"]["indistinct"] == [1, 65, 129, 300]


def test_half_an_adapter_is_neither():
    """A server that applies the adapter at half its scale (e.g. a wrong alpha / rsLoRA factor)."""
    result, _ = EffectCase(effect=0.5, sigma=0.01, carried=0.5).check()
    assert result.status is Status.FAIL and "at no length" in result.failures[0]
    assert abs(result.data["a"]["carried"] - 0.5) < 0.05 and "carry 0.50" in result.failures[0]


# --- the fast paths -----------------------------------------------------------------------------


def next_token(target, prefix: tuple[int, ...]) -> tuple[int, float]:
    """A stand-in model's greedy step: the top-1 token after `prefix` and its logprob."""
    token = (sum(prefix) * 31 + len(prefix) + (7 if target else 0)) % (VOCAB - 1) + 1
    return token, -0.05 - 0.01 * (len(prefix) % 9) - (0.3 if target else 0.0)


class FastServer(PerfectServer):
    """A perfect stand-in that also generates, with a prefix cache and speculative decoding that can
    be broken: `warm_shift` (a cached prefix changes the answers), `leak` (an adapter reuses the
    base's cached prefix), `bad_draft` (a draft token accepted at this step that the model would not
    choose)."""

    def __init__(
        self, ref, features: Features, warm_shift=0.0, leak=False, bad_draft=None, drafts=True, base_decode=False
    ):
        super().__init__(ref)
        self._features, self.warm_shift, self.leak, self.bad_draft = features, warm_shift, leak, bad_draft
        self.base_decode = base_decode  # generation serves the base model whatever the target (scoring does not)
        self.cache: dict[tuple, str | None] = {}
        self.drafted = 0.0 if drafts else None

    def features(self) -> Features:
        return self._features

    def speculation_counter(self):
        return self.drafted

    def generate(self, probes, max_tokens, prompt_logprobs=False):
        out = []
        for p in probes:
            ids = tuple(p.ids(self.ref.sequence))
            key = ids if self.leak else (p.target, ids)
            hit = not prompt_logprobs and key in self.cache
            target = self.cache[key] if hit and self.leak else p.target  # a leak serves the cached target
            target = None if self.base_decode else target
            self.cache.setdefault(key, p.target)
            tokens, logprobs, prefix = [], [], ids
            for j in range(max_tokens):
                token, lp = next_token(target, prefix)
                if j == self.bad_draft:
                    token, lp = token % (VOCAB - 1) + 1, lp - 3.0
                tokens.append(token)
                logprobs.append(lp + (self.warm_shift if hit else 0.0))
                prefix += (token,)
            if self.drafted is not None and self._features.speculative:
                self.drafted += 4 * max_tokens
            out.append(Generation(tokens, logprobs, list(tokens), cached_tokens=256 if hit else 0))
        return out

    def score(self, probes, concurrent=False):
        out = []
        for p in probes:
            if p.prompt is None:
                out += super().score([p], concurrent)
                continue
            ids = p.prompt
            tokens, logprobs, top1, top1_lp = [], [], [], []
            for i in range(1, len(ids) + 1):
                best, lp = next_token(p.target, ids[:i])
                actual = ids[i] if i < len(ids) else best
                tokens.append(actual)
                logprobs.append(lp if actual == best else lp - 3.0)
                top1.append(best)
                top1_lp.append(lp)
            out.append(Scores(tokens, logprobs, top1, top1_logprobs=top1_lp))
        return out


def fast_run(server):
    options = DoctorOptions(lengths=[1, 65, 129, 300], tolerance=FP32, short_max=129)
    report = run_doctor(server, server.ref, ["relic"], options, TEXTS)  # type: ignore[arg-type]
    return report, {c.name: c for c in report.checks}


ON = Features(prefix_caching=True, speculative=True)


def test_fast_paths_pass_when_right_and_skip_when_off():
    ref = StubReference(800, ["relic"])
    report, checks = fast_run(FastServer(ref, ON))
    assert checks["prefix_cache"].status is Status.PASS and checks["speculative"].status is Status.PASS
    assert checks["prefix_cache"].data["cached_tokens"] == {
        "base cold": 0, "adapter after base": 0, "adapter cold": 0, "base warm": 256, "adapter warm": 256,
    }  # fmt: skip
    assert report.exit_code == 0
    _, checks = fast_run(FastServer(ref, Features(prefix_caching=False, speculative=False)))
    assert checks["prefix_cache"].summary == "prefix caching is off on this deployment"
    assert checks["speculative"].summary == "speculative decoding is off on this deployment"
    # a server that does not say: probed, skipped when it reports no cache hits and no drafts
    _, checks = fast_run(FastServer(ref, Features(), drafts=False))
    assert checks["speculative"].status is Status.SKIP and "no speculative decoding" in checks["speculative"].summary


def test_a_prefix_cache_that_changes_answers_or_ignores_the_adapter_fails():
    ref = StubReference(800, ["relic"])
    _, checks = fast_run(FastServer(ref, ON, warm_shift=0.5))
    assert checks["prefix_cache"].status is Status.FAIL
    assert (
        "base, its prefix cached (300-token prompt) differs from the same prompt cold"
        in (checks["prefix_cache"].failures[0])
    )
    _, checks = fast_run(FastServer(ref, ON, leak=True))
    failures = " ".join(checks["prefix_cache"].failures)
    assert "relic reused 256 cached prompt tokens when only base had sent the prompt" in failures
    assert "relic, only the base model's prefix cached (300-token prompt) differs" in failures


def test_a_wrongly_accepted_draft_token_fails_speculation():
    ref = StubReference(800, ["relic"])
    _, checks = fast_run(FastServer(ref, ON, bad_draft=3))
    spec = checks["speculative"]
    assert spec.status is Status.FAIL and len(spec.failures) == 2  # base and relic
    assert "generated token 3" in spec.failures[0] and "accepted wrongly" in spec.failures[0]


OFF = Features(prefix_caching=False, speculative=False)


class TogetherServer(FastServer):
    """FastServer that takes `together` (its requests in flight at once), and records each call's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.together_calls: list[bool] = []

    def generate(self, probes, max_tokens, prompt_logprobs=False, together=False):
        self.together_calls.append(together)
        return super().generate(probes, max_tokens, prompt_logprobs)


def test_decode_is_held_to_the_prefill_of_the_same_tokens():
    ref = StubReference(800, ["relic"])
    report, checks = fast_run(FastServer(ref, OFF))
    decode = checks["decode"]
    assert decode.status is Status.PASS and decode.compared == 2 * DECODE_TOKENS  # base and relic, every token
    assert "decoded one at a time" in decode.summary and report.exit_code == 0
    assert any("no decode step mixed the targets" in n for n in decode.notes)
    server = TogetherServer(ref, OFF)
    _, checks = fast_run(server)
    assert checks["decode"].status is Status.PASS and "decoded in one batch" in checks["decode"].summary
    assert not checks["decode"].notes and True in server.together_calls
    # speculation on: the speculative check compares decode with prefill instead
    _, checks = fast_run(FastServer(ref, ON))
    assert checks["decode"].status is Status.SKIP and "speculative check" in checks["decode"].summary


def test_a_decode_path_that_serves_the_base_model_fails():
    """Prefill right (the sweep passes), decode without the adapter: the adapter's row fails, the base's not."""
    ref = StubReference(800, ["relic"])
    report, checks = fast_run(TogetherServer(ref, OFF, base_decode=True))
    decode = checks["decode"]
    assert decode.status is Status.FAIL and report.exit_code != 0
    assert checks["fidelity"].status is Status.PASS
    assert decode.failures and all(f.startswith("relic: ") for f in decode.failures)  # the base decodes right
    assert "generated token 0" in decode.failures[0] and "the decode path computes another model" in decode.failures[0]


def test_fp8_is_judged_against_the_dequantised_reference_only():
    ok = [Diff(n, positions=n, mean_abs=0.05, max_abs=1.0) for n in (65, 129)]
    off = check_fp8(Features(), object(), ok)
    assert off.status is Status.SKIP and "unquantised" in off.summary
    fp8 = Features(quantization="fp8")
    assert "not computed from the same weights dequantised" in check_fp8(fp8, object(), ok).summary

    class Dequantised:
        dequantised = True

    assert check_fp8(fp8, Dequantised(), ok).status is Status.PASS
    far = [*ok, Diff(400, positions=400, mean_abs=0.6, max_abs=9.0)]
    bad = check_fp8(fp8, Dequantised(), far)
    assert bad.status is Status.FAIL and bad.failures[0].startswith("base at 400 tokens")


def test_weight_only_fp8_keeps_the_unquantised_tolerance():
    """An FP8 deployment that quantises its activations, or may (a server not told otherwise), has its
    tolerance's ceiling raised to FP8's; weight-only FP8 (in-process with --fp8-activations none, or a
    server told by --endpoint-quantization fp8-weight-only) keeps the unquantised one, and so does its
    fp8 check when given that tolerance; split activations keep bf16's at least."""
    from types import SimpleNamespace

    from hylora.doctor.doctor import _policy
    from hylora.doctor.endpoint import Endpoint
    from hylora.doctor.fastpaths import FP8_TOLERANCE

    options, reference = SimpleNamespace(tolerance=None), SimpleNamespace(dtype="bfloat16")
    unquantised = _policy(options, reference, Features()).ceiling
    assert unquantised.max < FP8_TOLERANCE.max
    dynamic = Endpoint("http://127.0.0.1:1", [], [], quantization="fp8").features()
    weight_only = Endpoint("http://127.0.0.1:1", [], [], quantization="fp8-weight-only").features()
    assert weight_only.quantization == "fp8" and weight_only.quantized_activations is False
    assert _policy(options, reference, dynamic).ceiling == FP8_TOLERANCE
    assert _policy(options, reference, weight_only).ceiling == unquantised

    class Dequantised:
        dequantised = True

    fp8_sized = [Diff(n, positions=n, mean_abs=0.15, max_abs=3.0) for n in (65, 129)]  # within FP8's bounds
    assert check_fp8(dynamic, Dequantised(), fp8_sized).status is Status.PASS
    judged = check_fp8(weight_only, Dequantised(), fp8_sized, unquantised)
    assert judged.status is Status.FAIL and "unquantised or split activations" in judged.summary
    # split activations (a bf16 rounding's precision): an fp32 deployment's ceiling rises to bf16's, a
    # bf16 one's stays
    from hylora.doctor.noise import TolerancePolicy

    split = Features(quantization="fp8", quantized_activations=False, split_activations=True)
    fp32 = SimpleNamespace(tolerance=TolerancePolicy.measured("float32", "float32"))
    assert _policy(fp32, reference, weight_only).ceiling == PRESETS["float32"]
    assert _policy(fp32, reference, split).ceiling == PRESETS["bfloat16"]
    assert _policy(options, reference, split).ceiling == unquantised == PRESETS["bfloat16"]


# --- report, plot and progress ------------------------------------------------------------------


def test_exact_zeros_sit_in_their_own_strip_and_break_the_lines():
    """The base model is often bit-identical to its reference: no dive to the bottom of a log axis."""
    diffs = [Diff(n, positions=n, top1_compared=n, top1_agree=n, max_abs=v, mean_abs=v / 10)
             for n, v in ((63, 2e-6), (64, 0.0), (65, 3e-6), (127, 4e-6), (128, 0.0))]  # fmt: skip
    svg = sweep_svg([TargetSweep(None, diffs, None, None)], FP32)
    assert "0 (exact)" in svg and "exactly 0" in svg
    strip_y = float(re.search(r'<circle cx="[\d.]+" cy="([\d.]+)" r="3" fill="white"', svg).group(1))
    assert svg.count('fill="white" stroke="#555555"') == 2  # the two zeros, open circles in the strip
    lines = re.findall(r'<polyline points="([^"]+)"', svg)
    assert len(lines) == 2  # max and mean of 65…127 (63 alone, between zeros, is not a line)
    assert all(float(pt.split(",")[1]) < strip_y - 10 for line in lines for pt in line.split())


def test_a_progress_line_per_phase():
    stream = io.StringIO()
    progress = Progress(2, stream, update_s=1e9)
    progress.phase("sweep", 3)
    progress.tick()
    progress.tick(2)
    progress.phase("load", 1, "runs")
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("doctor [1/2] sweep: 0/3 requests (")
    assert re.fullmatch(r"doctor \[1/2\] sweep: 3/3 requests in \d+\.\d s \(\d+ s elapsed\)", lines[1])
    assert lines[2].startswith("doctor [2/2] load: 0/1 runs")


def test_doctor_kernels_flag_reaches_the_engine_it_checks(demo_cache_dir, monkeypatch):
    """`hylora doctor --kernels` (as serve's): the in-process deployment is built with those kernel
    switches, beside doctor's own kernel flags; a clash between the two says which; a bad name is argparse's
    exit 2 before anything loads."""
    from hylora.cli import build_parser
    from hylora.doctor.cli import run_from_args

    class Built(Exception):
        pass

    seen = []

    def engine(model_dir, config, **kwargs):
        seen.append(config.kernels)
        raise Built

    monkeypatch.setattr("hylora.engine.engine.LLMEngine", engine)
    monkeypatch.setenv("HYLORA_CACHE_DIR", str(demo_cache_dir))
    argv = ["doctor", "--demo", "--device", "cpu", "--lora-delta-first-from", "0"]
    with pytest.raises(Built):
        run_from_args(build_parser().parse_args([*argv, "--kernels", "fp8_deepgemm=1,decode_attention_block_t=64"]))
    assert seen[0].fp8_deepgemm and seen[0].decode_attention_block_t == 64 and seen[0].lora_delta_first_from == 0
    clash = [*argv, "--fp8-activations", "none", "--kernels", "fp8_activations=split"]
    with pytest.raises(ValueError, match="--fp8-activations none and --kernels fp8_activations=split disagree"):
        run_from_args(build_parser().parse_args(clash))
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--kernels", "fp8_deepgem=1"])


@pytest.mark.parametrize("where", ["missing/doctor.json", "."])
@pytest.mark.parametrize("flag", ["--json", "--report"])
def test_an_output_path_that_cannot_be_written_is_refused_before_anything_runs(tmp_path, monkeypatch, flag, where):
    """`--json` / `--report` into a directory that does not exist, or naming a directory: one line
    naming the path, before the demo is written or a model loads (not after a run of minutes)."""
    from hylora.cli import build_parser
    from hylora.doctor.cli import run_from_args

    started = []
    monkeypatch.setattr("hylora.demo.ensure_demo", lambda *a, **k: started.append(a))
    monkeypatch.setattr("hylora.engine.engine.LLMEngine", lambda *a, **k: started.append(a))
    path = tmp_path / where
    with pytest.raises(ValueError, match=re.escape(f"{flag} {path}: ")) as refused:
        run_from_args(build_parser().parse_args(["doctor", "--demo", "--device", "cpu", flag, str(path)]))
    assert "\n" not in str(refused.value) and not started

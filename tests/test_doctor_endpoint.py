"""doctor against a server: it catches each failure class of a fake OpenAI-compatible server (a thin
wrapper around hylora's engine, tests/doctor_helpers.py) with the right check, and passes the
unmodified hylora server — with the tolerance derived from the server's measured noise, as the CLI
does by default. Adapters with small effects (like real task adapters) pass on a correct fp32
server, and fail when the server ignores them, also on a noisy server where their effect is only
~5× the noise; a bf16 server passes with the demo."""

from __future__ import annotations

import json

import pytest

from hylora.cli import build_parser
from hylora.demo import DEMO_ADAPTERS
from hylora.doctor import DoctorOptions, Report, Status, Tolerance, run_doctor
from hylora.doctor.cli import run_from_args
from hylora.doctor.endpoint import ECHO, PROMPT_LOGPROBS, Budget, Endpoint
from hylora.doctor.noise import TolerancePolicy
from hylora.doctor.prompts import doctor_sequence
from hylora.doctor.reference import Reference
from hylora.doctor.report import render_text
from hylora.doctor.scores import TokenTexts
from hylora.engine import EngineConfig, LLMEngine
from tests.doctor_helpers import SUBTLE_ADAPTERS, Faults, fake_server, write_subtle_adapters
from tests.server_helpers import running_server

ADAPTERS = list(DEMO_ADAPTERS)
SUBTLE = list(SUBTLE_ADAPTERS)
LENGTHS = [1, 65, 129, 400]  # 129 and shorter go before the pollution burst (2 × 400 tokens)
SHORT_MAX = 129


@pytest.fixture(scope="module")
def adapters(demo_dir):
    return {name: demo_dir / "adapters" / name for name in ADAPTERS}


@pytest.fixture(scope="module")
def subtle(demo_dir, tmp_path_factory):
    """Held-out-like adapters: PEFT-written, small effects (tests/doctor_helpers.py)."""
    return write_subtle_adapters(demo_dir, tmp_path_factory.mktemp("subtle"))


@pytest.fixture(scope="module")
def engine(demo_dir):
    config = EngineConfig(
        max_model_len=512, max_num_seqs=2, max_loras=1, max_lora_rank=1, device="cpu", dtype="float32"
    )
    return LLMEngine(demo_dir, config, progress=False)


@pytest.fixture(scope="module")
def reference(engine, adapters):
    """One reference for every run in this module (it depends only on the model and adapters)."""
    return Reference(engine, adapters, doctor_sequence(engine.tokenizer, 600), LENGTHS[-1])


@pytest.fixture(scope="module")
def subtle_reference(engine, subtle):
    return Reference(engine, subtle, doctor_sequence(engine.tokenizer, 600), LENGTHS[-1])


@pytest.fixture(scope="module")
def fake(demo_dir, adapters, subtle):
    with fake_server(demo_dir, adapters | subtle, max_model_len=512) as server:
        yield server


def doctor(
    fake, reference, faults: Faults, vllm_fields: bool = True, tolerance=None
) -> tuple[Report, dict[str, Status], Endpoint]:
    """Run doctor on the fake server; without `vllm_fields` it answers like a plain OpenAI server
    (prompt logprobs only through echo, tokens as text). `tolerance` None: measured (the CLI's
    default for a server)."""
    names = list(reference.adapters)
    fake.reset(faults, vllm_fields)
    endpoint = Endpoint(fake.url, reference.sequence, names, request_timeout=120, budget=Budget(400, 600))
    endpoint.connect()
    options = DoctorOptions(lengths=LENGTHS, tolerance=tolerance, short_max=SHORT_MAX)
    report = run_doctor(endpoint, reference, names, options, TokenTexts(reference.engine.tokenizer))
    return report, {c.name: c.status for c in report.checks}, endpoint


def check(report: Report, name: str):
    return next(c for c in report.checks if c.name == name)


PASS, FAIL, SKIP = Status.PASS, Status.FAIL, Status.SKIP


EXPECTED = {
    "kernels": SKIP, "adapter_effect": PASS, "fidelity": PASS, "mixed_batches": PASS, "pollution": PASS,
    "decode": PASS, "prefix_cache": SKIP, "speculative": SKIP, "fp8": SKIP, "load": SKIP,
}  # fmt: skip


def test_unmodified_fake_server_passes(fake, reference):
    report, status, endpoint = doctor(fake, reference, Faults())
    assert endpoint.mode == PROMPT_LOGPROBS and endpoint.token_ids  # vLLM's extension, ids as token_id:N
    assert status == EXPECTED
    assert report.exit_code == 0
    assert all(c.compared > 0 for c in report.checks if c.status is PASS)
    # an fp32 server measured as such: the float32 tolerance, and the report says why
    assert report.tolerance == Tolerance.for_dtypes("float32") and "measured noise" in report.tolerance_why
    assert report.noise.measured and report.noise.max < 1e-3
    skips = {c.name: c.summary for c in report.checks if c.name in ("prefix_cache", "speculative")}
    assert "reported no cached prompt tokens" in skips["prefix_cache"]  # probed, then skipped
    assert "no speculative decoding" in skips["speculative"]


def test_ignored_adapter_is_reported_as_the_base_model_under_its_name(fake, reference):
    report, status, endpoint = doctor(fake, reference, Faults(ignore_adapter="relic"), vllm_fields=False)
    assert endpoint.mode == ECHO and not endpoint.token_ids
    assert status["adapter_effect"] is FAIL and status["fidelity"] is FAIL
    assert status["mixed_batches"] is PASS and status["pollution"] is PASS
    (failure,) = check(report, "adapter_effect").failures
    assert failure.startswith("relic: served the base model under the name 'relic'")
    assert all(f.startswith("relic at ") for f in check(report, "fidelity").failures)
    assert report.exit_code == 1


def test_base_requests_given_an_adapter_in_mixed_batches(fake, reference):
    report, status, _ = doctor(fake, reference, Faults(base_gets_adapter=True))
    assert status["mixed_batches"] is FAIL
    assert status["adapter_effect"] is PASS and status["fidelity"] is PASS and status["pollution"] is PASS
    failures = check(report, "mixed_batches").failures
    assert failures and all(f.startswith("base,") for f in failures)
    assert any("it matches" in f for f in failures)  # names the adapter the base request got
    assert report.exit_code == 1


def test_nan_and_token_0_after_n_prompt_tokens(fake, reference):
    report, status, _ = doctor(fake, reference, Faults(nan_after=300))
    assert status["fidelity"] is FAIL
    assert status["adapter_effect"] is PASS and status["mixed_batches"] is PASS and status["pollution"] is PASS
    failures = check(report, "fidelity").failures
    assert len(failures) == 1 + len(ADAPTERS)  # every target at 400 tokens, nothing shorter
    assert all(" at 400 tokens: " in f and "non-finite logprobs" in f and "from position 300" in f for f in failures)
    assert all("token 0 ('!')" in f for f in failures)
    assert {s.cliff for s in report.sweeps} == {400}


def test_later_requests_poisoned_after_a_long_one(fake, reference):
    report, status, endpoint = doctor(fake, reference, Faults(poison_after_long=400), vllm_fields=False)
    assert endpoint.mode == ECHO
    assert status["pollution"] is FAIL
    assert status["adapter_effect"] is PASS and status["mixed_batches"] is PASS
    failures = check(report, "pollution").failures
    assert any("changed after a burst of 2 × 400-token requests" in f for f in failures)
    # the sweep's long prompts, sent after the burst, are poisoned too; its short ones were not
    assert {s.cliff for s in report.sweeps} == {400}


def test_subtle_adapters_on_a_correct_fp32_server_pass(fake, subtle_reference):
    """The held-out case: adapters whose effect is modest (mean |Δ logprob| vs base ≈ 0.17) served
    correctly by an fp32 server pass — with the measured tolerance, and with the bfloat16 preset
    (`--endpoint-dtype bfloat16`, the old default that made doctor call them indistinguishable)."""
    report, status, _ = doctor(fake, subtle_reference, Faults())
    assert status == EXPECTED, [c.failures for c in report.checks]
    effects = check(report, "adapter_effect").data
    for name in SUBTLE:
        assert 0.1 < effects[name]["effect_mean"] < 0.3 and effects[name]["effect_max"] < 2.0
        assert effects[name]["lengths"] and not effects[name]["base"] and not effects[name]["indistinct"]
        assert abs(effects[name]["carried"] - 1.0) < 1e-3  # all of the adapter's effect is served
    bf16 = TolerancePolicy.of(Tolerance.for_dtypes("float32", "bfloat16"), "--endpoint-dtype bfloat16")
    report, status, _ = doctor(fake, subtle_reference, Faults(), tolerance=bf16)
    assert status == EXPECTED and report.tolerance.mean == 0.1


def test_ignored_subtle_adapter_fails_on_a_noisy_server(fake, subtle_reference):
    """A server whose logprobs carry noise (σ 0.03 per position, new every request) and that ignores
    one subtle adapter: that adapter — whose effect is only about 5× the measured noise — is reported
    as the base model under its name; the other two, served right through the same noise, pass."""
    report, status, _ = doctor(fake, subtle_reference, Faults(ignore_adapter="subtle_mlp", noise=0.03))
    assert status["adapter_effect"] is FAIL and status["mixed_batches"] is PASS and status["pollution"] is PASS
    (failure,) = check(report, "adapter_effect").failures
    assert failure.startswith("subtle_mlp: served the base model under the name 'subtle_mlp'")
    effects = check(report, "adapter_effect").data
    ratio = effects["subtle_mlp"]["effect_mean"] / effects["subtle_mlp"]["noise"]
    assert 4.0 < ratio < 8.0, ratio  # a small effect: about 5× the noise
    assert effects["subtle_mlp"]["carried"] < 0.2 and effects["subtle_attn"]["carried"] > 0.8
    # the tolerance came from the measured noise, between the float32 and bfloat16 presets
    assert report.noise.mean > 0.02 and Tolerance.for_dtypes("float32").mean < report.tolerance.mean <= 0.1
    assert all(f.startswith("subtle_mlp at ") for f in check(report, "fidelity").failures)


def test_a_wrong_served_model_name_is_the_servers_404_before_the_model_loads(fake, demo_cache_dir, monkeypatch, capsys):
    """A base-model name the server does not serve: doctor says that the server answered 404, in its
    own words, with the names it does serve, and stops (exit 1) before loading the reference's model
    (not "no prompt logprobs" after a full run)."""

    def load(*args, **kwargs):
        raise AssertionError("doctor went on to load the model")

    monkeypatch.setattr("hylora.engine.engine.LLMEngine", load)
    monkeypatch.setenv("HYLORA_CACHE_DIR", str(demo_cache_dir))
    fake.reset()
    argv = ["doctor", "--demo", "--endpoint", fake.url, "--served-model-name", "no-such-model", "--device", "cpu"]
    code = run_from_args(build_parser().parse_args(argv + ["--max-model-len", "512"]))
    err = capsys.readouterr().err
    assert code == 1, err
    assert "HTTP 404: model 'no-such-model' does not exist" in err and "prompt logprobs" not in err
    assert "check --served-model-name" in err and "fake-base, " in err  # what the server's /v1/models lists


def test_an_adapter_the_server_does_not_have_is_reported_on_that_adapter(fake, engine, adapters):
    """An adapter name the server does not serve (not loaded there): every failure is that adapter's,
    in the server's words (HTTP 404 and its message), not a numeric difference or a poisoned probe;
    the base and the other adapters pass."""
    ghost = {"ghost": adapters["relic"]} | adapters  # first: the pollution check probes it
    lengths = [1, 65]
    reference = Reference(engine, ghost, doctor_sequence(engine.tokenizer, 600), lengths[-1])
    fake.reset()
    endpoint = Endpoint(fake.url, reference.sequence, list(ghost), request_timeout=120, budget=Budget(400, 600))
    endpoint.connect()
    options = DoctorOptions(lengths=lengths, short_max=lengths[-1])
    report = run_doctor(endpoint, reference, list(ghost), options, TokenTexts(engine.tokenizer))
    failures = [f for c in report.checks for f in c.failures]
    refused = "HTTP 404: model 'ghost' does not exist"
    assert failures and all(f.startswith(("ghost", "probe ghost")) and refused in f for f in failures), failures
    assert not any("differs" in f or "poison" in f for f in failures), "\n".join(failures)
    failed = {c.name for c in report.checks if c.status is FAIL}
    assert failed == {"adapter_effect", "fidelity", "mixed_batches", "pollution", "decode", "prefix_cache"}
    assert report.exit_code == 1
    fidelity = next(c for c in report.checks if c.name == "fidelity")
    assert "ghost: every request refused" in fidelity.summary and "ghost fails from" not in fidelity.summary
    assert "ghost: refused" in render_text(report) and "ghost: cliff" not in render_text(report)


def test_bf16_server_with_the_demo_passes(demo_dir, adapters, reference):
    """A bf16 server (its weights and activations rounded) against the fp32 reference: the noise
    measured from it sets the tolerance, and every check passes."""
    with fake_server(demo_dir, adapters, max_model_len=512, dtype="bfloat16") as bf16:
        report, status, _ = doctor(bf16, reference, Faults())
    assert status == EXPECTED, [c.failures for c in report.checks]
    assert report.noise.mean > 1e-3  # bf16 noise, measured
    assert report.tolerance.mean > Tolerance.for_dtypes("float32").mean


def test_hylora_server_passes_through_the_cli(demo_cache_dir, tmp_path, monkeypatch, capsys):
    """The real server, with the optional load check; JSON and HTML written."""
    monkeypatch.setenv("HYLORA_CACHE_DIR", str(demo_cache_dir))
    serve = ["--demo", "--max-model-len", "512", "--dtype", "float32", "--device", "cpu"]
    with running_server(serve, demo_cache_dir, tmp_path / "server.log") as handle:
        args = build_parser().parse_args(
            ["doctor", "--demo", "--endpoint", handle.url, "--dtype", "float32"]
            + ["--device", "cpu", "--max-model-len", "512", "--lengths", ",".join(map(str, LENGTHS))]
            + ["--short-max-len", str(SHORT_MAX), "--load", "2", "--load-streams", "4"]
            + ["--json", str(tmp_path / "doctor.json"), "--report", str(tmp_path / "doctor.html")]
        )
        code = run_from_args(args)
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0, out
    # a progress line per phase on stderr: what, how many of how many, elapsed
    assert "doctor [1/7] references" in captured.err and "doctor [7/7] load: 1/1 runs in " in captured.err
    assert "tolerance: " in out and "measured noise" in out
    data = json.loads((tmp_path / "doctor.json").read_text())
    status = {c["name"]: c["status"] for c in data["checks"]}
    assert status.pop("prefix_cache") in ("pass", "skip")  # pass once the server reports cached tokens
    assert status == {
        "kernels": "skip", "adapter_effect": "pass", "fidelity": "pass", "mixed_batches": "pass",
        "pollution": "pass", "decode": "pass", "speculative": "skip", "fp8": "skip", "load": "pass",
    }  # fmt: skip
    assert "PASSED (exit 0)" in out
    (pollution,) = [c for c in data["checks"] if c["name"] == "pollution"]
    assert "a video" in pollution["summary"]  # the demo's clip joined the burst, through /v1/chat/completions
    assert "<svg" in (tmp_path / "doctor.html").read_text()

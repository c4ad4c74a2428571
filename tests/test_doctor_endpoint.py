"""doctor against a server: it catches each failure class of a fake OpenAI-compatible server (a thin
wrapper around hylora's engine, tests/doctor_helpers.py) with the right check, and passes the
unmodified hylora server."""

from __future__ import annotations

import json

import pytest

from hylora.cli import build_parser
from hylora.demo import DEMO_ADAPTERS
from hylora.doctor import DoctorOptions, Report, Status, Tolerance, run_doctor
from hylora.doctor.cli import run_from_args
from hylora.doctor.endpoint import ECHO, PROMPT_LOGPROBS, Budget, Endpoint
from hylora.doctor.prompts import doctor_sequence
from hylora.doctor.reference import Reference
from hylora.doctor.scores import TokenTexts
from hylora.engine import EngineConfig, LLMEngine
from tests.doctor_helpers import Faults, fake_server
from tests.server_helpers import running_server

ADAPTERS = list(DEMO_ADAPTERS)
LENGTHS = [1, 65, 129, 400]  # 129 and shorter go before the pollution burst (2 × 400 tokens)
SHORT_MAX = 129


@pytest.fixture(scope="module")
def adapters(demo_dir):
    return {name: demo_dir / "adapters" / name for name in ADAPTERS}


@pytest.fixture(scope="module")
def reference(demo_dir, adapters):
    """One reference for every run in this module (it depends only on the model and adapters)."""
    config = EngineConfig(
        max_model_len=512, max_num_seqs=2, max_loras=1, max_lora_rank=1, device="cpu", dtype="float32"
    )
    engine = LLMEngine(demo_dir, config, progress=False)
    return Reference(engine, adapters, doctor_sequence(engine.tokenizer, 600), LENGTHS[-1])


@pytest.fixture(scope="module")
def fake(demo_dir, adapters):
    with fake_server(demo_dir, adapters, max_model_len=512) as server:
        yield server


def doctor(fake, reference, faults: Faults, vllm_fields: bool = True) -> tuple[Report, dict[str, Status], Endpoint]:
    """Run doctor on the fake server; without `vllm_fields` it answers like a plain OpenAI server
    (prompt logprobs only through echo, tokens as text)."""
    fake.reset(faults, vllm_fields)
    endpoint = Endpoint(fake.url, reference.sequence, ADAPTERS, request_timeout=120, budget=Budget(400, 600))
    endpoint.connect()
    options = DoctorOptions(lengths=LENGTHS, tolerance=Tolerance.for_dtypes("float32"), short_max=SHORT_MAX)
    report = run_doctor(endpoint, reference, ADAPTERS, options, TokenTexts(reference.engine.tokenizer))
    return report, {c.name: c.status for c in report.checks}, endpoint


def check(report: Report, name: str):
    return next(c for c in report.checks if c.name == name)


PASS, FAIL, SKIP = Status.PASS, Status.FAIL, Status.SKIP


def test_unmodified_fake_server_passes(fake, reference):
    report, status, endpoint = doctor(fake, reference, Faults())
    assert endpoint.mode == PROMPT_LOGPROBS and endpoint.token_ids  # vLLM's extension, ids as token_id:N
    assert status == {
        "kernels": SKIP, "adapter_effect": PASS, "fidelity": PASS, "mixed_batches": PASS, "pollution": PASS,
        "load": SKIP,
    }  # fmt: skip
    assert report.exit_code == 0
    assert all(c.compared > 0 for c in report.checks if c.status is PASS)


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


def test_hylora_server_passes_through_the_cli(demo_cache_dir, tmp_path, monkeypatch, capsys):
    """The real server, with the optional load check; JSON and HTML written."""
    monkeypatch.setenv("HYLORA_CACHE_DIR", str(demo_cache_dir))
    serve = ["--demo", "--max-model-len", "512", "--dtype", "float32", "--device", "cpu"]
    with running_server(serve, demo_cache_dir, tmp_path / "server.log") as handle:
        args = build_parser().parse_args(
            ["doctor", "--demo", "--endpoint", handle.url, "--endpoint-dtype", "float32", "--dtype", "float32"]
            + ["--device", "cpu", "--max-model-len", "512", "--lengths", ",".join(map(str, LENGTHS))]
            + ["--short-max-len", str(SHORT_MAX), "--load", "2", "--load-streams", "4"]
            + ["--json", str(tmp_path / "doctor.json"), "--report", str(tmp_path / "doctor.html")]
        )
        code = run_from_args(args)
    out = capsys.readouterr().out
    assert code == 0, out
    data = json.loads((tmp_path / "doctor.json").read_text())
    status = {c["name"]: c["status"] for c in data["checks"]}
    assert status == {
        "kernels": "skip", "adapter_effect": "pass", "fidelity": "pass", "mixed_batches": "pass",
        "pollution": "pass", "load": "pass",
    }  # fmt: skip
    assert "PASSED (exit 0)" in out
    (pollution,) = [c for c in data["checks"] if c["name"] == "pollution"]
    assert "a video" in pollution["summary"]  # the demo's clip joined the burst, through /v1/chat/completions
    assert "<svg" in (tmp_path / "doctor.html").read_text()

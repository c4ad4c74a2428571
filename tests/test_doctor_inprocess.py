"""`hylora doctor --demo` in this process: every check on the demo model and its adapters passes, with
the fidelity sweep up to 4096 tokens; the JSON holds the numbers and the HTML report shows the sweep
(and renders in a real browser when Chromium is installed). The fast-path checks run on the engine
when its features say the paths are on."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hylora.cli import build_parser
from hylora.doctor.cli import run_from_args
from hylora.doctor.prompts import BOUNDARY_LENGTHS
from hylora.engine import EngineConfig
from tests.doctor_helpers import one_thread  # noqa: F401  (autouse: this module runs torch on one thread)

TARGETS = ["base", "relic", "tomb", "mural"]


@pytest.fixture(scope="module")
def doctor_run(demo_cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("doctor")
    argv = ["doctor", "--demo", "--device", "cpu", "--max-num-batched-tokens", "4096", "--load", "2"]
    argv += ["--json", str(out / "doctor.json"), "--report", str(out / "doctor.html")]
    text = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(text):
        mp.setenv("HYLORA_CACHE_DIR", str(demo_cache_dir))
        code = run_from_args(build_parser().parse_args(argv))
    return code, text.getvalue(), json.loads((out / "doctor.json").read_text()), out / "doctor.html"


def test_demo_passes_every_check_with_the_sweep_to_4096(doctor_run):
    code, text, data, _ = doctor_run
    assert code == 0, text
    status = {c["name"]: c["status"] for c in data["checks"]}
    prefix = "pass" if getattr(EngineConfig(), "enable_prefix_caching", False) else "skip"  # when the engine has it
    assert status == {
        "kernels": "skip", "adapter_effect": "pass", "fidelity": "pass", "mixed_batches": "pass",
        "pollution": "pass", "decode": "pass", "prefix_cache": prefix, "speculative": "skip", "fp8": "skip",
        "load": "pass",
    }  # fmt: skip
    assert data["lengths"] == list(BOUNDARY_LENGTHS) and data["lengths"][-1] == 4096
    # the engine's own precision: the float32 preset, and the noise it measured (repeats bit-identical)
    assert data["tolerance"]["mean"] == 1e-3 and "float32 preset" in data["tolerance"]["why"]
    assert data["noise"]["sources"]["repeat"]["max"] == 0.0
    sweep = {s["target"]: s for s in data["sweep"]}
    assert list(sweep) == TARGETS
    for s in sweep.values():
        assert [d["length"] for d in s["lengths"]] == list(BOUNDARY_LENGTHS)
        assert s["cliff"] is None
        assert all(d["error"] is None and d["non_finite"] == 0 for d in s["lengths"])
        assert all(d["positions"] >= d["length"] - 1 and d["top1_compared"] == d["length"] for d in s["lengths"])
    checks = {c["name"]: c for c in data["checks"]}
    assert checks["kernels"]["summary"].startswith("no fast kernels in use")  # CPU: every op is its reference
    assert any("injected NaN failed alone" in n for n in checks["pollution"]["notes"])
    assert "the video request in the burst (excavation.mp4) was served" in checks["pollution"]["notes"]
    assert "bit-identical" in checks["pollution"]["summary"]
    effects = checks["adapter_effect"]["data"]
    assert all(effects[a]["effect_mean"] > 0.1 and not effects[a]["base"] for a in TARGETS[1:])
    assert all(abs(effects[a]["carried"] - 1.0) < 1e-3 for a in TARGETS[1:])
    assert "PASSED (exit 0)" in text


def test_report_plot_shows_the_sweep(doctor_run):
    _, _, data, page = doctor_run
    html = page.read_text()
    svg = html[html.index("<svg") : html.index("</svg>")]
    assert svg.count("<polyline") >= 2 * len(TARGETS)  # max and mean per target (broken at exact zeros)
    assert svg.count("<title>") == len(TARGETS) * len(BOUNDARY_LENGTHS)  # one point per (target, length)
    assert ">4096<" in svg and "max tolerance" in svg
    # the base model's exact zeros: open circles in the "0 (exact)" strip, not dives to the axis
    zeros = sum(d["max_abs"] == 0 for s in data["sweep"] for d in s["lengths"])
    assert zeros > 0 and svg.count('r="3" fill="white" stroke="#555555"') == zeros and "0 (exact)" in svg
    assert not re.search(r"(src|href)=\"https?:", html)  # self-contained
    # the tolerance and why, and a short kernels row
    assert "float32 preset" in html and "measured noise" in html
    kernels_row = re.search(r"<td>kernels</td>.*?</tr>", html).group(0)
    assert len(kernels_row) < 250


def _chromium() -> str | None:
    return next((p for p in ("chromium", "chromium-browser", "google-chrome") if shutil.which(p)), None)


@pytest.mark.skipif(_chromium() is None, reason="Chromium is not installed")
def test_report_renders_in_headless_chromium(doctor_run, tmp_path):
    png = tmp_path / "report.png"
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={png}"]
    cmd += ["--window-size=1200,1500", Path(doctor_run[3]).resolve().as_uri()]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    from PIL import Image

    with Image.open(png) as image:
        assert image.size == (1200, 1500)
        assert len(image.convert("RGB").getcolors(1 << 20) or []) > 20  # drawn, not a blank page


def test_in_process_failures_fail_the_run(demo_dir):
    """A kernel that failed its start-up check, and an adapter that is not what its name says (the
    engine serves relic's files under 'relic', the reference is told 'relic' is tomb's)."""
    from hylora.doctor import DoctorOptions, Status, Tolerance, run_doctor
    from hylora.doctor.deployment import EngineDeployment
    from hylora.doctor.prompts import doctor_sequence
    from hylora.doctor.reference import Reference
    from hylora.doctor.scores import TokenTexts
    from hylora.engine import EngineConfig, LLMEngine
    from hylora.kernels import KernelVerdict

    adapters = {"relic": demo_dir / "adapters" / "relic"}
    config = EngineConfig(max_model_len=600, device="cpu", fault_injection=True)
    engine = LLMEngine(demo_dir, config, lora_modules=adapters, progress=False)
    failed = KernelVerdict("lora", "reference", "rel. error 3.00e-01 > 1e-04", 0.3, 1e-4, check_failed=True)
    engine.kernels = dict(engine.kernels, lora=failed)
    sequence = doctor_sequence(engine.tokenizer, 600)
    reference = Reference(engine, {"relic": demo_dir / "adapters" / "tomb"}, sequence, 129)
    options = DoctorOptions(lengths=[1, 65, 129], tolerance=Tolerance.for_dtypes("float32"), short_max=65)
    report = run_doctor(
        EngineDeployment(engine, sequence), reference, ["relic"], options, TokenTexts(engine.tokenizer), engine.kernels
    )
    status = {c.name: c.status for c in report.checks}
    assert status["kernels"] is Status.FAIL and status["fidelity"] is Status.FAIL
    assert status["adapter_effect"] is Status.FAIL  # matches neither its reference nor the base
    assert status["mixed_batches"] is Status.PASS and status["pollution"] is Status.PASS
    assert report.exit_code == 1


def test_fast_path_checks_pass_on_an_engine_that_caches_prefixes_and_speculates(demo_dir):
    """The demo engine with prefix caching and MTP speculation (the demo ships a draft layer): warm
    equals cold and resumes from the cache (the adapter never from the base's prefix); decode with
    drafts agrees with a plain prefill, and drafts were counted. A verifier that accepts every draft
    fails the check."""
    from hylora.doctor import Tolerance
    from hylora.doctor.deployment import EngineDeployment
    from hylora.doctor.fastpaths import judge_prefix_cache, judge_speculation, run_prefix_cache, run_speculation
    from hylora.doctor.prompts import doctor_sequence
    from hylora.doctor.scores import TokenTexts
    from hylora.engine import LLMEngine

    adapters = {"relic": demo_dir / "adapters" / "relic"}
    config = EngineConfig(max_model_len=800, device="cpu", num_speculative_tokens=2)
    engine = LLMEngine(demo_dir, config, lora_modules=adapters, progress=False)
    sequence = doctor_sequence(engine.tokenizer, 800)
    deployment = EngineDeployment(engine, sequence)
    features = deployment.features()
    assert features.prefix_caching is True and features.speculative is True
    texts, tol = TokenTexts(engine.tokenizer), Tolerance.for_dtypes("float32")
    prefix = judge_prefix_cache(run_prefix_cache(deployment, [None, "relic"], len(sequence)), texts, tol)
    assert prefix.status.value == "pass", prefix.failures
    cached = prefix.data["cached_tokens"]
    assert cached["base warm"] > 0 and cached["adapter warm"] > 0 and cached["adapter after base"] == 0
    drafts = engine.stats().spec_draft_tokens
    spec = judge_speculation(run_speculation(deployment, [None, "relic"], sequence), texts, tol)
    assert spec.status.value == "pass", spec.failures
    assert spec.compared >= 2 * 15 and engine.stats().spec_draft_tokens > drafts


def test_the_speculative_check_fails_a_verifier_that_accepts_every_draft(demo_dir, monkeypatch):
    import hylora.engine.engine as engine_module
    from hylora.doctor import Tolerance
    from hylora.doctor.deployment import EngineDeployment
    from hylora.doctor.fastpaths import judge_speculation, run_speculation
    from hylora.doctor.prompts import doctor_sequence
    from hylora.doctor.scores import TokenTexts
    from hylora.engine import LLMEngine
    from hylora.engine.speculative import launch_verify

    def accept_all(logits, requests, drafts, *rest):
        pending = launch_verify(logits, requests, drafts, *rest)
        results = pending.results()
        pending.results = (
            lambda: [  # type: ignore[method-assign]
                [(t, None) for t in d] + r[len(d) :] if isinstance(r, list) else r
                for d, r in zip(drafts, results, strict=True)
            ]
        )
        return pending

    monkeypatch.setattr(engine_module, "launch_verify", accept_all)
    config = EngineConfig(max_model_len=800, device="cpu", num_speculative_tokens=2)
    engine = LLMEngine(demo_dir, config, progress=False)
    sequence = doctor_sequence(engine.tokenizer, 800)
    spec = judge_speculation(
        run_speculation(EngineDeployment(engine, sequence), [None], sequence),
        TokenTexts(engine.tokenizer),
        Tolerance.for_dtypes("float32"),
    )
    assert spec.status.value == "fail"


def test_the_decode_check_fails_an_engine_that_decodes_without_its_adapters(demo_dir, monkeypatch):
    """Prompts prefilled with the adapters, decode steps (a token a sequence) run without them: the
    sweep cannot see it; the decode check fails each adapter and passes the base model. Unpatched, the
    four targets decoded in one batch agree with the prefill of the same tokens."""
    from hylora.doctor import Tolerance
    from hylora.doctor.decode import DECODE_TOKENS, judge_decode, run_decode
    from hylora.doctor.deployment import EngineDeployment
    from hylora.doctor.prompts import doctor_sequence
    from hylora.doctor.scores import TokenTexts
    from hylora.engine import LLMEngine
    from hylora.model.layers import Linear

    adapters = {name: demo_dir / "adapters" / name for name in TARGETS[1:]}
    engine = LLMEngine(demo_dir, EngineConfig(max_model_len=800, device="cpu"), lora_modules=adapters, progress=False)
    sequence = doctor_sequence(engine.tokenizer, 800)
    deployment, targets = EngineDeployment(engine, sequence), [None, *TARGETS[1:]]
    texts, tol = TokenTexts(engine.tokenizer), Tolerance.for_dtypes("float32")
    healthy = judge_decode(run_decode(deployment, targets, sequence), texts, tol)
    assert healthy.status.value == "pass", healthy.failures
    assert healthy.compared == len(targets) * DECODE_TOKENS and "in one batch" in healthy.summary

    forward = Linear.forward
    monkeypatch.setattr(Linear, "forward", lambda self, x, lora=None: forward(self, x, None if len(x) <= 4 else lora))
    broken = judge_decode(run_decode(deployment, targets, sequence), texts, tol)
    assert broken.status.value == "fail"
    assert {f.split(":")[0] for f in broken.failures} == set(TARGETS[1:])  # the base model decodes right


def test_fp8_quantised_at_load_is_checked_against_its_own_values_dequantised(demo_cache_dir, tmp_path):
    """`--quantization fp8` on the unquantised demo: the reference is the weights the deployment
    quantised at load, dequantised (before: the unquantised weights, so the fp8 check was skipped
    and the weights' FP8 error was charged to the adapters, failing relic on the H200)."""
    argv = ["doctor", "--demo", "--device", "cpu", "--quantization", "fp8", "--lengths", "17,129"]
    argv += ["--no-fast-paths", "--json", str(tmp_path / "doctor.json")]
    text = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(text):
        mp.setenv("HYLORA_CACHE_DIR", str(demo_cache_dir))
        code = run_from_args(build_parser().parse_args(argv))
    data = json.loads((tmp_path / "doctor.json").read_text())
    assert code == 0, text.getvalue()
    assert data["reference"].endswith("FP8 weights dequantised)")
    checks = {c["name"]: c for c in data["checks"]}
    assert checks["fp8"]["status"] == "pass", checks["fp8"]["summary"]
    assert checks["fp8"]["summary"].startswith("fp8 vs the dequantised reference")

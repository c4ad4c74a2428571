"""ops/fp8_linear/deepgemm.py's routing and operands, on the CPU with a stand-in for `deep_gemm`.

DeepGEMM runs only on an sm_90 GPU (bench/fp8_deepgemm_gpu.py times and checks the real one there). Here
a stand-in with `fp8_gemm_nt`'s contract (FP8 x [M, K] with fp32 1 x 128 scales [M, K / 128], the
weight [N, K] with its [N / 128, K / 128] block scales, a contiguous bf16 [M, N] output it writes) computes
the reference's product, so what the module hands it, and what it does with the output (leading dims,
a column slice of a wider output, the extra 16-bit rows, steps cuBLAS would not take), is checked
against the reference GEMM."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")

from hylora.ops.fp8_linear import cublas, deepgemm  # noqa: E402
from hylora.ops.fp8_linear import reference as R  # noqa: E402


def stand_in(calls: list[tuple[int, int, int]]) -> SimpleNamespace:
    def fp8_gemm_nt(a, b, d, disable_ue8m0_cast=False):
        (xq, xs), (w, ws) = a, b
        (M, K), N = xq.shape, w.shape[0]
        assert disable_ue8m0_cast, "the checkpoint's fp32 scales as they are, not rounded to powers of 2"
        assert xq.dtype == w.dtype == R.FP8_DTYPE and xs.dtype == ws.dtype == torch.float32
        assert xs.shape == (M, K // 128) and ws.shape == (N // 128, K // 128)
        assert d.shape == (M, N) and d.dtype == torch.bfloat16 and d.is_contiguous()
        x = (xq.float().view(M, K // 128, 128) * xs[..., None]).view(M, K)
        d.copy_(x @ R.dequantize_weight(w, ws, R.BLOCK).t())
        calls.append((M, N, K))

    return SimpleNamespace(fp8_gemm_nt=fp8_gemm_nt)


@pytest.fixture
def calls(monkeypatch) -> list[tuple[int, int, int]]:
    seen: list[tuple[int, int, int]] = []
    monkeypatch.setattr(deepgemm, "_deep_gemm", lambda: stand_in(seen))
    return seen


def weight(N: int, K: int):
    g = torch.Generator().manual_seed(N + K)
    return R.quantize_weight(torch.randn(N, K, generator=g) * 0.05)


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(torch.isfinite(got).all()) and (got.float() - want.float()).abs().max() <= 1e-2 * want.abs().max()


@pytest.mark.parametrize("lead", [(128,), (2, 80)], ids=str)
def test_steps_cublas_would_take_go_to_deepgemm_with_the_same_operands(calls, lead):
    """From cublas.CUBLAS_FROM tokens, whole blocks: DeepGEMM computes the reference's product, leading
    dims kept, into a NaN-filled output passed in or a new one."""
    N, K = 256, 512
    w, ws = weight(N, K)
    x = torch.randn(*lead, K).bfloat16()
    want = R.fp8_linear(x, w, ws)
    assert close(deepgemm.fp8_linear(x, w, ws), want)
    out = torch.full((*lead, N), math.nan, dtype=torch.bfloat16)
    assert deepgemm.fp8_linear(x, w, ws, out=out) is out and close(out, want)
    quantized = R.QuantizedActivation.of(x.reshape(-1, K))  # quantised by its producer
    assert close(deepgemm.fp8_linear(quantized, w, ws).view(*lead, N), want)
    assert calls == [(math.prod(lead), N, K)] * 3


def test_a_column_slice_and_extra_rows_leave_the_rest_of_the_output_as_it_was(calls):
    """The GDN in_proj's FP8 rows beside its unquantised tail: DeepGEMM writes a contiguous result that
    lands in the slice; extra 16-bit rows go after it; the columns beyond stay NaN."""
    N, K, M, E = 256, 512, 128, 8
    w, ws = weight(N, K)
    x = torch.randn(M, K).bfloat16()
    wider = torch.full((M, N + E + 4), math.nan, dtype=torch.bfloat16)
    deepgemm.fp8_linear(x, w, ws, out=wider[:, :N])
    assert close(wider[:, :N], R.fp8_linear(x, w, ws)) and wider[:, N:].isnan().all()
    extra = (x, torch.randn(E, K).bfloat16() / 8)
    deepgemm.fp8_linear(x, w, ws, out=wider[:, : N + E], extra=extra)
    assert close(wider[:, : N + E], R.fp8_linear(x, w, ws, extra=extra)) and wider[:, N + E :].isnan().all()
    assert calls == [(M, N, K)] * 2


@pytest.mark.parametrize(
    "M, N, K, dtype",
    [(127, 256, 512, torch.bfloat16), (128, 256, 384, torch.bfloat16), (128, 256, 512, torch.float32)],
    ids=["below CUBLAS_FROM", "K not a multiple of 512", "fp32 output"],
)
def test_other_steps_are_the_cublas_modules(calls, monkeypatch, M, N, K, dtype):
    """What cuBLAS would not take, and outputs DeepGEMM does not write (bf16 only), stay with the
    `cublas` module (which hands them on to Triton)."""
    served = []
    monkeypatch.setattr(cublas, "fp8_linear", lambda x, *a, **k: served.append(x.shape) or "cublas module")
    w, ws = weight(N, K)
    assert deepgemm.fp8_linear(torch.randn(M, K).to(dtype), w, ws) == "cublas module"
    assert served == [(M, K)] and calls == []


def test_without_deep_gemm_everything_is_the_cublas_modules(monkeypatch):
    """Not installed (or not an sm_90 GPU): `available()` says so, and fp8_linear is the cublas module's."""
    monkeypatch.setattr(deepgemm, "_deep_gemm", lambda: None)
    monkeypatch.setattr(cublas, "fp8_linear", lambda *a, **k: "cublas module")
    w, ws = weight(256, 512)
    assert not deepgemm.available()
    assert deepgemm.fp8_linear(torch.randn(128, 512).bfloat16(), w, ws) == "cublas module"
    assert deepgemm.fp8_split_linear is cublas.fp8_split_linear
    assert deepgemm.takes_split_input is cublas.takes_split_input


@pytest.mark.parametrize("max_tokens", [100, 128, 129, 1000, 2048, 8192])
def test_the_warm_up_sizes_meet_every_block_count_a_step_can_have(max_tokens):
    """DeepGEMM's sm_90 heuristic sees a step of M >= 33 rows only through its block counts
    ceil(M / block_m), block_m in 64, 128, 256: the warm-up's step sizes give every combination a step of
    CUBLAS_FROM to max_tokens tokens has, and no step size that a step of at most max_tokens cannot
    share its kernels with."""

    def blocks(M: int) -> tuple[int, ...]:
        return tuple(-(-M // block_m) for block_m in (64, 128, 256))

    sizes = deepgemm.warm_up_token_counts(max_tokens)
    assert {blocks(M) for M in sizes} == {blocks(M) for M in range(cublas.CUBLAS_FROM, max_tokens + 1)}
    assert all(cublas.CUBLAS_FROM <= M < max_tokens + deepgemm.WARM_UP_STRIDE for M in sizes)


def test_the_warm_up_runs_each_weight_shape_deepgemm_takes_at_each_size(calls):
    """One run per distinct [N, K] and step size, on the weights given; shapes cuBLAS would not take
    (K not a multiple of 512) none; where DeepGEMM is absent, nothing."""
    weights = [weight(256, 512), weight(256, 512), weight(128, 1024), weight(256, 384)]
    assert deepgemm.warm_up(weights, max_tokens=300) == 2 * 4
    assert calls == [(M, N, K) for N, K in ((256, 512), (128, 1024)) for M in (128, 192, 256, 320)]
    calls.clear()
    assert deepgemm.warm_up(weights, max_tokens=100) == 0 and calls == []


def test_the_kernel_floor_warms_the_fp8_projections_only_where_deepgemm_serves(calls):
    """kernels/warmup.py: the model's FP8 projections (not its 16-bit ones) at the engine's largest step,
    after the checks chose DeepGEMM; with the cuBLAS verdict nothing compiles at start-up."""
    from hylora.kernels.verdict import passed
    from hylora.kernels.warmup import DEEPGEMM, warm_up_kernels
    from hylora.model.layers import Linear

    model = torch.nn.Sequential(Linear(512, {"q": 256}), Linear(1024, {"o": 128}), Linear(512, {"bf16": 256}))
    for linear in list(model)[:2]:
        linear.set_fp8(*weight(linear.out_features, linear.in_features), R.BLOCK, None, torch.bfloat16)
    model.device = torch.device("cpu")
    warm_up_kernels(model, {"fp8_linear": passed("fp8_linear", "cublas+triton", 0.0, 1e-2)}, 300)
    assert calls == []
    warm_up_kernels(model, {"fp8_linear": passed("fp8_linear", DEEPGEMM, 0.0, 1e-2)}, 300)
    assert sorted({(N, K) for _, N, K in calls}) == [(128, 1024), (256, 512)] and len(calls) == 8


def test_the_engine_warms_its_kernels_for_its_largest_step(causal_ckpt, monkeypatch):
    """The engine hands the kernel floor max_num_batched_tokens, the largest step it will run."""
    import hylora.kernels.select as select
    from hylora.engine import EngineConfig, LLMEngine

    seen = []
    monkeypatch.setattr(select, "warm_up_kernels", lambda model, verdicts, tokens: seen.append(tokens))
    LLMEngine(causal_ckpt[0], EngineConfig(device="cpu", max_model_len=64, max_num_batched_tokens=96), progress=False)
    assert seen == [96]


def test_one_weight_shape_warms_up_on_zero_weights(calls):
    """warm_up_shape (a child process's work): the shape's kernels at every step size, no model needed."""
    assert deepgemm.warm_up_shape(256, 512, 200, "cpu") == 3  # 256: the block counts of 193-256 tokens
    assert calls == [(128, 256, 512), (192, 256, 512), (256, 256, 512)]


def test_on_a_gpu_each_shape_compiles_in_a_child_first_then_here(calls, monkeypatch):
    """With a CUDA model and several shapes, the floor hands the distinct DeepGEMM shapes to child
    processes, then runs every step size itself (which loads what they compiled)."""
    from hylora.kernels import warmup
    from hylora.kernels.verdict import passed
    from hylora.model.layers import Linear

    handed = []
    monkeypatch.setattr(warmup, "compile_in_processes", lambda *a: handed.append((a, len(calls))) or [])
    monkeypatch.setattr(warmup.torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(warmup.torch.cuda, "empty_cache", lambda: None)
    model = torch.nn.Sequential(Linear(512, {"q": 256}), Linear(1024, {"o": 128}), Linear(512, {"k": 256}))
    for linear in model:
        linear.set_fp8(*weight(linear.out_features, linear.in_features), R.BLOCK, None, torch.bfloat16)
    model.device = torch.device("cuda")
    warmup.warm_up_kernels(model, {"fp8_linear": passed("fp8_linear", warmup.DEEPGEMM, 0.0, 1e-2)}, 300)
    assert handed == [(([(128, 1024), (256, 512)], 300, "cuda"), 0)]  # before any GEMM here
    assert len(calls) == 8


def test_child_processes_run_the_shapes_and_report_the_ones_that_failed(caplog):
    """The children are fresh interpreters on this process's import path; one that fails (here: a device
    this machine lacks) is named in a warning and returned, so this process compiles its shape itself."""
    from hylora.kernels import warmup

    assert warmup.compile_in_processes([(256, 512), (128, 1024)], 256, "cpu") == []
    with caplog.at_level("WARNING", logger=warmup.__name__):
        failed = warmup.compile_in_processes([(256, 512)], 256, "no-such-device")
    assert failed == [(256, 512)]
    assert "[256, 512] weights in a child process failed (rc 1" in caplog.text and "compiling them here" in caplog.text

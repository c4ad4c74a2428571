"""FP8 (e4m3) block-scaled linear: the torch reference against dense fp32 arithmetic, the Triton
kernels against the reference.

Without CUDA the kernels run in Triton's CPU interpreter (its tl.dot takes e4m3 operands; its own
fp32 → fp8 cast rounds wrongly, which the kernels never rely on): activation quantisation bit for bit,
the GEMM to fp32 summation order, at sizes straddling every tile boundary. With CUDA the same
comparisons run compiled, plus bf16 inputs and a CUDA-graph replay.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.triton_mode import interpret_without_cuda, kernel_device

interpret_without_cuda()  # before triton is imported
pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")

from hylora.ops.fp8_linear import reference as R  # noqa: E402
from hylora.ops.fp8_linear import triton as T  # noqa: E402
from tests.fp8_gemm_configs import CONFIGS  # noqa: E402

DEVICE = kernel_device(T._gemm_kernel)
INTERPRETED = DEVICE == "cpu"
cuda_only = pytest.mark.skipif(
    INTERPRETED, reason="needs CUDA and compiled Triton (the interpreter was chosen at import)"
)
E4M3 = 2.0**-4  # e4m3's relative rounding bound on normals: half an ulp of 3 mantissa bits
E4M3_SUBNORMAL = 2.0**-10  # its absolute rounding bound below 2^-6, in units of the scale


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def blocky(N: int, K: int, block: tuple[int, int], seed: int) -> torch.Tensor:
    """Random [N, K] whose (bn, bk) blocks differ in magnitude by up to 10^4: a scale applied to the
    wrong block (transposed, shifted, per wrong row) is off by orders of magnitude."""
    g = torch.Generator().manual_seed(seed)
    bn, bk = block
    rows = torch.arange(N)[:, None] // bn
    cols = torch.arange(K)[None, :] // bk
    magnitude = 10.0 ** ((rows * 3 + cols * 7) % 5 - 2).float()
    return torch.randn(N, K, generator=g) * magnitude


def rounding_bound(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """|dequantize(quantize(w)) - w| ≤ 2^-4 |w| + 2^-10 scale (normal / subnormal e4m3), plus fp32 slack."""
    N, K = w.shape
    s = scale.repeat_interleave(block[0], 0)[:N].repeat_interleave(block[1], 1)[:, :K]
    return E4M3 * w.abs() + E4M3_SUBNORMAL * s + 1e-6 * 448 * s


# --- reference --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, block", [((300, 200), (128, 128)), ((5, 130), (1, 128)), ((128, 256), (128, 128))])
def test_weight_round_trip_within_e4m3_rounding(shape, block):
    N, K = shape
    w = blocky(N, K, block, seed=N)
    w_fp8, scale = R.quantize_weight(w, block)
    assert w_fp8.dtype == R.FP8_DTYPE and w_fp8.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (-(-N // block[0]), -(-K // block[1]))
    back = R.dequantize_weight(w_fp8, scale, block)
    assert (back - w).abs().le(rounding_bound(w, scale, block)).all()
    # each block's amax lands on ±448 and comes back (to fp32 rounding)
    amax = R.dequantize_weight(w_fp8.float().abs().to(R.FP8_DTYPE), torch.ones_like(scale), block)
    per_block = torch.nn.functional.pad(amax, (0, -K % block[1], 0, -N % block[0]))
    per_block = per_block.view(scale.shape[0], block[0], scale.shape[1], block[1]).amax(dim=(1, 3))
    assert per_block.eq(R.FP8_MAX).all()
    torch.testing.assert_close(back.abs().amax(), w.abs().amax(), rtol=1e-6, atol=0)
    with pytest.raises(ValueError):
        R.dequantize_weight(w_fp8, scale[:, :-1], block)


def test_scale_shapes_of_partial_blocks():
    w = torch.randn(257, 129)
    assert R.quantize_weight(w)[1].shape == (3, 2)
    assert R.quantize_weight(w, (1, 128))[1].shape == (257, 2)
    assert R.quantize_activation(torch.randn(3, 129))[1].shape == (3, 2)
    assert R.quantize_activation(torch.randn(3, 384))[1].shape == (3, 3)


def test_zero_blocks_and_groups_stay_zero_and_finite():
    w = torch.randn(256, 256)
    w[:128, 128:] = 0  # one whole zero block
    w_fp8, scale = R.quantize_weight(w)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    back = R.dequantize_weight(w_fp8, scale)
    assert back[:128, 128:].eq(0).all()
    x = torch.randn(4, 256)
    x[1] = 0  # a zero token
    x[2, :128] = 0  # a zero group
    x_fp8, x_scale = R.quantize_activation(x)
    assert torch.isfinite(x_scale).all() and x_fp8.float()[1].eq(0).all() and x_fp8.float()[2, :128].eq(0).all()
    y = R.fp8_linear(x, w_fp8, scale)
    assert torch.isfinite(y).all() and y[1].eq(0).all()


@pytest.mark.parametrize("block", [(128, 128), (1, 128)], ids=str)
def test_fp8_linear_within_quantisation_error_of_dense(block):
    M, N, K = 9, 300, 400
    w = blocky(N, K, block, seed=1)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(2)) * 10.0 ** (torch.arange(K) // 128 % 3 - 1)
    w_fp8, w_scale = R.quantize_weight(w, block)
    dense = x.double() @ w.double().T
    got = R.fp8_linear(x, w_fp8, w_scale, block)
    # |Σ a b - Σ x w| ≤ Σ |a - x| |b| + |x| |b - w|, with a, b the dequantised x and w (exact bound)
    a = R.dequantize_activation(*R.quantize_activation(x)).double()
    b = R.dequantize_weight(w_fp8, w_scale, block).double()
    bound = (a - x).abs() @ b.abs().T + x.abs().double() @ (b - w).abs().T
    assert ((got.double() - dense).abs() <= bound * (1 + 1e-5) + 1e-5 * dense.abs().amax()).all()
    rel = float((got.double() - dense).norm() / dense.norm())
    assert 1e-3 < rel < 0.05, rel  # e4m3 on both sides: a few per cent, not exact, not far off
    # what this bound catches: the same scales read transposed, or one row / block row off
    for wrong in (w_scale.T.reshape(w_scale.shape), w_scale.roll(1, 0)):
        off = R.fp8_linear(x, w_fp8, wrong, block).double()
        assert not ((off - dense).abs() <= bound * (1 + 1e-5) + 1e-5 * dense.abs().amax()).all()
        assert float((off - dense).norm() / dense.norm()) > 0.5


def test_fp8_linear_flattens_leading_dims_and_keeps_the_dtype():
    w_fp8, w_scale = R.quantize_weight(torch.randn(40, 160))
    x = torch.randn(2, 3, 160).bfloat16()
    y = R.fp8_linear(x, w_fp8, w_scale)
    assert y.shape == (2, 3, 40) and y.dtype == torch.bfloat16
    assert torch.equal(y, R.fp8_linear(x.reshape(6, 160), w_fp8, w_scale).reshape(2, 3, 40))


# --- Triton kernels ----------------------------------------------------------------------------------


def rounding_cases(device: str) -> torch.Tensor:
    """Rows [448 | values]: amax 448 makes the scale exactly 1, so every value below is rounded as
    is: all e4m3 values, the midpoints between neighbours (ties to even, the binade crossings
    15.5 → 16, subnormal ties), one fp32 ulp either side of each midpoint, signs, ±0, random values."""
    grid = torch.arange(256, dtype=torch.uint8).view(R.FP8_DTYPE).float()
    grid = grid[grid.isfinite() & (grid >= 0)].unique()  # 0 ... 448
    mid = (grid[1:] + grid[:-1]) / 2
    values = torch.cat(
        [grid, mid, mid.nextafter(torch.tensor(0.0)), mid.nextafter(torch.tensor(1e9)), torch.rand(2000) * 448]
    )
    values = torch.cat([values, -values, torch.tensor([0.0, -0.0])])
    rows = -(-len(values) // 127)
    body = torch.cat([values, torch.zeros(rows * 127 - len(values))]).view(rows, 127)
    return torch.cat([torch.full((rows, 1), 448.0), body], 1).to(device)


def test_quantize_activation_rounds_like_torch_bit_for_bit():
    x = rounding_cases(DEVICE)
    q, s = T.quantize_activation(x)
    q_ref, s_ref = R.quantize_activation(x)
    assert s.eq(1).all()
    assert torch.equal(bits(q), bits(q_ref)) and torch.equal(bits(s), bits(s_ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 64), (15, 127), (17, 129), (65, 384), (3, 1000)], ids=str)
def test_quantize_activation_equals_reference(shape, dtype):
    M, K = shape
    g = torch.Generator().manual_seed(K)
    x = (torch.randn(M, K, generator=g) * 10.0 ** torch.randint(-6, 4, (M, 1), generator=g)).to(dtype)
    x[0, : min(K, 128)] = 0  # a zero group
    wide = torch.randn(M, K + 16, dtype=dtype)
    wide[:, :K] = x  # rows with a stride past K
    for inp in (x, wide[:, :K]):
        q, s = T.quantize_activation(inp.to(DEVICE))
        q_ref, s_ref = R.quantize_activation(inp)
        assert torch.equal(bits(q.cpu()), bits(q_ref)) and torch.equal(bits(s.cpu()), bits(s_ref))


@pytest.mark.parametrize("split", [False, True], ids=["dynamic", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 128), (16, 300), (17, 256), (33, 64)], ids=str)
def test_silu_mul_quantized_is_the_unfused_ops_bit_for_bit(shape, dtype, split):
    """The activation and the FP8 quantisation of the down projection's input in one launch: the
    same bits as silu_mul then quantize_activation (`split`: quantize_activation_split's two terms;
    tokens straddling the 16-row programs, inputs straddling the 128-input groups), and the kept
    values those of silu_mul."""
    from hylora.ops.silu_mul import reference as silu_reference
    from hylora.ops.silu_mul import triton as silu_triton

    T_, inner = shape
    g = torch.Generator().manual_seed(T_ * inner)
    gate_up = (torch.randn(T_, 2 * inner, generator=g) * 4).to(dtype).to(DEVICE)
    gate_up[0, :inner] = 0  # a row whose groups are all zero: scale AMAX_FLOOR / 448, values 0
    h = silu_triton.silu_mul(gate_up)
    for keep in (False, True):
        got = silu_triton.silu_mul_quantized(gate_up, keep=keep, split=split)
        assert_terms_equal(got, quantized_terms(T, h, split))
        assert got.dtype == dtype and (torch.equal(got.x, h) if keep else got.x is None)
    ref = silu_reference.silu_mul_quantized(gate_up.cpu(), keep=True, split=split)
    assert_terms_equal(ref, quantized_terms(R, silu_reference.silu_mul(gate_up.cpu()), split))


def quantized_terms(module, values: torch.Tensor, split: bool) -> tuple[torch.Tensor, ...]:
    """`module`'s (the reference's or the Triton) quantisation of values: (q, scale) or (hi, lo, scale)."""
    return module.quantize_activation_split(values) if split else module.quantize_activation(values)


def assert_terms_equal(got: R.QuantizedActivation, want: tuple[torch.Tensor, ...]) -> None:
    """A producer's quantised input has exactly `want`'s bits: q (hi), lo where split (none where not), scale."""
    terms = (got.q, got.lo, got.scale) if len(want) == 3 else (got.q, got.scale)
    assert len(want) == 3 or got.lo is None
    for a, b in zip(terms, want, strict=True):
        assert torch.equal(bits(a.cpu()), bits(b.cpu()))


def assert_quantizes_the_unfused_norm(
    got: R.QuantizedActivation, out: torch.Tensor, keep: bool, split: bool = False
) -> None:
    """A fused norm's quantisation `got` against the unfused norm `out`: the same bits as
    quantize_activation(out) (`split`: quantize_activation_split's), and a kept norm the same bits as
    out. Except fp32 on a GPU: there the compiled sum of squares is ordered by each kernel's register
    layout, which the quantisation's e4m3 store changed (H200, run 34: the shapes of more than one row
    per program differed in fp32, never in bf16; since then a contiguity hint keeps the plain norm's
    layout, the same on sm_90 compiled on the CPU), so the norm may differ in its last bits: a kept
    norm stays within 4 ulp of out and its terms and scales are exactly its own quantisation; an unkept
    one's scales stay within 4 ulp and its values within one e4m3 step of out's quantisation (split:
    within twice the split's own bound of out)."""
    assert got.dtype == out.dtype and (got.x is not None) == keep
    if INTERPRETED or out.dtype != torch.float32:
        assert_terms_equal(got, quantized_terms(T, out, split))
        assert not keep or torch.equal(bits(got.x), bits(out))
        return
    ulps = dict(rtol=4 * torch.finfo(torch.float32).eps, atol=0)
    if keep:
        torch.testing.assert_close(got.x, out, **ulps)
        assert_terms_equal(got, quantized_terms(T, got.x, split))
        return
    want = quantized_terms(T, out, split)
    torch.testing.assert_close(got.scale, want[-1], **ulps)
    if split:
        s = got.scale.repeat_interleave(128, 1)[:, : out.shape[1]]
        assert ((got.dequantized() - out).abs() <= 2.0**-7 * out.abs() + 2.0**-9 * s).all()
    else:
        want = want[0].float()
        step = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(2**-6))) - 3)  # e4m3: 3 mantissa bits
        assert ((got.q.float() - want).abs() <= step).all()


@pytest.mark.parametrize("split", [False, True], ids=["dynamic", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 128), (17, 300), (3, 1000), (70, 64)], ids=str)
def test_rms_norm_quantized_is_the_unfused_ops_bit_for_bit(shape, dtype, split):
    """The decoder's norm and the FP8 quantisation of the projection behind it in one launch: the
    same bits as rms_norm then quantize_activation (`split`: its two terms), with and without the
    residual add (whose sum is rms_norm's), kept and not (widths straddling the 128-input groups and a
    power of two; rows straddling the norm's programs); the reference is the two reference ops."""
    from hylora.ops.rmsnorm import reference as norm_reference
    from hylora.ops.rmsnorm import triton as norm_triton

    T_, D = shape
    g = torch.Generator().manual_seed(T_ * D)
    x, res = ((torch.randn(T_, D, generator=g) * 3).to(dtype).to(DEVICE) for _ in range(2))
    w = (torch.randn(D, generator=g) * 0.1).to(dtype).to(DEVICE)
    x[0] = -res[0]  # a row summing to zero: every group's scale AMAX_FLOOR / 448, values 0
    for residual in (None, res):
        normed = norm_triton.rms_norm(x, w, 1e-6, residual)
        out, total = normed if residual is not None else (normed, None)
        for keep in (False, True):
            got = norm_triton.rms_norm_quantized(x, w, 1e-6, residual, keep=keep, split=split)
            got, got_total = got if residual is not None else (got, None)
            assert_quantizes_the_unfused_norm(got, out, keep, split)
            assert residual is None or torch.equal(bits(got_total), bits(total))
        ref = norm_reference.rms_norm_quantized(
            x.cpu(), w.cpu(), 1e-6, None if residual is None else res.cpu(), keep=True, split=split
        )
        ref = ref if residual is None else ref[0]
        assert_terms_equal(ref, quantized_terms(R, ref.x, split))


@pytest.mark.parametrize("split", [False, True], ids=["dynamic", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 3, 128), (17, 5, 128), (4, 2, 256)], ids=str)
def test_gated_rms_norm_quantized_is_the_unfused_ops_bit_for_bit(shape, dtype, split):
    """The GDN's gated norm quantised for its out_proj in one launch: heads [T, H, D] (D a multiple of
    the 128-input group) as [T, H·D] rows, the gate a strided view of a wider projection output; the
    same bits as gated_rms_norm then quantize_activation (`split`: its two terms), kept and not; D not
    a multiple is refused."""
    from hylora.ops.rmsnorm import reference as norm_reference
    from hylora.ops.rmsnorm import triton as norm_triton

    T_, H, D = shape
    g = torch.Generator().manual_seed(T_ * H * D)
    x = (torch.randn(T_, H, D, generator=g) * 3).to(dtype).to(DEVICE)
    z = torch.randn(T_, 2 * H * D + 7, generator=g).to(dtype).to(DEVICE)[:, 7 + H * D :].reshape(T_, H, D)
    w = (torch.randn(D, generator=g) + 1).to(dtype).to(DEVICE)
    out = norm_triton.gated_rms_norm(x, z, w, 1e-6).reshape(T_, H * D)
    for keep in (False, True):
        got = norm_triton.gated_rms_norm_quantized(x, z, w, 1e-6, keep=keep, split=split)
        assert_quantizes_the_unfused_norm(got, out, keep, split)
    ref = norm_reference.gated_rms_norm_quantized(x.cpu(), z.cpu(), w.cpu(), 1e-6, keep=True, split=split)
    assert_terms_equal(ref, quantized_terms(R, ref.x, split))
    for norm in (norm_triton, norm_reference):
        with pytest.raises(ValueError, match="multiple of 128"):
            norm.gated_rms_norm_quantized(x[..., :64], z[..., :64], w[:64], 1e-6)


@pytest.mark.parametrize("config", ["decode", "medium"])
def test_fp8_linear_takes_an_input_quantised_by_its_producer(config):
    """A QuantizedActivation skips the GEMM's own quantisation and gives the same output."""
    x, w_fp8, w_scale, block = gemm_inputs(17, 129, 384, 128, seed=11)
    quantized = R.QuantizedActivation(*R.quantize_activation(x), x.dtype)
    ref = R.fp8_linear(x, w_fp8, w_scale, block)
    assert torch.equal(R.fp8_linear(quantized, w_fp8, w_scale, block), ref)
    q = R.QuantizedActivation(quantized.q.to(DEVICE), quantized.scale.to(DEVICE), x.dtype)
    got = T.fp8_linear(q, w_fp8.to(DEVICE), w_scale.to(DEVICE), block, config=CONFIGS[config])
    assert_close_to_reference(got.cpu(), ref, GEMM_RTOL)


@pytest.mark.parametrize("config", ["decode", "medium"])
def test_split_linear_takes_an_input_split_by_its_producer(config):
    """A QuantizedActivation with both terms skips the split GEMM's own split launch and gives the same
    bits as the GEMM splitting x itself (Triton), the same values (reference). One term alone is refused
    by every split GEMM, not served without lo; a dynamic GEMM reads hi, which is its own quantisation."""
    from hylora.ops.fp8_linear import cublas

    x, w_fp8, w_scale, block = gemm_inputs(17, 129, 384, 128, seed=12)
    split = R.QuantizedActivation.of(x, split=True)
    assert torch.equal(R.fp8_split_linear(split, w_fp8, w_scale, block), R.fp8_split_linear(x, w_fp8, w_scale, block))
    wd, sd = w_fp8.to(DEVICE), w_scale.to(DEVICE)
    on_device = R.QuantizedActivation(split.q.to(DEVICE), split.scale.to(DEVICE), x.dtype, lo=split.lo.to(DEVICE))
    got = T.fp8_split_linear(on_device, wd, sd, block, config=CONFIGS[config])
    assert torch.equal(bits(got), bits(T.fp8_split_linear(x.to(DEVICE), wd, sd, block, config=CONFIGS[config])))
    one_term = R.QuantizedActivation.of(x)
    for gemm in (R.fp8_split_linear, T.fp8_split_linear, cublas.fp8_split_linear):
        with pytest.raises(ValueError, match="second term"):
            gemm(one_term, w_fp8, w_scale, block)
    assert torch.equal(R.fp8_linear(split, w_fp8, w_scale, block), R.fp8_linear(one_term, w_fp8, w_scale, block))


# fp32 summation order in the interpreter; on a GPU the fp8 MMA also sums 128 products with fewer bits
GEMM_RTOL = 1e-5 if INTERPRETED else 1e-3
# (M, N, K, bn): each of M 1 15 16 17 65, N 1 127 128 129 257, K 64 127 128 129 384 and bn 128 / 1
# at least once against each configuration (split K: K of 2 and 3 groups where it may split)
CASES = [
    (1, 1, 64, 128),
    (15, 127, 129, 1),
    (16, 128, 128, 128),
    (17, 129, 384, 1),
    (65, 257, 127, 128),
    (1, 257, 384, 128),
    (65, 129, 64, 1),
    (16, 1, 129, 1),
]


def gemm_inputs(M: int, N: int, K: int, bn: int, seed: int, dtype=torch.float32):
    block = (bn, 128)
    w_fp8, w_scale = R.quantize_weight(blocky(N, K, block, seed), block)
    g = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn(M, K, generator=g) * 10.0 ** torch.randint(-2, 2, (M, 1), generator=g)).to(dtype)
    return x, w_fp8, w_scale, block


def assert_close_to_reference(got: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    assert not got.isnan().any(), "elements left unwritten"
    err = (got.double() - ref.double()).abs().amax().item()
    assert err <= rtol * ref.double().abs().amax().item() + 1e-30, err


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_fp8_linear_equals_reference(case, config, monkeypatch):
    monkeypatch.setattr(T, "MIN_GROUPS_PER_SPLIT", 1)  # let K of 2-3 groups split (as 4+ groups on a GPU)
    M, N, K, bn = case
    x, w_fp8, w_scale, block = gemm_inputs(M, N, K, bn, seed=M * N + K)
    out = torch.full((M, N), float("nan"), device=DEVICE)
    got = T.fp8_linear(x.to(DEVICE), w_fp8.to(DEVICE), w_scale.to(DEVICE), block, out=out, config=CONFIGS[config])
    assert got is out
    assert_close_to_reference(got.cpu(), R.fp8_linear(x, w_fp8, w_scale, block), GEMM_RTOL)


@pytest.mark.parametrize("bn", [128, 1])
@pytest.mark.parametrize("config", ["tma-decode", "tma-wide-noswap"])
def test_tma_tiles_zero_fill_past_k_n_and_m(config, bn, monkeypatch):
    """K = 400 (3 whole groups and 16 inputs), N and M past their tiles: the TMA kernel runs (its
    zero fill replaces the masked last group) and matches the reference, every element written."""
    monkeypatch.setattr(T, "MIN_GROUPS_PER_SPLIT", 1)
    M, N, K = 17, 129, 400
    x, w_fp8, w_scale, block = gemm_inputs(M, N, K, bn, seed=7)
    x, w_dev = x.to(DEVICE), w_fp8.to(DEVICE)
    assert T._tma_usable(T.quantize_activation(x)[0], w_dev) == (DEVICE == "cpu" or on_hopper())
    out = torch.full((M, N), float("nan"), device=DEVICE)
    T.fp8_linear(x, w_dev, w_scale.to(DEVICE), block, out=out, config=CONFIGS[config])
    assert_close_to_reference(out.cpu(), R.fp8_linear(x.cpu(), w_fp8, w_scale, block), GEMM_RTOL)


def test_tma_needs_16_byte_row_strides():
    q = torch.zeros(4, 129, dtype=R.FP8_DTYPE)
    assert not T._tma_usable(q, q) and T._tma_usable(q[:, :128].contiguous(), q[:, :128].contiguous())


def test_cublas_takes_only_whole_blocks_with_aligned_scale_strides():
    """Steps cuBLAS's block-scaled GEMM cannot take go to the Triton GEMM: fewer than 128 tokens,
    partial or per-row blocks, and K whose weight-scale rows are not 16-byte aligned (K = 256: 2 fp32)
    or that is a single block (K = 128: cuBLAS off by 10x on an H200, run 36)."""
    from hylora.ops.fp8_linear import cublas

    assert cublas.usable(128, 256, 5120, (128, 128)) and cublas.usable(4096, 34816, 17408, (128, 128))
    assert not cublas.usable(128, 256, 128, (128, 128)) and cublas.usable(128, 256, 512, (128, 128))
    assert not cublas.usable(127, 256, 5120, (128, 128)) and not cublas.usable(128, 200, 5120, (128, 128))
    assert not cublas.usable(128, 256, 256, (128, 128)) and not cublas.usable(128, 256, 640, (128, 128))
    assert not cublas.usable(128, 256, 5120, (1, 128))


def on_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_split_k_happens_and_changes_nothing(monkeypatch):
    monkeypatch.setattr(T, "MIN_GROUPS_PER_SPLIT", 1)
    M, N, K, bn = 5, 70, 640, 128  # 5 groups: split 5, 3 (2 + 2 + 1) and 1
    x, w_fp8, w_scale, block = gemm_inputs(M, N, K, bn, seed=3)
    ref = R.fp8_linear(x, w_fp8, w_scale, block)
    x, w_fp8, w_scale = x.to(DEVICE), w_fp8.to(DEVICE), w_scale.to(DEVICE)
    for max_split, split in ((5, 5), (3, 3), (1, 1)):
        cfg = T.GemmConfig(block_m=16, block_n=64, num_warps=4, num_stages=2, max_split_k=max_split, swap_ab=True)
        assert T.split_k(cfg, M, N, 5, 132) == split
        assert_close_to_reference(T.fp8_linear(x, w_fp8, w_scale, block, config=cfg).cpu(), ref, GEMM_RTOL)


def test_fp8_linear_batch_dims_strides_and_out():
    x, w_fp8, w_scale, block = gemm_inputs(6, 129, 257, 128, seed=5)
    wide = torch.randn(6, 300)
    wide[:, :257] = x  # x rows with a stride past K
    ref = R.fp8_linear(x, w_fp8, w_scale, block)
    w_fp8, w_scale = w_fp8.to(DEVICE), w_scale.to(DEVICE)
    got = T.fp8_linear(wide[:, :257].reshape(2, 3, 257).to(DEVICE), w_fp8, w_scale, block)
    assert got.shape == (2, 3, 129)
    assert_close_to_reference(got.reshape(6, 129).cpu(), ref, GEMM_RTOL)
    buffer = torch.full((6, 200), float("nan"), device=DEVICE)
    T.fp8_linear(x.to(DEVICE), w_fp8, w_scale, block, out=buffer[:, 10:139])  # out with a row stride
    assert_close_to_reference(buffer[:, 10:139].cpu(), ref, GEMM_RTOL)
    assert buffer[:, :10].isnan().all() and buffer[:, 139:].isnan().all()  # nothing written outside
    with pytest.raises(ValueError):
        T.fp8_linear(x.to(DEVICE), w_fp8, w_scale[:, :1], block)
    assert T.fp8_linear(x[:0].to(DEVICE), w_fp8, w_scale, block).shape == (0, 129)


def test_fp8_linear_bf16_inputs():
    """bf16 x: the quantisation is exact from bf16 as from fp32; the result is rounded to bf16 (the
    interpreter truncates instead: one bf16 ulp)."""
    x, w_fp8, w_scale, block = gemm_inputs(17, 129, 384, 1, seed=7, dtype=torch.bfloat16)
    ref = R.fp8_linear(x, w_fp8, w_scale, block)
    for config in (T.DECODE, T.MEDIUM):
        got = T.fp8_linear(x.to(DEVICE), w_fp8.to(DEVICE), w_scale.to(DEVICE), block, config=config).cpu()
        assert got.dtype == torch.bfloat16
        diff = (got.float() - ref.float()).abs()
        assert (diff <= 2.0**-7 * ref.float().abs() + GEMM_RTOL * ref.float().abs().amax()).all()


# --- extra 16-bit rows in the FP8 GEMM's launch (an unquantised tail, every slot's LoRA A) ----------------

# (M, N, K, bn, E): E of 1, one tile, past one and two tiles of every configuration's BLOCK_N; K with a
# partial last group and of 3 groups (split K), M past a tile; K of 9 groups, which the extra rows split
# in chunks of their own (several to a split of the FP8 tiles, and one program left without a chunk)
EXTRA_CASES = [
    (1, 127, 129, 128, 1), (17, 129, 384, 1, 65), (16, 64, 400, 128, 129), (65, 1, 64, 1, 257), (33, 130, 1100, 128, 40)
]  # fmt: skip


GEMMS = {  # each --fp8-activations setting's GEMM and its reference
    "dynamic": (T.fp8_linear, R.fp8_linear),
    "weight-only": (T.fp8_weight_only_linear, R.fp8_weight_only_linear),
    "split": (T.fp8_split_linear, R.fp8_split_linear),
}


@pytest.mark.parametrize("gemm", GEMMS, ids=str)
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("case", EXTRA_CASES, ids=str)
def test_extra_rows_join_the_fp8_launch(case, config, gemm, monkeypatch):
    """Columns N.. N + E of the output are x · extraᵀ (16-bit rows, x unquantised), written by the
    same launch as the N FP8 columns, through split K and every tile configuration; the FP8 columns
    are unchanged by them, and columns past N + E of a wider NaN-filled buffer stay untouched."""
    monkeypatch.setattr(T, "MIN_GROUPS_PER_SPLIT", 1)
    M, N, K, bn, E = case
    x, w_fp8, w_scale, block = gemm_inputs(M, N, K, bn, seed=M + N + K + E)
    rows = torch.randn(E, K, generator=torch.Generator().manual_seed(E)) / 8
    kernel, reference = GEMMS[gemm]
    launches = []  # the GEMM launches: the extra rows take none of their own
    for name in ("_gemm_kernel", "_gemm_tma_kernel"):
        monkeypatch.setattr(T, name, LaunchCounter(getattr(T, name), launches))
    buffer = torch.full((M, N + E + 3), float("nan"), device=DEVICE)
    dev = (x.to(DEVICE), w_fp8.to(DEVICE), w_scale.to(DEVICE))
    got = kernel(*dev, block, out=buffer[:, : N + E], config=CONFIGS[config], extra=(dev[0], rows.to(DEVICE)))
    assert len(launches) == 1
    want = reference(x, w_fp8, w_scale, block, extra=(x, rows))
    assert want.shape == (M, N + E)
    assert_close_to_reference(got[:, :N].cpu(), reference(x, w_fp8, w_scale, block), GEMM_RTOL)
    assert_close_to_reference(got[:, N:].cpu(), (x.double() @ rows.double().T).float(), GEMM_RTOL)
    assert buffer[:, N + E :].isnan().all()
    if gemm == "dynamic":  # the input quantised by its producer, its kept values for the extra rows
        quantized = R.QuantizedActivation(*T.quantize_activation(dev[0], block[1]), torch.float32, dev[0])
        again = T.fp8_linear(quantized, *dev[1:], block, config=CONFIGS[config], extra=(dev[0], rows.to(DEVICE)))
        assert_close_to_reference(again.cpu(), want, GEMM_RTOL)


@pytest.mark.parametrize("fold", [True, False], ids=["folded", "sum-launch"])
@pytest.mark.parametrize("config", ["decode", "tma-decode", "prefill"])
@pytest.mark.parametrize("case", EXTRA_CASES, ids=str)
def test_extra_rows_take_whole_k_past_the_chunked_sizes(case, config, fold, monkeypatch):
    """Past EXTRA_CHUNKED_UP_TO tokens (prefill sizes) the extra rows take each split's whole K: the
    same columns, no fp32 partials of their own and no sum launch where the FP8 tiles need none (and
    none at all where the GEMM's last programs fold the partials)."""
    monkeypatch.setattr(T, "MIN_GROUPS_PER_SPLIT", 1)
    monkeypatch.setattr(T, "EXTRA_CHUNKED_UP_TO", 0)
    monkeypatch.setattr(T, "FOLD_SPLITS", fold)
    monkeypatch.setattr(T, "FOLD_UP_TO_TOKENS", 128)
    M, N, K, bn, E = case
    x, w_fp8, w_scale, block = gemm_inputs(M, N, K, bn, seed=M + N + K + E)
    rows = torch.randn(E, K, generator=torch.Generator().manual_seed(E)) / 8
    sums = []
    monkeypatch.setattr(T, "_sum_with_extra_kernel", LaunchCounter(T._sum_with_extra_kernel, sums))
    dev = (x.to(DEVICE), w_fp8.to(DEVICE), w_scale.to(DEVICE))
    got = T.fp8_linear(*dev, block, config=CONFIGS[config], extra=(dev[0], rows.to(DEVICE))).cpu()
    assert_close_to_reference(got[:, :N], R.fp8_linear(x, w_fp8, w_scale, block), GEMM_RTOL)
    assert_close_to_reference(got[:, N:], (x.double() @ rows.double().T).float(), GEMM_RTOL)
    split = T.split_k(CONFIGS[config], M, N, -(-K // block[1]), T._num_sms(torch.device(DEVICE)))
    assert len(sums) == (split > 1 and not fold)


# (M, N, K, bn, E) on 4 SMs: split K of the FP8 tiles alone (E = 0), with chunked extra rows, and extra
# rows chunked where the FP8 tiles do not split (N of 8 or more tiles fills the SMs)
FOLD_CASES = [(5, 70, 640, 128, 0), (17, 129, 400, 1, 0), (3, 64, 1100, 128, 33), (2, 1024, 384, 128, 20)]


@pytest.mark.parametrize("config", ["decode1", "decode", "decode32"])
@pytest.mark.parametrize("case", FOLD_CASES, ids=str)
def test_folded_split_k_is_the_sum_launch_and_leaves_the_counters_at_zero(case, config, monkeypatch):
    """The last program of each split tile sums its tile's fp32 partials in split order: the FP8
    columns are the separate sum launch's bits, the extra columns (that launch sums them as a tree)
    within rounding; nothing else is launched, every element is written, the arrival counters are
    all back at zero, and a second launch gives the same bits."""
    monkeypatch.setattr(T, "MIN_GROUPS_PER_SPLIT", 1)
    monkeypatch.setattr(T, "_num_sms", lambda device: 4)
    monkeypatch.setattr(T, "FOLD_UP_TO_TOKENS", 64)  # every case folds (served: one token with extra rows)
    monkeypatch.setattr(T, "FOLD_WITHOUT_EXTRA", True)
    M, N, K, bn, E = case
    x, w_fp8, w_scale, block = gemm_inputs(M, N, K, bn, seed=M + N + K)
    rows = torch.randn(E, K, generator=torch.Generator().manual_seed(E)) / 8
    dev = (x.to(DEVICE), w_fp8.to(DEVICE), w_scale.to(DEVICE))
    extra = (dev[0], rows.to(DEVICE)) if E else None

    def run(fold: bool) -> tuple[torch.Tensor, list]:
        launches = []
        with monkeypatch.context() as m:
            m.setattr(T, "FOLD_SPLITS", fold)
            for name in ("_gemm_kernel", "_gemm_tma_kernel", "_sum_splits_kernel", "_sum_with_extra_kernel"):
                m.setattr(T, name, LaunchCounter(getattr(T, name), launches))
            out = torch.full((M, N + E), float("nan"), device=DEVICE)
            T.fp8_linear(*dev, block, out=out, config=CONFIGS[config], extra=extra)
        return out.cpu(), launches

    summed, sum_launches = run(False)
    folded, launches = run(True)
    assert len(sum_launches) == 2 and len(launches) == 1  # the GEMM split, and folding took its sum launch
    assert not folded.isnan().any()
    assert torch.equal(bits(folded[:, :N]), bits(summed[:, :N]))
    if E:
        assert_close_to_reference(folded[:, N:], summed[:, N:], GEMM_RTOL)
    assert T._COUNTERS[dev[0].device].eq(0).all()
    again, _ = run(True)
    assert torch.equal(bits(again), bits(folded))


@pytest.mark.parametrize(
    "tokens, rows, counters, folds", [(1, 8, 64, True), (1, 8, 1, False), (1, 0, 64, False), (2, 8, 64, False)]
)
def test_only_one_token_with_extra_rows_folds_and_only_into_enough_counters(tokens, rows, counters, folds, monkeypatch):
    """Served, the partials are folded at one token with extra rows (where that beat the sum launch
    on an H200), and only where the device's counters cover the launch's split tiles; elsewhere the
    sum launch, with the same result."""
    monkeypatch.setattr(T, "MIN_GROUPS_PER_SPLIT", 1)
    monkeypatch.setattr(T, "FOLD_COUNTERS", counters)  # 1: the case's 2 split tiles (+ extra tiles) do not fit
    x, w_fp8, w_scale, block = gemm_inputs(tokens, 70, 640, 128, seed=3)
    extra = torch.randn(rows, 640, generator=torch.Generator().manual_seed(1)) / 8
    sums = []
    for name in ("_sum_splits_kernel", "_sum_with_extra_kernel"):
        monkeypatch.setattr(T, name, LaunchCounter(getattr(T, name), sums))
    dev = (x.to(DEVICE), w_fp8.to(DEVICE), w_scale.to(DEVICE))
    got = T.fp8_linear(*dev, block, config=CONFIGS["decode"], extra=(dev[0], extra.to(DEVICE)) if rows else None)
    assert len(sums) == (not folds)
    want = R.fp8_linear(x, w_fp8, w_scale, block, extra=(x, extra) if rows else None)
    assert_close_to_reference(got.cpu(), want, GEMM_RTOL)


class LaunchCounter:
    """A Triton kernel whose `kernel[grid](...)` launches are recorded before they run."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


def test_extra_rows_need_matching_shapes_and_dtype():
    x, w_fp8, w_scale, block = gemm_inputs(3, 64, 128, 128, seed=1)
    rows = torch.randn(5, 128)
    for bad in ((x[:2], rows), (x, rows[:, :64]), (x, rows.double())):
        with pytest.raises(ValueError, match="extra rows"):
            R.fp8_linear(x, w_fp8, w_scale, block, extra=bad)
        with pytest.raises(ValueError, match="extra rows"):
            T.fp8_linear(
                x.to(DEVICE), w_fp8.to(DEVICE), w_scale.to(DEVICE), block, extra=tuple(t.to(DEVICE) for t in bad)
            )
    with pytest.raises(ValueError, match="out must be"):  # out sized for the FP8 rows alone
        T.fp8_linear(
            x.to(DEVICE),
            w_fp8.to(DEVICE),
            w_scale.to(DEVICE),
            block,
            out=torch.empty(3, 64, device=DEVICE),
            extra=(x.to(DEVICE), rows.to(DEVICE)),
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cublas_serves_extra_rows_beside_its_gemm(dtype, gpu_bf16, monkeypatch):
    """From the cuBLAS thresholds the FP8 columns come from its GEMM (here the weight-only
    dequantise + 16-bit GEMM) and the extra columns from its 16-bit GEMM, into one output."""
    from hylora.ops.fp8_linear import cublas

    monkeypatch.setattr(cublas, "WEIGHT_ONLY_FROM", 4)
    x, w_fp8, w_scale, block = gemm_inputs(9, 130, 256, 128, seed=21, dtype=dtype)
    rows = (torch.randn(7, 256) / 8).to(dtype)
    dev = (x.to(DEVICE), w_fp8.to(DEVICE), w_scale.to(DEVICE))
    got = cublas.fp8_weight_only_linear(*dev, block, extra=(dev[0], rows.to(DEVICE)))
    assert got.shape == (9, 137)
    plain = cublas.fp8_weight_only_linear(*dev, block)
    assert torch.equal(got[:, :130], plain)
    want = torch.nn.functional.linear(dev[0], rows.to(DEVICE))
    assert torch.equal(got[:, 130:], want)


# --- weight-only: the activations as they are, the weights' exact values ------------------------------


def test_weight_only_reference_is_the_dequantised_weights_and_differs_by_activation_rounding():
    x, w_fp8, w_scale, block = gemm_inputs(17, 129, 384, 1, seed=11)
    got = R.fp8_weight_only_linear(x, w_fp8, w_scale, block)
    torch.testing.assert_close(got, x @ R.dequantize_weight(w_fp8, w_scale, block).T, rtol=1e-6, atol=1e-6)
    quantised = R.fp8_linear(x, w_fp8, w_scale, block)  # the same weights on e4m3-rounded inputs
    rel = ((quantised - got).abs().amax() / got.abs().amax()).item()
    assert 1e-4 < rel < E4M3 * 4  # activation rounding shows, within e4m3's bound


@pytest.mark.parametrize("config", [c for c in CONFIGS if c != "fused-noswap"], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_weight_only_linear_equals_reference(case, config, monkeypatch):
    """Every tile configuration, sizes straddling every tile, scale block and K group, split K: the
    NaN-filled output fully written with x · dequantise(W)ᵀ."""
    monkeypatch.setattr(T, "MIN_GROUPS_PER_SPLIT", 1)
    M, N, K, bn = case
    x, w_fp8, w_scale, block = gemm_inputs(M, N, K, bn, seed=M * N + K + 1)
    out = torch.full((M, N), float("nan"), device=DEVICE)
    cfg = CONFIGS[config]
    got = T.fp8_weight_only_linear(x.to(DEVICE), w_fp8.to(DEVICE), w_scale.to(DEVICE), block, out=out, config=cfg)
    assert got is out
    assert_close_to_reference(got.cpu(), R.fp8_weight_only_linear(x, w_fp8, w_scale, block), GEMM_RTOL)


def test_weight_only_ignores_fuse_quant_and_takes_bf16_and_strided_inputs(gpu_bf16):
    x, w_fp8, w_scale, block = gemm_inputs(6, 129, 257, 128, seed=13, dtype=torch.bfloat16)
    ref = R.fp8_weight_only_linear(x, w_fp8, w_scale, block)
    wide = torch.zeros(6, 300, dtype=torch.bfloat16)
    wide[:, :257] = x  # rows with a stride past K
    w_fp8, w_scale = w_fp8.to(DEVICE), w_scale.to(DEVICE)
    for config in (T.DECODE, T.MEDIUM, CONFIGS["fused-noswap"]):
        got = T.fp8_weight_only_linear(wide[:, :257].to(DEVICE), w_fp8, w_scale, block, config=config).cpu()
        assert got.dtype == torch.bfloat16
        diff = (got.float() - ref.float()).abs()
        assert (diff <= 2.0**-7 * ref.float().abs() + GEMM_RTOL * ref.float().abs().amax()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("N, K, bn", [(1, 64, 128), (31, 129, 1), (129, 384, 128), (33, 127, 1)], ids=str)
def test_dequantize_weight_kernel_is_the_reference_bit_for_bit(N, K, bn, dtype, gpu_bf16):
    """Every element of a NaN-filled output: e4m3 times its block's scale in fp32, rounded once."""
    block = (bn, 128)
    w_fp8, w_scale = R.quantize_weight(blocky(N, K, block, seed=N + K), block)
    out = torch.full((N, K), float("nan"), dtype=dtype, device=DEVICE)
    got = T.dequantize_weight(w_fp8.to(DEVICE), w_scale.to(DEVICE), block, dtype, out=out)
    assert got is out
    assert torch.equal(bits(got.cpu()), bits(R.dequantize_weight(w_fp8, w_scale, block, dtype)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_weight_only_many_tokens_dequantise_for_a_16_bit_gemm(dtype, gpu_bf16, monkeypatch):
    """From WEIGHT_ONLY_FROM tokens a 16-bit x meets the weight dequantised into its dtype (what a
    16-bit copy of the dequantised checkpoint holds) in one 16-bit GEMM; fewer tokens, or fp32, keep
    the Triton GEMM's exact weights. Both close to the exact reference; into a column slice of `out`."""
    from hylora.ops.fp8_linear import cublas

    monkeypatch.setattr(cublas, "WEIGHT_ONLY_FROM", 17)
    x, w_fp8, w_scale, block = gemm_inputs(17, 129, 384, 128, seed=17, dtype=dtype)
    xd, wd, sd = x.to(DEVICE), w_fp8.to(DEVICE), w_scale.to(DEVICE)
    wide = torch.full((17, 140), float("nan"), dtype=dtype, device=DEVICE)
    got = cublas.fp8_weight_only_linear(xd, wd, sd, block, out=wide[:, 5:134])
    want = torch.nn.functional.linear(xd, R.dequantize_weight(w_fp8, w_scale, block, dtype).to(DEVICE))
    assert torch.equal(bits(got), bits(want))  # the same GEMM on the same device
    assert wide[:, :5].isnan().all() and wide[:, 134:].isnan().all()
    ref = R.fp8_weight_only_linear(x, w_fp8, w_scale, block).float()
    assert ((got.cpu().float() - ref).abs() <= 2.0**-6 * ref.abs() + 1e-3 * ref.abs().amax()).all()
    fewer = cublas.fp8_weight_only_linear(xd[:16], wd, sd, block)
    assert torch.equal(bits(fewer), bits(T.fp8_weight_only_linear(xd[:16], wd, sd, block)))
    x32 = x.float().to(DEVICE)
    assert torch.equal(cublas.fp8_weight_only_linear(x32, wd, sd, block), T.fp8_weight_only_linear(x32, wd, sd, block))


@pytest.mark.parametrize("config", ["tma-decode", "tma-wide-noswap"])
def test_weight_only_tma_tiles_take_16_bit_x(config, gpu_bf16, monkeypatch):
    """bf16 x with 16-byte row strides: the weight-only GEMM loads x's tile and the e4m3 tile by TMA
    (K = 400: the zero fill past K, N and M) and matches the exact reference to bf16 rounding."""
    monkeypatch.setattr(T, "MIN_GROUPS_PER_SPLIT", 1)
    x, w_fp8, w_scale, block = gemm_inputs(17, 129, 400, 128, seed=19, dtype=torch.bfloat16)
    xd, wd = x.to(DEVICE), w_fp8.to(DEVICE)
    assert T._tma_usable(xd, wd) == (DEVICE == "cpu" or on_hopper())
    launched = []
    kernel = T._gemm_tma_kernel
    monkeypatch.setattr(T, "_gemm_tma_kernel", _Spy(kernel, launched))
    out = torch.full((17, 129), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    T.fp8_weight_only_linear(xd, wd, w_scale.to(DEVICE), block, out=out, config=CONFIGS[config])
    assert launched == [True] or not T._tma_usable(xd, wd)
    ref = R.fp8_weight_only_linear(x, w_fp8, w_scale, block).float()
    assert ((out.cpu().float() - ref).abs() <= 2.0**-7 * ref.abs() + GEMM_RTOL * ref.abs().amax()).all()


class _Spy:
    """A kernel whose launches record their WEIGHT_ONLY flag, then run."""

    def __init__(self, kernel, launched: list) -> None:
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched.append(kwargs["WEIGHT_ONLY"])
            return self.kernel[grid](*args, **kwargs)

        return launch


# --- split: the activations as two e4m3 terms, the weights' exact values --------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 64), (15, 127), (17, 129), (65, 384), (3, 1000)], ids=str)
def test_quantize_activation_split_equals_reference(shape, dtype):
    """hi, lo and their shared scales, bit for bit: rows past a 16-row program, a partial last group,
    a zero group (both terms 0), strided rows."""
    M, K = shape
    g = torch.Generator().manual_seed(K + 1)
    x = (torch.randn(M, K, generator=g) * 10.0 ** torch.randint(-6, 4, (M, 1), generator=g)).to(dtype)
    x[0, : min(K, 128)] = 0  # a zero group
    wide = torch.randn(M, K + 16, dtype=dtype)
    wide[:, :K] = x
    for inp in (x, wide[:, :K]):
        got = T.quantize_activation_split(inp.to(DEVICE))
        want = R.quantize_activation_split(inp.float())
        for a, b in zip(got, want, strict=True):
            assert torch.equal(bits(a.cpu()), bits(b))
    hi, lo, _ = want
    assert not bits(hi[0, : min(K, 128)]).any() and not bits(lo[0, : min(K, 128)]).any()


def test_split_terms_hold_x_to_a_bf16_rounding():
    """(hi + lo) · scale is within 2^-8 |x| of x on every element (plus lo's subnormal floor, 2^-10 of
    the scale), and closer in norm than x rounded to bf16; hi alone is e4m3's 2^-4 away. Outliers 30x
    the rest in every group, groups' magnitudes spread over e^±9; lo never leaves e4m3's range (|lo| ≤ 16)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 1000, generator=g) * torch.exp(torch.randn(64, 1, generator=g) * 3)
    x[:, ::97] *= 30
    hi, lo, scale = R.quantize_activation_split(x)
    s = scale.repeat_interleave(128, 1)[:, :1000]
    two = (hi.float() + lo.float()) * s
    assert ((two - x).abs() <= 2.0**-8 * x.abs() + 2.0**-10 * s).all()
    assert (two - x).norm() < (x.bfloat16().float() - x).norm() / 4
    assert lo.float().abs().max() <= 16
    assert (hi.float() * s - x).norm() > 10 * (two - x).norm()


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_split_linear_equals_reference(case, config, monkeypatch):
    """Every tile configuration (TMA and pointer loads, swapped or not, split K, fuse_quant ignored),
    sizes straddling every tile, scale block and K group: the NaN-filled output fully written with
    the two terms' product, and within the activations' 2^-8 of the weight-only result."""
    monkeypatch.setattr(T, "MIN_GROUPS_PER_SPLIT", 1)
    M, N, K, bn = case
    x, w_fp8, w_scale, block = gemm_inputs(M, N, K, bn, seed=M * N + K + 2)
    out = torch.full((M, N), float("nan"), device=DEVICE)
    got = T.fp8_split_linear(x.to(DEVICE), w_fp8.to(DEVICE), w_scale.to(DEVICE), block, out=out, config=CONFIGS[config])
    assert got is out
    assert_close_to_reference(got.cpu(), R.fp8_split_linear(x, w_fp8, w_scale, block), GEMM_RTOL)
    assert_close_to_reference(got.cpu(), R.fp8_weight_only_linear(x, w_fp8, w_scale, block), 2.0**-8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_split_serves_few_tokens_and_many_tokens_take_the_weight_only_path(dtype, gpu_bf16, monkeypatch):
    """cublas.fp8_split_linear: below SPLIT_BELOW tokens the Triton split GEMM, from there the weight-only
    path (the weight dequantised for a 16-bit GEMM, x exact); fp32 x keeps the split GEMM. Into a column
    slice of `out`, the columns beside it untouched."""
    from hylora.ops.fp8_linear import cublas

    monkeypatch.setattr(cublas, "SPLIT_BELOW", 17)
    monkeypatch.setattr(cublas, "WEIGHT_ONLY_FROM", 17)
    x, w_fp8, w_scale, block = gemm_inputs(17, 129, 384, 128, seed=23, dtype=dtype)
    xd, wd, sd = x.to(DEVICE), w_fp8.to(DEVICE), w_scale.to(DEVICE)
    wide = torch.full((17, 140), float("nan"), dtype=dtype, device=DEVICE)
    got = cublas.fp8_split_linear(xd, wd, sd, block, out=wide[:, 5:134])
    assert torch.equal(bits(got), bits(cublas.fp8_weight_only_linear(xd, wd, sd, block)))
    assert wide[:, :5].isnan().all() and wide[:, 134:].isnan().all()
    fewer = cublas.fp8_split_linear(xd[:16], wd, sd, block)
    assert torch.equal(bits(fewer), bits(T.fp8_split_linear(xd[:16], wd, sd, block)))
    x32 = x.float().to(DEVICE)
    assert torch.equal(cublas.fp8_split_linear(x32, wd, sd, block), T.fp8_split_linear(x32, wd, sd, block))
    # split by its producer: the split GEMM below SPLIT_BELOW; from there the weight-only path on the kept
    # x, or the split GEMM where x was not kept (the terms are all there is)
    for rows, keep in ((16, True), (17, True), (17, False)):
        split = R.QuantizedActivation.of(xd[:rows], keep=keep, split=True)
        took = cublas.fp8_split_linear(split, wd, sd, block)
        served = T.fp8_split_linear(split, wd, sd, block) if rows < 17 or not keep else got
        assert torch.equal(bits(took), bits(served))


# --- CUDA only -----------------------------------------------------------------------------------------


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 32, 128, 512])
def test_cuda_bf16_27b_shapes(tokens):
    """bf16 x at a 27B shape (down_proj's K, a GDN-sized N), each token count's own configuration:
    within half a bf16 ulp (≤ 2^-8 relative) of the fp32 result, plus the GEMM's own error."""
    torch.manual_seed(tokens)
    N, K = 1152, 17408
    w_fp8, w_scale = (t.cuda() for t in R.quantize_weight(torch.randn(N, K) * 0.02))
    x = torch.randn(tokens, K, device="cuda").bfloat16()
    got = T.fp8_linear(x, w_fp8, w_scale)
    assert got.dtype == torch.bfloat16
    ref = R.fp8_linear(x.float(), w_fp8, w_scale)  # bf16 → fp32 is exact: the same quantised x
    diff = (got.float() - ref).abs()
    assert (diff <= 2.0**-8 * ref.abs() + GEMM_RTOL * ref.abs().amax()).all()


@cuda_only
@pytest.mark.gpu
def test_cuda_reference_equals_the_cpu_reference():
    """bf16-valued x lands on e4m3 ties often: a scale one ulp off (CUDA torch divides by a Python
    scalar through its reciprocal) rounds those elements the other way."""
    x = torch.randn(64, 5120, device="cuda").bfloat16()
    for got, ref in zip(R.quantize_activation(x), R.quantize_activation(x.cpu()), strict=True):
        assert torch.equal(bits(got.cpu()), bits(ref))
    for got, ref in zip(T.quantize_activation(x), R.quantize_activation(x), strict=True):
        assert torch.equal(bits(got), bits(ref))
    w = torch.randn(384, 640, device="cuda") * 0.02
    for got, ref in zip(R.quantize_weight(w), R.quantize_weight(w.cpu()), strict=True):
        assert torch.equal(bits(got.cpu()), bits(ref))


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 32, 128, 512])
def test_cuda_weight_only_bf16_27b_shapes(tokens):
    """The weight-only GEMM in bf16 on the tensor cores: within half a bf16 ulp of the fp32 dequantised
    product, plus fp32 summation order."""
    torch.manual_seed(tokens)
    N, K = 1152, 17408
    w_fp8, w_scale = (t.cuda() for t in R.quantize_weight(torch.randn(N, K) * 0.02))
    x = torch.randn(tokens, K, device="cuda").bfloat16()
    got = T.fp8_weight_only_linear(x, w_fp8, w_scale)
    ref = R.fp8_weight_only_linear(x.float(), w_fp8, w_scale)
    diff = (got.float() - ref).abs()
    assert (diff <= 2.0**-8 * ref.abs() + 1e-4 * ref.abs().amax()).all()


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 17, 32, 64, 127])
def test_cuda_split_bf16_27b_shapes(tokens):
    """The split GEMM on the FP8 tensor cores (two dots per weight tile): within half a bf16 ulp of the
    fp32 dequantised product, as the weight-only GEMM, plus the terms' 2^-8 and the MMA's accumulation."""
    torch.manual_seed(tokens)
    N, K = 1152, 17408
    w_fp8, w_scale = (t.cuda() for t in R.quantize_weight(torch.randn(N, K) * 0.02))
    x = torch.randn(tokens, K, device="cuda").bfloat16()
    got = T.fp8_split_linear(x, w_fp8, w_scale)
    ref = R.fp8_weight_only_linear(x.float(), w_fp8, w_scale)
    diff = (got.float() - ref).abs()
    assert (diff <= 2.0**-8 * ref.abs() + 1e-3 * ref.abs().amax()).all()
    split_ref = R.fp8_split_linear(x.float(), w_fp8, w_scale)
    assert ((got.float() - split_ref).abs() <= 2.0**-8 * split_ref.abs() + 1e-3 * split_ref.abs().amax()).all()


@cuda_only
@pytest.mark.gpu
def test_cuda_graph_replay():
    w_fp8, w_scale = (t.cuda() for t in R.quantize_weight(torch.randn(640, 5120)))
    x = torch.randn(8, 5120, device="cuda").bfloat16()
    out = torch.empty(8, 640, device="cuda", dtype=torch.bfloat16)
    T.fp8_linear(x, w_fp8, w_scale, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        T.fp8_linear(x, w_fp8, w_scale, out=out)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, T.fp8_linear(x, w_fp8, w_scale))


def test_start_up_checks_pass_the_kernels_and_fail_wrong_ones():
    """The kernel floor's FP8 checks (hylora.kernels.checks): the Triton GEMM passes, also writing into
    a column slice of a wider output, taking a pre-quantised input and serving 16-bit rows in its launch;
    a GEMM that writes past its slice, ignores a pre-quantised input's scales or mixes up the 16-bit
    rows fails, as does an activation that drops a scale."""
    from hylora.kernels import checks
    from hylora.ops.silu_mul import triton as silu_triton

    def fp8_error(kernel):
        return checks.fp8_linear_error(129, 256, (128, 128), torch.float32, DEVICE, tokens=(1, 17), kernel=kernel)

    assert fp8_error(T.fp8_linear) <= GEMM_RTOL * 10  # the kernel floor allows 1e-2 (FP8_TOLERANCE)

    def spills(x, w, s, block, out=None, extra=None):
        y = T.fp8_linear(x, w, s, block, extra=extra)
        if out is not None:
            out.as_strided((out.shape[0], out.shape[1] + 1), out.stride()).copy_(torch.cat([y, y[:, :1]], 1))
        return y if out is None else out

    def unscaled(x, w, s, block, out=None, extra=None):
        if isinstance(x, R.QuantizedActivation):
            x = R.QuantizedActivation(x.q, torch.ones_like(x.scale), x.dtype)
        return T.fp8_linear(x, w, s, block, out=out, extra=extra)

    def extra_rows_shifted(x, w, s, block, out=None, extra=None):  # the extra rows' columns off by one row
        if extra is not None:
            extra = (extra[0], extra[1].roll(1, 0))
        return T.fp8_linear(x, w, s, block, out=out, extra=extra)

    assert fp8_error(spills) == math.inf and fp8_error(unscaled) > 0.5 and fp8_error(extra_rows_shifted) > 0.5

    def split_error(kernel):
        return checks.fp8_linear_error(
            129, 256, (128, 128), torch.float32, DEVICE, tokens=(1, 17), kernel=kernel, activations="split"
        )

    assert split_error(T.fp8_split_linear) <= GEMM_RTOL * 10
    assert split_error(T.fp8_linear) > 1e-2  # the second term dropped: e4m3's rounding shows past FP8_TOLERANCE
    for split in (False, True):  # exp: an ulp
        assert checks.silu_mul_error(300, torch.float32, DEVICE, tokens=(1, 17), quantized=True, split=split) <= 1e-6

    def half_scale(gate_up, group=128, keep=False, split=False):
        a = silu_triton.silu_mul_quantized(gate_up, group, keep, split)
        return R.QuantizedActivation(a.q, a.scale * 0.5, a.dtype, a.x, a.lo)

    def one_term(gate_up, group=128, keep=False, split=False):  # asked for both terms, writes hi alone
        return silu_triton.silu_mul_quantized(gate_up, group, keep)

    for split in (False, True):
        error = checks.silu_mul_error(300, torch.float32, DEVICE, tokens=(17,), kernel=half_scale, quantized=True,
                                      split=split)  # fmt: skip
        assert error > 0.3
    assert checks.silu_mul_error(300, torch.float32, DEVICE, quantized=True, split=True, kernel=one_term) == math.inf

    from hylora.ops.rmsnorm import triton as norm_triton

    for split in (False, True):  # a compiled norm's fp32 sum runs in its own order: ~10 ulp (H100: 1.2e-6 split)
        error = checks.rms_norm_quantized_error(
            300, 1e-6, torch.float32, DEVICE, tokens=(1, 17), heads=(3, 128), split=split
        )
        assert error <= 1e-5

    def norm_half_scale(x, w, eps, residual=None, group=128, keep=False, split=False):
        got = norm_triton.rms_norm_quantized(x, w, eps, residual, group, keep, split)
        a, total = got if residual is not None else (got, None)
        a = R.QuantizedActivation(a.q, a.scale * 0.5, a.dtype, a.x, a.lo)
        return a if residual is None else (a, total)

    def norm_drops_residual(x, w, eps, residual=None, group=128, keep=False, split=False):
        got = norm_triton.rms_norm_quantized(x, w, eps, None, group, keep, split)
        return got if residual is None else (got, x + residual)

    def norm_drops_lo(x, w, eps, residual=None, group=128, keep=False, split=False):  # hi alone
        got = norm_triton.rms_norm_quantized(x, w, eps, residual, group, keep, split)
        a, total = got if residual is not None else (got, None)
        a = R.QuantizedActivation(a.q, a.scale, a.dtype, a.x, torch.zeros_like(a.q) if split else None)
        return a if residual is None else (a, total)

    for wrong in (norm_half_scale, norm_drops_residual):
        for split in (False, True):
            error = checks.rms_norm_quantized_error(
                300, 1e-6, torch.float32, DEVICE, tokens=(17,), kernel=wrong, split=split
            )
            assert error > 0.3
    error = checks.rms_norm_quantized_error(300, 1e-6, torch.float32, DEVICE, tokens=(17,), kernel=norm_drops_lo,
                                            split=True)  # fmt: skip
    assert error > 1e-2  # e4m3's rounding, past FP8_TOLERANCE

    def gated_half_scale(x, z, w, eps, group=128, keep=False, split=False):
        a = norm_triton.gated_rms_norm_quantized(x, z, w, eps, group, keep, split)
        return R.QuantizedActivation(a.q, a.scale * 0.5, a.dtype, a.x, a.lo)

    for split in (False, True):
        error = checks.rms_norm_quantized_error(
            300, 1e-6, torch.float32, DEVICE, tokens=(17,), heads=(3, 128), gated_kernel=gated_half_scale, split=split
        )
        assert error > 0.3

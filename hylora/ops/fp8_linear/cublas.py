"""The FP8 linears through cuBLAS for steps of many tokens, the Triton GEMM for the rest.

`fp8_linear` (`reference.fp8_linear`): `torch._scaled_mm` with 1 x 128 activation and 128 x 128
weight block scales (Hopper).

On an H200 cuBLAS's block-scaled GEMM is 1.3-1.6x faster than the Triton kernel from ~128 tokens
and slower below; it refuses a single token and takes only whole 128 x 128 weight blocks
(`bench/fp8_gemm_gpu.py`). The activations are quantised by the Triton kernel either way, so both
paths see the same FP8 inputs; cuBLAS sums in its own order.

`fp8_weight_only_linear` (`reference.fp8_weight_only_linear`, activations unquantised): from
WEIGHT_ONLY_FROM tokens in a 16-bit dtype, the weight is dequantised into x's dtype (the Triton
`dequantize_weight`: each e4m3 value times its scale in fp32, rounded once) and multiplied by cuBLAS's
16-bit GEMM. The Triton weight-only GEMM converts every weight tile in registers and runs ~3x slower
than bf16 at prefill sizes (docs/FP8.md); the dequantisation reads 1 and writes 2 bytes a weight, a
few per cent of an 8k-token step's GEMM. The rounding of each dequantised weight to bf16 is the one a
bf16 copy of the dequantised checkpoint has; below the threshold (decode) the weights stay exact.

`fp8_split_linear` (`reference.fp8_split_linear`, activations as two e4m3 terms): below SPLIT_BELOW
tokens the Triton GEMM with two FP8 dots per weight tile; from there the weight-only path above, whose
16-bit x is exact (the split's ~2^-8 is where decode's weight stream pays for it; a prefill step is
bound by the tensor cores, where two FP8 dots cost what one bf16 dot does).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hylora.ops.fp8_linear import triton as fp8_triton
from hylora.ops.fp8_linear.reference import BLOCK, Extra, QuantizedActivation, check_extra

CUBLAS_FROM = 128  # tokens
PAD_TOKENS = 16
WEIGHT_ONLY_FROM = 128  # tokens: dequantise then cuBLAS (H200 sweep: bench/fp8_gemm_gpu.py --sweep-weight-only)
SPLIT_BELOW = 768  # tokens: split activations in Triton's FP8 GEMM; more: the weight-only path (H100: run 55)


def usable(tokens: int, N: int, K: int, block: tuple[int, int]) -> bool:
    """Whole 128 x 128 blocks whose fp32 weight scales, as cuBLAS reads them ([K / 128, N / 128] with
    row stride K / 128), have 16-byte aligned strides, as torch's message for 128 x 128 block scales
    asks: K a multiple of 512. A single K block (K = 128), which torch accepts, came out ~10x off the
    reference on the H200 (docs/BASELINE.md run 36; K of 512, 1024, 5120 within 7e-4): the demo's
    o_proj, whose failed check kept the demo's FP8 engines on the Triton GEMM alone until then."""
    return tokens >= CUBLAS_FROM and block == (128, 128) and N % 128 == 0 and K % 512 == 0


def fp8_linear(
    x: torch.Tensor | QuantizedActivation,  # [..., K], or [M, K] quantised already
    w_fp8: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [N / 128, K / 128]
    block: tuple[int, int] = BLOCK,
    out: torch.Tensor | None = None,  # [..., N (+ E)]
    extra: Extra | None = None,  # E more output columns from 16-bit rows
) -> torch.Tensor:
    *lead, K = x.shape
    N, M = w_fp8.shape[0], math.prod(lead)
    if not usable(M, N, K, block):
        return fp8_triton.fp8_linear(x, w_fp8, w_scale, block, out=out, extra=extra)
    if extra is not None:  # cuBLAS's FP8 GEMM into the first N columns, the extra rows by its 16-bit one
        return linear_with_extra(lambda y: fp8_linear(x, w_fp8, w_scale, block, out=y), out, extra, lead, N)
    if isinstance(x, QuantizedActivation):
        xq, xs = x.q, x.scale
    else:
        xq, xs = fp8_triton.quantize_activation(x.reshape(-1, K), block[1])
    padded = -(-M // PAD_TOKENS) * PAD_TOKENS
    if padded != M:  # cuBLAS's heuristics refuse some token counts: zero rows up to a multiple of 16
        xq = torch.cat([xq.view(torch.uint8), xq.new_zeros(padded - M, K, dtype=torch.uint8)]).view(xq.dtype)
        xs = torch.cat([xs, xs.new_ones(padded - M, xs.shape[1])])
    # cuBLAS wants the activation scales column-major and the weight's as [K / 128, N / 128]
    args = dict(scale_a=xs.t().contiguous().t(), scale_b=w_scale.t(), out_dtype=x.dtype)
    if out is not None and padded == M and out.dim() == 2 and _writes_into(out):
        # into `out` as it lies, a column slice of a wider output included (the GDN in_proj's FP8 rows
        # beside its unquantised tail): cuBLAS takes the row stride as the leading dimension, no copy
        try:
            return torch._scaled_mm(xq, w_fp8.t(), **args, out=out)
        except (RuntimeError, TypeError):  # a torch without the out= form here: the copy below
            _WRITES_INTO.append(False)
    y = torch._scaled_mm(xq, w_fp8.t(), **args)
    y = y[:M].view(*lead, N)
    if out is None:
        return y
    return out.copy_(y)


_WRITES_INTO: list[bool] = []  # set once torch refused out=


def _writes_into(out: torch.Tensor) -> bool:
    return not _WRITES_INTO and out.stride(1) == 1 and out.stride(0) >= out.shape[1]


def fp8_weight_only_linear(
    x: torch.Tensor,  # [..., K]
    w_fp8: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [ceil(N/bn), ceil(K/bk)]
    block: tuple[int, int] = BLOCK,
    out: torch.Tensor | None = None,  # [..., N (+ E)] in x.dtype
    extra: Extra | None = None,  # E more output columns from 16-bit rows
) -> torch.Tensor:
    *lead, K = x.shape
    if math.prod(lead) < WEIGHT_ONLY_FROM or x.dtype not in (torch.bfloat16, torch.float16):
        return fp8_triton.fp8_weight_only_linear(x, w_fp8, w_scale, block, out=out, extra=extra)
    if extra is not None:
        linear = lambda y: fp8_weight_only_linear(x, w_fp8, w_scale, block, out=y)  # noqa: E731
        return linear_with_extra(linear, out, extra, lead, len(w_fp8))
    w = fp8_triton.dequantize_weight(w_fp8, w_scale, block, x.dtype)
    if out is None:
        return F.linear(x, w)
    if out.dim() == 2 and out.stride(1) == 1 and out.stride(0) >= out.shape[1]:
        # into `out` as it lies (the GDN in_proj's FP8 rows, a column slice beside its unquantised tail):
        # cuBLAS takes the row stride as the leading dimension, no [M, N] result and copy
        return torch.mm(x.reshape(-1, K), w.t(), out=out)
    return out.copy_(F.linear(x, w))


def fp8_split_linear(
    x: torch.Tensor | QuantizedActivation,  # [..., K], or [M, K] split already (by its producer)
    w_fp8: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [ceil(N/bn), ceil(K/bk)]
    block: tuple[int, int] = BLOCK,
    out: torch.Tensor | None = None,  # [..., N (+ E)] in x.dtype
    extra: Extra | None = None,  # E more output columns from 16-bit rows
) -> torch.Tensor:
    *lead, K = x.shape
    if isinstance(x, QuantizedActivation):  # the weight-only path reads x itself, where it was kept
        if math.prod(lead) < SPLIT_BELOW or x.x is None:  # (producers split only below SPLIT_BELOW)
            return fp8_triton.fp8_split_linear(x, w_fp8, w_scale, block, out=out, extra=extra)
        x = x.x
    if math.prod(lead) < SPLIT_BELOW or x.dtype not in (torch.bfloat16, torch.float16):
        return fp8_triton.fp8_split_linear(x, w_fp8, w_scale, block, out=out, extra=extra)
    return fp8_weight_only_linear(x, w_fp8, w_scale, block, out=out, extra=extra)


def takes_split_input(tokens: int) -> bool:
    """Whether a step of `tokens` runs the split GEMM (so that x's producer may split it in its own
    launch), not the weight-only path from SPLIT_BELOW."""
    return tokens < SPLIT_BELOW


def linear_with_extra(
    linear: Callable[[torch.Tensor], torch.Tensor], out: torch.Tensor | None, extra: Extra, lead: list[int], N: int
) -> torch.Tensor:
    """`linear` into out's first N columns, then the extra columns by cuBLAS's 16-bit GEMM."""
    x16, w16 = extra
    E = check_extra(extra, lead, x16.shape[-1], x16.dtype)
    if out is None:
        out = torch.empty(*lead, N + E, dtype=x16.dtype, device=x16.device)
    linear(out[..., :N])
    out[..., N:] = F.linear(x16, w16)
    return out

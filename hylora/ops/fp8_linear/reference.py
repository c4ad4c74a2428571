"""FP8 (e4m3) block-scaled linear in plain torch: the arithmetic the Triton kernels reproduce
(`fp8_linear`: activations quantised as the checkpoints' `activation_scheme: dynamic` says;
`fp8_weight_only_linear`: activations kept, the weights' exact values; `fp8_split_linear`: activations
as the sum of two e4m3 terms, about a 16-bit value's precision on the FP8 tensor cores).

Weights (the Qwen / DeepSeek FP8 checkpoints): W [N, K] float8_e4m3fn with `scale_inv`
[ceil(N / bn), ceil(K / bk)] fp32, W ≈ W_fp8 * scale_inv[n // bn, k // bk]; block (bn, bk) is (128, 128)
in the checkpoints, bn = 1 (one scale per row) where a loader fuses projections whose row counts are
not multiples of 128. Activations are quantised when used, per token and per group of bk = 128
inputs: scale = amax(|x_group|) / 448, x_fp8 = rne(clamp(x / scale, ±448)). Partial blocks / groups
at the ends of N and K take the amax of the elements they hold.

A block or group whose amax is 0 (or below AMAX_FLOOR) gets the scale AMAX_FLOOR / 448 instead of 0,
so that its elements quantise to 0 rather than 0 / 0 = NaN and its dequantised values are 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-12  # far below any amax a real bf16 activation group or weight block has
BLOCK = (128, 128)
GROUP = 128


@dataclass(frozen=True)
class QuantizedActivation:
    """An FP8 projection's input already quantised (`quantize_activation`) by the op that produced it
    (e.g. `silu_mul_quantized`), so the GEMM launches no quantisation of its own. Split for a split
    GEMM (`quantize_activation_split`): q is hi, and lo the second term; a split GEMM refuses an input
    without lo, a dynamic one reads q alone (hi is `quantize_activation`'s q)."""

    q: torch.Tensor  # [M, K] e4m3
    scale: torch.Tensor  # [M, ceil(K / group)] fp32
    dtype: torch.dtype  # the unquantised activation's: the GEMM's output dtype
    x: torch.Tensor | None = None  # [M, K] the unquantised values, kept when LoRA needs them
    lo: torch.Tensor | None = None  # [M, K] e4m3, the second term where split

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @staticmethod
    def of(values: torch.Tensor, group: int = GROUP, keep: bool = False, split: bool = False) -> QuantizedActivation:
        """values [M, K] quantised per token and group (split: as two terms); with `keep`, values too."""
        kept = values if keep else None
        if split:
            hi, lo, scale = quantize_activation_split(values, group)
            return QuantizedActivation(hi, scale, values.dtype, kept, lo)
        return QuantizedActivation(*quantize_activation(values, group), values.dtype, kept)

    def dequantized(self, group: int = GROUP) -> torch.Tensor:
        """[M, K] fp32: (q (+ lo)) · scale, the values the GEMM multiplies (hi + lo is exact in fp32)."""
        terms = self.q.float() if self.lo is None else self.q.float() + self.lo.float()
        return dequantize_activation(terms, self.scale, group)


# (x16 [..., K], w16 [E, K]), both in the output's dtype: E output columns x16 · w16ᵀ after the N FP8
# ones, from the same launch. The rows an FP8 GEMM serves beside its FP8 weight: a projection's
# unquantised tail (the GDN in_proj's b / a rows) and every adapter slot's LoRA A (a decode step's shrink).
Extra = tuple[torch.Tensor, torch.Tensor]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_weight(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] → (w_fp8 [N, K] e4m3, scale_inv [ceil(N/bn), ceil(K/bk)] fp32), scale = block amax / 448."""
    N, K = w.shape
    bn, bk = block
    nb, kb = _cdiv(N, bn), _cdiv(K, bk)
    blocks = F.pad(w.float(), (0, kb * bk - K, 0, nb * bn - N)).view(nb, bn, kb, bk)  # zero padding: same amax
    scale = _div_rn(blocks.abs().amax(dim=(1, 3)).clamp_min(AMAX_FLOOR), FP8_MAX)  # [nb, kb]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * bn, kb * bk)[:N, :K].contiguous(), scale


def dequantize_weight(
    w_fp8: torch.Tensor,  # [N, K] e4m3
    scale_inv: torch.Tensor,  # [ceil(N/bn), ceil(K/bk)]
    block: tuple[int, int] = BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """W [N, K] = w_fp8 * scale_inv[n // bn, k // bk] (fp32 product, then cast to `dtype`)."""
    N, K = w_fp8.shape
    bn, bk = block
    _check_scales(scale_inv, N, K, block)
    scales = scale_inv.float().repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    return (w_fp8.float() * scales).to(dtype)


def quantize_activation(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (x_fp8 [M, K] e4m3, x_scale [M, ceil(K/group)] fp32), scale = group amax / 448."""
    q, scale = _scaled_groups(x, group)
    return _ungroup(q.to(FP8_DTYPE), x.shape[1]), scale


def _scaled_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (x / scale clamped to ±448 [M, G, group] fp32, zero-padded past K; scale [M, G])."""
    M, K = x.shape
    G = _cdiv(K, group)
    groups = F.pad(x.float(), (0, G * group - K)).view(M, G, group)
    scale = _div_rn(groups.abs().amax(dim=-1).clamp_min(AMAX_FLOOR), FP8_MAX)  # [M, G]
    return (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX), scale


def _ungroup(q: torch.Tensor, K: int) -> torch.Tensor:
    """[M, G, group] → [M, K], contiguous."""
    return q.flatten(1)[:, :K].contiguous()


def dequantize_activation(x_fp8: torch.Tensor, x_scale: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """[M, K] fp32 = x_fp8 * x_scale[m, k // group]."""
    return x_fp8.float() * x_scale.float().repeat_interleave(group, 1)[:, : x_fp8.shape[1]]


def quantize_activation_split(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] → (hi, lo, scale): x ≈ (hi + lo) · scale, two e4m3 terms per token and group sharing
    `quantize_activation`'s scale (so the GEMM sums both dots before applying it once). q = x / scale as
    quantize_activation has it, hi = e4m3(q), lo = e4m3(q - hi) (that difference is exact in fp32, and
    |q - hi| ≤ 16: half an ulp of e4m3's top binade). hi keeps 4 significant bits of q and lo 4 of what
    is left, so (hi + lo) · scale is within ~2^-8 of the larger elements (a bf16 rounding's size, less in
    norm; quantize_activation alone leaves 2^-4), and within 2^-10 scale of the smallest (lo's subnormals)."""
    q, scale = _scaled_groups(x, group)
    hi = q.to(FP8_DTYPE)
    lo = (q - hi.float()).to(FP8_DTYPE)
    return _ungroup(hi, x.shape[1]), _ungroup(lo, x.shape[1]), scale


def fp8_linear(
    x: torch.Tensor | QuantizedActivation,  # [..., K] bf16 / fp16 / fp32, or [M, K] already quantised
    w_fp8: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [ceil(N/bn), ceil(K/bk)] fp32
    block: tuple[int, int] = BLOCK,
    out: torch.Tensor | None = None,  # [..., N (+ E)] in x.dtype (may be a column slice of a wider output)
    extra: Extra | None = None,  # E more output columns from 16-bit rows
) -> torch.Tensor:
    """y [..., N] in x.dtype: x quantised per token and group of bk, both sides dequantised, one fp32
    matmul, one rounding to x.dtype. With `extra` (x16, w16): y [..., N + E], its last E columns
    x16 · w16ᵀ (see `Extra`)."""

    def activation(x2: torch.Tensor) -> torch.Tensor:
        if isinstance(x, QuantizedActivation):
            return dequantize_activation(x.q, x.scale, block[1])  # q alone (split: hi, this GEMM's own q)
        return dequantize_activation(*quantize_activation(x2, block[1]), block[1])

    return _dense("fp8_linear", x, activation, w_fp8, w_scale, block, out, extra)


def fp8_weight_only_linear(
    x: torch.Tensor,  # [..., K] bf16 / fp16 / fp32
    w_fp8: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [ceil(N/bn), ceil(K/bk)] fp32
    block: tuple[int, int] = BLOCK,
    out: torch.Tensor | None = None,  # [..., N (+ E)] in x.dtype
    extra: Extra | None = None,  # E more output columns from 16-bit rows (`Extra`)
) -> torch.Tensor:
    """y [..., N] in x.dtype = x · dequantize(W)ᵀ: the weights' exact values and x unquantised, one fp32
    matmul, one rounding to x.dtype (FP8 weights in memory, the arithmetic of the dequantised model)."""
    return _dense("fp8_weight_only_linear", x, lambda x2: x2.float(), w_fp8, w_scale, block, out, extra)


def fp8_split_linear(
    x: torch.Tensor,  # [..., K] bf16 / fp16 / fp32
    w_fp8: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [ceil(N/bn), ceil(K/bk)] fp32
    block: tuple[int, int] = BLOCK,
    out: torch.Tensor | None = None,  # [..., N (+ E)] in x.dtype
    extra: Extra | None = None,  # E more output columns from 16-bit rows (`Extra`)
) -> torch.Tensor:
    """y [..., N] in x.dtype = ((hi + lo) · scale) · dequantize(W)ᵀ with x split into two e4m3 terms
    (`quantize_activation_split`), one fp32 matmul, one rounding to x.dtype: the weights' exact values,
    the activations to about a bf16 rounding (the GEMM runs two FP8 dots per weight tile, which decode's
    weight stream leaves room for)."""

    def activation(x2: torch.Tensor) -> torch.Tensor:
        if isinstance(x, QuantizedActivation):
            return x.dequantized(block[1])
        return QuantizedActivation.of(x2, block[1], split=True).dequantized(block[1])

    check_split_input(x)
    return _dense("fp8_split_linear", x, activation, w_fp8, w_scale, block, out, extra)


def check_split_input(x: torch.Tensor | QuantizedActivation) -> None:
    """A split GEMM takes x, or x quantised as two terms; one term alone would drop lo silently."""
    if isinstance(x, QuantizedActivation) and x.lo is None:
        raise ValueError("fp8_split_linear: a quantised input needs its second term (quantise it with split=True)")


def _dense(
    name: str,
    x: torch.Tensor | QuantizedActivation,
    activation: Callable[[torch.Tensor], torch.Tensor],  # x [M, K] → the fp32 values the GEMM multiplies
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    out: torch.Tensor | None,
    extra: Extra | None,
) -> torch.Tensor:
    """activation(x) · dequantize(W)ᵀ [..., N]: one fp32 matmul, one rounding to x.dtype, with `extra`."""
    *lead, K = x.shape
    N = w_fp8.shape[0]
    if w_fp8.shape[1] != K:
        raise ValueError(f"{name}: x has {K} features, the weight {w_fp8.shape[1]}")
    x2 = x.q if isinstance(x, QuantizedActivation) else x.reshape(-1, K)
    y = (activation(x2) @ dequantize_weight(w_fp8, w_scale, block).T).to(x.dtype).reshape(*lead, N)
    return with_extra(y, out, extra)


def check_extra(extra: Extra | None, lead: list[int], K: int, dtype: torch.dtype) -> int:
    """E, the extra output columns (0 without `extra`); a clear error where its shapes do not fit."""
    if extra is None:
        return 0
    x16, w16 = extra
    if list(x16.shape) != [*lead, K] or w16.dim() != 2 or w16.shape[1] != K or x16.dtype != dtype or w16.dtype != dtype:
        raise ValueError(
            f"fp8 extra rows: need x [{', '.join(map(str, (*lead, K)))}] and rows [E, {K}] in {dtype}, got "
            f"{list(x16.shape)} {x16.dtype} and {list(w16.shape)} {w16.dtype}"
        )
    return w16.shape[0]


def with_extra(y: torch.Tensor, out: torch.Tensor | None, extra: Extra | None) -> torch.Tensor:
    """y [..., N] into `out`, followed by the extra columns (fp32 products, one rounding) when given."""
    if extra is None:
        return y if out is None else out.copy_(y)
    *lead, N = y.shape
    x16, w16 = extra
    E = check_extra(extra, lead, x16.shape[-1], y.dtype)
    if out is None:
        out = torch.empty(*lead, N + E, dtype=y.dtype, device=y.device)
    out[..., :N] = y
    out[..., N:] = (x16.float() @ w16.float().T).to(y.dtype)
    return out


def _div_rn(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """t / divisor rounded once, on every device: CUDA torch divides by a Python scalar as a product
    with its rounded reciprocal (1 / 448 is inexact), which moves some scales by an ulp and with
    them the e4m3 rounding of elements near a tie."""
    return t / torch.full_like(t, divisor)


def _check_scales(scale: torch.Tensor, N: int, K: int, block: tuple[int, int]) -> None:
    want = (_cdiv(N, block[0]), _cdiv(K, block[1]))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"fp8 weight scales: expected {want} for [{N}, {K}] in blocks {block}, got {tuple(scale.shape)}"
        )

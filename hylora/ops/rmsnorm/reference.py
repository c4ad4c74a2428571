"""RMSNorm in plain torch, in fp32, rounded once to the input's dtype.

`rms_norm`: the decoder's zero-centred norm, norm(x) * (1 + w); given `residual` it first forms
s = residual + x (in x's dtype, as an unfused `x = x + h` would) and returns (norm(s), s); given
`rotary` (the attention's q/k norms) it applies the rotary embedding to the normed heads.
`rms_norm_quantized`: `rms_norm` (2-D, no rotary) quantised for an FP8 projection
(`fp8_linear.quantize_activation`, or with `split` its two-term `quantize_activation_split`), e.g. the
GDN in_proj or the MLP's gate_up behind the norm;
`gated_rms_norm_quantized`: `gated_rms_norm` of [T, H, D] heads as [T, H·D] rows, quantised for the
GDN out_proj (D a multiple of the group: a group never spans two heads).
`gated_rms_norm`: the GDN output norm, w * norm(x) * silu(z), with the roundings of the layer it
replaces (norm(x) rounded to x's dtype, then times w in that dtype, then times silu(z) in fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hylora.ops.fp8_linear.reference import GROUP, QuantizedActivation


def rms_norm(
    x: torch.Tensor,  # [..., D]
    weight: torch.Tensor,  # [D]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., D], same shape as x
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,  # (cos, sin) [T, R] for x [T, H, D]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = residual + x
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (out * (1.0 + weight.float())).to(x.dtype)
    if rotary is not None:
        out = apply_rotary(out, *rotary)
    return out if residual is None else (out, x)


def rms_norm_quantized(
    x: torch.Tensor,  # [T, D]
    weight: torch.Tensor,  # [D]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, D]
    group: int = GROUP,
    keep: bool = False,
    split: bool = False,  # as two e4m3 terms, for a split GEMM (`quantize_activation_split`)
) -> QuantizedActivation | tuple[QuantizedActivation, torch.Tensor]:
    """`rms_norm(x, weight, eps, residual)` quantised per token and group of `group` inputs; with
    `keep`, the unquantised norm too (for the projection's LoRA or unquantised rows)."""
    normed = rms_norm(x, weight, eps, residual)
    out, total = normed if residual is not None else (normed, None)
    quantized = QuantizedActivation.of(out, group, keep, split)
    return quantized if residual is None else (quantized, total)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; rotate-half on the first rotary_dim (= cos.shape[-1]) dims, the rest passed
    through; in x's dtype, one rounding per op as transformers' apply_rotary_pos_emb."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


def gated_rms_norm(
    x: torch.Tensor,  # [..., D]
    z: torch.Tensor,  # [..., D] the gate
    weight: torch.Tensor,  # [D]
    eps: float,
) -> torch.Tensor:
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(z.float())).to(x.dtype)


def gated_rms_norm_quantized(
    x: torch.Tensor,  # [T, H, D]
    z: torch.Tensor,  # [T, H, D]
    weight: torch.Tensor,  # [D]
    eps: float,
    group: int = GROUP,
    keep: bool = False,
    split: bool = False,  # as two e4m3 terms, for a split GEMM
) -> QuantizedActivation:
    """`gated_rms_norm(x, z, weight, eps)` as [T, H·D] rows, quantised per token and group of `group`
    inputs; with `keep`, the unquantised rows too."""
    if x.ndim != 3 or x.shape[-1] % group:
        raise ValueError(f"gated_rms_norm_quantized: takes [T, H, D] heads with D a multiple of {group}")
    out = gated_rms_norm(x, z, weight, eps).reshape(x.shape[0], -1)
    return QuantizedActivation.of(out, group, keep, split)

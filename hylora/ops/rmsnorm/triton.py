"""The RMSNorms of `reference` in one Triton launch each, same signatures and results.
`rms_norm_quantized` (and `gated_rms_norm_quantized`) also quantise the norm for an FP8 projection in
that launch, bit-equal to `fp8_linear.triton.quantize_activation` (with `split`, to its two-term
`quantize_activation_split`) of this module's `rms_norm` (`gated_rms_norm`): the norm is not written
(unless kept) nor read back by a quantisation launch of its own.

Rows may be strided views (the attention layer's q/k heads are slices of its fused projection): x
is addressed as [A, B, D] with strides (sa, sb, 1), row r = (r // B, r % B). Each program normalises
ROWS rows of up to BLOCK_D elements in fp32; offsets are int64; the outputs are contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylora.ops.fp8_linear.reference import FP8_DTYPE, GROUP, QuantizedActivation
from hylora.ops.fp8_linear.triton import _check_group, _quantize_rows, _quantize_split_rows

ELEMENTS_PER_PROGRAM = 4096


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual {list(residual.shape)} != x {list(x.shape)}")
    if rotary is not None:
        cos, sin = rotary
        r = cos.shape[-1]
        if residual is not None or x.ndim != 3 or cos.shape != (x.shape[0], r) or sin.shape != cos.shape:
            raise ValueError("rms_norm: rotary takes x [T, H, D] and cos, sin [T, R], without a residual")
        if r % 2 or r > x.shape[-1] or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError(f"rms_norm: rotary dim {r} must be even, at most {x.shape[-1]}, cos/sin contiguous")
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    out = _launch(x, weight, eps, residual=residual, total=total, rotary=rotary)
    return out if residual is None else (out, total)


def rms_norm_quantized(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    group: int = GROUP,
    keep: bool = False,
    split: bool = False,
) -> QuantizedActivation | tuple[QuantizedActivation, torch.Tensor]:
    if x.ndim != 2 or (residual is not None and residual.shape != x.shape):
        raise ValueError("rms_norm_quantized: takes x [T, D] and a residual of the same shape")
    _check_group(group)
    T, D = x.shape
    q = torch.empty(T, D, dtype=FP8_DTYPE, device=x.device)
    lo = torch.empty_like(q) if split else None
    scale = torch.empty(T, triton.cdiv(D, group), dtype=torch.float32, device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    out = _launch(x, weight, eps, residual=residual, total=total, quant=(q, scale, group), lo=lo, keep=keep)
    quantized = QuantizedActivation(q, scale, x.dtype, out if keep else None, lo)
    return quantized if residual is None else (quantized, total)


def gated_rms_norm_quantized(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group: int = GROUP,
    keep: bool = False,
    split: bool = False,
) -> QuantizedActivation:
    if x.ndim != 3 or z.shape != x.shape or x.shape[-1] % group:
        raise ValueError(f"gated_rms_norm_quantized: takes [T, H, D] heads and gate, D a multiple of {group}")
    _check_group(group)
    T, H, D = x.shape
    q = torch.empty(T, H * D, dtype=FP8_DTYPE, device=x.device)
    lo = torch.empty_like(q) if split else None
    scale = torch.empty(T, H * D // group, dtype=torch.float32, device=x.device)
    # head row r of q: [r // H, r % H]
    out = _launch(x, weight, eps, gate=z, quant=(q, scale, group), lo=lo, keep=keep)
    return QuantizedActivation(q, scale, x.dtype, out.reshape(T, H * D) if keep else None, lo)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if z.shape != x.shape:
        raise ValueError(f"gated_rms_norm: z {list(z.shape)} != x {list(x.shape)}")
    return _launch(x, weight, eps, gate=z)


def _rows(t: torch.Tensor) -> tuple[int, int, int, int]:
    """t [D], [A, D] or [A, B, D] → (A, B, stride of A, stride of B)."""
    if t.stride(-1) != 1:
        raise ValueError("rms_norm: the last dimension must have unit stride")
    if t.ndim == 1:
        return 1, 1, 0, 0
    if t.ndim == 2:
        return t.shape[0], 1, t.stride(0), 0
    return t.shape[0], t.shape[1], t.stride(0), t.stride(1)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    total: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    quant: tuple[torch.Tensor, torch.Tensor, int] | None = None,  # (e4m3 [T, D], scales [T, D / group], group)
    lo: torch.Tensor | None = None,  # with quant: e4m3 [T, D], quant's q split into (q, lo)
    keep: bool = True,  # write the norm (with quant: only when kept)
) -> torch.Tensor | None:
    if x.ndim > 3:
        x = x.reshape(-1, *x.shape[-2:])
        residual = residual.reshape(x.shape) if residual is not None else None
        gate = gate.reshape(x.shape) if gate is not None else None
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"rms_norm: weight {list(weight.shape)} for rows of {D}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if keep else None
    A, B, sxa, sxb = _rows(x)
    rows = A * B
    if rows == 0:
        return out
    _, _, sra, srb = _rows(residual) if residual is not None else (0, 0, 0, 0)
    _, _, sga, sgb = _rows(gate) if gate is not None else (0, 0, 0, 0)
    q, scale, group = quant if quant is not None else (x, x, GROUP)
    block_d = max(triton.next_power_of_2(D), group if quant is not None else 1)
    block_rows = max(1, min(64, ELEMENTS_PER_PROGRAM // block_d))
    grid = (triton.cdiv(rows, block_rows),)
    cos, sin = rotary if rotary is not None else (x, x)
    _rms_norm_kernel[grid](
        x, residual if residual is not None else x, gate if gate is not None else x, weight,
        out if out is not None else x, total if total is not None else x, cos, sin, q,
        lo if lo is not None else q, scale, rows, B, sxa, sxb, sra, srb, sga, sgb, D, eps,
        cos.shape[-1] if rotary is not None else 0, triton.cdiv(D, group),
        HAS_RESIDUAL=residual is not None, GATED=gate is not None, ROTARY=rotary is not None,
        QUANT=quant is not None, SPLIT=lo is not None, STORE_OUT=out is not None, GROUP=group,
        GROUPS_PER_ROW=block_d // group,
        BLOCK_D=block_d, ROWS=block_rows, VEC=16 // x.element_size(), num_warps=8 if block_d >= 4096 else 4,
    )  # fmt: skip
    return out


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, gate_ptr, w_ptr, out_ptr, total_ptr, cos_ptr, sin_ptr, q_ptr, lo_ptr, s_ptr,
    rows, B, sxa, sxb, sra, srb, sga, sgb, D, eps, R, groups,
    HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr, ROTARY: tl.constexpr, QUANT: tl.constexpr,
    SPLIT: tl.constexpr, STORE_OUT: tl.constexpr, GROUP: tl.constexpr, GROUPS_PER_ROW: tl.constexpr,
    BLOCK_D: tl.constexpr, ROWS: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)  # [ROWS]
    a, b = r // B, r % B
    d = tl.arange(0, BLOCK_D)
    mask = (r < rows)[:, None] & (d < D)[None, :]
    dense = r[:, None] * D + d[None, :]  # offsets in the contiguous outputs
    x = tl.load(x_ptr + (a * sxa + b * sxb)[:, None] + d[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + (a * sra + b * srb)[:, None] + d[None, :], mask=mask, other=0.0)
        x = (res.to(tl.float32) + x.to(tl.float32)).to(x.dtype)  # rounded as the unfused add
        tl.store(total_ptr + dense, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + eps)  # [ROWS]
    w = tl.load(w_ptr + d, mask=d < D, other=0.0)
    if GATED:
        normed = (xf * rstd[:, None]).to(x.dtype)
        scaled = (w.to(tl.float32)[None, :] * normed.to(tl.float32)).to(x.dtype).to(tl.float32)  # as w * normed
        z = tl.load(gate_ptr + (a * sga + b * sgb)[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
        y = scaled * (z / (1.0 + tl.exp(-z)))
    else:
        y = xf * rstd[:, None] * (1.0 + w.to(tl.float32))[None, :]
    if ROTARY:  # rotate-half on the first R dims of head b of token a, rounded as the unfused ops
        half = R // 2
        in_rot = d < R
        partner = tl.where(d < half, d + half, d - half)  # the element rotate_half brings to d
        r_mask = mask & in_rot[None, :]
        xp = tl.load(x_ptr + (a * sxa + b * sxb)[:, None] + partner[None, :], mask=r_mask, other=0.0)
        wp = tl.load(w_ptr + partner, mask=in_rot, other=0.0).to(tl.float32)
        normed_p = (xp.to(tl.float32) * rstd[:, None] * (1.0 + wp)[None, :]).to(x.dtype).to(tl.float32)
        rotated = tl.where((d < half)[None, :], -normed_p, normed_p)
        cs = a[:, None] * R + d[None, :]
        c = tl.load(cos_ptr + cs, mask=r_mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + cs, mask=r_mask, other=0.0).to(tl.float32)
        normed = y.to(x.dtype).to(tl.float32)
        turned = (normed * c).to(x.dtype).to(tl.float32) + (rotated * s).to(x.dtype).to(tl.float32)
        y = tl.where(in_rot[None, :], turned, normed)
    y = y.to(x_ptr.dtype.element_ty)
    if STORE_OUT:
        tl.store(out_ptr + dense, y, mask=mask)
    if QUANT:  # each row's groups of GROUP inputs, from the rounded norm (lanes past D are zeros)
        groups_of_y = tl.reshape(y.to(tl.float32), (ROWS * GROUPS_PER_ROW, GROUP))
        if SPLIT:
            q, lo, scale = _quantize_split_rows(groups_of_y)
        else:
            q, scale = _quantize_rows(groups_of_y)
        # q's offsets declared VEC-contiguous (VEC: x's elements in 16 bytes; they are BLOCK_D-contiguous):
        # the e4m3 store then takes the layout of x's loads and stores (VEC a thread) instead of its own
        # (16 a thread), so x, w, y and the sum of squares keep the plain norm's layout: no [ROWS, BLOCK_D]
        # conversion through shared memory, and the plain norm's summation order (as compiled for sm_90)
        q_offsets = tl.max_contiguous(dense, [1, VEC])
        tl.store(q_ptr + q_offsets, tl.reshape(q, (ROWS, BLOCK_D)), mask=mask)
        if SPLIT:
            tl.store(lo_ptr + q_offsets, tl.reshape(lo, (ROWS, BLOCK_D)), mask=mask)
        g = tl.arange(0, GROUPS_PER_ROW)
        s_mask = (r < rows)[:, None] & (g < groups)[None, :]
        tl.store(s_ptr + r[:, None] * groups + g[None, :], tl.reshape(scale, (ROWS, GROUPS_PER_ROW)), mask=s_mask)

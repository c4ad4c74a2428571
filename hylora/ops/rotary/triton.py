"""`reference.rotate_half` in one Triton launch, bit for bit: the same fp32 products and sum, one
rounding, and no FMA contraction (`enable_fp_fusion=False`).

x is addressed as [A, B, D] with strides (sa, sb, 1), row r = (r // B, r % B) (the tower rotates the
q and k heads of its fused qkv projection in place, a strided view). Each program loads both halves
of ROWS whole rows before it writes them, so `out=x` is safe; offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ELEMENTS_PER_PROGRAM = 4096


def rotate_half(
    x: torch.Tensor,  # [A, B, D]
    cos: torch.Tensor,  # [A, D] fp32, contiguous
    sin: torch.Tensor,  # [A, D] fp32, contiguous
    out: torch.Tensor | None = None,  # [A, B, D], x's dtype; may be x itself
) -> torch.Tensor:
    A, B, D = x.shape
    if D % 2 or x.stride(-1) != 1:
        raise ValueError(f"rotate_half: x {list(x.shape)} needs an even head dim with unit stride")
    if cos.shape != (A, D) or sin.shape != (A, D) or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"rotate_half: cos and sin must be contiguous [{A}, {D}]")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError("rotate_half: cos and sin must be fp32")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"rotate_half: out must be {list(x.shape)} {x.dtype} with unit last stride")
    rows = A * B
    if rows == 0:
        return out
    block_h = triton.next_power_of_2(D // 2)
    block_rows = block_rows_for(D)
    _rotate_half_kernel[(triton.cdiv(rows, block_rows),)](
        x, cos, sin, out, rows, B, x.stride(0), x.stride(1), out.stride(0), out.stride(1), D // 2,
        BLOCK_H=block_h, ROWS=block_rows, enable_fp_fusion=False,
    )  # fmt: skip
    return out


def block_rows_for(D: int) -> int:
    """Rows (token, head) one program rotates."""
    return max(1, min(64, ELEMENTS_PER_PROGRAM // (2 * triton.next_power_of_2(D // 2))))


@triton.jit
def _rotate_half_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, rows, B, sxa, sxb, soa, sob, half,
    BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)  # [ROWS]
    a, b = r // B, r % B
    d = tl.arange(0, BLOCK_H)  # [BLOCK_H], within one half
    mask = (r < rows)[:, None] & (d < half)[None, :]
    x_row = x_ptr + (a * sxa + b * sxb)[:, None] + d[None, :]
    x1 = tl.load(x_row, mask=mask, other=0.0)
    x2 = tl.load(x_row + half, mask=mask, other=0.0)
    cs = a[:, None] * (2 * half) + d[None, :]  # cos/sin are [A, D]
    c1 = tl.load(cos_ptr + cs, mask=mask, other=0.0)
    c2 = tl.load(cos_ptr + cs + half, mask=mask, other=0.0)
    s1 = tl.load(sin_ptr + cs, mask=mask, other=0.0)
    s2 = tl.load(sin_ptr + cs + half, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    y1 = x1f * c1 + (-x2f) * s1  # rotate_half(x) = [-x2, x1]
    y2 = x2f * c2 + x1f * s2
    out_row = out_ptr + (a * soa + b * sob)[:, None] + d[None, :]
    tl.store(out_row, y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_row + half, y2.to(out_ptr.dtype.element_ty), mask=mask)

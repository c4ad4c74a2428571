"""`reference.rotate_half` in one Triton launch, bit for bit: the same fp32 products and sum, one
rounding, and no FMA contraction (`enable_fp_fusion=False`).

x is addressed as [A, B, D] with strides (sa, sb, 1), row r = (r // B, r % B) (the tower rotates the
q and k heads of its fused qkv projection in place, a strided view). The launch walks the flat list
of (row, d) pairs, d < D / 2, PAIRS to a program: each lane loads x[r, d] and x[r, d + D/2], the
angles of both, and writes the same two elements, so `out=x` is safe (no lane writes what another
reads) and every lane has work whatever D is. (Run 25 d's first form gave each program whole rows
padded to a power of two: 36 of the 64 lanes busy at the tower's D = 72, ~0.84 TB/s on an H200.)
Offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PAIRS = 1024  # (row, d) pairs a program rotates: 2048 elements of x and of out


def rotate_half(
    x: torch.Tensor,  # [A, B, D]
    cos: torch.Tensor,  # [A, D] fp32, contiguous
    sin: torch.Tensor,  # [A, D] fp32, contiguous
    out: torch.Tensor | None = None,  # [A, B, D], x's dtype; may be x itself
    pairs: int = PAIRS,
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
    total = A * B * (D // 2)
    if total == 0:
        return out
    _rotate_half_kernel[(triton.cdiv(total, pairs),)](
        x, cos, sin, out, total, B, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        HALF=D // 2, PAIRS=pairs, enable_fp_fusion=False,
    )  # fmt: skip
    return out


@triton.jit
def _rotate_half_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, total, B, sxa, sxb, soa, sob,
    HALF: tl.constexpr, PAIRS: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0).to(tl.int64) * PAIRS + tl.arange(0, PAIRS).to(tl.int64)  # [PAIRS] flat (row, d)
    mask = p < total
    r, d = p // HALF, p % HALF  # HALF is a constant: no division instruction
    a, b = r // B, r % B
    x_at = x_ptr + a * sxa + b * sxb + d
    x1 = tl.load(x_at, mask=mask, other=0.0)
    x2 = tl.load(x_at + HALF, mask=mask, other=0.0)
    cs = a * (2 * HALF) + d  # cos/sin are [A, D]
    c1 = tl.load(cos_ptr + cs, mask=mask, other=0.0)
    c2 = tl.load(cos_ptr + cs + HALF, mask=mask, other=0.0)
    s1 = tl.load(sin_ptr + cs, mask=mask, other=0.0)
    s2 = tl.load(sin_ptr + cs + HALF, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    y1 = x1f * c1 + (-x2f) * s1  # rotate_half(x) = [-x2, x1]
    y2 = x2f * c2 + x1f * s2
    out_at = out_ptr + a * soa + b * sob + d
    tl.store(out_at, y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_at + HALF, y2.to(out_ptr.dtype.element_ty), mask=mask)

"""`reference.silu_mul` in one Triton launch: reads [gate | up] once, writes [T, I] once.
`silu_mul_quantized`: the same values quantised for an FP8 down projection in that launch (bit-equal
to `fp8_linear.triton.quantize_activation` of `silu_mul`): the [T, I] activation is neither written
(unless kept for LoRA) nor read back by a quantisation launch of its own."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylora.ops.fp8_linear.reference import FP8_DTYPE, GROUP, QuantizedActivation
from hylora.ops.fp8_linear.triton import QUANT_BLOCK_M, _check_group, _quantize_rows

BLOCK = 2048


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    T, two_i = gate_up.shape
    if two_i % 2 or gate_up.stride(1) != 1:
        raise ValueError("silu_mul: needs [T, 2I] with unit stride along the last dimension")
    inner = two_i // 2
    out = torch.empty(T, inner, dtype=gate_up.dtype, device=gate_up.device)
    n = T * inner
    if n:
        _silu_mul_kernel[(triton.cdiv(n, BLOCK),)](gate_up, out, n, inner, gate_up.stride(0), BLOCK=BLOCK)
    return out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n, inner, stride_t, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = i < n
    t, c = i // inner, i % inner
    gate = tl.load(x_ptr + t * stride_t + c, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_t + inner + c, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # F.silu rounds to the input dtype
    tl.store(out_ptr + i, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_quantized(gate_up: torch.Tensor, group: int = GROUP, keep: bool = False) -> QuantizedActivation:
    T, two_i = gate_up.shape
    if two_i % 2 or gate_up.stride(1) != 1:
        raise ValueError("silu_mul_quantized: needs [T, 2I] with unit stride along the last dimension")
    _check_group(group)
    inner = two_i // 2
    q = torch.empty(T, inner, dtype=FP8_DTYPE, device=gate_up.device)
    s = torch.empty(T, triton.cdiv(inner, group), dtype=torch.float32, device=gate_up.device)
    h = torch.empty(T, inner, dtype=gate_up.dtype, device=gate_up.device) if keep else q
    if T and inner:
        grid = (triton.cdiv(T, QUANT_BLOCK_M), triton.cdiv(inner, group))
        _silu_mul_quant_kernel[grid](
            gate_up, h, q, s, T, inner, gate_up.stride(0), BLOCK_M=QUANT_BLOCK_M, GROUP=group, KEEP=keep
        )
    return QuantizedActivation(q, s, gate_up.dtype, h if keep else None)


@triton.jit
def _silu_mul_quant_kernel(
    x_ptr, h_ptr, q_ptr, s_ptr, T, inner, stride_t, BLOCK_M: tl.constexpr, GROUP: tl.constexpr, KEEP: tl.constexpr
):
    rt = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    rc = g * GROUP + tl.arange(0, GROUP)
    mask = (rt < T)[:, None] & (rc < inner)[None, :]
    rows = rt.to(tl.int64)[:, None]
    gate = tl.load(x_ptr + rows * stride_t + rc[None, :], mask=mask, other=0.0)
    up = tl.load(x_ptr + rows * stride_t + inner + rc[None, :], mask=mask, other=0.0)
    gf = gate.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype).to(tl.float32)  # F.silu rounds to the input dtype
    h = (act * up.to(tl.float32)).to(gate.dtype)  # the unfused op's [T, I] output, rounded as it is
    out = rows * inner + rc[None, :]
    if KEEP:
        tl.store(h_ptr + out, h, mask=mask)
    q, scale = _quantize_rows(h.to(tl.float32))
    tl.store(q_ptr + out, q, mask=mask)
    tl.store(s_ptr + rt.to(tl.int64) * tl.cdiv(inner, GROUP) + g, scale, mask=rt < T)

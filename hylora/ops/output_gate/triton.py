"""`reference.output_gate` in one Triton launch: o and the gate read where they lie (the gate is a
strided view of the fused qkv projection's output; the unfused ops copy it, then apply the sigmoid,
then the product: three launches), [T, H·d] written once. `output_gate_quantized`: the same values
quantised for an FP8 o_proj in that launch (bit-equal to `fp8_linear.triton.quantize_activation` of
`output_gate`; with `split`, to its two-term `quantize_activation_split`), the [T, H·d] activation
written only when kept for the o_proj's LoRA.

Programs over (16 tokens, 128 output columns): the FP8 group, so a program's columns share their
scales. The sigmoid is rounded to the input dtype before the product, as torch's ops round it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylora.ops.fp8_linear.reference import FP8_DTYPE, GROUP, QuantizedActivation
from hylora.ops.fp8_linear.triton import QUANT_BLOCK_M, _check_group, _store_quantized_rows


def output_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    T, H, d = _check(o, gate, "output_gate")
    out = torch.empty(T, H * d, dtype=o.dtype, device=o.device)
    _launch(o, gate, out, quantized=None, group=GROUP, split=False)  # the values alone: h is the output
    return out


def output_gate_quantized(
    o: torch.Tensor, gate: torch.Tensor, group: int = GROUP, keep: bool = False, split: bool = False
) -> QuantizedActivation:
    T, H, d = _check(o, gate, "output_gate_quantized")
    _check_group(group)
    q = torch.empty(T, H * d, dtype=FP8_DTYPE, device=o.device)
    lo = torch.empty_like(q) if split else None
    s = torch.empty(T, triton.cdiv(H * d, group), dtype=torch.float32, device=o.device)
    h = torch.empty(T, H * d, dtype=o.dtype, device=o.device) if keep else None
    _launch(o, gate, h, quantized=(q, q if lo is None else lo, s), group=group, split=split)
    return QuantizedActivation(q, s, o.dtype, h, lo)


def _check(o: torch.Tensor, gate: torch.Tensor, name: str) -> tuple[int, int, int]:
    if o.ndim != 3 or gate.shape != o.shape or gate.dtype != o.dtype:
        raise ValueError(f"{name}: needs o and gate of one [T, H, d] shape and dtype, got {list(o.shape)}, "
                         f"{list(gate.shape)}")  # fmt: skip
    if o.stride(2) != 1 or gate.stride(2) != 1:
        raise ValueError(f"{name}: needs unit stride along d")
    return o.shape


def _launch(
    o: torch.Tensor,
    gate: torch.Tensor,
    h: torch.Tensor | None,  # [T, H·d] the values, written where given
    quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,  # (q, lo (q unless split), scales)
    group: int,
    split: bool,
) -> None:
    T, H, d = o.shape
    assert h is not None or quantized is not None
    q, lo, s = quantized if quantized is not None else (h, h, h)  # (unused pointers where not quantising)
    if T and H * d:
        grid = (triton.cdiv(T, QUANT_BLOCK_M), triton.cdiv(H * d, group))
        _output_gate_kernel[grid](
            o, gate, q if h is None else h, q, lo, s, T, H * d, d, o.stride(0), o.stride(1), gate.stride(0),
            gate.stride(1), BLOCK_M=QUANT_BLOCK_M, GROUP=group, QUANT=quantized is not None, KEEP=h is not None,
            SPLIT=split,
        )  # fmt: skip


@triton.jit
def _output_gate_kernel(
    o_ptr, g_ptr, h_ptr, q_ptr, lo_ptr, s_ptr, T, width, d, stride_ot, stride_oh, stride_gt, stride_gh,
    BLOCK_M: tl.constexpr, GROUP: tl.constexpr, QUANT: tl.constexpr, KEEP: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    rt = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    grp = tl.program_id(1)
    rc = grp * GROUP + tl.arange(0, GROUP)
    mask = (rt < T)[:, None] & (rc < width)[None, :]
    rows = rt.to(tl.int64)[:, None]
    head, j = (rc // d)[None, :], (rc % d)[None, :]
    o = tl.load(o_ptr + rows * stride_ot + head * stride_oh + j, mask=mask, other=0.0)
    g = tl.load(g_ptr + rows * stride_gt + head * stride_gh + j, mask=mask, other=0.0)
    sig = tl.math.div_rn(tl.full(g.shape, 1.0, tl.float32), 1.0 + tl.exp(-g.to(tl.float32))).to(o.dtype)
    h = (o.to(tl.float32) * sig.to(tl.float32)).to(o.dtype)  # the unfused ops' [T, H·d], rounded as they are
    out = rows * width + rc[None, :]
    if KEEP:
        tl.store(h_ptr + out, h, mask=mask)
    if QUANT:
        scales = rt.to(tl.int64) * tl.cdiv(width, GROUP) + grp
        _store_quantized_rows(h, q_ptr, lo_ptr, s_ptr, out, mask, scales, rt < T, SPLIT)

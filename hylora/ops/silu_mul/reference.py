"""silu(gate) * up in plain torch, over the fused projection's output [T, 2I] = [gate | up];
`silu_mul_quantized`: the same, quantised for an FP8 down projection (`fp8_linear.quantize_activation`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hylora.ops.fp8_linear.reference import GROUP, QuantizedActivation, quantize_activation


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] → [T, I]: silu(gate) rounded to the input dtype, times up (as the unfused layer)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_quantized(gate_up: torch.Tensor, group: int = GROUP, keep: bool = False) -> QuantizedActivation:
    """`silu_mul(gate_up)` quantised per token and group of `group` inputs; with `keep`, the
    unquantised [T, I] too (for the down projection's LoRA)."""
    h = silu_mul(gate_up)
    q, scale = quantize_activation(h, group)
    return QuantizedActivation(q, scale, h.dtype, h if keep else None)

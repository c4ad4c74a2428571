"""o * sigmoid(gate) in plain torch: the gated attention's output before its o_proj.

o is the attention's [T, H, d] output and gate the [T, H, d] half of the q_proj rows (a strided view
of the fused qkv projection's output). The unfused layer rounds sigmoid(gate) to the input dtype,
then the product; `output_gate_quantized` quantises that [T, H·d] for an FP8 o_proj
(`fp8_linear.quantize_activation`, or its split)."""

from __future__ import annotations

import torch

from hylora.ops.fp8_linear.reference import GROUP, QuantizedActivation


def output_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """[T, H, d] o and gate (any strides) → [T, H·d] in o's dtype."""
    T = o.shape[0]
    return o.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))


def output_gate_quantized(
    o: torch.Tensor, gate: torch.Tensor, group: int = GROUP, keep: bool = False, split: bool = False
) -> QuantizedActivation:
    """`output_gate(o, gate)` quantised per token and group of `group` inputs (`split`: as two e4m3
    terms); with `keep`, the unquantised [T, H·d] too (for the o_proj's LoRA)."""
    return QuantizedActivation.of(output_gate(o, gate), group, keep, split)

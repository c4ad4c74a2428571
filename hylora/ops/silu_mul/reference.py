"""silu(gate) * up in plain torch, over the fused projection's output [T, 2I] = [gate | up];
`silu_mul_quantized`: the same, quantised for an FP8 down projection (`fp8_linear.quantize_activation`);
`silu_mul_lora`: either, after the gate_up projection's LoRA expand (`lora.reference.lora_expand` of
each token's h into its [gate | up] rows, rounded once), from the h the LoRA shrink (or a decode
step's stacked GEMM) left."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hylora.ops.fp8_linear.reference import GROUP, QuantizedActivation
from hylora.ops.lora.reference import lora_expand


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] → [T, I]: silu(gate) rounded to the input dtype, times up (as the unfused layer)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_quantized(
    gate_up: torch.Tensor, group: int = GROUP, keep: bool = False, split: bool = False
) -> QuantizedActivation:
    """`silu_mul(gate_up)` quantised per token and group of `group` inputs (`split`: as two e4m3 terms,
    `quantize_activation_split`); with `keep`, the unquantised [T, I] too (for the down projection's LoRA)."""
    return QuantizedActivation.of(silu_mul(gate_up), group, keep, split)


def silu_mul_lora(
    gate_up: torch.Tensor,  # [T, 2I]: the base GEMM's [gate | up], without the LoRA delta
    h: torch.Tensor,  # [split, T, 2, r] shrink partials (fp32), or [1, T, 2, L, r] every slot's (stacked GEMM)
    b: list[torch.Tensor],  # [B_gate, B_up], each [L, r, I]
    token_slots: torch.Tensor,  # [T] each token's slot, -1: no adapter
    group: int | None = None,  # quantise for an FP8 down projection with groups of `group` inputs
    keep: bool = False,  # with group: also the unquantised [T, I] (for the down projection's LoRA)
    split: bool = False,  # with group: as two e4m3 terms
) -> torch.Tensor | QuantizedActivation:
    """silu_mul (or silu_mul_quantized) of gate_up plus each adapter token's delta h · B, the sum
    rounded to gate_up's dtype first, as the unfused expand then activation do."""
    T, inner = gate_up.shape[0], gate_up.shape[1] // 2
    if h.ndim == 5:  # every slot's h: each token's own slot (zeros for base tokens, never read)
        own = h[0, torch.arange(T, device=h.device), :, token_slots.clamp(min=0)].float()
    else:
        own = h.float().sum(0)
    y = lora_expand(own, b, [(0, inner), (inner, inner)], token_slots, gate_up.clone())
    return silu_mul(y) if group is None else silu_mul_quantized(y, group, keep, split)

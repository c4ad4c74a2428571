"""The MLP's activation, silu(gate) * up over the fused [gate | up] projection, the same quantised
for an FP8 down projection, and either after gate_up's LoRA expand: `reference` (torch) and `triton`
(imported on demand: needs the triton package)."""

from hylora.ops.silu_mul.reference import silu_mul, silu_mul_lora, silu_mul_quantized

__all__ = ["silu_mul", "silu_mul_lora", "silu_mul_quantized"]

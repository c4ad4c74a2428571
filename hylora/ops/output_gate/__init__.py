"""The gated attention's output gate, o * sigmoid(gate) over [T, H, d] views, and the same quantised
for an FP8 o_proj: `reference` (torch) and `triton` (imported on demand: needs the triton package)."""

from hylora.ops.output_gate.reference import output_gate, output_gate_quantized

__all__ = ["output_gate", "output_gate_quantized"]

"""Depthwise causal conv1d + SiLU over a varlen batch with carried state: `reference` (torch) and
`triton` (the state read and written in place by pool slot; imported on demand)."""

from hylora.ops.causal_conv1d.reference import causal_conv1d_by_slot, causal_conv1d_varlen

__all__ = ["causal_conv1d_by_slot", "causal_conv1d_varlen"]

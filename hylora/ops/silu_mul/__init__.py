"""The MLP's activation, silu(gate) * up over the fused [gate | up] projection: `reference` (torch)
and `triton` (imported on demand: needs the triton package)."""

from hylora.ops.silu_mul.reference import silu_mul

__all__ = ["silu_mul"]

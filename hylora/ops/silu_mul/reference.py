"""silu(gate) * up in plain torch, over the fused projection's output [T, 2I] = [gate | up]."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] → [T, I]: silu(gate) rounded to the input dtype, times up (as the unfused layer)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

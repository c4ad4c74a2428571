"""Small building blocks: bias-free linear, the two RMSNorms, the SiLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hylora.lora.apply import LoRABatch, LoRAStack, lora_apply
from hylora.model.device_lora import DeviceLoRABatch
from hylora.ops.rmsnorm.reference import gated_rms_norm, rms_norm
from hylora.ops.silu_mul.reference import silu_mul


def _param(*shape: int) -> nn.Parameter:
    # Created empty (usually on the meta device); the loader assigns the checkpoint tensor.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ the batch's LoRA deltas). The unit LoRA attaches to.

    `slices` names the output row blocks: one for a plain projection, several when hylora fuses
    checkpoint projections into one GEMM (see model/packing.py). LoRA deltas are added per slice.
    """

    def __init__(self, in_features: int, slices: dict[str, int]):
        super().__init__()
        self.in_features = in_features
        self.slices = dict(slices)  # checkpoint module name → output rows
        self.out_features = sum(slices.values())
        self.weight = _param(self.out_features, in_features)
        self.lora: LoRAStack | None = None  # set by the adapter registry
        self.lora_backend: str | None = None  # set by the start-up kernel check ("triton" if it passed)

    @property
    def slice_offsets(self) -> list[tuple[int, int]]:
        offsets, start = [], 0
        for rows in self.slices.values():
            offsets.append((start, rows))
            start += rows
        return offsets

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if lora is None or self.lora is None:
            return y
        if isinstance(lora, DeviceLoRABatch):  # a padded decode step (CUDA graph): every slice, no host decision
            return lora.apply(x, y, self.lora, self.lora_backend)
        if lora.has_adapters:
            y = lora_apply(x, y, self.lora, lora, self.lora_backend)
        return y


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: norm(x) * (1 + w), computed in fp32. With `residual`, the residual add
    is fused in front: returns (norm(residual + x), residual + x)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim)
        self.kernel = rms_norm  # ops.rmsnorm: the Triton kernel once the start-up check installs it

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.kernel(x, self.weight, self.eps, residual)


class GatedRMSNorm(nn.Module):
    """Output norm of the GDN layer: norm(x) * w * silu(z), plain weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim)
        self.kernel = gated_rms_norm  # ops.rmsnorm

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, z, self.weight, self.eps)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, {"gate_proj": intermediate, "up_proj": intermediate})
        self.down_proj = Linear(intermediate, {"down_proj": hidden})
        self.act = silu_mul  # ops.silu_mul: silu(gate) * up

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x, lora)), lora)

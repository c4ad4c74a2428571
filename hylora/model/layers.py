"""Small building blocks: bias-free linear, the two RMSNorms, the SiLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _param(*shape: int) -> nn.Parameter:
    # Created empty (usually on the meta device); the loader assigns the checkpoint tensor.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T. The unit the LoRA layer attaches to."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param(out_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: norm(x) * (1 + w), computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Output norm of the GDN layer: norm(x) * w * silu(z), plain weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(z.float())).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

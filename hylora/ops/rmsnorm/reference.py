"""RMSNorm in plain torch, in fp32, rounded once to the input's dtype.

`rms_norm`: the decoder's zero-centred norm, norm(x) * (1 + w); given `residual` it first forms
s = residual + x (in x's dtype, as an unfused `x = x + h` would) and returns (norm(s), s).
`gated_rms_norm`: the GDN output norm, w * norm(x) * silu(z), with the roundings of the layer it
replaces (norm(x) rounded to x's dtype, then times w in that dtype, then times silu(z) in fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor,  # [..., D]
    weight: torch.Tensor,  # [D]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., D], same shape as x
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = residual + x
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (out * (1.0 + weight.float())).to(x.dtype)
    return out if residual is None else (out, x)


def gated_rms_norm(
    x: torch.Tensor,  # [..., D]
    z: torch.Tensor,  # [..., D] the gate
    weight: torch.Tensor,  # [D]
    eps: float,
) -> torch.Tensor:
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(z.float())).to(x.dtype)

"""Rotate-half rotary over the whole head in plain torch: fp32 arithmetic, one rounding to x's dtype.

As transformers' Qwen3-VL vision attention applies it (`apply_rotary_pos_emb_vision`):
y = x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] for x = [x1, x2] split at D / 2.
"""

from __future__ import annotations

import torch


def rotate_half(
    x: torch.Tensor,  # [A, B, D]: A tokens of B heads, any strides
    cos: torch.Tensor,  # [A, D] fp32
    sin: torch.Tensor,  # [A, D] fp32
    out: torch.Tensor | None = None,  # [A, B, D], x's dtype; may be x itself
) -> torch.Tensor:
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    y = (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)
    return y if out is None else out.copy_(y)

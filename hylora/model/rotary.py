"""Interleaved multimodal rotary embedding (M-RoPE) on the first `rotary_dim` dims of each head.

Frequency i of the rotary half takes its position from the height axis when i % 3 == 1 and
i < 3 * sections[1], from the width axis when i % 3 == 2 and i < 3 * sections[2], otherwise
from the temporal axis. Text tokens carry the same position on all three axes.
"""

from __future__ import annotations

import math

import torch

from hylora.config import ModelConfig, YarnScaling


def yarn_inv_freq(base: float, dim: int, yarn: YarnScaling) -> torch.Tensor:
    """YaRN's frequencies [dim/2] (arXiv 2309.00071): the high frequencies as trained, the low ones divided by
    `factor`, a linear ramp between over the dims that turn `beta_fast` to `beta_slow` times in the original
    context (transformers' and vLLM's formula)."""

    def dim_of(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times in the context
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(yarn.beta_fast), dim_of(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # 0: kept, 1: scaled
    trained = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return trained / yarn.factor * ramp + trained * (1 - ramp)


class MRotaryEmbedding:
    def __init__(self, config: ModelConfig, device: torch.device | str):
        dim = config.rotary_dim
        if config.yarn is None:
            self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            self.scale = 1.0
        else:
            self.inv_freq = yarn_inv_freq(config.rope_theta, dim, config.yarn)
            self.scale = config.yarn.attention_factor  # YaRN's attention temperature, on cos and sin
        self.inv_freq = self.inv_freq.to(device)
        axis = torch.zeros(dim // 2, dtype=torch.long)
        i = torch.arange(dim // 2)
        axis[(i % 3 == 1) & (i < 3 * config.mrope_section[1])] = 1
        axis[(i % 3 == 2) & (i < 3 * config.mrope_section[2])] = 2
        self.axis = axis.to(device)  # [dim/2] which of T/H/W drives each frequency
        self.rotary_dim = dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] → cos, sin [T, rotary_dim]."""
        pos = positions.gather(0, self.axis[:, None].expand(-1, positions.shape[1]))  # [dim/2, T]
        freqs = pos.T.float() * self.inv_freq  # [T, dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        if self.scale == 1.0:
            return emb.cos().to(dtype), emb.sin().to(dtype)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)

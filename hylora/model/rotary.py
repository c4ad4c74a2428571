"""Interleaved multimodal rotary embedding (M-RoPE) on the first `rotary_dim` dims of each head.

Frequency i of the rotary half takes its position from the height axis when i % 3 == 1 and
i < 3 * sections[1], from the width axis when i % 3 == 2 and i < 3 * sections[2], otherwise
from the temporal axis. Text tokens carry the same position on all three axes.
"""

from __future__ import annotations

import torch

from hylora.config import ModelConfig


class MRotaryEmbedding:
    def __init__(self, config: ModelConfig, device: torch.device | str):
        dim = config.rotary_dim
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
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
        return emb.cos().to(dtype), emb.sin().to(dtype)

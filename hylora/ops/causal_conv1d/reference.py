"""Depthwise causal conv1d + SiLU over a flat varlen batch, carrying a per-sequence conv state.

The conv state of a sequence holds its last K-1 inputs (zeros before the first token), so a
prefill split into chunks, or a decode step, sees exactly the inputs one full pass would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_varlen(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, K]
    conv_states: torch.Tensor,  # [N, C, K-1]
    seq_lens: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (silu(conv(x)) [T, C], new conv states [N, C, K-1])."""
    K = weight.shape[1]
    out = torch.empty_like(x)
    new_states = torch.empty_like(conv_states)
    start = 0
    for i, n in enumerate(seq_lens):
        window = torch.cat([conv_states[i], x[start : start + n].T.to(conv_states.dtype)], dim=1)  # [C, K-1+n]
        y = F.conv1d(window[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]  # [C, n]
        out[start : start + n] = F.silu(y).T.to(x.dtype)
        new_states[i] = window[:, window.shape[1] - (K - 1) :]
        start += n
    return out, new_states

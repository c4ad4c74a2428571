"""The varlen causal conv (with carried state) equals a plain full-sequence conv."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hylora.ops.causal_conv1d.reference import causal_conv1d_varlen


def full_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, C] from zero state: F.conv1d with left padding, then SiLU (fp64)."""
    K = weight.shape[1]
    y = F.conv1d(F.pad(x.T[None].double(), (K - 1, 0)), weight[:, None].double(), groups=x.shape[1])[0]
    return F.silu(y).T


@pytest.mark.parametrize("kernel", [2, 4])
def test_varlen_chunks_and_decode_equal_full_conv(kernel):
    g = torch.Generator().manual_seed(kernel)
    C, lens = 6, [1, 5, 1, 64, 3]
    seqs = [torch.randn(n + 7, C, generator=g) for n in lens]  # 7 tokens before, then this step's
    weight = torch.randn(C, kernel, generator=g)
    states = torch.zeros(len(lens), C, kernel - 1)
    # first step: the 7 leading tokens of every sequence
    _, states = causal_conv1d_varlen(torch.cat([s[:7] for s in seqs]), weight, states, [7] * len(lens))
    out, states = causal_conv1d_varlen(torch.cat([s[7:] for s in seqs]), weight, states, lens)
    start = 0
    for s, n in zip(seqs, lens, strict=True):
        torch.testing.assert_close(out[start : start + n].double(), full_conv(s, weight)[7:], atol=1e-5, rtol=1e-5)
        start += n

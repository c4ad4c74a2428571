"""The chunked and recurrent gated-delta-rule references compute the same function."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hylora.ops.gated_delta_rule.reference import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
    varlen_gated_delta_rule,
)


def inputs(T: int, H: int, dk: int, dv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, H, dk, generator=g), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(T, H, dk, generator=g), dim=-1)
    v = torch.randn(T, H, dv, generator=g)
    decay = -F.softplus(torch.randn(T, H, generator=g)) * 0.5
    beta = torch.rand(T, H, generator=g)
    state = torch.randn(H, dk, dv, generator=g) * 0.1
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 127, 128, 129, 257, 400])
def test_chunk_equals_recurrent(T):
    q, k, v, g, beta, s0 = inputs(T, 3, 16, 8, seed=T)
    o_ref, s_ref = recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], s0[None])
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, s0)
    torch.testing.assert_close(o, o_ref[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s, s_ref[0], atol=1e-5, rtol=1e-4)
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunk_size_does_not_change_result(chunk):
    q, k, v, g, beta, s0 = inputs(150, 2, 8, 8, seed=7)
    o64, s64 = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=64)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=chunk)
    torch.testing.assert_close(o, o64, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s, s64, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("group", [1, 2, 3])
def test_varlen_mixes_decode_and_prefill(group):
    """Raw q/k with Hk heads, Hv = group * Hk value heads: normalised, expanded and scaled inside."""
    lens = [1, 65, 1, 3, 128, 1]
    hk, dk, dv = 2, 8, 4
    hv, scale = hk * group, dk**-0.5
    g = torch.Generator().manual_seed(group)
    per_seq = []
    for i, n in enumerate(lens):
        _, _, v, decay, beta, state = inputs(n, hv, dk, dv, seed=i)
        raw_q, raw_k = torch.randn(n, hk, dk, generator=g) * 3, torch.randn(n, hk, dk, generator=g)
        per_seq.append((raw_q, raw_k, v, decay, beta, state))
    flat = [torch.cat([p[j] for p in per_seq]) for j in range(5)]
    states = torch.stack([p[5] for p in per_seq])
    o, s = varlen_gated_delta_rule(*flat, states, lens, scale)
    start = 0
    for i, (n, p) in enumerate(zip(lens, per_seq, strict=True)):
        q = (F.normalize(p[0], dim=-1, eps=0) * scale).repeat_interleave(group, dim=1)
        k = F.normalize(p[1], dim=-1, eps=0).repeat_interleave(group, dim=1)
        o_ref, s_ref = recurrent_gated_delta_rule(q[None], k[None], *(x[None] for x in p[2:5]), p[5][None])
        torch.testing.assert_close(o[start : start + n], o_ref[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(s[i], s_ref[0], atol=1e-5, rtol=1e-4)
        start += n

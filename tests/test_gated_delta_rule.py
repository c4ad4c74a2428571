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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's kernels need a CUDA device")
@pytest.mark.parametrize("lens", [[512, 512, 1, 1, 1], [2048], [63, 1, 65, 128, 1, 7], [1, 1, 2]])
def test_fla_without_its_wrappers_gives_the_public_calls_bits(lens):
    """A prefill step calls fla's forward functions directly (`_chunk_forward`): the same kernels and
    arguments as `chunk_gated_delta_rule`, so the same bits, at lengths straddling fla's 64-token chunks
    and decode rows beside prompt chunks."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as public

    from hylora.ops.gated_delta_rule import fla

    forward = fla._chunk_forward()
    assert forward is not None, "this fla-core lacks the functions hylora calls directly"
    g = torch.Generator(device="cuda").manual_seed(len(lens))
    T, N, hk, hv, dk, dv = sum(lens), len(lens), 4, 8, 128, 128

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda")

    q, k, v = rand(T, hk, dk).bfloat16(), rand(T, hk, dk).bfloat16(), rand(T, hv, dv).bfloat16()
    decay, beta = -F.softplus(rand(T, hv)) * 0.5, torch.sigmoid(rand(T, hv)).bfloat16()
    states = rand(N, hv, dk, dv) * 0.1
    cu_seqlens, chunk_indices = fla._varlen_meta(tuple(lens), q.device)
    o_pub, s_pub = public(
        q=q[None], k=k[None], v=v[None], g=decay[None], beta=beta[None], scale=dk**-0.5,
        initial_state=states.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
    )  # fmt: skip
    o, s = forward(q, k, v, decay, beta, states.clone(), dk**-0.5, cu_seqlens, chunk_indices)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert torch.equal(o, o_pub[0]) and torch.equal(s, s_pub.float())
    o2, s2 = fla.varlen_gated_delta_rule(q, k, v, decay, beta, states.clone(), lens, dk**-0.5)
    assert torch.equal(o2, o) and torch.equal(s2, s)

"""One Gated DeltaNet decode step for N sequences, in place in the state pool, in plain torch.

Per sequence n (one new token) with state slot s = slots[n]:
    window    = [conv[s] | qkv[n]]                       conv state = the last K-1 inputs
    mixed     = silu(sum_j window[:, j] * w[:, j])       rounded to the model dtype
    conv[s]   = window[:, 1:]
    q, k, v   = mixed split [Hk*dk | Hk*dk | Hv*dv];     q, k L2-normalised, q *= scale
    beta      = sigmoid(b)  (model dtype),  g = -exp(A_log) * softplus(a + dt_bias)
    value head h reads key head h // (Hv / Hk):
    S         = recurrent[s, h] * exp(g)
    S        += k ⊗ beta (v - Sᵀk);   o = Sᵀq;   recurrent[s, h] = S

Padding rows: a negative slot. Such a row reads nothing, writes no state and its output is zeros,
so a CUDA graph padded to a bucket size can give its extra rows slot -1. Live slots must be
distinct. This is the same arithmetic as `ops.causal_conv1d_varlen` + the gating of
`model/gdn.py` + `ops.varlen_gated_delta_rule` on one-token sequences (tests prove it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hylora.ops.gated_delta_rule.reference import l2norm


def num_key_heads(conv_dim: int, num_value_heads: int, dk: int, dv: int) -> int:
    """Hk from the conv width: conv_dim = 2 * Hk * dk + Hv * dv."""
    hk, rest = divmod(conv_dim - num_value_heads * dv, 2 * dk)
    if rest or hk <= 0 or num_value_heads % hk:
        raise ValueError(f"conv_dim {conv_dim} is not [q | k | v] for Hv {num_value_heads}, dk {dk}, dv {dv}")
    return hk


def gdn_decode(
    qkv: torch.Tensor,  # [N, conv_dim] projected, before the conv (model dtype)
    b: torch.Tensor,  # [N, Hv]
    a: torch.Tensor,  # [N, Hv]
    conv_weight: torch.Tensor,  # [conv_dim, K]
    A_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    conv_state: torch.Tensor,  # [S, conv_dim, K-1] one layer of StatePool.conv, updated in place
    recurrent_state: torch.Tensor,  # [S, Hv, dk, dv] fp32, one layer of StatePool.recurrent, in place
    slots: torch.Tensor,  # [N] int, < 0 = padding row
    scale: float | None = None,  # default dk ** -0.5
    out: torch.Tensor | None = None,  # [N, Hv, dv] to write into
) -> torch.Tensor:
    """Returns o [N, Hv, dv] in qkv's dtype (zeros on padding rows)."""
    N, hv = b.shape
    dk, dv = recurrent_state.shape[-2:]
    hk = num_key_heads(qkv.shape[1], hv, dk, dv)
    scale = dk**-0.5 if scale is None else scale
    if out is None:
        out = torch.empty(N, hv, dv, dtype=qkv.dtype, device=qkv.device)
    out.zero_()
    live = torch.nonzero(slots >= 0).flatten()
    if live.numel() == 0:
        return out
    idx = slots[live].long()
    n = live.numel()

    window = torch.cat([conv_state[idx], qkv[live, :, None].to(conv_state.dtype)], dim=2)  # [n, C, K]
    mixed = F.silu((window.float() * conv_weight.float()).sum(-1)).to(qkv.dtype)
    conv_state[idx] = window[:, :, 1:]
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    group = hv // hk
    q = (l2norm(q.float().reshape(n, hk, dk)) * scale).repeat_interleave(group, dim=1)  # [n, Hv, dk]
    k = l2norm(k.float().reshape(n, hk, dk)).repeat_interleave(group, dim=1)
    v = v.float().reshape(n, hv, dv)
    beta = b[live].sigmoid().float()  # rounded to the model dtype first, as the model does
    g = -A_log.float().exp() * F.softplus(a[live].float() + dt_bias.float())

    state = recurrent_state[idx].float() * g.exp()[..., None, None]  # [n, Hv, dk, dv]
    delta = (v - torch.einsum("nhkv,nhk->nhv", state, k)) * beta[..., None]
    state = state + k[..., None] * delta[:, :, None, :]
    out[live] = torch.einsum("nhkv,nhk->nhv", state, q).to(qkv.dtype)
    recurrent_state[idx] = state
    return out

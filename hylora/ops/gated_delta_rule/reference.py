"""Gated delta rule in plain torch: the reference every fast kernel is tested against.

Per value head, with state S [dk, dv], for each token t:
    S <- S * exp(g_t)
    S <- S + k_t ⊗ beta_t (v_t - S^T k_t)
    o_t = S^T q_t
`chunk_` and `recurrent_` take q and k already L2-normalised, expanded to the value heads and (q)
scaled; `varlen_gated_delta_rule` takes raw q and k and does that itself, like fla's kernels with
`use_qk_l2norm_in_kernel=True`. All arithmetic is fp32; outputs in v's dtype, states fp32.

Varlen layout (as fla): flat tokens [T, H, d] with cu_seqlens [N+1] and one state per sequence
[N, H, dk, dv].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hylora.ops.varlen import live_sequences, seq_starts, single_token_seqs

CHUNK_SIZE = 64


def recurrent_gated_delta_rule(
    q: torch.Tensor,  # [B, T, H, dk]
    k: torch.Tensor,  # [B, T, H, dk]
    v: torch.Tensor,  # [B, T, H, dv]
    g: torch.Tensor,  # [B, T, H] log decay (<= 0)
    beta: torch.Tensor,  # [B, T, H]
    initial_state: torch.Tensor,  # [B, H, dk, dv]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence over equal-length sequences. Returns (o [B, T, H, dv], state)."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    state = initial_state.float().clone()
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        kv_mem = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t])
    return out, state


def chunk_gated_delta_rule(
    q: torch.Tensor,  # [T, H, dk]
    k: torch.Tensor,  # [T, H, dk]
    v: torch.Tensor,  # [T, H, dv]
    g: torch.Tensor,  # [T, H]
    beta: torch.Tensor,  # [T, H]
    initial_state: torch.Tensor,  # [H, dk, dv]
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunked (WY / UT-transform form). Returns (o [T, H, dv], state [H, dk, dv])."""
    T = q.shape[0]
    C = chunk_size
    pad = (-T) % C
    # head-major fp32: [H, T, d]
    q, k, v = (F.pad(x.float(), (0, 0, 0, 0, 0, pad)).transpose(0, 1) for x in (q, k, v))
    g, beta = (F.pad(x.float(), (0, 0, 0, pad)).transpose(0, 1) for x in (g, beta))
    H, Tp, dk = k.shape
    n = Tp // C
    q, k, v = (x.reshape(H, n, C, -1) for x in (q, k, v))
    g, beta = g.reshape(H, n, C), beta.reshape(H, n, C)

    G = g.cumsum(-1)  # [H, n, C] log decay from chunk start to position i
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, n, C, C]
    k_beta = k * beta[..., None]
    # (I + A) with A strictly lower: A[i, j] = beta_i k_i.k_j exp(G_i - G_j)
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * G.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay  # [H, n, C, C], diagonal included
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]
    chunk_decay = G[..., -1].exp()  # [H, n]

    state = initial_state.float().clone()
    out = torch.empty_like(v)
    for c in range(n):
        v_new = u[:, c] - w[:, c] @ state  # [H, C, dv]
        out[:, c] = q_decayed[:, c] @ state + intra[:, c] @ v_new
        state = state * chunk_decay[:, c, None, None] + k_to_end[:, c].transpose(-1, -2) @ v_new
    out = out.reshape(H, Tp, -1)[:, :T].transpose(0, 1)
    return out, state


def varlen_gated_delta_rule(
    q: torch.Tensor,  # [T, Hk, dk] raw (not normalised)
    k: torch.Tensor,  # [T, Hk, dk] raw
    v: torch.Tensor,  # [T, Hv, dv]
    g: torch.Tensor,  # [T, Hv]
    beta: torch.Tensor,  # [T, Hv]
    initial_states: torch.Tensor,  # [N, Hv, dk, dv]
    seq_lens: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Several sequences in one flat batch. q and k are L2-normalised here (fp32) and value head i
    reads key head i // (Hv / Hk); q is multiplied by `scale`. Single-token sequences (decode) are
    stepped together by the recurrence; longer ones go through the chunked form one by one.
    Returns (o [T, Hv, dv] in v's dtype, final states [N, Hv, dk, dv] fp32)."""
    q, k = _value_head_qk(q, k, v.shape[1], scale)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    final = torch.empty(initial_states.shape, dtype=torch.float32, device=v.device)
    starts = seq_starts(seq_lens)
    single = single_token_seqs(seq_lens)
    if single:
        idx = torch.tensor([starts[i] for i in single], device=v.device)
        seq = torch.tensor(single, device=v.device)
        o, s = recurrent_gated_delta_rule(
            q[idx, None], k[idx, None], v[idx, None], g[idx, None], beta[idx, None], initial_states[seq]
        )
        out[idx] = o[:, 0]
        final[seq] = s
    for i, n in enumerate(seq_lens):
        if n == 1:
            continue
        sl = slice(starts[i], starts[i + 1])
        if n == 0:
            final[i] = initial_states[i].float()
            continue
        out[sl], final[i] = chunk_gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], initial_states[i])
    return out.to(v.dtype), final


def gating(
    b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The GDN layer's (g, beta) from its projections b, a [T, Hv]: beta = sigmoid(b) in b's dtype,
    g = -exp(A_log) * softplus(a + dt_bias) in fp32 (the log decay)."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def recurrent_by_slot(
    q: torch.Tensor,  # [T, Hk, dk] raw
    k: torch.Tensor,  # [T, Hk, dk] raw
    v: torch.Tensor,  # [T, Hv, dv]
    b: torch.Tensor,  # [T, Hv] beta before its sigmoid
    a: torch.Tensor,  # [T, Hv] decay input before softplus
    A_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    state_pool: torch.Tensor,  # [S, Hv, dk, dv] fp32, sequence i's state at slots[i], in place
    slots: torch.Tensor,  # [N]
    seq_lens: list[int],
    scale: float,
    *,
    spec_slots: torch.Tensor | None = None,  # [N, J], J >= max(seq_lens) - 1
    starts: torch.Tensor | None = None,  # the kernel's device copy of seq_lens; the reference reads seq_lens
) -> torch.Tensor:
    """The layer's prefill delta rule with the gating, states read and written in the pool by slot:
    what `triton.recurrent_by_slot` computes token by token. Returns o [T, Hv, dv] in v's dtype.

    With `spec_slots` (a speculative verify step) every sequence is stepped token by token and its
    state after token j < n_i - 1 is also written to slot spec_slots[i, j] (-1: nowhere). Spec slots
    must be distinct and differ from every slot in `slots`. A negative slot reads and writes no
    state, and its tokens' outputs are zeros."""
    live = live_sequences(slots, seq_lens)
    if live is not None:
        keep, rows = live
        out = torch.zeros_like(v)
        if keep:
            out[rows] = recurrent_by_slot(
                q[rows], k[rows], v[rows], b[rows], a[rows], A_log, dt_bias, state_pool, slots[keep],
                [seq_lens[i] for i in keep], scale, spec_slots=spec_slots[keep] if spec_slots is not None else None,
            )  # fmt: skip
        return out
    g, beta = gating(b, a, A_log, dt_bias)
    if spec_slots is None:
        o, final = varlen_gated_delta_rule(q, k, v, g, beta, state_pool[slots], seq_lens, scale)
        state_pool[slots] = final
        return o
    return _recurrent_with_spec_states(q, k, v, g, beta, state_pool, slots, seq_lens, scale, spec_slots)


def _recurrent_with_spec_states(
    q: torch.Tensor,  # [T, Hk, dk] raw
    k: torch.Tensor,  # [T, Hk, dk] raw
    v: torch.Tensor,  # [T, Hv, dv]
    g: torch.Tensor,  # [T, Hv]
    beta: torch.Tensor,  # [T, Hv]
    state_pool: torch.Tensor,  # [S, Hv, dk, dv]
    slots: torch.Tensor,  # [N]
    seq_lens: list[int],
    scale: float,
    spec_slots: torch.Tensor,  # [N, J]
) -> torch.Tensor:
    """All sequences stepped together over [N, max(n_i)] padded tokens (a padding token has k = v =
    g = beta = 0, so it leaves the state exactly as it was). After each step one scatter writes the
    states to their spec slots without a host sync: entries that write nothing go to their row's own
    slot, which the final states overwrite at the end."""
    N, L = len(seq_lens), max(seq_lens, default=0)
    if spec_slots.dim() != 2 or spec_slots.shape[0] != N or spec_slots.shape[1] < L - 1:
        raise ValueError(f"recurrent_by_slot: spec_slots {tuple(spec_slots.shape)} do not fit lengths {seq_lens}")
    starts, T, device = seq_starts(seq_lens), sum(seq_lens), v.device
    padded = [[starts[i] + t if t < n else T for t in range(L)] for i, n in enumerate(seq_lens)]
    index = torch.tensor(padded, dtype=torch.long).to(device, non_blocking=True)  # [N, L], T: a zero row
    q, k = _value_head_qk(q, k, v.shape[1], scale)
    q, k, v, g, beta = (
        torch.cat([x.float(), x.new_zeros(1, *x.shape[1:], dtype=torch.float32)])[index] for x in (q, k, v, g, beta)
    )
    spec = spec_slots[:, : max(L - 1, 0)].long()
    writes = torch.tensor([[t < n - 1 for t in range(spec.shape[1])] for n in seq_lens], dtype=torch.bool)
    dst = torch.where(writes.to(device, non_blocking=True) & (spec >= 0), spec, slots[:, None].long())
    state = state_pool[slots].float()
    out = torch.empty(N, L, *v.shape[2:], dtype=torch.float32, device=device)
    for t in range(L):
        step = slice(t, t + 1)
        out[:, step], state = recurrent_gated_delta_rule(
            q[:, step], k[:, step], v[:, step], g[:, step], beta[:, step], state
        )
        if t < L - 1:
            state_pool[dst[:, t]] = state
    state_pool[slots] = state
    real = torch.tensor([i * L + t for i, n in enumerate(seq_lens) for t in range(n)], dtype=torch.long)
    return out.flatten(0, 1)[real.to(device, non_blocking=True)].to(v.dtype)


def _value_head_qk(q: torch.Tensor, k: torch.Tensor, hv: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q and k [T, Hk, dk] L2-normalised (q times `scale`) and expanded to the Hv value heads."""
    group = hv // q.shape[1]
    q = (l2norm(q.float()) * scale).repeat_interleave(group, dim=1)
    return q, l2norm(k.float()).repeat_interleave(group, dim=1)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)

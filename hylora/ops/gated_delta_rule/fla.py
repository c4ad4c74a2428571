"""The gated delta rule through fla's Triton kernels (CUDA only), with the reference's signature.

Keyword arguments only: fla 0.6 inserted `gk, gv` before `beta` in
`fused_recurrent_gated_delta_rule`, so a positional call silently passes beta as gk.
fla handles grouped value heads (value head i reads key head i // (Hv / Hk)) and q/k L2-norm itself.

fla computes its chunk indices from `cu_seqlens` with a device→host copy, which would stall the GPU
queue once per layer; every GDN layer of a step has the same lengths, so the indices are built here,
on the host, once per step and reused (`_varlen_meta`).

A prefill step calls fla's forward functions directly (`_chunk_forward`): the public entry wraps them
in an autograd Function, a backend dispatch, torch.compile's disable guard, an autocast decorator and
an input guard (contiguity and device context for every argument), which cost the host ~0.1 ms a
layer (run 41 d; its 8 Triton launches cost the rest of its ~0.9-1.9 ms) and run nothing on the device
that matters here (no gradients; the inputs are contiguous on one device). Same kernels, same
arguments: the same bits as the public call (a GPU test). At 2048 tokens a step a slower host queues
the 16-layer cut's forward more slowly than the device runs it (run 41): host time is step time there.
fla-core is pinned (pyproject's gpu extra); a version without these functions falls back to the
public call.
"""

from __future__ import annotations

import functools

import torch

from hylora.ops.host_to_device import host_to_device
from hylora.ops.varlen import device_seq_starts


def is_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception:  # not installed, or no Triton for this platform
        return False
    return True


def varlen_gated_delta_rule(
    q: torch.Tensor,  # [T, Hk, dk] raw
    k: torch.Tensor,  # [T, Hk, dk] raw
    v: torch.Tensor,  # [T, Hv, dv]
    g: torch.Tensor,  # [T, Hv] log decay
    beta: torch.Tensor,  # [T, Hv]
    initial_states: torch.Tensor,  # [N, Hv, dk, dv] fp32
    seq_lens: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    q, k, beta = q.to(v.dtype), k.to(v.dtype), beta.to(v.dtype)
    if all(n == 1 for n in seq_lens):  # decode: one token per sequence, as a batch of length-1 sequences
        o, final = fused_recurrent_gated_delta_rule(
            q=q[:, None],
            k=k[:, None],
            v=v[:, None],
            g=g[:, None].float(),
            beta=beta[:, None],
            scale=scale,
            initial_state=initial_states.float(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        return o[:, 0], final.float()
    cu_seqlens, chunk_indices = _varlen_meta(tuple(seq_lens), v.device)
    forward = _chunk_forward()
    if forward is not None:
        return forward(q, k, v, g, beta, initial_states, scale, cu_seqlens, chunk_indices)
    o, final = chunk_gated_delta_rule(
        q=q[None],
        k=k[None],
        v=v[None],
        g=g[None].float(),
        beta=beta[None],
        scale=scale,
        initial_state=initial_states.float(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
    )
    return o[0], final.float()


FLA_CHUNK = 64  # chunk_gated_delta_rule's default chunk size


@functools.cache
def _chunk_forward():
    """What `chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True, output_final_state=True)` runs
    in its forward, without its wrappers; None where this fla lacks the functions."""
    try:
        from fla.modules.norm.l2norm import l2norm_fwd
        from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd
    except ImportError:
        return None

    def forward(
        q: torch.Tensor,  # [T, Hk, dk] raw
        k: torch.Tensor,
        v: torch.Tensor,  # [T, Hv, dv]
        g: torch.Tensor,  # [T, Hv] log decay
        beta: torch.Tensor,  # [T, Hv]
        initial_states: torch.Tensor,  # [N, Hv, dk, dv]
        scale: float,
        cu_seqlens: torch.Tensor,
        chunk_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # the public call's input guard makes every tensor contiguous; these are unless a caller slices
        if v.device.index != torch.cuda.current_device():  # fla's guard: Triton launches on the current device
            with torch.cuda.device(v.device):
                return forward(q, k, v, g, beta, initial_states, scale, cu_seqlens, chunk_indices)
        q, k, v, beta = (x[None].contiguous() for x in (q, k, v, beta))
        q, _ = l2norm_fwd(q)
        k, _ = l2norm_fwd(k)
        _, o, _, final, _, _ = chunk_gated_delta_rule_fwd(
            q=q,
            k=k,
            v=v,
            g=g[None].float().contiguous(),
            beta=beta,
            scale=scale,
            initial_state=initial_states.float().contiguous(),
            output_final_state=True,
            cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices,
        )
        return o[0].to(q.dtype), final.float()

    return forward


@functools.lru_cache(maxsize=1)  # every GDN layer of a step asks with the same lengths
def _varlen_meta(seq_lens: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens [N + 1], chunk_indices [chunks, 2]: (sequence, chunk within it)) on `device`."""
    pairs = [(i, j) for i, n in enumerate(seq_lens) for j in range(-(-n // FLA_CHUNK))]
    cu_seqlens = device_seq_starts(seq_lens, device)
    chunk_indices = host_to_device(torch.tensor(pairs, dtype=torch.long).reshape(-1, 2), device)
    return cu_seqlens, chunk_indices

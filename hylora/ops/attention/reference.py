"""Causal attention of new tokens over a paged KV cache, in plain torch.

Each sequence's keys/values live in pages of the cache; `block_table[i]` lists its pages in order.
The new tokens of sequence i sit at positions [context_lens[i], context_lens[i] + seq_lens[i]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hylora.ops.varlen import seq_starts, single_token_seqs


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D] new tokens' queries (rotary applied)
    k_cache: torch.Tensor,  # [num_pages * page_size, Hkv, D], new tokens already written
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [N, max_pages] int
    context_lens: list[int],  # tokens cached before this step
    seq_lens: list[int],  # new tokens this step
    page_size: int,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_cache.shape[1]
    starts = seq_starts(seq_lens)
    single = single_token_seqs(seq_lens)
    if single:
        rows = torch.tensor([starts[i] for i in single], device=q.device)
        out[rows] = _decode(
            q[rows],
            k_cache,
            v_cache,
            block_table[single],
            torch.tensor([context_lens[i] + 1 for i in single], device=q.device),
            page_size,
            scale,
        )
    start = 0
    for i, (ctx, n) in enumerate(zip(context_lens, seq_lens, strict=True)):
        if n <= 1:
            start += n
            continue
        total = ctx + n
        pos = torch.arange(total, device=q.device)
        slots = block_table[i, pos // page_size].long() * page_size + pos % page_size
        k = k_cache[slots].transpose(0, 1)  # [Hkv, total, D]
        v = v_cache[slots].transpose(0, 1)
        qi = q[start : start + n].transpose(0, 1)  # [Hq, n, D]
        # query j (position ctx + j) sees keys 0..ctx + j
        mask = torch.arange(total, device=q.device)[None, :] <= (ctx + torch.arange(n, device=q.device))[:, None]
        o = F.scaled_dot_product_attention(
            qi.float(), k.float(), v.float(), attn_mask=mask, scale=scale, enable_gqa=hq != hkv
        )
        out[start : start + n] = o.transpose(0, 1).to(q.dtype)
        start += n
    return out


def _decode(
    q: torch.Tensor,  # [B, Hq, D] one new token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [B, max_pages]
    totals: torch.Tensor,  # [B] tokens to attend to (cached + the new one)
    page_size: int,
    scale: float,
) -> torch.Tensor:
    """All single-token sequences at once: gather each one's keys padded to the longest."""
    pos = torch.arange(int(totals.max()), device=q.device)
    slots = block_table[:, pos // page_size].long() * page_size + pos % page_size  # [B, L]
    valid = pos[None, :] < totals[:, None]  # [B, L]
    # Padding rows point at arbitrary pages: zero them so nothing read there (even NaN left by a
    # faulting neighbour in this step) can reach the output through 0 * NaN.
    keep = valid[:, :, None, None]
    k = torch.where(keep, k_cache[slots], 0).float().transpose(1, 2)  # [B, Hkv, L, D]
    v = torch.where(keep, v_cache[slots], 0).float().transpose(1, 2)
    o = F.scaled_dot_product_attention(
        q[:, :, None].float(), k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return o[:, :, 0].to(q.dtype)

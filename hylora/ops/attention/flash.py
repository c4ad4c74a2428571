"""Causal prefill attention over the paged KV cache through torch's fused SDPA kernels (CUDA).

Same signature and result as `reference.paged_attention`, which computes in fp32 with an explicit
mask (the math kernel: quadratic memory, no tensor cores). Here each sequence's keys and values are
gathered from its pages in the cache's dtype and attended with a lower-right causal mask, which
torch's FlashAttention / memory-efficient kernels take natively (the new tokens are the last
`n` of the `ctx + n` keys), fp32 accumulation inside. Decode rows (one new token) go through the
reference's batched path. Used only after the start-up check (`ops.kernel_check`) passes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from hylora.ops.attention.reference import _decode
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
        totals = torch.tensor([context_lens[i] + 1 for i in single], device=q.device)
        out[rows] = _decode(q[rows], k_cache, v_cache, block_table[single], totals, page_size, scale)
    for i, (ctx, n) in enumerate(zip(context_lens, seq_lens, strict=True)):
        if n <= 1:
            continue
        total = ctx + n
        pos = torch.arange(total, device=q.device)
        slots = block_table[i, pos // page_size].long() * page_size + pos % page_size
        k = k_cache[slots].transpose(0, 1).repeat_interleave(hq // hkv, dim=0)  # [Hq, total, D]
        v = v_cache[slots].transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        qi = q[starts[i] : starts[i + 1]].transpose(0, 1).to(k.dtype)  # [Hq, n, D]
        mask = causal_lower_right(n, total)  # query j (position ctx + j) sees keys 0..ctx + j
        o = F.scaled_dot_product_attention(qi[None], k[None], v[None], attn_mask=mask, scale=scale)
        out[starts[i] : starts[i + 1]] = o[0].transpose(0, 1).to(q.dtype)
    return out

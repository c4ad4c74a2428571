"""Causal prefill attention over the paged KV cache through FlashAttention's varlen kernel (CUDA).

Same signature and result as `reference.paged_attention`, which computes in fp32 with an explicit
mask, one sequence at a time (the math kernel: quadratic memory, no tensor cores, ~15 launches per
sequence). Here every sequence of the step goes at once: its keys and values (cached prefix and new
tokens) are gathered from the pages in one index op, and one varlen FlashAttention call attends all
of them, causal aligned bottom-right (a chunk's new tokens are the last n of its ctx + n keys),
grouped KV heads native, fp32 accumulation inside. Decode rows in a mixed step are sequences of one
query. The CPU (tests) runs the same gather and a per-sequence SDPA in its place. Used only after the
start-up check (`ops.kernel_check`) passes.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from hylora.ops.host_to_device import host_to_device
from hylora.ops.varlen import seq_starts


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
    cu_q, cu_k, key_seq, key_pos, max_q, max_k = _meta(tuple(context_lens), tuple(seq_lens), q.device)
    slots = block_table[key_seq, key_pos // page_size].long() * page_size + key_pos % page_size
    k, v = k_cache[slots], v_cache[slots]  # [sum(ctx + n), Hkv, D]
    qk = q.to(k.dtype)
    if q.is_cuda:
        out = torch.ops.aten._flash_attention_forward(qk, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)
        return out[0].to(q.dtype)
    return _per_sequence(qk, k, v, cu_q.tolist(), cu_k.tolist(), scale).to(q.dtype)


def _per_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int], scale: float
) -> torch.Tensor:
    """The varlen call's CPU twin: q [Tq, Hq, D], k/v [Tk, Hkv, D] packed by cu_q / cu_k."""
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        n, total = rows.stop - rows.start, keys.stop - keys.start
        # query j (position ctx + j) sees keys 0..ctx + j
        mask = torch.arange(total)[None, :] <= (total - n + torch.arange(n))[:, None]
        heads_first = [t.transpose(0, 1)[None] for t in (q[rows], k[keys], v[keys])]  # [1, H, len, D]
        o = F.scaled_dot_product_attention(*heads_first, attn_mask=mask.to(q.device), scale=scale, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    return out


@functools.lru_cache(maxsize=1)  # every attention layer of a step asks with the same lengths
def _meta(context_lens: tuple[int, ...], seq_lens: tuple[int, ...], device: torch.device) -> tuple:
    """(cu_seqlens_q, cu_seqlens_k int32 [N + 1], sequence and position of every key [Tk], max query
    and key lengths)."""
    totals = [c + n for c, n in zip(context_lens, seq_lens, strict=True)]
    cu_k = seq_starts(totals)
    # numpy, not torch: torch's CPU ops wake its thread pool (~2 ms a call on a busy host)
    key_seq = np.repeat(np.arange(len(totals)), totals)
    key_pos = np.arange(cu_k[-1]) - np.asarray(cu_k[:-1])[key_seq]
    return (
        host_to_device(np.asarray(seq_starts(list(seq_lens)), dtype=np.int32), device),
        host_to_device(np.asarray(cu_k, dtype=np.int32), device),
        host_to_device(key_seq, device),
        host_to_device(key_pos, device),
        max(seq_lens),
        max(totals),
    )

"""Decode attention over the paged KV cache in plain torch: one query token per sequence.

Sequence n attends to its first `seq_lens[n]` cached tokens (the new token included, already
written to the cache); token t of it lives in cache row `block_table[n, t // page_size] * page_size
+ t % page_size`. Query head h reads KV head h // (H / Hkv). fp32 softmax and accumulation.

Padding rows: `seq_lens[n] == 0`. Such a row reads nothing (its block-table row may point
anywhere, e.g. at a null page) and its output is zeros, never NaN. Block-table entries past a
sequence's length are never read. For rows with `seq_lens >= 1` this equals the decode rows of
`ops.paged_attention` (tests prove it).
"""

from __future__ import annotations

import torch


def paged_decode_attention(
    q: torch.Tensor,  # [N, H, D] (rotary applied)
    k_cache: torch.Tensor,  # [num_pages * page_size, Hkv, D] one layer
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [N, max_pages] int
    seq_lens: torch.Tensor,  # [N] int: tokens to attend to, the new one included; 0 = padding row
    page_size: int,
    scale: float,
    max_seq_len: int | None = None,  # accepted for the Triton kernel's signature; not needed here
    out: torch.Tensor | None = None,  # [N, H, D] to write into
) -> torch.Tensor:
    """Returns o [N, H, D] in q's dtype."""
    N, H, D = q.shape
    longest = int(seq_lens.max()) if N else 0
    if out is None:
        out = torch.empty_like(q)
    if longest == 0:
        return out.zero_()
    pos = torch.arange(longest, device=q.device)
    valid = pos[None, :] < seq_lens[:, None].to(q.device)  # [N, L]
    rows = block_table[:, pos // page_size].long() * page_size + pos % page_size
    rows = torch.where(valid, rows, 0)  # never index through entries past the length
    keep = valid[:, :, None, None]
    k = torch.where(keep, k_cache[rows], 0).float()  # [N, L, Hkv, D]
    v = torch.where(keep, v_cache[rows], 0).float()
    hkv = k_cache.shape[1]
    qg = q.float().reshape(N, hkv, H // hkv, D)  # query head h reads KV head h // (H / Hkv)
    scores = torch.einsum("nkgd,nlkd->nkgl", qg, k) * scale
    probs = torch.softmax(scores.masked_fill(~valid[:, None, None, :], float("-inf")), dim=-1)
    o = torch.einsum("nkgl,nlkd->nkgd", probs, v).reshape(N, H, D)
    return out.copy_(torch.where((seq_lens > 0).to(q.device)[:, None, None], o, 0))

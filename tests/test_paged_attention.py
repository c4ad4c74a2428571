"""Paged attention equals dense causal attention; unowned pages (even NaN ones) are never read."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hylora.ops.attention.reference import paged_attention


@pytest.mark.parametrize("page_size", [1, 7, 16])
def test_paged_equals_dense_with_nan_in_foreign_pages(page_size):
    g = torch.Generator().manual_seed(page_size)
    hq, hkv, D = 4, 2, 8
    contexts, news = [0, 5, 17, 40, 0, 3], [1, 1, 1, 9, 33, 1]  # decode, continued and fresh prefill
    totals = [c + n for c, n in zip(contexts, news, strict=True)]
    pages_per = [-(-t // page_size) for t in totals]
    num_pages = sum(pages_per) + 5
    order = torch.randperm(num_pages, generator=g).tolist()
    foreign = order[: num_pages - sum(pages_per)]  # pages no sequence owns: fill with NaN
    k_cache = torch.randn(num_pages * page_size, hkv, D, generator=g)
    v_cache = torch.randn(num_pages * page_size, hkv, D, generator=g)
    for p in foreign:
        k_cache[p * page_size : (p + 1) * page_size] = float("nan")
        v_cache[p * page_size : (p + 1) * page_size] = float("nan")
    owned = order[len(foreign) :]
    table = torch.zeros(len(totals), max(pages_per), dtype=torch.int32)
    table[:] = foreign[0]  # padding entries point at a NaN page
    keys, values = [], []
    for i, n in enumerate(pages_per):
        pages = [owned.pop() for _ in range(n)]
        table[i, :n] = torch.tensor(pages)
        rows = torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages])[: totals[i]]
        keys.append(k_cache[rows])
        values.append(v_cache[rows])
    q = torch.randn(sum(news), hq, D, generator=g)
    out = paged_attention(q, k_cache, v_cache, table, contexts, news, page_size, D**-0.5)
    assert torch.isfinite(out).all()
    start = 0
    for i, (c, n) in enumerate(zip(contexts, news, strict=True)):
        k = keys[i].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        v = values[i].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        mask = torch.arange(c + n)[None, :] <= (c + torch.arange(n))[:, None]
        ref = F.scaled_dot_product_attention(q[start : start + n].transpose(0, 1), k, v, attn_mask=mask)
        torch.testing.assert_close(out[start : start + n], ref.transpose(0, 1), atol=1e-5, rtol=1e-5)
        start += n

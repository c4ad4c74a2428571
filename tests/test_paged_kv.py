"""The KV cache hands out pages zeroed, whatever a previous owner (or a fault) left in them."""

from __future__ import annotations

import pytest
import torch

from hylora.cache.paged_kv import PagedKVCache
from hylora.config import ModelConfig


@pytest.mark.parametrize("pages", [[3], [0, 6], [1, 4, 5, 7]], ids=["one", "two", "four"])
def test_scrub_zeroes_exactly_the_pages_rows_in_every_layer(causal_ckpt, pages):
    """Both ways of scrubbing (slice fills for a page or two, one index fill for more): the pages' rows
    become 0 in K and V of every attention layer, and no other row changes (NaN elsewhere stays)."""
    ps = 4
    kv = PagedKVCache(
        ModelConfig.from_dir(causal_ckpt[0]), num_pages=8, page_size=ps, dtype=torch.float32, device="cpu"
    )
    assert kv.k.shape[0] >= 1
    for cache in (kv.k, kv.v):
        cache.fill_(float("nan"))
    kv.scrub(pages)
    rows = torch.zeros(kv.k.shape[1], dtype=torch.bool)
    for p in pages:
        rows[p * ps : (p + 1) * ps] = True
    for cache in (kv.k, kv.v):
        assert (cache[:, rows] == 0).all()
        assert torch.isnan(cache[:, ~rows]).all()


def test_allocated_pages_come_zeroed(causal_ckpt):
    kv = PagedKVCache(ModelConfig.from_dir(causal_ckpt[0]), num_pages=6, page_size=4, dtype=torch.float32, device="cpu")
    for n in (1, 2, 3):  # a decode step's page, and a prompt's several
        kv.k.fill_(float("inf"))
        kv.v.fill_(float("nan"))
        pages = kv.allocate(n)
        for p in pages:
            assert (kv.k[:, p * 4 : (p + 1) * 4] == 0).all() and (kv.v[:, p * 4 : (p + 1) * 4] == 0).all()
        kv.free(pages)

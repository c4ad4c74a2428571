"""Paged KV cache for the full-attention layers."""

from __future__ import annotations

import torch

from hylora.cache.allocator import IndexAllocator
from hylora.config import ModelConfig


class OutOfPages(RuntimeError):
    pass


class PagedKVCache:
    """k/v [L_attn, (num_pages + 1) * page_size, Hkv, D]. A page handed out is zeroed first.

    Page `null_page` (the extra last one) is never handed out: padding rows of a decode batch
    padded to a CUDA-graph bucket write their K/V there, so they never touch a live sequence's
    page, and nothing ever reads it (a padding row attends to 0 tokens).
    """

    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        n_layers = len(config.attention_layers)
        self.layer_index = {layer: i for i, layer in enumerate(config.attention_layers)}
        shape = (n_layers, (num_pages + 1) * page_size, config.num_key_value_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_pages = num_pages
        self.page_size = page_size
        self.null_page = num_pages  # write-only sink for padding rows; no sequence owns it
        self._pages = IndexAllocator(num_pages, "page")

    @property
    def num_free(self) -> int:
        return self._pages.num_free

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfPages(f"need {n} KV pages, {self.num_free} of {self.num_pages} free")
        pages = self._pages.take(n)
        self.scrub(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        self._pages.give_back(pages)

    def scrub(self, pages: list[int]) -> None:
        """Zero the K/V rows of `pages` in every layer (one fill per tensor, not one per page)."""
        if not pages:
            return
        index = torch.tensor(pages, dtype=torch.long).to(self.k.device, non_blocking=True)
        for cache in (self.k, self.v):
            layers, _, heads, dim = cache.shape
            cache.view(layers, -1, self.page_size, heads, dim).index_fill_(1, index, 0)

    def bytes_per_page(self) -> int:
        return 2 * self.k[:, : self.page_size].numel() * self.k.element_size()

"""Paged KV cache for the full-attention layers."""

from __future__ import annotations

import torch

from hylora.config import ModelConfig


class OutOfPages(RuntimeError):
    pass


class PagedKVCache:
    """k/v [L_attn, num_pages * page_size, Hkv, D]. A page handed out is zeroed first."""

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
        shape = (n_layers, num_pages * page_size, config.num_key_value_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} KV pages, {len(self._free)} of {self.num_pages} free")
        pages = [self._free.pop() for _ in range(n)]
        self._allocated.update(pages)
        self.scrub(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._allocated:
                raise ValueError(f"page {p} is not allocated")
        self._allocated.difference_update(pages)
        self._free.extend(pages)

    def scrub(self, pages: list[int]) -> None:
        """Zero the K/V rows of `pages` in every layer."""
        for p in pages:
            sl = slice(p * self.page_size, (p + 1) * self.page_size)
            self.k[:, sl].zero_()
            self.v[:, sl].zero_()

    def bytes_per_page(self) -> int:
        return 2 * self.k[:, : self.page_size].numel() * self.k.element_size()

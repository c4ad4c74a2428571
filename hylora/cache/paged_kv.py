"""Paged KV cache for the full-attention layers."""

from __future__ import annotations

import torch

from hylora.cache.allocator import IndexAllocator
from hylora.config import ModelConfig
from hylora.ops.host_to_device import host_to_device


class OutOfPages(RuntimeError):
    pass


class PagedKVCache:
    """k/v [L_attn, (num_pages + 1) * page_size, Hkv, D]. A page handed out is zeroed first.

    Page `null_page` (the extra last one) is never handed out: padding rows of a decode batch
    padded to a CUDA-graph bucket write their K/V there, so they never touch a live sequence's
    page, and nothing ever reads it (a padding row attends to 0 tokens).

    Pages are reference-counted: `allocate` hands a page out with one reference, `retain` adds one
    (a prefix-cache entry, or a request reusing a cached prefix), `free` drops one, and the page is
    free again when none is left.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        layers: list[int] | None = None,
    ):
        """`layers`: the layer ids with a KV cache (HybridDecoder.kv_layers: the attention layers and
        any MTP layer); None: the config's attention layers."""
        layers = config.attention_layers if layers is None else layers
        n_layers = len(layers)
        self.layer_index = {layer: i for i, layer in enumerate(layers)}
        shape = (n_layers, (num_pages + 1) * page_size, config.num_key_value_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_pages = num_pages
        self.page_size = page_size
        self.null_page = num_pages  # write-only sink for padding rows; no sequence owns it
        self._pages = IndexAllocator(num_pages, "page")
        self._refs: dict[int, int] = {}  # allocated page → references

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
        for p in pages:
            self._refs[p] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._refs:
                raise ValueError(f"page {p} is not allocated")
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; a page nobody references any more is free."""
        released = []
        for p in pages:
            refs = self._refs.get(p)
            if refs is None:
                raise ValueError(f"page {p} is not allocated")
            if refs == 1:
                del self._refs[p]
                released.append(p)
            else:
                self._refs[p] = refs - 1
        self._pages.give_back(released)

    release = free

    def references(self, page: int) -> int:
        return self._refs.get(page, 0)

    def shared(self, page: int) -> bool:
        """Someone else references the page too (a cached prefix): it must not be written or scrubbed."""
        return self._refs.get(page, 0) > 1

    def copy_page(self, src: int, dst: int, rows: int) -> None:
        """The first `rows` token rows of page `src` into page `dst`, in every layer."""
        ps = self.page_size
        for cache in (self.k, self.v):
            cache[:, dst * ps : dst * ps + rows] = cache[:, src * ps : src * ps + rows]

    def scrub(self, pages: list[int]) -> None:
        """Zero the K/V rows of `pages` in every layer: a page or two (a decode step's new page) by a
        fill of its slice, more by one index fill per tensor. The index fill costs a host-to-device
        copy and several launches (H200, run 34's decode profile: 24 index fills, 96 kernels)."""
        if not pages or self.k.shape[0] == 0:  # no attention layer (a model cut to its first GDN layers)
            return
        ps = self.page_size
        if len(pages) <= 2:
            for p in pages:
                self.k[:, p * ps : (p + 1) * ps].zero_()
                self.v[:, p * ps : (p + 1) * ps].zero_()
            return
        index = host_to_device(torch.tensor(pages, dtype=torch.long), self.k.device)
        for cache in (self.k, self.v):
            layers, _, heads, dim = cache.shape
            cache.view(layers, -1, self.page_size, heads, dim).index_fill_(1, index, 0)

    def bytes_per_page(self) -> int:
        return 2 * self.k[:, : self.page_size].numel() * self.k.element_size()

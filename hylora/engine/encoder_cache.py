"""Vision-tower outputs by content: the same video sent to `relic`, `tomb` and `mural` is encoded
once. Keyed by (media content hash incl. preprocessing parameters, temporal patch, tower adapter),
least recently used first out, bounded in bytes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import torch


class EncoderCache:
    def __init__(self, capacity_bytes: int):
        self.capacity = max(0, int(capacity_bytes))
        self._entries: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def get(self, key: Hashable) -> torch.Tensor | None:
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return value

    def put(self, key: Hashable, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if size > self.capacity:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.numel() * old.element_size()
        self._entries[key] = value
        self.bytes += size
        while self.bytes > self.capacity:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.numel() * evicted.element_size()

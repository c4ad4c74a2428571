"""Index allocation shared by the KV page pool and the GDN state-slot pool."""

from __future__ import annotations


class IndexAllocator:
    """Hands out indices 0..n-1; the most recently freed index is reused first."""

    def __init__(self, n: int, what: str):
        self.n, self.what = n, what
        self._free = list(range(n - 1, -1, -1))
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int]:
        assert count <= len(self._free), "callers check num_free first"
        taken = [self._free.pop() for _ in range(count)]
        self._allocated.update(taken)
        return taken

    def give_back(self, indices: list[int]) -> None:
        for i in indices:
            if i not in self._allocated:
                raise ValueError(f"{self.what} {i} is not allocated")
        self._allocated.difference_update(indices)
        self._free.extend(indices)

"""Small device tensors on their way to the host without a wait.

The copies are queued behind whatever the stream holds (the model's step, the sampler) into
page-locked memory, and `values()` waits for them only when read, so the host can queue more work
(the next decode step) before it needs the numbers. On the CPU the values are taken at once.
"""

from __future__ import annotations

import torch


class HostCopy:
    def __init__(self, *tensors: torch.Tensor) -> None:
        self._ready: torch.cuda.Event | None = None
        if tensors and tensors[0].is_cuda:
            # page-locked blocks from torch's caching host allocator: a block is reused only after
            # this object is gone and its copy has completed, so no later step overwrites them
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(self._host, tensors, strict=True):
                h.copy_(t.contiguous(), non_blocking=True)  # contiguous both ends: one async copy
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = [t.cpu() for t in tensors]
        self._values: list[list] | None = None

    def values(self) -> list[list]:
        """Each tensor as (nested) Python lists, in the order given; waits for the copies once."""
        if self._values is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._values = [h.tolist() for h in self._host]
        return self._values

"""LoRA for a batch whose adapter slots live only on the device (a CUDA graph's input buffer).

The host does not know which adapters a captured decode step will serve, so nothing may be decided
from them: every slice of every linear runs for every slot, with the per-token grouping built on the
device. That is exact, not approximate: a free slot and an absent slice hold zeros (the registry
zeroes them), base and padding rows (slot -1) get no program, and y + 0 == y bit for bit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from hylora.lora.apply import LoRABatch, LoRAStack


@dataclass
class DeviceLoRABatch(LoRABatch):
    """`token_slots` [T] on the device (-1 = base / padding row); no host-side groups."""

    groups: list = field(default_factory=list)

    @property
    def has_adapters(self) -> bool:
        return True  # unknown on the host: apply, and let slot -1 rows stay unchanged

    def apply(self, x: torch.Tensor, y: torch.Tensor, stack: LoRAStack, backend: str | None) -> torch.Tensor:
        """y[:, slice] += each token's adapter delta on every slice. `backend` as `lora_apply` takes it
        (HYLORA_LORA_BACKEND overrides): "triton" runs hylora's shrink/expand kernels; anything else
        runs the masked two-GEMM form (the grouped reference has no graph-safe form)."""
        chosen = os.environ.get("HYLORA_LORA_BACKEND", "auto")
        if chosen == "auto":
            chosen = backend or "masked"
        num_slots = stack.a[0].shape[0]
        if chosen == "triton":
            from hylora.ops.lora.triton import LoRAKernelMeta, lora_expand, lora_shrink

            meta = self.memo(("triton", num_slots), lambda: LoRAKernelMeta.build(self.token_slots, num_slots))
            return lora_expand(lora_shrink(x, stack.a, meta), stack.b, stack.offsets, y, meta)
        xf = x.float()
        for a, b, (start, n) in zip(stack.a, stack.b, stack.offsets, strict=True):
            rank = a.shape[1]
            h = (xf @ a.reshape(num_slots * rank, -1).float().T) * self._rank_mask(num_slots, rank)  # [T, L*r]
            delta = h @ b.reshape(num_slots * rank, -1).float()
            y[:, start : start + n] = (y[:, start : start + n].float() + delta).to(y.dtype)
        return y

    def _rank_mask(self, num_slots: int, rank: int) -> torch.Tensor:
        """[T, num_slots * rank] fp32: 1 on the rank block of the token's own slot (none for -1)."""

        def build() -> torch.Tensor:
            slots = torch.arange(num_slots, device=self.token_slots.device)
            onehot = (self.token_slots[:, None] == slots[None, :]).float()  # [T, L]
            return onehot[:, :, None].expand(-1, -1, rank).reshape(len(onehot), num_slots * rank)

        return self.memo(("device_rank_mask", num_slots, rank), build)

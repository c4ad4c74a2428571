"""LoRA for a batch whose adapter slots live only on the device (a CUDA graph's input buffer).

The host does not know which adapters a captured decode step will serve, so nothing may be decided
from them: every slice of every linear runs for every slot, with the per-token grouping built on the
device. That is exact, not approximate: a free slot and an absent slice hold zeros (the registry
zeroes them), base and padding rows (slot -1) get no program, and y + 0 == y bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hylora.lora.apply import LoRABatch, resolve_backend, triton_meta

if TYPE_CHECKING:
    from hylora.model.layers import Linear


@dataclass
class DeviceLoRABatch(LoRABatch):
    """`token_slots` [T] on the device (-1 = base / padding row); no host-side groups."""

    groups: list = field(default_factory=list)

    @property
    def has_adapters(self) -> bool:
        return True  # unknown on the host: apply, and let slot -1 rows stay unchanged

    def forward(self, x: torch.Tensor, linear: Linear) -> torch.Tensor:
        """linear(x) + each token's adapter delta on every slice. The backend is the one the start-up
        kernel check installed on the linear (HYLORA_LORA_BACKEND overrides): "triton" runs hylora's
        kernels, with the shrink inside the base GEMM when the weight is stacked with the A matrices
        (`Linear.stack_lora_a`); anything else runs the masked two-GEMM form (the grouped reference has
        no graph-safe form)."""
        stack = linear.lora
        num_slots = stack.a[0].shape[0]
        if resolve_backend(x, linear.lora_backend) == "triton":
            from hylora.ops.lora.triton import lora_apply_stacked, lora_expand, lora_shrink

            meta = triton_meta(self, stack)
            if linear.stacked_weight is not None:
                return lora_apply_stacked(x, linear.stacked_weight, linear.out_features, stack, meta)
            y = F.linear(x, linear.weight)
            return lora_expand(lora_shrink(x, stack.a, meta), stack.b, stack.offsets, y, meta)
        y = F.linear(x, linear.weight)
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

"""Per-sequence state of the Gated DeltaNet layers: one slot-indexed pool for all GDN layers."""

from __future__ import annotations

import torch

from hylora.cache.allocator import IndexAllocator
from hylora.config import ModelConfig


class OutOfSlots(RuntimeError):
    pass


class StatePool:
    """conv state [L, S, conv_dim, K-1] (model dtype) and recurrent state [L, S, Hv, dk, dv] (fp32).

    A slot handed out by `allocate` is zeroed first: a sequence never reads another's state.
    """

    def __init__(self, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str):
        n_layers = len(config.gdn_layers)
        self.layer_index = {layer: i for i, layer in enumerate(config.gdn_layers)}
        self.conv = torch.zeros(
            n_layers,
            num_slots,
            config.linear_conv_dim,
            config.linear_conv_kernel_dim - 1,
            dtype=dtype,
            device=device,
        )
        self.recurrent = torch.zeros(
            n_layers,
            num_slots,
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
            dtype=torch.float32,
            device=device,
        )
        self.num_slots = num_slots
        self._slots = IndexAllocator(num_slots, "slot")

    @property
    def num_free(self) -> int:
        return self._slots.num_free

    def allocate(self) -> int:
        if not self.num_free:
            raise OutOfSlots(f"all {self.num_slots} GDN state slots are in use")
        (slot,) = self._slots.take(1)
        self.reset(slot)
        return slot

    def free(self, slot: int) -> None:
        self._slots.give_back([slot])

    def copy_to(self, other: StatePool, slot: int, other_slot: int) -> None:
        """Slot `slot`'s conv and recurrent state, every layer, into `other_slot` of `other` (a
        device copy queued in stream order)."""
        other.conv[:, other_slot].copy_(self.conv[:, slot])
        other.recurrent[:, other_slot].copy_(self.recurrent[:, slot])

    def reset(self, slot: int) -> None:
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()

    def bytes_per_slot(self) -> int:
        return (
            self.conv[:, 0].numel() * self.conv.element_size()
            + self.recurrent[:, 0].numel() * self.recurrent.element_size()
        )

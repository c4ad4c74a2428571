"""The LoRA data every floor shares: each linear's slot tensors and each step's per-token slots.

Each LoRA-capable linear owns a `LoRAStack`: per output slice, A [max_loras, r_max, in] and
B [max_loras, r_max, rows] (scaling folded into B, zero-padded to r_max). A step carries the
device slot of every token (-1 = base) as a `LoRABatch`; a CUDA graph's decode step, whose slots
live only on the device, carries a `DeviceLoRABatch`. The arithmetic is in `hylora.ops.lora`; the
choice of kernel is the layer's (`hylora.model.layers.lora_forward`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hylora.ops.host_to_device import host_to_device


@dataclass
class LoRAStack:
    a: list[torch.Tensor]  # per slice [max_loras, r_max, in]
    b: list[torch.Tensor]  # per slice [max_loras, r_max, rows], scale folded in
    offsets: list[tuple[int, int]]  # per slice (first output row, rows)
    # present[slot][i]: the adapter in `slot` has LoRA on slice i; absent slices are skipped, so
    # they contribute exactly zero.
    present: list[list[bool]] = field(default_factory=list)

    @property
    def num_slots(self) -> int:
        return self.a[0].shape[0]

    def clear_slot(self, slot: int) -> None:
        for a, b in zip(self.a, self.b, strict=True):
            a[slot].zero_()
            b[slot].zero_()
        self.present[slot] = [False] * len(self.a)

    def pick(self, slices: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[int, int]]]:
        """(A, B, offsets) of the given slices, as the LoRA ops take them."""
        return [self.a[i] for i in slices], [self.b[i] for i in slices], [self.offsets[i] for i in slices]

    def slices_used_by(self, slots: Iterable[int]) -> list[int]:
        """The slices that at least one of `slots` targets (the others add exactly zero)."""
        slots = list(slots)
        return [i for i in range(len(self.a)) if any(self.present[slot][i] for slot in slots)]


@dataclass
class LoRABatch:
    token_slots: torch.Tensor  # [T] device slot of each token, -1 = base model
    # (slot, rows of the flat batch using it): a slice when the rows are contiguous
    groups: list[tuple[int, slice | torch.Tensor]]
    _memo: dict[Hashable, Any] = field(default_factory=dict)

    def memo(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """Per-step metadata shared by every linear of the forward (built once)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    @property
    def has_adapters(self) -> bool:
        return bool(self.groups)

    @property
    def slots(self) -> list[int]:
        """The adapter slots of this step (known on the host)."""
        return [slot for slot, _ in self.groups]

    @classmethod
    def build(cls, seq_slots: list[int], seq_lens: list[int], device: torch.device | str) -> LoRABatch:
        # numpy on the host (a torch CPU op costs several times more), copies queued behind the device
        per_token = np.repeat(np.asarray(seq_slots, dtype=np.int64), seq_lens)
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot in sorted(set(seq_slots) - {-1}):
            rows = np.flatnonzero(per_token == slot)
            if rows.size == 0:
                continue
            first, last = int(rows[0]), int(rows[-1])
            if last - first + 1 == rows.size:
                groups.append((slot, slice(first, last + 1)))
            else:
                groups.append((slot, host_to_device(rows.astype(np.int64), device)))
        return cls(token_slots=host_to_device(per_token, device), groups=groups)


@dataclass
class DeviceLoRABatch(LoRABatch):
    """`token_slots` [T] on the device (-1 = base / padding row); no host-side groups.

    The host does not know which adapters a captured decode step will serve, so nothing may be
    decided from them: every slice of every linear runs for every slot. That is exact: a free slot
    and an absent slice hold zeros (the registry zeroes them), base and padding rows (slot -1) get
    nothing added, and y + 0 == y bit for bit."""

    groups: list = field(default_factory=list)

    @property
    def has_adapters(self) -> bool:
        return True  # unknown on the host: apply, and let slot -1 rows stay unchanged

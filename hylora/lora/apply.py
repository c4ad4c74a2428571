"""Batched LoRA application: several adapters (and base rows) in one flat batch.

Each LoRA-capable linear owns a `LoRAStack`: per output slice, A [max_loras, r_max, in] and
B [max_loras, rows, r_max] (scaling folded into B, zero-padded to r_max). A batch carries the
device slot of every token (-1 = base). `lora_apply` is the plain-torch reference (the "shrink"
x·Aᵀ then "expand" ·Bᵀ per adapter group); a Triton kernel implements the same signature.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRAStack:
    a: list[torch.Tensor]  # per slice [max_loras, r_max, in]
    b: list[torch.Tensor]  # per slice [max_loras, rows, r_max], scale folded in
    offsets: list[tuple[int, int]]  # per slice (first output row, rows)
    # present[slot][i]: the adapter in `slot` has LoRA on slice i; absent slices are skipped, so
    # they contribute exactly zero.
    present: list[list[bool]] = field(default_factory=list)

    def clear_slot(self, slot: int) -> None:
        for a, b in zip(self.a, self.b, strict=True):
            a[slot].zero_()
            b[slot].zero_()
        self.present[slot] = [False] * len(self.a)


@dataclass
class LoRABatch:
    token_slots: torch.Tensor  # [T] device slot of each token, -1 = base model
    # (slot, rows of the flat batch using it): a slice when the rows are contiguous
    groups: list[tuple[int, slice | torch.Tensor]]

    @property
    def has_adapters(self) -> bool:
        return bool(self.groups)

    @classmethod
    def build(cls, seq_slots: list[int], seq_lens: list[int], device: torch.device | str) -> LoRABatch:
        per_token = torch.repeat_interleave(torch.tensor(seq_slots), torch.tensor(seq_lens))
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot in sorted(set(seq_slots) - {-1}):
            rows = torch.nonzero(per_token == slot).flatten()
            first, last = int(rows[0]), int(rows[-1])
            if last - first + 1 == rows.numel():
                groups.append((slot, slice(first, last + 1)))
            else:
                groups.append((slot, rows.to(device)))
        return cls(token_slots=per_token.to(device), groups=groups)


def lora_apply(x: torch.Tensor, y: torch.Tensor, stack: LoRAStack, batch: LoRABatch) -> torch.Tensor:
    """y[rows, slice] += (x[rows] A_slot^T) B_slot^T for every adapter group; fp32 accumulation."""
    for slot, rows in batch.groups:
        xs = x[rows].float()
        for i, (start, n) in enumerate(stack.offsets):
            if not stack.present[slot][i]:
                continue
            delta = (xs @ stack.a[i][slot].float().T) @ stack.b[i][slot].float().T
            y[rows, start : start + n] = (y[rows, start : start + n].float() + delta).to(y.dtype)
    return y

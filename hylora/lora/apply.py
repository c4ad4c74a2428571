"""Batched LoRA application: several adapters (and base rows) in one flat batch.

Each LoRA-capable linear owns a `LoRAStack`: per output slice, A [max_loras, r_max, in] and
B [max_loras, r_max, rows] (scaling folded into B, zero-padded to r_max). A batch carries the
device slot of every token (-1 = base). Two implementations of one signature:

- `lora_apply_grouped` (the reference): per adapter group, the "shrink" x·Aᵀ then "expand" ·B.
- `lora_apply_masked` (used on CUDA): one shrink against every slot's A at once, a one-hot mask
  that keeps each token's own slot (zero for base tokens), one expand against every slot's B — two
  GEMMs per slice whatever the number of adapters in the batch, instead of two per adapter.
  Masked-off blocks are exact zeros, so base rows and absent slices are unchanged bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class LoRAStack:
    a: list[torch.Tensor]  # per slice [max_loras, r_max, in]
    b: list[torch.Tensor]  # per slice [max_loras, r_max, rows], scale folded in
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
    _memo: dict[Hashable, Any] = field(default_factory=dict)

    def memo(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """Per-step metadata shared by every linear of the forward (built once)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def rank_mask(self, num_slots: int, rank: int) -> torch.Tensor:
        """[T, num_slots * rank] fp32: 1 on the rank block of the token's own slot, 0 elsewhere."""

        def build() -> torch.Tensor:
            slots = torch.arange(num_slots, device=self.token_slots.device)
            onehot = (self.token_slots[:, None] == slots[None, :]).float()  # [T, L]
            return onehot.repeat_interleave(rank, dim=1)

        return self.memo(("rank_mask", num_slots, rank), build)

    @property
    def has_adapters(self) -> bool:
        return bool(self.groups)

    @classmethod
    def build(cls, seq_slots: list[int], seq_lens: list[int], device: torch.device | str) -> LoRABatch:
        per_token = torch.repeat_interleave(torch.tensor(seq_slots), torch.tensor(seq_lens))
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot in sorted(set(seq_slots) - {-1}):
            rows = torch.nonzero(per_token == slot).flatten()
            if rows.numel() == 0:
                continue
            first, last = int(rows[0]), int(rows[-1])
            if last - first + 1 == rows.numel():
                groups.append((slot, slice(first, last + 1)))
            else:
                groups.append((slot, rows.to(device)))
        return cls(token_slots=per_token.to(device), groups=groups)


def lora_apply(
    x: torch.Tensor, y: torch.Tensor, stack: LoRAStack, batch: LoRABatch, backend: str | None = None
) -> torch.Tensor:
    """y[:, slice] += the LoRA delta of each token's adapter, for every slice of this linear.

    `backend` is what the start-up kernel check installed on the linear ("triton" when hylora's LoRA
    kernels passed); HYLORA_LORA_BACKEND=grouped|masked|triton overrides it. Default: masked on
    CUDA, grouped on CPU."""
    chosen = resolve_backend(x, backend)
    if chosen == "triton":
        from hylora.ops.lora.triton import lora_apply as triton_apply

        return triton_apply(x, y, stack, batch, meta=triton_meta(batch, stack))
    if chosen == "masked":
        return lora_apply_masked(x, y, stack, batch)
    return lora_apply_grouped(x, y, stack, batch)


def resolve_backend(x: torch.Tensor, backend: str | None) -> str:
    """HYLORA_LORA_BACKEND if set, else what the start-up check installed, else masked on CUDA and
    grouped on the CPU."""
    chosen = os.environ.get("HYLORA_LORA_BACKEND", "auto")
    if chosen == "auto":
        chosen = backend or ("masked" if x.is_cuda else "grouped")
    return chosen


def triton_meta(batch: LoRABatch, stack: LoRAStack):  # -> hylora.ops.lora.triton.LoRAKernelMeta
    """The Triton kernels' token grouping of this batch, built once per step."""
    from hylora.ops.lora.triton import LoRAKernelMeta

    num_slots = stack.a[0].shape[0]
    return batch.memo(("triton", num_slots), lambda: LoRAKernelMeta.build(batch.token_slots, num_slots))


def lora_apply_grouped(x: torch.Tensor, y: torch.Tensor, stack: LoRAStack, batch: LoRABatch) -> torch.Tensor:
    """Reference: y[rows, slice] += (x[rows] A_slot^T) B_slot for every adapter group; fp32."""
    for slot, rows in batch.groups:
        xs = x[rows].float()
        for i, (start, n) in enumerate(stack.offsets):
            if not stack.present[slot][i]:
                continue
            delta = (xs @ stack.a[i][slot].float().T) @ stack.b[i][slot].float()
            y[rows, start : start + n] = (y[rows, start : start + n].float() + delta).to(y.dtype)
    return y


def lora_apply_masked(x: torch.Tensor, y: torch.Tensor, stack: LoRAStack, batch: LoRABatch) -> torch.Tensor:
    """Same result as the reference with two GEMMs per slice for all adapters together; fp32."""
    used = [slot for slot, _ in batch.groups]
    xf = x.float()
    for i, (start, n) in enumerate(stack.offsets):
        if not any(stack.present[slot][i] for slot in used):
            continue  # no adapter of this batch targets this slice: exactly zero
        a, b = stack.a[i], stack.b[i]  # [L, r, in], [L, r, rows]
        num_slots, rank = a.shape[0], a.shape[1]
        h = (xf @ a.reshape(num_slots * rank, -1).float().T) * batch.rank_mask(num_slots, rank)  # [T, L*r]
        delta = h @ b.reshape(num_slots * rank, -1).float()  # [T, rows]
        y[:, start : start + n] = (y[:, start : start + n].float() + delta).to(y.dtype)
    return y

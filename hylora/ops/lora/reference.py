"""LoRA shrink and expand for a flat batch where every token has an adapter slot, in plain torch.

    shrink:  h[t, i, :r]        = x[t] · A_i[slot_t]ᵀ               (fp32; zeros for base tokens)
    expand:  y[t, slice i]     += h[t, i] · B_i[slot_t]             (fp32, rounded once into y)

`slot_t = -1` marks a base-model token: its rows of y are never touched. Stack layout as
`hylora.lora.apply.LoRAStack`: per slice A [max_loras, r_max, in], B [max_loras, r_max, rows].
Every slice is applied; a slice an adapter does not target has zero A and B in the stack (the
registry's layout), so it adds exactly zero. `lora_apply` equals `lora_apply_grouped` (tests prove it).
"""

from __future__ import annotations

import torch

from hylora.lora.apply import LoRABatch, LoRAStack


def lora_shrink(x: torch.Tensor, a: list[torch.Tensor], token_slots: torch.Tensor) -> torch.Tensor:
    """x [T, in], a per slice [L, r, in] → h [T, slices, r] fp32."""
    h = torch.zeros(x.shape[0], len(a), a[0].shape[1], dtype=torch.float32, device=x.device)
    for slot in _slots_in_use(token_slots):
        rows = token_slots == slot
        xs = x[rows].float()
        for i, ai in enumerate(a):
            h[rows, i] = xs @ ai[slot].float().T
    return h


def lora_expand(
    h: torch.Tensor,  # [T, slices, r] fp32
    b: list[torch.Tensor],  # per slice [L, r, rows]
    offsets: list[tuple[int, int]],  # per slice (first output column, rows)
    token_slots: torch.Tensor,  # [T]
    y: torch.Tensor,  # [T, out], updated in place
) -> torch.Tensor:
    for slot in _slots_in_use(token_slots):
        rows = token_slots == slot
        for i, (bi, (start, n)) in enumerate(zip(b, offsets, strict=True)):
            delta = h[rows, i] @ bi[slot].float()
            y[rows, start : start + n] = (y[rows, start : start + n].float() + delta).to(y.dtype)
    return y


def lora_apply(x: torch.Tensor, y: torch.Tensor, stack: LoRAStack, batch: LoRABatch) -> torch.Tensor:
    """y[:, slice] += each token's adapter delta, for every slice (the signature of `lora_apply_grouped`)."""
    return lora_expand(lora_shrink(x, stack.a, batch.token_slots), stack.b, stack.offsets, batch.token_slots, y)


def _slots_in_use(token_slots: torch.Tensor) -> list[int]:
    return [s for s in torch.unique(token_slots).tolist() if s >= 0]

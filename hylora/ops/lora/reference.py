"""LoRA for a flat batch where every token has an adapter slot, in plain torch (fp32 arithmetic).

    shrink:  h[t, i, :r]        = x[t] · A_i[slot_t]ᵀ               (fp32; zeros for base tokens)
    expand:  y[t, slice i]     += h[t, i] · B_i[slot_t]             (fp32, rounded once into y)

`slot_t = -1` marks a base-model token: its rows of y are never touched. Per slice, A is
[max_loras, r_max, in] and B [max_loras, r_max, rows] (`hylora.lora.LoRAStack`'s layout). Three
forms of one result:

- `lora_apply`: every slice, token by token's slot (the twin of the Triton kernels);
- `lora_apply_grouped`: per adapter group of rows, the slices that adapter targets (the reference
  the others are tested against);
- `lora_apply_masked`: one shrink against every slot's A at once, a one-hot mask that keeps each
  token's own slot, one expand against every slot's B — two GEMMs per slice whatever the number of
  adapters in the batch. Masked-off blocks are exact zeros, so base rows are unchanged bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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


def lora_apply(
    x: torch.Tensor,
    y: torch.Tensor,
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    offsets: list[tuple[int, int]],
    token_slots: torch.Tensor,
) -> torch.Tensor:
    """y[:, slice] += each token's adapter delta, for every slice given."""
    return lora_expand(lora_shrink(x, a, token_slots), b, offsets, token_slots, y)


def lora_apply_grouped(
    x: torch.Tensor,
    y: torch.Tensor,
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    offsets: list[tuple[int, int]],
    present: list[list[bool]],  # present[slot][i]: the slot's adapter targets slice i
    groups: Sequence[tuple[int, slice | torch.Tensor]],  # (slot, its rows of the batch)
) -> torch.Tensor:
    """Reference: y[rows, slice] += (x[rows] A_slot^T) B_slot for every adapter group; fp32."""
    for slot, rows in groups:
        xs = x[rows].float()
        for i, (start, n) in enumerate(offsets):
            if not present[slot][i]:
                continue
            delta = (xs @ a[i][slot].float().T) @ b[i][slot].float()
            y[rows, start : start + n] = (y[rows, start : start + n].float() + delta).to(y.dtype)
    return y


def lora_apply_masked(
    x: torch.Tensor,
    y: torch.Tensor,
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    offsets: list[tuple[int, int]],
    rank_mask: torch.Tensor,  # [T, L * r] fp32 from `rank_mask`
) -> torch.Tensor:
    """Same result as the grouped reference with two GEMMs per slice for all adapters together; fp32."""
    xf = x.float()
    for ai, bi, (start, n) in zip(a, b, offsets, strict=True):
        num_slots, rank = ai.shape[0], ai.shape[1]
        h = (xf @ ai.reshape(num_slots * rank, -1).float().T) * rank_mask  # [T, L*r]
        delta = h @ bi.reshape(num_slots * rank, -1).float()  # [T, rows]
        y[:, start : start + n] = (y[:, start : start + n].float() + delta).to(y.dtype)
    return y


def rank_mask(token_slots: torch.Tensor, num_slots: int, rank: int) -> torch.Tensor:
    """[T, num_slots * rank] fp32: 1 on the rank block of the token's own slot, 0 elsewhere (all
    zero for slot -1). Built on the device: CUDA-graph safe."""
    slots = torch.arange(num_slots, device=token_slots.device)
    onehot = (token_slots[:, None] == slots[None, :]).float()  # [T, L]
    return onehot[:, :, None].expand(-1, -1, rank).reshape(len(onehot), num_slots * rank)


def _slots_in_use(token_slots: torch.Tensor) -> list[int]:
    return [s for s in torch.unique(token_slots).tolist() if s >= 0]

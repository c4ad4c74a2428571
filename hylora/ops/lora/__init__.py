"""Batched LoRA shrink/expand: `reference` (torch) and `triton` (imported on demand: needs the
triton package). Both offer `lora_apply(x, y, a, b, offsets, ...)` over per-slice A / B tensors;
the reference also has the grouped and masked forms the model layer chooses between."""

from hylora.ops.lora.reference import (
    lora_apply,
    lora_apply_grouped,
    lora_apply_masked,
    lora_expand,
    lora_shrink,
    rank_mask,
)

__all__ = ["lora_apply", "lora_apply_grouped", "lora_apply_masked", "lora_expand", "lora_shrink", "rank_mask"]

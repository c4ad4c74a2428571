"""Batched LoRA shrink/expand: `reference` (torch) and `triton` (imported on demand: needs the
triton package). Both offer `lora_apply(x, y, stack, batch)` with the signature of
`hylora.lora.apply.lora_apply_grouped`."""

from hylora.ops.lora.reference import lora_apply, lora_expand, lora_shrink

__all__ = ["lora_apply", "lora_expand", "lora_shrink"]

"""LoRA types shared by every floor: a linear's slot tensors (`LoRAStack`) and a step's per-token
adapter slots (`LoRABatch`, `DeviceLoRABatch`). Adapter files and slots are managed by
`hylora.adapters`; the arithmetic is `hylora.ops.lora`."""

from hylora.lora.batch import DeviceLoRABatch, LoRABatch, LoRAStack

__all__ = ["DeviceLoRABatch", "LoRABatch", "LoRAStack"]

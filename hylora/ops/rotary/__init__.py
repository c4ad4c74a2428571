"""The vision tower's rotary embedding, rotate-half over the whole head in fp32: `reference` (torch)
and `triton` (imported on demand: needs the triton package)."""

from hylora.ops.rotary.reference import rotate_half

__all__ = ["rotate_half"]

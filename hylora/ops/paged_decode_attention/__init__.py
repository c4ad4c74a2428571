"""Decode attention over the paged KV cache: `reference.paged_decode_attention` (torch) and
`triton.paged_decode_attention` (split-KV; imported on demand, needs the triton package)."""

from hylora.ops.paged_decode_attention.reference import paged_decode_attention

__all__ = ["paged_decode_attention"]

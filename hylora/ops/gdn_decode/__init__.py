"""GDN decode step in place by state slot: `reference.gdn_decode` (torch) and `triton.gdn_decode`
(imported on demand: `from hylora.ops.gdn_decode import triton`; needs the triton package)."""

from hylora.ops.gdn_decode.reference import gdn_decode

__all__ = ["gdn_decode"]

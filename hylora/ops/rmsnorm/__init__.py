"""RMSNorm (zero-centred, optionally fused with the residual add) and the GDN output's gated RMSNorm:
`reference` (torch) and `triton` (imported on demand: needs the triton package)."""

from hylora.ops.rmsnorm.reference import gated_rms_norm, rms_norm

__all__ = ["gated_rms_norm", "rms_norm"]

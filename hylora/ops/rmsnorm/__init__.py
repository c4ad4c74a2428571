"""RMSNorm (zero-centred, optionally fused with the residual add; `rms_norm_quantized` also quantises it
for an FP8 projection) and the GDN output's gated RMSNorm: `reference` (torch) and `triton` (imported on
demand: needs the triton package)."""

from hylora.ops.rmsnorm.reference import gated_rms_norm, gated_rms_norm_quantized, rms_norm, rms_norm_quantized

__all__ = ["gated_rms_norm", "gated_rms_norm_quantized", "rms_norm", "rms_norm_quantized"]

"""One pass over a batch's fp32 logits: each row's greedy token and whether it holds NaN, ±inf or
any finite value (the sampler's and the NaN guard's questions): `reference` (torch) and `triton`
(imported on demand: needs the triton package)."""

from hylora.ops.logits_scan.reference import ALL_FINITE, HAS_FINITE, HAS_NAN, NOT_FINITE, scan_logits

__all__ = ["ALL_FINITE", "HAS_FINITE", "HAS_NAN", "NOT_FINITE", "scan_logits"]

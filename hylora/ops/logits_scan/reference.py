"""The logits scan in plain torch: per row of [N, V] fp32 logits, the first index of its largest
value and a bit set of what the row holds."""

from __future__ import annotations

import torch

HAS_NAN, NOT_FINITE, HAS_FINITE = 1, 2, 4  # flag bits: some NaN; some NaN or ±inf; some finite value
ALL_FINITE = HAS_FINITE  # the flags of a row of finite values only


def scan_logits(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] fp32 → [2, N] int64: the greedy token (torch.argmax: the first largest; with a NaN
    in the row it is unspecified) and the row's flags."""
    finite = torch.isfinite(logits)
    flags = (
        torch.isnan(logits).any(-1).long() * HAS_NAN
        + (~finite.all(-1)).long() * NOT_FINITE
        + finite.any(-1).long() * HAS_FINITE
    )
    return torch.stack([logits.argmax(-1), flags])

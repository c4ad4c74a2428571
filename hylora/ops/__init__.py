"""Kernels. Each op has a plain-torch reference (`<op>/reference.py`) that the CPU runs and that
tests compare fast GPU versions against."""

from hylora.ops.attention.reference import paged_attention
from hylora.ops.causal_conv1d.reference import causal_conv1d_by_slot, causal_conv1d_varlen
from hylora.ops.gated_delta_rule.reference import varlen_gated_delta_rule

__all__ = ["causal_conv1d_by_slot", "causal_conv1d_varlen", "paged_attention", "varlen_gated_delta_rule"]

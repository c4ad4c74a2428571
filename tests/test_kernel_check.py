"""The start-up kernel check accepts a kernel equal to the reference and rejects wrong or NaN ones."""

from __future__ import annotations

import torch

from hylora.model.loader import load_model
from hylora.ops import kernel_check
from hylora.ops.gated_delta_rule import reference


def test_check_catches_wrong_and_nan_kernels(causal_ckpt, monkeypatch):
    model = load_model(causal_ckpt[0], progress=False)
    assert kernel_check.select_gdn_kernel(model) == "reference"  # CPU: never swapped

    monkeypatch.setattr(kernel_check.fla, "varlen_gated_delta_rule", reference.varlen_gated_delta_rule)
    assert all(kernel_check._relative_error(model, lens) < 1e-6 for lens in kernel_check.BATCHES)

    def swapped_heads(q, k, v, g, beta, states, seq_lens, scale):  # value heads read the wrong key heads
        return reference.varlen_gated_delta_rule(q.flip(1), k.flip(1), v, g, beta, states, seq_lens, scale)

    monkeypatch.setattr(kernel_check.fla, "varlen_gated_delta_rule", swapped_heads)
    assert max(kernel_check._relative_error(model, lens) for lens in kernel_check.BATCHES) > 0.05

    def nan_on_long(q, k, v, g, beta, states, seq_lens, scale):
        o, s = reference.varlen_gated_delta_rule(q, k, v, g, beta, states, seq_lens, scale)
        if max(seq_lens) > 128:
            o[-1] = float("nan")
        return o, s

    monkeypatch.setattr(kernel_check.fla, "varlen_gated_delta_rule", nan_on_long)
    assert kernel_check._relative_error(model, [257]) == float("inf")
    assert torch.isfinite(torch.tensor(kernel_check._relative_error(model, [1, 1])))

"""The start-up check of the GDN prefill kernel accepts a kernel equal to the reference and rejects
wrong or NaN ones; on the CPU the reference always serves."""

from __future__ import annotations

import torch

from hylora.kernels import checks
from hylora.kernels.select import select_gdn_kernel
from hylora.model.loader import load_model
from hylora.ops.gated_delta_rule import reference

SHAPE = (2, 4, 16, 16)  # hk, hv, dk, dv


def gdn_error(kernel, batches=checks.GDN_BATCHES) -> float:
    return checks.gated_delta_rule_error(*SHAPE, torch.float32, "cpu", batches=batches, kernel=kernel)


def test_check_catches_wrong_and_nan_kernels(causal_ckpt):
    model = load_model(causal_ckpt[0], progress=False)
    verdict = select_gdn_kernel(model)
    assert verdict.implementation == "reference" and not verdict.fast and not verdict.check_failed  # CPU
    assert gdn_error(reference.varlen_gated_delta_rule) < 1e-6

    def swapped_heads(q, k, v, g, beta, states, seq_lens, scale):  # value heads read the wrong key heads
        return reference.varlen_gated_delta_rule(q.flip(1), k.flip(1), v, g, beta, states, seq_lens, scale)

    assert gdn_error(swapped_heads) > 0.05

    def nan_on_long(q, k, v, g, beta, states, seq_lens, scale):
        o, s = reference.varlen_gated_delta_rule(q, k, v, g, beta, states, seq_lens, scale)
        if max(seq_lens) > 128:
            o[-1] = float("nan")
        return o, s

    assert gdn_error(nan_on_long, batches=([257],)) == checks.FAILED
    assert gdn_error(nan_on_long, batches=([1, 1],)) < 1e-6

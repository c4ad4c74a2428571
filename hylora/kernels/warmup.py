"""Kernels that compile at their first call, compiled at start-up instead, once the checks chose them:
DeepGEMM's (`--kernels fp8_deepgemm=1`) compiles one kernel per configuration its heuristic picks for a
weight shape and step size, seconds each, which a served step would otherwise wait for."""

from __future__ import annotations

import logging
import time

import torch

from hylora.kernels.verdict import KernelVerdict
from hylora.model.decoder import HybridDecoder
from hylora.model.layers import Linear

log = logging.getLogger(__name__)

DEEPGEMM = "deepgemm+cublas+triton"  # the FP8 verdict's implementation that serves DeepGEMM


def warm_up_kernels(model: HybridDecoder, verdicts: dict[str, KernelVerdict], max_step_tokens: int) -> None:
    """Compile what the chosen kernels would compile in steps of up to `max_step_tokens` tokens."""
    fp8 = verdicts.get("fp8_linear")
    if fp8 is None or fp8.implementation != DEEPGEMM or max_step_tokens <= 0:
        return
    from hylora.ops.fp8_linear import deepgemm

    start = time.perf_counter()
    by_block: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for m in model.modules():
        if isinstance(m, Linear) and m.is_fp8:
            by_block.setdefault(m.quant_block, []).append((m.weight, m.weight_scale))
    runs = sum(deepgemm.warm_up(weights, max_step_tokens, block) for block, weights in by_block.items())
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
        torch.cuda.empty_cache()  # the warm-up's inputs and outputs, before the caches are planned
    log.info("DeepGEMM warm-up: %d GEMMs over steps of up to %d tokens in %.1f s", runs, max_step_tokens,
             time.perf_counter() - start)  # fmt: skip

"""Split FP8 activations (`--fp8-activations split`) from the ops that produce them.

With dynamic activations the decoder's norms, the MLP's activation and the attention's output gate
quantise the input of the FP8 projection behind them in their own launch (`rms_norm_quantized`,
`gated_rms_norm_quantized`, `silu_mul_quantized`, `output_gate_quantized`). For a split deployment the
same launches write the input's two e4m3 terms (`split=True`), where the split GEMM will read them:
below `cublas.SPLIT_BELOW` tokens when cuBLAS serves the GEMMs (from there the weight-only path reads x
itself, so those steps get the plain values), at every size where Triton's split GEMM serves alone.
`splits(tokens)` says which; these wrappers keep the quantising kernels' signatures, so the layers
call them as they do for dynamic activations.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hylora.ops.fp8_linear.reference import GROUP, QuantizedActivation

Kernel = Callable[..., torch.Tensor]
Splits = Callable[[int], bool]
Normed = torch.Tensor | QuantizedActivation


def rms_norm(quantized: Kernel, plain: Kernel, splits: Splits) -> Kernel:
    def kernel(
        x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
        group: int = GROUP, keep: bool = False,
    ) -> Normed | tuple[Normed, torch.Tensor]:  # fmt: skip
        if not splits(x.shape[0]):
            return plain(x, weight, eps, residual)
        return quantized(x, weight, eps, residual, group, keep, split=True)

    return kernel


def gated_rms_norm(quantized: Kernel, plain: Kernel, splits: Splits) -> Kernel:
    def kernel(
        x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group: int = GROUP, keep: bool = False
    ) -> Normed:
        if not splits(x.shape[0]):
            return plain(x, z, weight, eps)
        return quantized(x, z, weight, eps, group, keep, split=True)

    return kernel


def silu_mul(quantized: Kernel, plain: Kernel, splits: Splits) -> Kernel:
    def kernel(gate_up: torch.Tensor, group: int = GROUP, keep: bool = False) -> Normed:
        if not splits(gate_up.shape[0]):
            return plain(gate_up)
        return quantized(gate_up, group, keep, split=True)

    return kernel


def output_gate(quantized: Kernel, plain: Kernel, splits: Splits) -> Kernel:
    def kernel(o: torch.Tensor, gate: torch.Tensor, group: int = GROUP, keep: bool = False) -> Normed:
        if not splits(o.shape[0]):
            return plain(o, gate)
        return quantized(o, gate, group, keep, split=True)

    return kernel


def silu_mul_lora(fused: Kernel, splits: Splits) -> Kernel:
    """`ops.silu_mul.triton.silu_mul_lora`, splitting where it quantises (group given) for a split GEMM."""

    def kernel(
        gate_up: torch.Tensor, h: torch.Tensor, b: list[torch.Tensor], meta: object, group: int | None = None,
        keep: bool = False,
    ) -> Normed:  # fmt: skip
        if group is None or not splits(gate_up.shape[0]):
            return fused(gate_up, h, b, meta)
        return fused(gate_up, h, b, meta, group, keep, split=True)

    return kernel

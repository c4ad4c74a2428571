"""FP8 (e4m3) block-scaled linear, the format of the Qwen / DeepSeek FP8 checkpoints: a weight
[N, K] float8_e4m3fn with fp32 `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] (block (128, 128), or
(1, 128) for per-row scales), activations quantised per token and group of 128 inputs on the fly.

- `reference`: plain torch (fp32 arithmetic): quantise / dequantise weights and activations, and
  `fp8_linear`, the arithmetic the kernels reproduce.
- `triton` (imported on demand: needs the triton package): `quantize_activation` (bit-equal to the
  reference) and `fp8_linear`, a block-scaled FP8 GEMM with tile configurations by token count;
  `fp8_weight_only_linear`, the same GEMM on unquantised activations (the weights converted in
  registers); `quantize_activation_split` and `fp8_split_linear`, the GEMM on x split into two e4m3
  terms (two FP8 dots per weight tile).
- `cublas` (the FP8 GEMMs as served on Hopper): cuBLAS where it takes the step, the Triton kernels below.
- `deepgemm` (where DeepGEMM is installed, unless `--kernels fp8_deepgemm=0`): `cublas`, with DeepGEMM's GEMM
  in cuBLAS's place.
"""

from hylora.ops.fp8_linear.reference import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_weight,
    fp8_linear,
    fp8_split_linear,
    fp8_weight_only_linear,
    quantize_activation,
    quantize_activation_split,
    quantize_weight,
)

__all__ = [
    "FP8_DTYPE", "FP8_MAX", "dequantize_weight", "fp8_linear", "fp8_split_linear", "fp8_weight_only_linear",
    "quantize_activation", "quantize_activation_split", "quantize_weight",
]  # fmt: skip

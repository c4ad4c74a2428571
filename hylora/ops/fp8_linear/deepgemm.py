"""The FP8 linears through DeepGEMM's block-scaled GEMM for steps of many tokens, where it is installed.

DeepGEMM (deepseek-ai/DeepGEMM, MIT; `deep_gemm.fp8_gemm_nt`) is the kernel stock vLLM serves
block-FP8 linears with on Hopper. It has no usable PyPI wheel: it is built from source against the
torch it runs with (its README's `./install.sh`; vLLM's wheel vendors a prebuilt copy), and it compiles
its kernels at first use with the CUDA toolkit's nvcc (2.5-8.7 s each on an H100, docs/BASELINE.md run
57; `kernels/warmup.py` compiles them at start-up; `--kernels fp8_deepgemm=0` turns DeepGEMM off).
Where `import deep_gemm` works on an sm_90 GPU, `fp8_linear` serves the steps that `cublas.usable`
gives to cuBLAS with it instead (same FP8 operands: x quantised by hylora's Triton kernel in 1 x 128
groups, the checkpoint's 128 x 128 weight blocks, fp32 scales as they are, no UE8M0 rounding);
everything else is the `cublas` module's. `warm_up` compiles, at start-up, every kernel the steps can
meet, so no step stalls on DeepGEMM's compiler.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch

from hylora.ops.fp8_linear import cublas
from hylora.ops.fp8_linear import reference as R
from hylora.ops.fp8_linear import triton as fp8_triton
from hylora.ops.fp8_linear.cublas import fp8_split_linear, fp8_weight_only_linear, takes_split_input
from hylora.ops.fp8_linear.reference import BLOCK, Extra, QuantizedActivation

__all__ = [
    "available", "fp8_linear", "fp8_split_linear", "fp8_weight_only_linear", "takes_split_input", "warm_up",
    "serves_shape", "warm_up_shape", "warm_up_token_counts",
]  # fmt: skip

# DeepGEMM's smallest block_m for the steps it takes here (from cublas.CUBLAS_FROM = 128 tokens)
WARM_UP_STRIDE = 64


@functools.cache
def _deep_gemm():  # the module, or None where it is not installed / not for this GPU
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return None
    try:
        import deep_gemm
    except (ImportError, OSError):
        return None
    return deep_gemm if hasattr(deep_gemm, "fp8_gemm_nt") else None


def available() -> bool:
    """Whether DeepGEMM is importable here and the GPU is a Hopper (sm_90)."""
    return _deep_gemm() is not None


def fp8_linear(
    x: torch.Tensor | QuantizedActivation, w_fp8: torch.Tensor, w_scale: torch.Tensor,
    block: tuple[int, int] = BLOCK, out: torch.Tensor | None = None, extra: Extra | None = None,
) -> torch.Tensor:  # fmt: skip
    """`cublas.fp8_linear` (its arguments, shapes and result), with DeepGEMM's GEMM where cuBLAS's would serve."""
    *lead, K = x.shape
    N, M = w_fp8.shape[0], math.prod(lead)
    deep_gemm = _deep_gemm()
    if deep_gemm is None or not cublas.usable(M, N, K, block) or x.dtype != torch.bfloat16:  # bf16 out only
        return cublas.fp8_linear(x, w_fp8, w_scale, block, out=out, extra=extra)
    if extra is not None:  # DeepGEMM's GEMM into the first N columns, the extra rows by the 16-bit one
        return cublas.linear_with_extra(lambda y: fp8_linear(x, w_fp8, w_scale, block, out=y), out, extra, lead, N)
    if isinstance(x, QuantizedActivation):
        xq, xs = x.q, x.scale
    else:
        xq, xs = fp8_triton.quantize_activation(x.reshape(-1, K), block[1])
    into = out is not None and out.dim() == 2 and out.is_contiguous()
    y = out if into else torch.empty(M, N, dtype=torch.bfloat16, device=xq.device)
    deep_gemm.fp8_gemm_nt((xq, xs), (w_fp8, w_scale), y, disable_ue8m0_cast=True)
    if into:
        return y
    y = y.view(*lead, N)
    return y if out is None else out.copy_(y)


def warm_up_token_counts(max_tokens: int) -> list[int]:
    """Step sizes that meet every kernel DeepGEMM's sm_90 heuristic can pick for a weight in steps of
    cublas.CUBLAS_FROM to `max_tokens` tokens. From 33 rows its block_m candidates are 64, 128 and 256,
    and M enters its choice only through ceil(M / block_m) (DeepGEMM's csrc/jit_kernels/heuristics
    sm90.hpp: the blocks, waves and last-wave use of each layout), which is the same for every M of
    (64 (j - 1), 64 j]: one M from each such interval, the multiples of 64. vLLM's "relax" warm-up
    (VLLM_DEEP_GEMM_WARMUP) runs these among more."""
    if max_tokens < cublas.CUBLAS_FROM:
        return []
    top = -(-max_tokens // WARM_UP_STRIDE) * WARM_UP_STRIDE
    return list(range(cublas.CUBLAS_FROM, top + 1, WARM_UP_STRIDE))


def warm_up(
    weights: Iterable[tuple[torch.Tensor, torch.Tensor]], max_tokens: int, block: tuple[int, int] = BLOCK
) -> int:
    """Run `fp8_linear` on each distinct weight shape ([N, K] e4m3 with its block scales) at every step
    size of `warm_up_token_counts(max_tokens)` that DeepGEMM takes, so that DeepGEMM compiles each kernel
    those steps can pick now (seconds each; it keeps them on disk, DG_JIT_CACHE_DIR) and not in a served
    step. Returns the number of GEMMs run (0 where DeepGEMM is not available)."""
    if _deep_gemm() is None:
        return 0
    shapes: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for w, w_scale in weights:
        if serves_shape(*w.shape, block):
            shapes.setdefault(tuple(w.shape), (w, w_scale))
    counts = warm_up_token_counts(max_tokens)
    for (_, K), (w, w_scale) in shapes.items():
        x = torch.zeros(max(counts, default=0), K, dtype=torch.bfloat16, device=w.device)
        for M in counts:
            fp8_linear(x[:M], w, w_scale, block)
    return len(shapes) * len(counts)


def serves_shape(N: int, K: int, block: tuple[int, int] = BLOCK) -> bool:
    """Whether DeepGEMM takes an [N, K] weight's steps from cublas.CUBLAS_FROM tokens (cuBLAS's shapes)."""
    return cublas.usable(cublas.CUBLAS_FROM, N, K, block)


def warm_up_shape(N: int, K: int, max_tokens: int, device: str, block: tuple[int, int] = BLOCK) -> int:
    """`warm_up` for one [N, K] weight shape on zero weights: DeepGEMM's kernels depend on the shapes,
    not the values, so a process without the model can compile them into the shared JIT cache."""
    w = torch.zeros(N, K, dtype=R.FP8_DTYPE, device=device)
    w_scale = torch.ones(-(-N // block[0]), -(-K // block[1]), dtype=torch.float32, device=device)
    return warm_up([(w, w_scale)], max_tokens, block)

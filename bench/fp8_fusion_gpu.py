"""The two FP8 glue changes of 2026-12-03 against the paths they replace, in one process (GPU):

1. the MLP activation quantising the FP8 down projection's input (`silu_mul_quantized`, one launch)
   against `silu_mul` then `quantize_activation` (two launches, the [T, I] activation written and read
   back), at the 27B's intermediate size 17408;
2. cuBLAS writing the GDN in_proj's FP8 rows (16384 x 5120) into their column slice of the
   [T, 16384 + 96] output (`out=`) against writing a [T, 16384] result and copying it in.

Each: the kernel floor's check of the new path first (error vs the reference; the FP8 GEMM's check
includes the sliced out), then the median GPU time of one call (20 calls in a CUDA graph), old / new.

    python bench/fp8_fusion_gpu.py [--tokens 32,2048,8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernel_sweep_gpu import bench  # noqa: E402
from hylora.kernels import checks  # noqa: E402
from hylora.ops.fp8_linear import cublas, reference  # noqa: E402
from hylora.ops.fp8_linear import triton as fp8_triton  # noqa: E402
from hylora.ops.silu_mul import triton as silu  # noqa: E402

INTERMEDIATE, HIDDEN, IN_PROJ_FP8, IN_PROJ_TAIL = 17408, 5120, 16384, 96


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="32,2048,8192")
    tokens = [int(t) for t in ap.parse_args().tokens.split(",")]
    dev, dtype = "cuda", torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    err = checks.silu_mul_error(INTERMEDIATE, dtype, dev, quantized=True)
    print(f"check silu_mul_quantized: max rel. error {err:.2e}", flush=True)
    err = checks.fp8_linear_error(IN_PROJ_FP8, HIDDEN, (128, 128), dtype, dev, kernel=cublas.fp8_linear)
    print(f"check cublas fp8_linear (sliced out, pre-quantised input): max rel. error {err:.2e}", flush=True)

    w, w_scale = reference.quantize_weight(torch.randn(IN_PROJ_FP8, HIDDEN, device=dev))
    print("\n| tokens | silu_mul + quantize µs | silu_mul_quantized µs | in_proj: result + copy µs | out= µs |")
    print("| --- | --- | --- | --- | --- |")
    for T in tokens:
        gate_up = torch.randn(T, 2 * INTERMEDIATE, device=dev, dtype=dtype)
        unfused = bench(lambda g=gate_up: fp8_triton.quantize_activation(silu.silu_mul(g)))
        fused = bench(lambda g=gate_up: silu.silu_mul_quantized(g))
        x = torch.randn(T, HIDDEN, device=dev, dtype=dtype)
        y = torch.empty(T, IN_PROJ_FP8 + IN_PROJ_TAIL, device=dev, dtype=dtype)
        view = y[:, :IN_PROJ_FP8]

        def copy(x=x, view=view):
            view.copy_(cublas.fp8_linear(x, w, w_scale))

        def into(x=x, view=view):
            cublas.fp8_linear(x, w, w_scale, out=view)

        copied, direct = bench(copy), bench(into)
        row = (T, 1e3 * unfused, 1e3 * fused, 1e3 * copied, 1e3 * direct)
        print("| {} | {:.1f} | {:.1f} | {:.1f} | {:.1f} |".format(*row), flush=True)
    print(f"\ncuBLAS took out= : {not cublas._WRITES_INTO}")


if __name__ == "__main__":
    main()

"""gate_up's LoRA expand in the MLP activation (`silu_mul_lora`, one launch) against the expand
kernel then the activation (two launches, [T, 2I] read and written back by the expand), in one
process on a GPU, at the 27B's gate_up (2 x 17408 outputs), 8 rank-16 slots, every token an
adapter's (the tokens spread evenly over the slots):

- decode sizes (32, 64 tokens): every slot's bf16 h from the stacked GEMM, the expand's decode launch;
- prefill sizes (2048, 8192): the shrink's fp32 partials (split 4, as LARGE), its 32-token expand tiles;

each plain (bf16 out) and quantised for an FP8 down projection (kept values, as LoRA on down_proj
needs). First the kernel floor's check of the fused kernel at these shapes, then the median GPU
time of one call (20 calls in a CUDA graph), old / new.

    python bench/lora_activation_gpu.py [--tokens 32,64,2048,8192] [--rank 16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernel_sweep_gpu import bench  # noqa: E402
from hylora.kernels import checks  # noqa: E402
from hylora.ops.lora import triton as lora  # noqa: E402
from hylora.ops.silu_mul import triton as silu  # noqa: E402

INTERMEDIATE, SLOTS = 17408, 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="32,64,2048,8192")
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    dev, dtype, R, inner = "cuda", torch.bfloat16, args.rank, INTERMEDIATE
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    err = checks.silu_mul_lora_error(inner, dtype, dev, ranks=(R,))
    print(f"check silu_mul_lora at I={inner}, rank {R}: max rel. error {err:.2e}", flush=True)
    b = [torch.randn(SLOTS, R, inner, device=dev, dtype=dtype) * 0.01 for _ in range(2)]
    offsets = [(0, inner), (inner, inner)]
    print("\n| tokens | h | expand + silu_mul µs | silu_mul_lora µs | expand + silu_mul_quantized µs | fused µs |")
    print("| --- | --- | --- | --- | --- | --- |")
    for T in (int(t) for t in args.tokens.split(",")):
        slots = torch.arange(T, device=dev) * SLOTS // T
        meta = lora.LoRAKernelMeta.build(slots, SLOTS)
        gate_up = torch.randn(T, 2 * inner, device=dev, dtype=dtype)
        if T < lora.LARGE_FROM:
            h, form, config = torch.randn(1, T, 2, SLOTS, R, device=dev, dtype=dtype), "stacked bf16", None
        else:
            config = lora.choose_config(T, 5120)
            h, form = torch.randn(config.split_k, T, 2, R, device=dev), f"fp32 partials x{config.split_k}"
        meta.tile_map(lora.choose_config(T, 0).block_m), meta.tile_map(16)  # built before the capture

        def unfused(quantized: bool, g=gate_up, h=h, meta=meta, config=config):
            y = lora.lora_expand(h, b, offsets, g, meta, config)
            return silu.silu_mul_quantized(y, keep=True) if quantized else silu.silu_mul(y)

        def fused(quantized: bool, g=gate_up, h=h, meta=meta):
            return silu.silu_mul_lora(g, h, b, meta, 128 if quantized else None, keep=quantized)

        times = [bench(lambda q=q, f=f: f(q)) for q in (False, True) for f in (unfused, fused)]
        print("| {} | {} | {:.1f} | {:.1f} | {:.1f} | {:.1f} |".format(T, form, *(1e3 * t for t in times)), flush=True)


if __name__ == "__main__":
    main()

"""The vision tower alone on one video: how far from its FLOP floor, and where the time goes.

The real-size tower of the Qwen3.5 / 3.6 family (depth 27, hidden 1152, 16 heads of 72, MLP 4304,
merger to 5120), random bf16 weights, on the users' video: 20 frames of 1280x720 (grid (10, 44, 80),
35,200 patch rows, 8,800 visual tokens). Timed three ways, median of `--repeats` after a warm-up, CUDA
events:
- the whole video in one call (10 attention segments of 3,520 rows);
- one temporal patch per call, as a prefill that reaches the video's segments one at a time calls it;
- attention alone (SDPA on [10, 16, 3520, 72]), and the linear layers alone (their GEMMs on 35,200 rows);
- the rotary alone (the q and k heads of a [35200, 48, 72] qkv, in place, every block);
- on CUDA, SDPA on the tower's strided q/k/v views and the whole video's call under each of torch's
  fused backends (flash, cuDNN, memory-efficient), to see whether another than torch's pick is faster.
The FLOP floor counts the GEMMs (patch embedding, qkv, proj, the MLP, the merger) and attention's two
matmuls at `--peak-tflops` (dense bf16). `--profile` prints torch.profiler's top kernels of one
whole-video call.

    python3 bench/tower_gpu.py [--repeats 10] [--profile] [--out tower.json]
    python3 bench/tower_gpu.py --smoke --device cpu       # the script's logic on a CPU (a tiny tower)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.vision_gpu import VIDEO, VISION_27B, synthetic_video  # noqa: E402
from hylora.config import VisionConfig  # noqa: E402
from hylora.media import MediaConfig, MediaLimits  # noqa: E402
from hylora.media.processor import process_frames  # noqa: E402
from hylora.model.vision import VisionTower  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.0
SMOKE = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=64)


def random_tower(c: VisionConfig, device: str, dtype: torch.dtype) -> VisionTower:
    with torch.device("meta"):
        tower = VisionTower(c)
    g = torch.Generator(device=device).manual_seed(0)
    for name, p in list(tower.named_parameters()):
        if "norm" in name:
            t = torch.ones(p.shape, device=device) if name.endswith("weight") else torch.zeros(p.shape, device=device)
        elif name.endswith("bias"):
            t = torch.zeros(p.shape, device=device)
        else:
            fan_in = p[0].numel() if p.ndim > 1 else 1
            t = torch.randn(p.shape, device=device, generator=g) * (0.02 if "pos_embed" in name else fan_in**-0.5)
        module, _, attr = name.rpartition(".")
        setattr(tower.get_submodule(module), attr, torch.nn.Parameter(t.to(dtype), requires_grad=False))
    return tower.eval()


def flops(c: VisionConfig, grid: tuple[int, int, int]) -> dict[str, float]:
    t, h, w = grid
    n, seg = t * h * w, h * w
    d, m = c.hidden_size, c.intermediate_size
    per_row = c.patch_dim * d + c.depth * (3 * d * d + d * d + 2 * d * m)
    merged = c.merge_unit * d
    gemm = 2 * (n * per_row + n // c.merge_unit * (merged * merged + merged * c.out_hidden_size))
    attention = c.depth * t * 4 * seg * seg * d  # QK^T and PV over every head
    return {"gemm": gemm, "attention": attention}


def timer(device: str):
    """A function that times `fn` (seconds): CUDA events on a GPU, perf_counter on a CPU."""

    def run(fn) -> float:
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return run


def median_of(fn, repeats: int, time_it) -> float:
    fn()
    return statistics.median(time_it(fn) for _ in range(repeats))


def sdpa_backends(tower, pixels, whole, qkv_views, depth: int, args, time_it) -> dict[str, float]:
    """SDPA on the tower's strided q/k/v views (all blocks), then the whole video's call, under each of
    torch's fused backends (CUDA; one that refuses the shape is reported and skipped)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not args.device.startswith("cuda"):
        return {}
    found = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        name = backend.name.lower()
        try:
            with sdpa_kernel(backend):
                found[f"attention alone, strided views, {name}"] = median_of(
                    lambda: [F.scaled_dot_product_attention(*qkv_views) for _ in range(depth)], args.repeats, time_it
                )
                found[f"whole video, one call, {name}"] = median_of(lambda: tower(pixels, whole), args.repeats, time_it)
        except RuntimeError as e:
            print(f"SDPA backend {name}: {str(e).splitlines()[0][:200]}", flush=True)
    return found


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="a tiny tower and video (the logic on a CPU)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    c = VisionConfig.from_hf({"vision_config": SMOKE if args.smoke else VISION_27B})
    frames = synthetic_video(4, 64, 128) if args.smoke else synthetic_video()
    item = process_frames(frames, 2.0, MediaConfig(video=VIDEO), MediaLimits())
    tower = random_tower(c, args.device, dtype)
    if args.device == "cuda":  # the kernel the engine's floor installs once it passes its check
        from hylora.ops.rotary.triton import rotate_half

        for block in tower.blocks:
            block.attn.rotary = rotate_half
    pixels = item.rows(0, len(item.pixels), args.device)
    t, h, w = item.grid_thw
    seg = h * w
    whole = torch.tensor([item.grid_thw])
    one = torch.tensor([(1, h, w)])
    time_it = timer(args.device)

    heads, hd = c.num_heads, c.head_dim
    q = torch.randn(t, heads, seg, hd, device=args.device, dtype=dtype)
    x = torch.randn(t * seg, c.hidden_size, device=args.device, dtype=dtype)

    def linears() -> None:
        for block in tower.blocks:
            block.attn.proj(block.attn.qkv(x)[:, : c.hidden_size])
            block.mlp.linear_fc2(block.mlp.linear_fc1(x))

    qkv = torch.randn(t * seg, 3 * heads, hd, device=args.device, dtype=dtype)  # [n, 3H, d] as the tower's
    angles = torch.rand(t * seg, hd, device=args.device)
    cos, sin = angles.cos(), angles.sin()
    rotary = tower.blocks[0].attn.rotary

    def strided(i: int) -> torch.Tensor:  # q, k or v of the fused qkv: the [t, H, seg, d] views SDPA gets
        return qkv.view(t, seg, 3, heads, hd)[:, :, i].transpose(1, 2)

    results = {
        "whole video, one call": median_of(lambda: tower(pixels, whole), args.repeats, time_it),
        f"{t} calls of one temporal patch": median_of(
            lambda: [tower(pixels[i * seg : (i + 1) * seg], one) for i in range(t)], args.repeats, time_it
        ),
        "attention alone (SDPA, all blocks)": median_of(
            lambda: [F.scaled_dot_product_attention(q, q, q) for _ in range(c.depth)], args.repeats, time_it
        ),
        "qkv, proj and MLP GEMMs alone (all blocks)": median_of(linears, args.repeats, time_it),
        "rotary alone, q and k in place (all blocks)": median_of(
            lambda: [rotary(qkv[:, : 2 * heads], cos, sin, out=qkv[:, : 2 * heads]) for _ in range(c.depth)],
            args.repeats,
            time_it,
        ),
    }
    results |= sdpa_backends(tower, pixels, whole, [strided(i) for i in range(3)], c.depth, args, time_it)
    f = flops(c, item.grid_thw)
    floor = (f["gemm"] + f["attention"]) / (args.peak_tflops * 1e12)
    card = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"{card}, {dtype}; grid {item.grid_thw}: {t * seg} patch rows, {item.num_tokens} visual tokens; "
          f"{f['gemm'] / 1e12:.1f} TFLOP of GEMMs + {f['attention'] / 1e12:.1f} of attention = a "
          f"{1e3 * floor:.1f} ms floor at {args.peak_tflops:.0f} TFLOP/s; median of {args.repeats}, "
          f"{time.strftime('%Y-%m-%d')}\n")  # fmt: skip
    print("| what | ms | over the whole video's floor |\n| --- | --- | --- |")
    for name, seconds in results.items():
        print(f"| {name} | {1e3 * seconds:.1f} | {seconds / floor:.2f}x |")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
        with profile(activities=activities) as prof:
            tower(pixels, whole)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
        key = "self_cuda_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
        print("\n" + prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=60))
    if args.out:
        args.out.write_text(json.dumps({"card": card, "grid": item.grid_thw, "flops": f, "floor_s": floor,
                                        "seconds": results}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()

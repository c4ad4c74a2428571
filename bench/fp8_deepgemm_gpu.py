"""DeepGEMM's block-scaled FP8 GEMM against cuBLAS's, at the Qwen3.6-27B linear shapes (GPU, sm_90).

Issue 29's 8k prefill (1.43x bf16, target 1.5x) and its 64-layer FP8 workload (1.45x, target 1.6x) wait
on the FP8 GEMM: cuBLAS's block-scaled kernel (`torch._scaled_mm` with 1 x 128 / 128 x 128 scales, what
hylora serves from 128 tokens) runs at ~66 % of the FP8 peak, and with the rest of an 8k prefill step
unchanged the 1.56x the workload needs wants the GEMMs ~14 % faster (docs/BASELINE.md, "What blocks the
unmet targets"). DeepGEMM (deepseek-ai/DeepGEMM, MIT) is the public kernel that claims more.

For each weight shape N x K and token count M, on the same FP8 operands (the weight quantised in
128 x 128 blocks, x by hylora's Triton quantisation in 1 x 128 groups): cuBLAS's time (hylora's path,
which lays out the activation scales in each call, as DeepGEMM's `fp8_gemm_nt` does too), DeepGEMM's,
TFLOP/s, their ratio, and each result's max error against the fp32 reference of the same quantised
operands (max |y - ref| / max |ref|); then the sum over a GDN layer's and an attention layer's
projections. Times: the median of one call over calls replayed in a CUDA graph
(`kernel_sweep_gpu.bench`). Exits 1 when an error is NaN or
above BOUND, 2 when deep_gemm is not importable.

    bash bench/peer/build_bundle.sh                       # here: .vllm/, with the DeepGEMM vLLM's wheel vendors
    bash bench/fp8_deepgemm_gpu.sh [--tokens 8192,2048]   # there (.vllm carried): unpacks it, runs this
(without .vllm the script builds DeepGEMM from .deepgemm/, `bash bench/build_deepgemm.sh`; run 56's such
build crashed)

`--warm-up 8192` checks hylora's start-up warm-up instead (what the engine runs with `--kernels
fp8_deepgemm=1`, `kernels/warmup.py`: each distinct shape compiled in a child process, in parallel, then
every step size in this process): its time over the shapes on a cold JIT cache, the kernels DeepGEMM
compiled, then steps of random sizes up to that many tokens: none may compile another kernel (exit 1 if
one does), and their slowest first call.

    DG_JIT_CACHE_DIR=/tmp/dg_cold bash bench/fp8_deepgemm_gpu.sh --warm-up 8192
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fp8_gemm_gpu import BOUND, SHAPES, max_error  # noqa: E402
from bench.kernel_sweep_gpu import bench  # noqa: E402
from hylora.ops.fp8_linear import cublas  # noqa: E402
from hylora.ops.fp8_linear import reference as R  # noqa: E402
from hylora.ops.fp8_linear import triton as T  # noqa: E402
from hylora.ops.fp8_linear.reference import QuantizedActivation  # noqa: E402

DEV = "cuda"
LAYERS = {  # the FP8 projections of a layer of each kind (GDN: 48 of the 64 layers, attention: 16)
    "GDN layer": ("gdn_in_qkvz", "gdn_out", "gate_up", "down"),
    "attention layer": ("attn_q_gate", "attn_kv", "attn_o", "gate_up", "down"),
}


def cublas_call(xq: torch.Tensor, xs: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor):
    """hylora's serving path from 128 tokens (`ops.fp8_linear.cublas.fp8_linear`, torch._scaled_mm) on
    an input its producer quantised, into `out`."""
    x = QuantizedActivation(xq, xs, torch.bfloat16)
    return lambda: cublas.fp8_linear(x, w_fp8, w_scale, out=out)


def deepgemm_call(deep_gemm, xq, xs, w_fp8, w_scale, out):
    """deep_gemm.fp8_gemm_nt (its default recipe for fp32 scales on sm_90: 1 x 128 / 128 x 128) on the
    same operands; like the cuBLAS path it lays out the activation scales as its kernel reads them in
    each call, and reads the weight's [N / 128, K / 128] scales as they lie."""
    return lambda: deep_gemm.fp8_gemm_nt((xq, xs), (w_fp8, w_scale), out, disable_ue8m0_cast=True)


def module_call(xq, xs, w_fp8, w_scale, out):
    """hylora's `ops.fp8_linear.deepgemm.fp8_linear` (what the engine serves where DeepGEMM is installed)
    on the same input, into `out`."""
    from hylora.ops.fp8_linear import deepgemm as module

    x = QuantizedActivation(xq, xs, torch.bfloat16)
    return lambda: module.fp8_linear(x, w_fp8, w_scale, out=out)


def timed(fn) -> float:
    """`bench` (calls replayed in a CUDA graph), or where DeepGEMM's launcher cannot be captured the
    median of 20 back-to-back eager calls between two events (an 8k-token GEMM is ~1 ms: its launch is
    hidden behind the previous call's kernel)."""
    try:
        return bench(fn, 4)
    except RuntimeError as e:
        print(f"  (no CUDA graph: {str(e).splitlines()[0][:100]}; eager calls)")
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 20)
    return sorted(times)[2]


def compiled_kernels() -> int:
    """The kernels in DeepGEMM's JIT cache (a folder with a .cubin each)."""
    return sum(1 for _ in Path(os.environ.get("DG_JIT_CACHE_DIR", Path.home() / ".deep_gemm")).rglob("*.cubin"))


def warm_up_check(max_tokens: int, shapes: dict[str, tuple[int, int]], samples: int = 40) -> int:
    """hylora's start-up warm-up on these weight shapes, then `samples` steps of random sizes (and the
    extremes) through the module: 1 if one of them compiled a kernel the warm-up had not."""
    from hylora.ops.fp8_linear import deepgemm as module

    weights = []
    for N, K in shapes.values():
        g = torch.Generator(device=DEV).manual_seed(N + K)
        weights.append(R.quantize_weight(torch.randn(N, K, device=DEV, generator=g) * 0.02))
    from hylora.kernels.warmup import compile_in_processes

    before = compiled_kernels()
    t0 = time.perf_counter()
    distinct = sorted(set(shapes.values()))
    failed = compile_in_processes(distinct, max_tokens, DEV) if len(distinct) > 1 else []
    children_s, by_children = time.perf_counter() - t0, compiled_kernels()
    runs = module.warm_up(weights, max_tokens)
    torch.cuda.synchronize()
    warm_s, after = time.perf_counter() - t0, compiled_kernels()
    print(f"warm-up as the engine runs it: {len(distinct)} distinct shapes in child processes in {children_s:.1f} s "
          f"({len(failed)} failed), then {runs} GEMMs here, steps of up to {max_tokens} tokens: {warm_s:.1f} s in "
          f"all; kernels in the JIT cache {before} -> {by_children} (children) -> {after}")  # fmt: skip
    sizes = [cublas.CUBLAS_FROM, max_tokens] + random.Random(0).sample(range(cublas.CUBLAS_FROM, max_tokens), samples)
    slowest = (0.0, 0, "")
    for M in sizes:
        for (name, (_, K)), (w, ws) in zip(shapes.items(), weights, strict=True):
            x = torch.randn(M, K, device=DEV).bfloat16()
            t0 = time.perf_counter()
            module.fp8_linear(x, w, ws)
            torch.cuda.synchronize()
            slowest = max(slowest, (time.perf_counter() - t0, M, name))
    added = compiled_kernels() - after
    flag = "" if added == 0 else "  <-- MISSED"
    print(f"{len(sizes)} step sizes x {len(shapes)} shapes after it: {added} kernels compiled; slowest first call "
          f"{slowest[0] * 1e3:.1f} ms ({slowest[2]}, {slowest[1]} tokens){flag}")  # fmt: skip
    return 0 if added == 0 else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,2048,512,128,32")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="of bench/fp8_gemm_gpu.py's SHAPES")
    ap.add_argument("--warm-up", type=int, default=0, metavar="MAX_TOKENS", help="check the start-up warm-up")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    try:
        import deep_gemm
    except ImportError as e:
        print(f"deep_gemm is not importable here ({e}): bench/fp8_deepgemm_gpu.sh with .vllm carried")
        return 2
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, deep_gemm {getattr(deep_gemm, '__version__', '?')}"
    )
    from hylora.ops.fp8_linear import deepgemm as module

    print(f"hylora's ops.fp8_linear.deepgemm sees DeepGEMM: {module.available()}")
    if args.warm_up:
        return warm_up_check(args.warm_up, shapes)
    print(f"{'shape':<12} {'N':>6} {'K':>6} {'M':>5} {'cuBLAS us':>10} {'TFLOP/s':>8} {'DeepGEMM us':>11} "
          f"{'TFLOP/s':>8} {'cuBLAS/DG':>9} {'hylora+DG us':>12} {'err cuBLAS':>10} {'err DG':>9} "
          f"{'err hy+DG':>9}")  # fmt: skip
    ok, times = True, {}
    for name, (N, K) in shapes.items():
        g = torch.Generator(device=DEV).manual_seed(N + K)
        w_fp8, w_scale = R.quantize_weight(torch.randn(N, K, device=DEV, generator=g) * 0.02)
        for M in tokens:
            x = torch.randn(M, K, device=DEV, generator=g).bfloat16()
            xq, xs = T.quantize_activation(x)
            ref = R.fp8_linear(x.float(), w_fp8, w_scale)  # the same quantised operands, fp32 sums
            out_c = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
            out_d = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
            cublas = cublas_call(xq, xs, w_fp8, w_scale, out_c)
            cublas()
            err_c = max_error(out_c, ref)
            out_h = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
            try:
                dg = deepgemm_call(deep_gemm, xq, xs, w_fp8, w_scale, out_d)
                t0 = time.perf_counter()
                dg()
                torch.cuda.synchronize()
                first_s = time.perf_counter() - t0  # its JIT compile where this config is new
                hy = module_call(xq, xs, w_fp8, w_scale, out_h)
                hy()
                torch.cuda.synchronize()
                err_d, err_h = max_error(out_d, ref), max_error(out_h, ref)
            except Exception as e:  # noqa: BLE001  (a shape DeepGEMM refuses: say so, go on)
                print(f"{name:<12} {N:>6} {K:>6} {M:>5} DeepGEMM refused: {str(e).splitlines()[0][:120]}")
                continue
            good = err_c <= BOUND and err_d <= BOUND and err_h <= BOUND  # False for NaN too
            ok &= good
            t_c, t_d, t_h = bench(cublas, 4), timed(dg), timed(hy)  # ms
            times[name, M] = (t_c, t_d)
            flops = 2 * M * N * K
            print(f"{name:<12} {N:>6} {K:>6} {M:>5} {t_c * 1e3:10.1f} {flops / t_c / 1e9:8.0f} {t_d * 1e3:11.1f} "
                  f"{flops / t_d / 1e9:8.0f} {t_c / t_d:9.2f} {t_h * 1e3:12.1f} {err_c:10.2e} {err_d:9.2e} "
                  f"{err_h:9.2e}{'' if good else '  <-- ERROR'}  (first call {first_s:.1f} s)", flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    for M in tokens:
        for layer, names in LAYERS.items():
            if all((n, M) in times for n in names):
                c, d = (sum(times[n, M][i] for n in names) for i in (0, 1))
                print(f"{layer}, {M} tokens: cuBLAS {c * 1e3:.0f} us, DeepGEMM {d * 1e3:.0f} us ({c / d:.2f}x)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

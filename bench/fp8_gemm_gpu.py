"""FP8 block-scaled linear (hylora.ops.fp8_linear) at the Qwen3.6-27B linear shapes, on one GPU.

For each weight shape N x K and token count M, bf16 x: the max error of the Triton fp8_linear (bf16
out) against the torch reference's fp32 result (max |y - ref| / max |ref|), the median GPU time of
one call (20 calls captured in one CUDA graph, so the launch path is not timed and capture is
exercised), bf16 F.linear at the same shape, their ratio, the weight stream in GB/s for M ≤ 32 (N·K
fp8 bytes plus the fp32 scales, over the fp8 time), torch._scaled_mm with 1x128 / 128x128 block
scales where this torch has them (timed with the Triton activation quantisation in front; "n/a"
otherwise), and the weight-only GEMM (`fp8_weight_only_linear`, x unquantised) with its error against
its own reference. Exits 1 when an error is NaN or above BOUND.

    python bench/fp8_gemm_gpu.py [--quick] [--sweep | --sweep-tma | --sweep-weight-only | --extra-rows | --fold]
    python bench/fp8_gemm_gpu.py --split   # split activations (--fp8-activations split) against the others
    python bench/fp8_gemm_gpu.py --sweep-split   # the split GEMM's tile candidates, its input split by its producer

--sweep times candidate tile configurations instead (decode and prefill) at a few shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernel_sweep_gpu import bench  # noqa: E402  (median ms per call, calls replayed in one CUDA graph)
from hylora.ops.fp8_linear import reference as R  # noqa: E402
from hylora.ops.fp8_linear import triton as T  # noqa: E402

DEV = "cuda"
SHAPES = {  # name: (N, K) of the Qwen3.6-27B linears (hidden 5120)
    "gate_up": (34816, 5120),
    "down": (5120, 17408),
    "gdn_in_qkvz": (16384, 5120),
    "gdn_out": (5120, 6144),
    "attn_q_gate": (12288, 5120),
    "attn_kv": (2048, 5120),
    "attn_o": (5120, 6144),
}
TOKENS = (1, 8, 32, 128, 2048, 8192)
QUICK_SHAPES, QUICK_TOKENS = ("gate_up", "down", "attn_kv"), (1, 32, 2048)
# max |y - ref| / max |ref|, ref in fp32: y's rounding to bf16 (half an ulp: ≤ 2^-8 relative), and
# the fp8 MMA summing each 128-product group with fewer bits than fp32 (~2e-4 seen on an H200)
BOUND = 2.0**-8 + 1e-3


def max_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("nan")
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


SCALED_MM_LAYOUTS = {  # (scale_a, scale_b) layouts cuBLAS may want, tried in order
    "a [M, K/128] stride (1, M), b = w_scale.t()": lambda xs, ws: (xs.t().contiguous().t(), ws.t()),
    "a [M, K/128] row-major, b = w_scale.t().contiguous()": lambda xs, ws: (xs, ws.t().contiguous()),
    "a [M, K/128] stride (1, M), b = w_scale.t().contiguous()": lambda xs, ws: (
        xs.t().contiguous().t(),
        ws.t().contiguous(),
    ),
    "a [M, K/128] row-major, b = w_scale.t()": lambda xs, ws: (xs, ws.t()),
}
SCALED_MM_NOTES: dict[str, str] = {}  # the layout that worked; why it did not, by M


def scaled_mm_fn(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, ref: torch.Tensor):
    """A call of torch._scaled_mm with block scales (after the Triton activation quantisation) that
    runs and agrees with the reference, or None."""
    for desc, layout in SCALED_MM_LAYOUTS.items():

        def call(layout=layout):
            xq, xs = T.quantize_activation(x)
            sa, sb = layout(xs, w_scale)
            return torch._scaled_mm(xq, w_fp8.t(), scale_a=sa, scale_b=sb, out_dtype=x.dtype)

        try:
            y = call()
            torch.cuda.synchronize()
        except (RuntimeError, ValueError, TypeError, AttributeError) as e:
            SCALED_MM_NOTES.setdefault(f"M={x.shape[0]}", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            continue
        if max_error(y, ref) <= BOUND:
            SCALED_MM_NOTES.setdefault("layout", desc)
            return call
        SCALED_MM_NOTES.setdefault(f"M={x.shape[0]}", f"error {max_error(y, ref):.1e} with {desc}")
    return None


def run_table(shapes: list[str], tokens: tuple[int, ...]) -> bool:
    print(f"{'shape':<12} {'N':>6} {'K':>6} {'M':>5} {'err':>9} {'fp8 us':>9} {'bf16 us':>9} {'bf16/fp8':>8} "
          f"{'GB/s':>6} {'scaled_mm us':>12} {'w-only us':>9} {'w-only err':>10}")  # fmt: skip
    ok = True
    for name in shapes:
        N, K = SHAPES[name]
        g = torch.Generator(device=DEV).manual_seed(N + K)
        w_fp8, w_scale = R.quantize_weight(torch.randn(N, K, device=DEV, generator=g) * 0.02)
        w_bf16 = R.dequantize_weight(w_fp8, w_scale, dtype=torch.bfloat16)
        for M in tokens:
            x = torch.randn(M, K, device=DEV, generator=g).bfloat16()
            ref = R.fp8_linear(x.float(), w_fp8, w_scale)  # bf16 → fp32 is exact: the same quantised x
            out = torch.empty(M, N, device=DEV, dtype=torch.bfloat16)
            err = max_error(T.fp8_linear(x, w_fp8, w_scale, out=out), ref)
            ok &= err <= BOUND  # False for NaN too
            calls = 20 if M <= 128 else 4
            t_fp8 = bench(lambda: T.fp8_linear(x, w_fp8, w_scale, out=out), calls)  # noqa: B023
            t_bf16 = bench(lambda: F.linear(x, w_bf16), calls)  # noqa: B023
            smm = scaled_mm_fn(x, w_fp8, w_scale, ref)
            t_smm = f"{bench(smm, calls) * 1e3:12.1f}" if smm else f"{'n/a':>12}"
            # weight-only: x unquantised, the weights converted in the GEMM (--fp8-activations none)
            err_wo = max_error(
                T.fp8_weight_only_linear(x, w_fp8, w_scale), R.fp8_weight_only_linear(x.float(), w_fp8, w_scale)
            )
            ok &= err_wo <= BOUND
            t_wo = bench(lambda: T.fp8_weight_only_linear(x, w_fp8, w_scale, out=out), calls)  # noqa: B023
            weight_bytes = N * K + w_scale.numel() * 4
            gbs = f"{weight_bytes / (t_fp8 * 1e-3) / 1e9:6.0f}" if M <= 32 else f"{'':>6}"
            flag = "" if err <= BOUND and err_wo <= BOUND else "  <-- ERROR"
            print(f"{name:<12} {N:>6} {K:>6} {M:>5} {err:9.2e} {t_fp8 * 1e3:9.1f} {t_bf16 * 1e3:9.1f} "
                  f"{t_bf16 / t_fp8:8.2f} {gbs} {t_smm} {t_wo * 1e3:9.1f} {err_wo:10.2e}{flag}",
                  flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    for key, note in SCALED_MM_NOTES.items():
        print(f"torch._scaled_mm {key}: {note}")
    return ok


def _config(base: T.GemmConfig, **changes) -> T.GemmConfig:
    return dataclasses.replace(base, **changes)


def _chosen(M: int, N: int, split: bool = False, **changes) -> T.GemmConfig:
    return _config(T.choose_config(M, N, split=split), **changes)


TMA_SWEEP = [  # decode sizes: the pointer loads (today's choice) against TMA tiles; None = choose_config's
    (
        (1, 8, 32),
        ("down", "gate_up", "gdn_in_qkvz", "attn_o", "attn_kv"),
        {
            "chosen": None,
            "tma": {"tma": True},
            "tma-s6": {"tma": True, "num_stages": 6},
            "tma-n128": {"tma": True, "block_n": 128},
            "tma-n128-s6": {"tma": True, "block_n": 128, "num_stages": 6},
            "tma-n128-w8": {"tma": True, "block_n": 128, "num_warps": 8},
            "tma-pps4": {"tma": True, "programs_per_sm": 4},
            # Triton's warp specialisation of the TMA loop (a producer warp for the loads, the MMA and the
            # scale FMAs in the others): compiles for sm_90 with triton 3.7 (168 registers at 4 warps, no spills)
            "tma-ws": {"tma": True, "warp_specialize": True},
            "tma-ws-s6": {"tma": True, "warp_specialize": True, "num_stages": 6},
        },
    ),
]

SWEEPS = [  # (token counts, shapes, candidates)
    (
        (1, 4, 8, 16),
        ("down", "gate_up", "gdn_in_qkvz", "attn_o", "attn_kv"),
        {
            "m16-n64-w4": T.DECODE,
            "n64-w8": _config(T.DECODE, num_warps=8),
            "n128-w4": _config(T.DECODE, block_n=128),
            "n128-w8": _config(T.DECODE, block_n=128, num_warps=8),
            "n128-w8-s3 (DECODE_1)": T.DECODE_1,
            "n128-w8-pps4": _config(T.DECODE, block_n=128, num_warps=8, programs_per_sm=4),
            "fused-n128-w8": _config(T.DECODE, block_n=128, num_warps=8, fuse_quant=True),
        },
    ),
    (
        (24, 32),
        ("down", "gate_up", "gdn_in_qkvz", "attn_o", "attn_kv"),
        {
            "m32-n64-w4": T.DECODE_32,
            "m16-n64-w4": T.DECODE,
            "m32-n128-w4": _config(T.DECODE_32, block_n=128),
            "m32-pps4": _config(T.DECODE_32, programs_per_sm=4),
            "medium": T.MEDIUM,
        },
    ),
    (
        (512, 2048, 8192),
        ("down", "gate_up", "gdn_in_qkvz", "attn_kv"),
        {
            "64x128-s4": _config(T.PREFILL, num_stages=4, group_m=8),
            "64x128-s3": _config(T.PREFILL, group_m=8),
            "64x128-s3-g16 (PREFILL)": T.PREFILL,
            "64x128-s4-g16": _config(T.PREFILL, num_stages=4),
            "64x64-s3-g16": _config(T.PREFILL, block_n=64),
        },
    ),
]


SWEPT_SHAPES = ("down", "gate_up", "gdn_in_qkvz", "attn_o")
# split activations, the input split by its producer (as served): changes to the split GEMM's pick (3 stages
# since run 54, which swept the 4-stage pick then: "s4" is that pick)
SPLIT_SWEEP = [
    ((8, 16, 24, 32), SWEPT_SHAPES, {"chosen": None, "s4": {"num_stages": 4}, "m16": {"block_m": 16},
                                     "m32": {"block_m": 32}, "n128": {"block_n": 128}}),
    ((64, 128, 256), SWEPT_SHAPES, {"chosen": None, "s4": {"num_stages": 4}, "s2": {"num_stages": 2},
                                    "n64": {"block_n": 64}, "w8": {"num_warps": 8}}),
]  # fmt: skip


STAGES_SWEEP = [  # the dynamic GEMM's pipeline depth at decode and medium sizes (split takes 3 since run 54)
    ((1, 8, 16, 32, 64, 128), SWEPT_SHAPES, {"chosen": None, "s3": {"num_stages": 3}, "s5": {"num_stages": 5}}),
]


def sweep(sweeps: list = SWEEPS, split: bool = False) -> None:
    """Candidate tiles at each token count and 27B shape; `split`: the split GEMM on an input split
    already (a QuantizedActivation with lo, as the norms and the activation hand it over)."""
    gemm, reference = (T.fp8_split_linear, R.fp8_split_linear) if split else (T.fp8_linear, R.fp8_linear)
    for tokens, shapes, configs in sweeps:
        print(f"--- M {tokens}: us per call (/ GB/s of weight for M <= 64)")
        for name in shapes:
            N, K = SHAPES[name]
            w_fp8, w_scale = R.quantize_weight(torch.randn(N, K, device=DEV) * 0.02)
            for M in tokens:
                x = torch.randn(M, K, device=DEV).bfloat16()
                ref = reference(x.float(), w_fp8, w_scale)
                x = R.QuantizedActivation.of(x, split=True) if split else x
                cells = []
                for cname, cfg in configs.items():
                    if not isinstance(cfg, T.GemmConfig):  # changes to choose_config's pick for (M, N)
                        cfg = _chosen(M, N, split, **(cfg or {}))
                    err = max_error(gemm(x, w_fp8, w_scale, config=cfg), ref)
                    t = bench(lambda: gemm(x, w_fp8, w_scale, config=cfg), 20 if M <= 256 else 4)  # noqa: B023
                    gbs = f"/{N * K / (t * 1e-3) / 1e9:.0f}" if M <= 64 else ""
                    bad = f"(e{err:.0e})" if not err <= BOUND else ""
                    cells.append(f"{cname}={t * 1e3:.1f}{gbs}{bad}")
                print(f"{name} M={M}: " + "  ".join(cells), flush=True)
            torch.cuda.empty_cache()


WEIGHT_ONLY_DECODE = {  # changes to choose_config's weight-only pick (TMA at 2-32 tokens, one 32-token tile)
    "chosen": {},
    "pointer": {"tma": False},
    "m16": {"block_m": 16},
    "pps4": {"programs_per_sm": 4},
    "n128": {"block_n": 128},
    "s6": {"num_stages": 6},
}


def sweep_weight_only() -> None:
    """The weight-only GEMM (x unquantised): tile candidates at decode sizes beside the dynamic GEMM and
    bf16 F.linear; then, at more tokens, the Triton GEMM against the weight dequantised for cuBLAS's
    bf16 GEMM (cublas.WEIGHT_ONLY_FROM's crossover)."""
    from hylora.ops.fp8_linear import cublas

    def dequant_linear(x, w_fp8, w_scale):
        return F.linear(x, T.dequantize_weight(w_fp8, w_scale, (128, 128), x.dtype))

    print("--- weight-only, decode: us per call / GB/s of fp8 weight")
    for name in ("down", "gate_up", "gdn_in_qkvz", "attn_o", "attn_kv"):
        N, K = SHAPES[name]
        w_fp8, w_scale = R.quantize_weight(torch.randn(N, K, device=DEV) * 0.02)
        w16 = R.dequantize_weight(w_fp8, w_scale, dtype=torch.bfloat16)
        for M in (1, 8, 32):
            x = torch.randn(M, K, device=DEV).bfloat16()
            ref = R.fp8_weight_only_linear(x.float(), w_fp8, w_scale)
            cells = []
            for cname, changes in WEIGHT_ONLY_DECODE.items():
                cfg = _config(T.choose_config(M, N, weight_only=True), **changes)
                err = max_error(T.fp8_weight_only_linear(x, w_fp8, w_scale, config=cfg), ref)
                t = bench(lambda: T.fp8_weight_only_linear(x, w_fp8, w_scale, config=cfg), 20)  # noqa: B023
                bad = f"(e{err:.0e})" if not err <= BOUND else ""
                cells.append(f"{cname}={t * 1e3:.1f}/{N * K / (t * 1e-3) / 1e9:.0f}{bad}")
            dyn = bench(lambda: T.fp8_linear(x, w_fp8, w_scale), 20)  # noqa: B023
            b16 = bench(lambda: F.linear(x, w16), 20)  # noqa: B023
            cells.append(f"| dynamic={dyn * 1e3:.1f} bf16={b16 * 1e3:.1f}")
            print(f"{name} M={M}: " + "  ".join(cells), flush=True)
        torch.cuda.empty_cache()
    print(f"--- weight-only, more tokens: us per call (cublas.WEIGHT_ONLY_FROM = {cublas.WEIGHT_ONLY_FROM})")
    for name in ("down", "gate_up", "attn_kv"):
        N, K = SHAPES[name]
        w_fp8, w_scale = R.quantize_weight(torch.randn(N, K, device=DEV) * 0.02)
        w16 = R.dequantize_weight(w_fp8, w_scale, dtype=torch.bfloat16)
        for M in (64, 128, 256, 2048, 8192):
            x = torch.randn(M, K, device=DEV).bfloat16()
            ref = R.fp8_weight_only_linear(x.float(), w_fp8, w_scale)
            err = max_error(dequant_linear(x, w_fp8, w_scale), ref)
            reps = 20 if M <= 256 else 4
            tri = bench(lambda: T.fp8_weight_only_linear(x, w_fp8, w_scale), reps)  # noqa: B023
            deq = bench(lambda: dequant_linear(x, w_fp8, w_scale), reps)  # noqa: B023
            b16 = bench(lambda: F.linear(x, w16), reps)  # noqa: B023
            dyn = bench(lambda: cublas.fp8_linear(x, w_fp8, w_scale), reps)  # noqa: B023
            print(f"{name} M={M}: triton={tri * 1e3:.1f} dequant+cublas={deq * 1e3:.1f} (e{err:.1e}) "
                  f"bf16={b16 * 1e3:.1f} dynamic={dyn * 1e3:.1f}", flush=True)  # fmt: skip
        torch.cuda.empty_cache()


SPLIT_TOKENS = (1, 8, 32, 64, 127, 256, 512, 1024)


def split_table(tokens: tuple[int, ...] = SPLIT_TOKENS) -> bool:
    """`--fp8-activations split` at every 27B shape: the Triton split GEMM (its split launch included)
    against the dynamic FP8 GEMM, the weight-only GEMM and bf16 F.linear, us per call; its error against
    the weight-only reference (x exact, the yardstick it must stay within a bf16 rounding of) and its
    weight stream. From 128 tokens also cuBLAS's weight-only path (`cublas.fp8_weight_only_linear`,
    what `cublas.fp8_split_linear` serves from SPLIT_BELOW), for the crossover. False when an error is
    NaN or above BOUND."""
    from hylora.ops.fp8_linear import cublas

    print(f"--- split activations: us per call (cublas.SPLIT_BELOW = {cublas.SPLIT_BELOW})")
    print(f"{'shape':<12} {'M':>4} {'split':>7} {'dynamic':>7} {'w-only':>7} {'bf16':>7} {'split/dyn':>9} "
          f"{'GB/s':>5} {'err':>8} {'cuBLAS':>7}")  # fmt: skip
    ok = True
    for name, (N, K) in SHAPES.items():
        g = torch.Generator(device=DEV).manual_seed(N + K)
        w_fp8, w_scale = R.quantize_weight(torch.randn(N, K, device=DEV, generator=g) * 0.02)
        w16 = R.dequantize_weight(w_fp8, w_scale, dtype=torch.bfloat16)
        for M in tokens:
            x = torch.randn(M, K, device=DEV, generator=g).bfloat16()
            out = torch.empty(M, N, device=DEV, dtype=torch.bfloat16)
            err = max_error(T.fp8_split_linear(x, w_fp8, w_scale), R.fp8_weight_only_linear(x.float(), w_fp8, w_scale))
            ok &= err <= BOUND
            t = {
                "split": bench(lambda: T.fp8_split_linear(x, w_fp8, w_scale, out=out), 20),  # noqa: B023
                "dynamic": bench(lambda: T.fp8_linear(x, w_fp8, w_scale, out=out), 20),  # noqa: B023
                "w-only": bench(lambda: T.fp8_weight_only_linear(x, w_fp8, w_scale, out=out), 20),  # noqa: B023
                "bf16": bench(lambda: F.linear(x, w16), 20),  # noqa: B023
            }
            w_only = cublas.fp8_weight_only_linear
            cublas_t = bench(lambda: w_only(x, w_fp8, w_scale, out=out), 20) if M >= cublas.WEIGHT_ONLY_FROM else None  # noqa: B023
            cells = " ".join(f"{t[k] * 1e3:7.1f}" for k in ("split", "dynamic", "w-only", "bf16"))
            gbs = N * K / (t["split"] * 1e-3) / 1e9
            flag = "" if err <= BOUND else "  <-- ERROR"
            cublas_cell = f"{cublas_t * 1e3:7.1f}" if cublas_t is not None else f"{'':>7}"
            ratio = t["split"] / t["dynamic"]
            print(f"{name:<12} {M:>4} {cells} {ratio:9.2f} {gbs:5.0f} {err:8.1e} {cublas_cell}{flag}", flush=True)
        torch.cuda.empty_cache()
    return ok


def extra_rows(extra_groups: list[int]) -> None:
    """A decode step's LoRA shrink with an FP8 base (8 slots of rank 16 on every slice, and the GDN
    in_proj's 96 unquantised b / a rows): the 16-bit rows served in the FP8 GEMM's launch (`extra=`,
    their K in chunks of each of `extra_groups` groups) against the FP8 GEMM plus a 16-bit F.linear
    beside it (the path before), and the FP8 GEMM alone."""
    slots, rank = 8, 16
    rows = {"gate_up": 2, "down": 1, "gdn_in_qkvz": 2, "gdn_out": 1, "attn_q_gate": 3, "attn_o": 1}  # slices
    chunks = " | ".join(f"in the launch, {g} groups a chunk" for g in extra_groups)
    print(f"--- extra rows, us per call: {chunks} | FP8 + F.linear beside it | FP8 alone (max error)")
    for name, slices in rows.items():
        N, K = SHAPES[name]
        E = slices * slots * rank + (96 if name == "gdn_in_qkvz" else 0)
        w_fp8, w_scale = R.quantize_weight(torch.randn(N, K, device=DEV) * 0.02)
        a16 = (torch.randn(E, K, device=DEV) * 0.02).bfloat16()
        for gemm in (T.fp8_linear, T.fp8_weight_only_linear):
            for M in (1, 8, 32):
                x = torch.randn(M, K, device=DEV).bfloat16()
                out = torch.empty(M, N + E, device=DEV, dtype=torch.bfloat16)
                times, err = [], 0.0
                for groups in extra_groups:
                    T.EXTRA_GROUPS = groups
                    got = gemm(x, w_fp8, w_scale, extra=(x, a16))[:, N:]
                    err = max(err, max_error(got, F.linear(x.float(), a16.float())))
                    times.append(bench(functools.partial(gemm, x, w_fp8, w_scale, out=out, extra=(x, a16)), 20))
                times += [
                    bench(functools.partial(_beside, gemm, x, w_fp8, w_scale, a16, out), 20),
                    bench(functools.partial(gemm, x, w_fp8, w_scale), 20),
                ]
                cells = " | ".join(f"{t * 1e3:.1f}" for t in times)
                print(f"{name} {gemm.__name__} M={M} E={E}: {cells}  (e{err:.1e})", flush=True)
        torch.cuda.empty_cache()
    T.EXTRA_GROUPS = extra_groups[0]


FOLD_LAYERS = {  # a 64-layer 27B decode step: its FP8 projections, per layer kind, and the layers of that kind
    "gdn": (("gdn_in_qkvz", "gdn_out", "gate_up", "down"), 48),
    "attention": (("attn_q_gate", "attn_kv", "attn_o", "gate_up", "down"), 16),
}


def fold_splits() -> None:
    """Split-K partials summed by the tile's last program (`T.FOLD_SPLITS`) against a sum launch after
    the GEMM, at decode sizes, base and with a mixed step's extra rows (8 slots of rank 16 on every
    slice; the GDN in_proj's 96 unquantised rows in both). FP8 columns must be bit-equal; the extra
    columns within rounding. Then what it saves on a 64-layer decode step (every projection once)."""
    slots, rank = 8, 16
    slices = {"gate_up": 2, "down": 1, "gdn_in_qkvz": 2, "gdn_out": 1, "attn_q_gate": 3, "attn_kv": 2, "attn_o": 1}
    print("--- us per call: sum launch -> folded (split K ways; extra-rows chunks) [max |diff| of the extra columns]")
    saved: dict[tuple[str, int], float] = {}
    for name, (N, K) in SHAPES.items():
        w_fp8, w_scale = R.quantize_weight(torch.randn(N, K, device=DEV) * 0.02)
        tail = 96 if name == "gdn_in_qkvz" else 0
        for mixed in (False, True):
            E = tail + (slices[name] * slots * rank if mixed else 0)
            a16 = (torch.randn(E, K, device=DEV) * 0.02).bfloat16() if E else None
            for M in (1, 8, 32):
                x = torch.randn(M, K, device=DEV).bfloat16()
                out = torch.empty(M, N + E, device=DEV, dtype=torch.bfloat16)
                extra = (x, a16) if E else None
                call = functools.partial(T.fp8_linear, x, w_fp8, w_scale, out=out, extra=extra)
                results, times = [], []
                for fold in (False, True):
                    T.FOLD_SPLITS = fold
                    results.append(call().clone())
                    times.append(bench(call, 20))
                T.FOLD_SPLITS = True
                cfg = T.choose_config(M, N)
                split = T.split_k(cfg, M, N, K // 128, T._num_sms(x.device))
                chunks = T._extra_split(K // 128, split, M)[2] if E else 0
                same = torch.equal(results[0][:, :N], results[1][:, :N])
                diff = float((results[0][:, N:].float() - results[1][:, N:].float()).abs().max()) if E else 0.0
                key = ("mixed" if mixed else "base", M)
                saved[key] = saved.get(key, 0.0) + (times[0] - times[1]) * sum(
                    layers for names, layers in FOLD_LAYERS.values() if name in names
                )
                scale = float(results[0][:, N:].float().abs().max()) if E else 1.0
                flag = "" if same and diff <= 2e-2 * scale else "  <-- DIFFERS"
                print(f"{name} M={M} E={E}: {times[0] * 1e3:.1f} -> {times[1] * 1e3:.1f} "
                      f"(split {split}; {chunks} chunks) [{diff:.1e}]{flag}", flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    for (label, M), ms in saved.items():
        print(f"64-layer decode step, {label}, batch {M}: folding saves {ms * 1e3:.0f} us of FP8 GEMM time")


def _beside(gemm, x, w_fp8, w_scale, a16, out) -> None:
    N = w_fp8.shape[0]
    gemm(x, w_fp8, w_scale, out=out[:, :N])
    out[:, N:] = F.linear(x, a16)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="gate_up, down, attn_kv at M 1, 32, 2048")
    p.add_argument("--sweep", action="store_true", help="time candidate tile configurations instead")
    p.add_argument("--sweep-tma", action="store_true", help="decode sizes: pointer loads against TMA tiles")
    p.add_argument("--sweep-weight-only", action="store_true", help="the weight-only GEMM's tiles and crossover")
    p.add_argument("--extra-rows", action="store_true", help="16-bit rows (LoRA A) in the FP8 launch against beside it")
    p.add_argument("--extra-groups", default=str(T.EXTRA_GROUPS), help="K groups per extra chunk, e.g. 1,2,4")
    p.add_argument("--fold", action="store_true", help="split-K partials summed by the last program, or a launch")
    p.add_argument("--split", action="store_true", help="split activations against dynamic, weight-only and bf16")
    p.add_argument(
        "--split-tokens",
        type=lambda s: tuple(int(t) for t in s.split(",")),
        default=SPLIT_TOKENS,
        help="--split: the token counts, e.g. 512,640,768,896,1024 for SPLIT_BELOW's crossover",
    )
    p.add_argument("--sweep-split", action="store_true", help="the split GEMM's tile candidates on pre-split inputs")
    p.add_argument("--sweep-stages", action="store_true", help="the dynamic GEMM's pipeline depth, decode and medium")
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.fold:
        fold_splits()
        return
    if args.split:
        if not split_table(args.split_tokens):
            print(f"FAIL: a split error is NaN or above {BOUND:.1e}")
            sys.exit(1)
        return
    if args.extra_rows:
        extra_rows([int(g) for g in args.extra_groups.split(",")])
        return
    if args.sweep_weight_only:
        sweep_weight_only()
        return
    if args.sweep_split or args.sweep_stages:
        sweep(SPLIT_SWEEP if args.sweep_split else STAGES_SWEEP, split=args.sweep_split)
        return
    if args.sweep or args.sweep_tma:
        sweep(TMA_SWEEP if args.sweep_tma else SWEEPS)
        return
    shapes = list(QUICK_SHAPES if args.quick else SHAPES)
    if not run_table(shapes, QUICK_TOKENS if args.quick else TOKENS):
        print(f"FAIL: an error is NaN or above {BOUND:.1e}")
        sys.exit(1)


if __name__ == "__main__":
    main()

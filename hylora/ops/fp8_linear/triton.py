"""`reference.fp8_linear` in Triton: per-token activation quantisation and a block-scaled FP8 GEMM.

- `quantize_activation`: one program per (16 rows, group of 128 inputs); bit-equal to the reference.
  Under the interpreter the fp32 → e4m3 rounding is done in fp32 (`_e4m3`), so that the cast itself
  only meets representable values: the interpreter's own fp32 → fp8 cast rounds wrongly (compiled,
  the cast rounds to nearest even itself). Division is correctly rounded (Triton's `/` is the
  approximate `div.full.f32` on NVIDIA): `div_rn` once a row, then two FMAs an element (`_div_rows`).
- `fp8_linear`: y[m, n] = Σ_kb dot(a_fp8[m, kb], b_fp8[n, kb]) · a_scale[m, kb] · b_scale[n // bn, kb],
  one tl.dot per 128-input group (its scales differ group to group), the sum in fp32. On Hopper the
  fp8 MMA accumulates with reduced precision inside one dot; promoting every 128 inputs to fp32 keeps
  that error to 128-term sums (DeepSeek-V3's recipe; ~2e-4 of the output's max on an H200).
  Tiles over (M, N), GROUP_M swizzle for L2 reuse; rows past M / N read the tile's first rows again
  (modulo: unmasked loads) and are not stored; a partial last K group is loaded masked after the
  loop. Where a tile's weight rows share one scale row (bn a multiple of BLOCK_N) the scales cost
  one FMA per element and group. Few tokens: A and B swapped (the weight's rows on the MMA's M side,
  the tokens on its N side of 16 or 32), and K split over programs when the (M, N) tiles alone would
  leave SMs idle: fp32 partials [split, M, N] summed by a second launch (no atomics: deterministic).
  `GemmConfig.fuse_quant` quantises x inside the GEMM instead of in its own launch (slower, below).
  `GemmConfig.tma` (2-32 tokens): `_gemm_tma_kernel` loads both e4m3 tiles by Hopper's TMA (host tensor
  descriptors, where bases and row strides are 16-byte aligned; the pointer kernel elsewhere): no
  address arithmetic in the loop, and TMA's zero fill past M, N and K replaces the masked last group.
- `fp8_weight_only_linear` (`reference.fp8_weight_only_linear`): the same GEMM on unquantised x, the
  weight tile converted to x's dtype in registers (e4m3 values are exact in bf16 and fp16) and the
  dot in x's dtype, times the weight scale per group: x · Wᵀ to fp32 summation order, no activation
  rounding. No quantisation launch; the tensor cores run at x's dtype's rate. 16-bit x at 2-32 tokens
  is loaded by TMA too, and 17-32 tokens take one 32-token tile, so each weight tile is converted
  once. On an H200 (docs/BASELINE.md run 36) it decodes at bf16 F.linear's speed, ~1.6-1.8x the
  dynamic GEMM's time; converting e4m3 → bf16 by integer bit moves instead of the cvt instructions
  made no difference there (the conversion is not what bounds it). Prefill sizes: `cublas`.
- `fp8_split_linear` (`reference.fp8_split_linear`): x split into two e4m3 terms per token and group
  that share one scale (`quantize_activation_split`, bit-equal to the reference: hi = e4m3(x / s), lo =
  e4m3(x / s - hi)), and the dynamic GEMM with a second FP8 dot per weight tile (`LO`), the two summed
  before the scales, which then cost what they cost `fp8_linear`. The weight tile is read and fed
  to the tensor cores as e4m3, as in `fp8_linear`: decode keeps its weight stream, and the activations
  lose ~2^-8 of their value at most (less than a bf16 rounding in norm).
- `dequantize_weight`: W in a 16-bit dtype, bit-equal to the reference (the weight-only prefill).
- `extra=(x16, rows)` on both GEMMs: E more output columns x16 · rowsᵀ (16-bit rows: the GDN in_proj's
  unquantised b / a rows, every slot's LoRA A), computed by extra programs of the same launch, placed
  first in the grid. They split K on their own, in chunks of at most EXTRA_GROUPS groups (their loads
  are not pipelined, to leave the FP8 tiles' shared memory as it is), into fp32 partials that one sum
  launch adds (with the FP8 columns' split-K partials where those exist); above 128 tokens each takes
  its split's whole K, so no partials grow with a prompt. On an H200 (docs/BASELINE.md run 38) this
  beat the FP8 GEMM plus a 16-bit F.linear beside it on every decode shape (up to 7 us a projection);
  at decode sizes, whole-K extra programs placed last in the grid had been up to 2x slower (run 37).

- Folding (`_finish_tile`, one token with extra rows): the split tiles' last program to finish sums
  the partials itself, counted by per-tile arrival counters that live on the device (`_fold_counters`)
  and that the summing program sets back to zero: no sum launch. The same bits as the launch for the
  FP8 columns (the same order). Elsewhere the sum launch was as fast or faster (docs/BASELINE.md run 40).

No host sync and no data-dependent Python: the launches depend on the shapes alone (CUDA-graph safe).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from hylora.ops.fp8_linear.reference import (
    AMAX_FLOOR,
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    GROUP,
    Extra,
    QuantizedActivation,
    _check_scales,
    check_extra,
    check_split_input,
    with_extra,
)

QUANT_BLOCK_M = 16  # rows per quantisation program
DEQUANT_ROWS = 32  # weight rows per dequantisation program (one K group each)
SUM_BLOCK = 1024  # outputs per program of the split-K sum
EXTRA_GROUPS = 2  # K groups per extra-rows program at most (they run unpipelined: short chunks)
EXTRA_CHUNKED_UP_TO = 128  # tokens; more: the extra rows take their split's whole K (`_extra_split`)
EXTRA_SUM_ELEMENTS = 4096  # partials one program of the extra columns' sum loads at once
EXTRA_SUM_MIN_SPLIT = 32  # the sum's compiled chunk count: 32 or, past it, the next power of two
# The last program of a split tile may sum its partials itself (`_finish_tile`) instead of a sum launch
# after the GEMM. On an H200 (docs/BASELINE.md run 40 b; CUDA graphs) that paid only at one token with
# extra rows: 0.6-2.1 us less per projection than the extra rows' sum launch. Without extra rows the
# split FP8 columns' sum launch was 0.3-0.8 us faster, and at 8-32 tokens one program reading 20-68
# partial tiles in turn cost up to 33 us (the launch reads them in parallel).
FOLD_SPLITS = True  # False: always the sum launch (the A/B switch)
FOLD_UP_TO_TOKENS = 1
FOLD_WITHOUT_EXTRA = False
FOLD_COUNTERS = 1 << 14  # arrival counters per device; a launch with more split tiles sums in a launch of its own
# the GEMMs' extra-rows arguments that vary with the token count or the adapters: not specialised on
# (== 1, multiples of 16), so that they add no compiled variants (the row strides stay specialised)
_EXTRA_RUNTIME_ARGS = [
    "E", "stride_ecm", "stride_ecs", "ec_col0", "extra_programs", "extra_per_split", "extra_chunk", "stride_ym"
]  # fmt: skip
_FP8_MAX = tl.constexpr(FP8_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_FLT_MAX = tl.constexpr(3.4028234663852886e38)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # tokens per tile (16 at least: tl.dot)
    block_n: int  # weight rows per tile
    num_warps: int
    num_stages: int
    max_split_k: int = 1  # split K up to this many ways when the tiles alone leave SMs idle
    swap_ab: bool = False  # dot(W tile, x tileᵀ): weight rows on the MMA's M side (few tokens)
    fuse_quant: bool = False  # quantise x inside the GEMM (each N tile quantises its x tiles again)
    group_m: int = 8  # M tiles swept together per N tile (L2 reuse of the weight)
    programs_per_sm: int = 2  # split K until the grid holds this many programs per SM
    tma: bool = False  # load the e4m3 tiles by Hopper's TMA (tensor descriptors) where the operands allow it
    warp_specialize: bool = False  # TMA tiles: Triton's warp specialisation of the K loop (a sweep candidate)


# From H200 sweeps (bench/fp8_gemm_gpu.py --sweep) at the Qwen3.6-27B shapes, bf16 x:
# - decode is a weight stream (down_proj's 5120 x 17408 fp8 is 89 MB, ~21 us at 4.3 TB/s): swap A and
#   B (weight rows on the MMA's M side, 64 at a time), split K until 2 programs sit on every SM, 4
#   stages. One token takes 128-row tiles and 8 warps (Triton specialises M = 1 as a constant; the
#   64-row tile ran up to 25% slower there). 17-32 tokens: 32-token tiles where N is narrow (split K
#   on), two 16-token tiles where N is wide. ~2.7-3.5 TB/s on the large linears. 2-32 tokens load their
#   tiles by TMA (--sweep-tma, 2026-12-03: 4-8% less time on gate_up, the GDN in_proj and o_proj at 32
#   tokens, within 3% either way elsewhere; at one token no better).
# - quantising x inside the GEMM (fuse_quant) ran 1.3-1.8x slower than the separate launch: each
#   weight tile quantises its x tile again (div_rn, amax) on the critical path.
# - from 33 tokens: 64 x 128 tiles, one warpgroup (two CTAs per SM overlap one's scale FMAs with the
#   other's MMAs); 128 x 128 tiles with 8 warps use all 255 registers, one CTA per SM, and ran slower.
#   Prefill runs at about bf16 F.linear's speed; cuBLAS's block-scaled torch._scaled_mm was ~1.5x
#   faster there (and slower than these kernels below 32 tokens).
DECODE_1 = GemmConfig(block_m=16, block_n=128, num_warps=8, num_stages=3, max_split_k=8, swap_ab=True)
DECODE = GemmConfig(block_m=16, block_n=64, num_warps=4, num_stages=4, max_split_k=8, swap_ab=True, tma=True)
DECODE_32 = GemmConfig(block_m=32, block_n=64, num_warps=4, num_stages=4, max_split_k=8, swap_ab=True, tma=True)
MEDIUM = GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=4, max_split_k=4)
PREFILL = GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, group_m=16)
WIDE_N = 12288  # from this many output features, 17-32 tokens take two 16-token tiles
PREFILL_FROM = 1024  # tokens
MIN_GROUPS_PER_SPLIT = 4  # 512 inputs at least per split


# Split activations (two x tiles a stage): 3 stages. H100 sweep (bench/fp8_gemm_gpu.py --sweep-split, BASELINE
# run 54), the split GEMM on pre-split inputs, a layer's gate_up + down + GDN in_proj + o_proj: 5.7-6.8 % less
# time at 8-16 tokens (gate_up 73 -> 63 us), 3 % at 32, 9-12 % at 64-256 (MEDIUM); the dynamic GEMM's
# depth, swept the same way (--sweep-stages), stays at 4 (3 was within +-4 %, either way by shape)
SPLIT_STAGES = 3


def choose_config(num_tokens: int, out_features: int, weight_only: bool = False, split: bool = False) -> GemmConfig:
    config = _size_config(num_tokens, out_features, weight_only)
    if split and config.num_stages > SPLIT_STAGES:
        return replace(config, num_stages=SPLIT_STAGES)
    return config


def _size_config(num_tokens: int, out_features: int, weight_only: bool) -> GemmConfig:
    if num_tokens == 1:
        return DECODE_1
    # weight-only: one 32-token tile, each weight tile converted once (two 16-token tiles convert it twice)
    if num_tokens <= 16 or (num_tokens <= 32 and out_features >= WIDE_N and not weight_only):
        return DECODE
    if num_tokens <= 32:
        return DECODE_32
    return MEDIUM if num_tokens < PREFILL_FROM else PREFILL


def split_k(config: GemmConfig, M: int, N: int, groups: int, num_sms: int) -> int:
    """Ways to split the K groups: 1 unless the (M, N) tiles fill fewer than programs_per_sm per SM."""
    tiles = triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)
    want = triton.cdiv(config.programs_per_sm * num_sms, tiles)
    split = max(1, min(config.max_split_k, want, groups // MIN_GROUPS_PER_SPLIT))
    return triton.cdiv(groups, triton.cdiv(groups, split))  # no empty split


@functools.lru_cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: decide as on an H200
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache
def _has_tma(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9  # the interpreter emulates it


def quantize_activation(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (x_fp8 [M, K] e4m3, x_scale [M, ceil(K/group)] fp32), bit-equal to the reference."""
    q, _, s = _quantize(x, group, split=False)
    return q, s


def quantize_activation_split(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] → (hi, lo, scale), bit-equal to `reference.quantize_activation_split`."""
    return _quantize(x, group, split=True)


def _quantize(x: torch.Tensor, group: int, split: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] → (q or hi, lo (q itself unless split), scale)."""
    M, K = x.shape
    _check_group(group)
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(M, K, dtype=FP8_DTYPE, device=x.device)
    lo = torch.empty_like(q) if split else q
    s = torch.empty(M, triton.cdiv(K, group), dtype=torch.float32, device=x.device)
    if M and K:
        grid = (triton.cdiv(M, QUANT_BLOCK_M), triton.cdiv(K, group))
        _quantize_kernel[grid](
            x, q, lo, s, M, K, x.stride(0), s.stride(0), BLOCK_M=QUANT_BLOCK_M, GROUP=group, SPLIT=split
        )
    return q, lo, s


def fp8_linear(
    x: torch.Tensor | QuantizedActivation,  # [..., K] bf16 / fp16 / fp32, or [M, K] quantised already
    w_fp8: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [ceil(N/bn), ceil(K/bk)]
    block: tuple[int, int] = BLOCK,
    out: torch.Tensor | None = None,  # [..., N (+ E)] in x.dtype
    config: GemmConfig | None = None,  # None: choose_config(tokens, N)
    extra: Extra | None = None,  # E more output columns from 16-bit rows, in the same launch
) -> torch.Tensor:
    """y [..., N (+ E)] = `reference.fp8_linear(x, w_fp8, w_scale, block, extra=extra)` up to fp32
    summation order (and the fp8 MMA's own accumulation on a GPU), written into `out` when given."""
    if isinstance(x, QuantizedActivation):
        return _linear(x.q, w_fp8, w_scale, block, out, config, weight_only=False, quantized=x, extra=extra)
    return _linear(x, w_fp8, w_scale, block, out, config, weight_only=False, extra=extra)


def fp8_weight_only_linear(
    x: torch.Tensor,  # [..., K] bf16 / fp16 / fp32 (fp32: exact fp32 dots, slow; a reference aid)
    w_fp8: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [ceil(N/bn), ceil(K/bk)]
    block: tuple[int, int] = BLOCK,
    out: torch.Tensor | None = None,  # [..., N (+ E)] in x.dtype
    config: GemmConfig | None = None,  # None: choose_config(tokens, N); fuse_quant is ignored
    extra: Extra | None = None,  # E more output columns from 16-bit rows, in the same launch
) -> torch.Tensor:
    """y [..., N (+ E)] = `reference.fp8_weight_only_linear(x, w_fp8, w_scale, block, extra=extra)` up
    to fp32 summation order: x unquantised, the weights' exact values."""
    return _linear(x, w_fp8, w_scale, block, out, config, weight_only=True, extra=extra)


def fp8_split_linear(
    x: torch.Tensor | QuantizedActivation,  # [..., K] bf16 / fp16 / fp32, or [M, K] split already
    w_fp8: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [ceil(N/bn), ceil(K/bk)]
    block: tuple[int, int] = BLOCK,
    out: torch.Tensor | None = None,  # [..., N (+ E)] in x.dtype
    config: GemmConfig | None = None,  # None: choose_config(tokens, N, split=True); fuse_quant is ignored
    extra: Extra | None = None,  # E more output columns from 16-bit rows, in the same launch
) -> torch.Tensor:
    """y [..., N (+ E)] = `reference.fp8_split_linear(x, w_fp8, w_scale, block, extra=extra)` up to fp32
    summation order (and the fp8 MMA's own accumulation on a GPU): x as two e4m3 terms, two FP8 dots.
    x may come split already (a QuantizedActivation with lo, from its producer's launch)."""
    check_split_input(x)
    if isinstance(x, QuantizedActivation):
        return _linear(x.q, w_fp8, w_scale, block, out, config, False, quantized=x, extra=extra, split=True)
    return _linear(x, w_fp8, w_scale, block, out, config, weight_only=False, extra=extra, split=True)


def _linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    out: torch.Tensor | None,
    config: GemmConfig | None,
    weight_only: bool,
    quantized: QuantizedActivation | None = None,  # x is its q: no quantisation launch
    extra: Extra | None = None,
    split: bool = False,  # x as two e4m3 terms (quantize_activation_split), a second dot per tile
) -> torch.Tensor:
    *lead, K = x.shape
    dtype = x.dtype if quantized is None else quantized.dtype
    N = w_fp8.shape[0]
    bn, bk = block
    _check_group(bk)
    if w_fp8.shape[1] != K or w_fp8.dtype != FP8_DTYPE or w_fp8.stride(1) != 1:
        raise ValueError(f"fp8_linear: needs an e4m3 weight [N, {K}] with unit stride along K")
    _check_scales(w_scale, N, K, block)
    E = check_extra(extra, lead, K, dtype)
    width = N + E  # the output's columns: N from the FP8 weight, then E from the extra rows
    if out is None:
        out = torch.empty(*lead, width, dtype=dtype, device=x.device)
    elif out.shape != (*lead, width) or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"fp8_linear: out must be [{', '.join(map(str, (*lead, width)))}] {dtype}, unit last stride")
    x2, y = x.reshape(-1, K), out.view(-1, width)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if M == 0 or width == 0:
        return out
    if K == 0:
        return out.zero_()
    if N == 0:  # only extra rows (not a path the model takes: a projection has FP8 rows)
        return with_extra(out[..., :0], out, extra)
    ex, ew = _extra_operands(extra, x2, M, K)
    cfg = config or choose_config(M, N, weight_only, split)
    fuse_quant = cfg.fuse_quant and not weight_only and quantized is None and not split
    groups = triton.cdiv(K, bk)
    ksplit = split_k(cfg, M, N, groups, _num_sms(x.device))
    a2 = None  # the second e4m3 term of x (split; its scale is a_scale too)
    if quantized is not None:
        a, a_scale = x2, quantized.scale
        a2 = quantized.lo.reshape(M, K) if split else None
    elif split:
        a, a2, a_scale = quantize_activation_split(x2, bk)
    elif fuse_quant or weight_only:
        a, a_scale = x2, x2  # the kernel reads x itself (and quantises it when fused); no scale tensor
    else:
        a, a_scale = quantize_activation(x2, bk)
    target = y if ksplit == 1 else torch.empty(ksplit, M, N, dtype=torch.float32, device=x.device)
    tiles_m = triton.cdiv(M, cfg.block_m)
    tiles_n = triton.cdiv(N, cfg.block_n)
    per_split, chunk, chunks = _extra_split(groups, ksplit, M) if E else (0, 0, 1)
    extra_tiles = tiles_m * triton.cdiv(E, cfg.block_n)
    extra_programs = extra_tiles * per_split
    # the extra columns: straight into y when one chunk holds all of K, else fp32 partials [chunks, M, E]
    e_target = y if chunks == 1 else torch.empty(chunks, M, E, dtype=torch.float32, device=x.device)
    e_col0, e_stride_s = (N, 0) if chunks == 1 else (0, M * E)
    # split tiles: the last of their programs to finish sums the partials (counters: main tiles, then extra)
    folds = (ksplit > 1 or chunks > 1) and M <= FOLD_UP_TO_TOKENS and (E > 0 or FOLD_WITHOUT_EXTRA)
    counters = _fold_counters(x.device, tiles_m * tiles_n + extra_tiles) if folds else None
    fold = counters is not None
    grid = (extra_programs + tiles_m * tiles_n, ksplit)
    extra_args = (
        ex, ew, e_target, E, ex.stride(0), ew.stride(0), e_target.stride(-2), e_stride_s, e_col0,
        extra_programs, per_split, chunk, y, y.stride(0), counters if fold else y,
    )  # fmt: skip
    precision = "ieee" if dtype == torch.float32 else "tf32"
    # weight-only: TMA for 16-bit x only (an fp32 x tile converted for an fp32 dot is a test aid, not a path to tune)
    tma_x = not weight_only or a.dtype in (torch.bfloat16, torch.float16)
    lo = a2 is not None
    if not lo:  # the kernels' second-term argument, never read
        a2 = a
    if cfg.tma and not fuse_quant and tma_x and _tma_usable(a, w_fp8):
        a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, bk])
        _gemm_tma_kernel[grid](
            a_desc, a_scale, TensorDescriptor.from_tensor(a2, [cfg.block_m, bk]) if lo else a_desc,
            TensorDescriptor.from_tensor(w_fp8, [cfg.block_n, bk]), w_scale, target,
            M, N, bn, triton.cdiv(groups, ksplit), a_scale.stride(0), w_scale.stride(0), target.stride(-2),
            M * N if ksplit > 1 else 0, *extra_args,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m, SWAP_AB=cfg.swap_ab,
            ONE_B_SCALE=bn % cfg.block_n == 0, WEIGHT_ONLY=weight_only, LO=lo, HAS_EXTRA=E > 0,
            PRECISION=precision, FOLD=fold, WARP_SPECIALIZE=cfg.warp_specialize, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
    else:
        _gemm_kernel[grid](
            a, a_scale, a2, w_fp8, w_scale, target,
            M, N, K, bn, triton.cdiv(groups, ksplit),
            a.stride(0), a_scale.stride(0), w_fp8.stride(0), w_scale.stride(0), target.stride(-2),
            M * N if ksplit > 1 else 0, *extra_args,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m,
            SWAP_AB=cfg.swap_ab, FUSE_QUANT=fuse_quant, WEIGHT_ONLY=weight_only, EVEN_K=K % bk == 0,
            ONE_B_SCALE=bn % cfg.block_n == 0, LO=lo, HAS_EXTRA=E > 0, PRECISION=precision, FOLD=fold,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    if not fold and E and chunks > 1:  # one launch sums both column ranges' partials
        main_programs = triton.cdiv(M * N, SUM_BLOCK) if ksplit > 1 else 0
        split_extra = max(EXTRA_SUM_MIN_SPLIT, triton.next_power_of_2(chunks))  # few compiled variants
        block_e = max(16, EXTRA_SUM_ELEMENTS // split_extra)
        _sum_with_extra_kernel[(main_programs + triton.cdiv(M * E, block_e),)](
            target, e_target, y, M, N, E, y.stride(0), main_programs, ksplit, chunks,
            SPLIT_EXTRA=split_extra, BLOCK=SUM_BLOCK, BLOCK_E=block_e,
        )  # fmt: skip
    elif not fold and ksplit > 1:
        _sum_splits_kernel[(triton.cdiv(M * N, SUM_BLOCK),)](
            target, y, M * N, N, y.stride(0), SPLIT=ksplit, BLOCK=SUM_BLOCK
        )
    return out


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _fold_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's arrival counters (int32 zeros; each folding program that sums a tile sets its
    counter back to 0), or None: folding off, more tiles than counters, or no counters yet while a
    CUDA graph captures (an allocation there would belong to the graph's pool). The engine launches
    its GEMMs on one stream, so no two launches share a counter at once."""
    if not FOLD_SPLITS or tiles > FOLD_COUNTERS:
        return None
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _COUNTERS[device] = torch.zeros(FOLD_COUNTERS, dtype=torch.int32, device=device)
    return counters


def _extra_operands(extra: Extra | None, x: torch.Tensor, M: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The extra rows' x [M, K] and w [E, K] with unit stride along K (without extra: x twice, which
    the kernel then never reads)."""
    if extra is None:
        return x, x
    x16, w16 = extra
    x16 = x16.reshape(M, K)
    return (x16 if x16.stride(1) == 1 else x16.contiguous()), (w16 if w16.stride(1) == 1 else w16.contiguous())


def _extra_split(groups: int, split: int, tokens: int) -> tuple[int, int, int]:
    """How the extra rows split K: (programs per extra tile in each of the FP8 GEMM's K splits, K groups
    per chunk, chunks). Chunks of at most EXTRA_GROUPS groups, so that an extra program (loads not
    pipelined) finishes within an FP8 tile's time; chunk j of split s is chunk j * split + s. Above
    EXTRA_CHUNKED_UP_TO tokens (prefill sizes, where the FP8 tiles run many waves and the extra
    programs, first in the grid, finish long before them) each split's whole K: the fp32 partials
    [chunks, tokens, E] would grow with the tokens."""
    if tokens > EXTRA_CHUNKED_UP_TO:
        return 1, triton.cdiv(groups, split), split
    per_split = triton.cdiv(triton.cdiv(groups, split), EXTRA_GROUPS)
    chunk = triton.cdiv(groups, split * per_split)
    return per_split, chunk, triton.cdiv(groups, chunk)


def dequantize_weight(
    w_fp8: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [ceil(N/bn), ceil(K/bk)] fp32
    block: tuple[int, int] = BLOCK,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,  # [N, K] dtype
) -> torch.Tensor:
    """W [N, K] in `dtype` = `reference.dequantize_weight`, bit for bit: each e4m3 value times its
    block's scale in fp32, rounded once to `dtype`."""
    N, K = w_fp8.shape
    bn, bk = block
    _check_group(bk)
    _check_scales(w_scale, N, K, block)
    if w_fp8.stride(1) != 1:
        raise ValueError("dequantize_weight: needs unit stride along K")
    if out is None:
        out = torch.empty(N, K, dtype=dtype, device=w_fp8.device)
    if N and K:
        grid = (triton.cdiv(N, DEQUANT_ROWS), triton.cdiv(K, bk))
        _dequantize_kernel[grid](
            w_fp8, w_scale, out, N, K, bn, w_fp8.stride(0), w_scale.stride(0), out.stride(0),
            BLOCK_N=DEQUANT_ROWS, BLOCK_K=bk,
        )  # fmt: skip
    return out


def _tma_usable(a: torch.Tensor, w: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned bases and row strides (and Hopper or newer; the interpreter emulates it)."""
    if not _has_tma(a.device):
        return False
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 and t.stride(1) == 1 for t in (a, w))


def _check_group(group: int) -> None:
    if group < 32 or group & (group - 1):
        raise ValueError(f"fp8 group / K block must be a power of two ≥ 32 (one tl.dot), got {group}")


@triton.jit
def _e4m3(q):
    """fp32 q, |q| ≤ 448 → e4m3, rounded to nearest even (`_e4m3_value`); the cast meets exact values only."""
    return _e4m3_value(q).to(tl.float8e4nv)


@triton.jit
def _e4m3_value(q):
    """fp32 q, |q| ≤ 448 → its e4m3 rounding (to nearest even) as an fp32 value: q + c - c with
    c = 1.5·2^23 e4m3 ulps of q rounds q to a multiple of that ulp in fp32 arithmetic."""
    bits = q.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    # e4m3 keeps 3 mantissa bits; below its smallest normal 2^-6 (biased 121) the ulp stays 2^-9
    ulp = ((tl.maximum(exponent, 121) - 3) << 23).to(tl.float32, bitcast=True)
    magic = ulp * 12582912.0
    rounded = (tl.abs(q) + magic) - magic
    sign = (bits >> 31) << 31
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


# Compiled, the e4m3 cast is cvt.rn.satfinite.e4m3x2.f32, itself round-to-nearest-even, and tl.fma one
# rounding: `_e4m3`'s ~10 operations an element and div_rn an element only serve the interpreter
# (TRITON_INTERPRET=1), whose cast rounds half away from zero and whose fma rounds twice
_INTERPRETED = tl.constexpr(isinstance(_e4m3, InterpretedFunction))


@triton.jit
def _div_rows(x, scale):
    """div_rn(x, scale[:, None]) with one IEEE division a row instead of one an element (each a
    MUFU.RCP, five FFMAs, an FCHK and a branch to a slow path, serialised by BSSY/BSYNC): y = RN(1/s)
    is within half an ulp of 1/s and q0 = RN(x·y) within one ulp of x/s, so with the exact remainder
    r = x - q0·s (an fma), RN(q0 + r·y) = RN(x/s) (Markstein's theorem, barring underflow of the
    remainder or the quotient: subnormal x or q, all at |q| < 2^-50, an e4m3 zero either way;
    tests/test_fp8_row_division.py). r = -(q0·s - x) negated by `* -1.0`
    (Triton's unary minus is 0 - v) is -0 for x = -0, which then stays -0. A row holding an inf has
    s = inf: the fma takes FLT_MAX instead, so r·y = x·0 and q = x·0 = x / inf (NaN for x = ±inf)."""
    y = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None]
    s = tl.minimum(scale, _FLT_MAX)[:, None]
    q0 = x * y
    r = tl.fma(q0, s, x * -1.0) * -1.0
    return tl.fma(r, y, q0)


@triton.jit
def _quantize_rows(x):
    """x [R, GROUP] fp32, one group per row → (e4m3 [R, GROUP], scale [R] fp32), as the reference."""
    q, scale = _scaled_rows(x)
    return _to_e4m3(q), scale


@triton.jit
def _quantize_split_rows(x):
    """x [R, GROUP] fp32, one group per row → (hi, lo e4m3 [R, GROUP], scale [R] fp32), as the reference:
    `_quantize_rows`' q = x / scale as hi = e4m3(q) and lo = e4m3(q - hi) (an exact difference). hi's
    value is rounded in fp32 arithmetic (`_e4m3_value`), not read back from its e4m3 registers: on an
    H100 the fp32 → e4m3 → fp32 round trip in registers gave wrong values (lo off by up to 448)."""
    q, scale = _scaled_rows(x)
    hi_value = _e4m3_value(q)
    return hi_value.to(tl.float8e4nv), _to_e4m3(q - hi_value), scale  # hi's cast meets exact values


@triton.jit
def _store_quantized_rows(h, q_ptr, lo_ptr, s_ptr, offsets, mask, s_offsets, s_mask, SPLIT: tl.constexpr):
    """A producer's h [R, GROUP] (one group per row) quantised as `quantize_activation` (SPLIT: both terms
    of `quantize_activation_split`) into q (and lo) at `offsets`, each row's scale at `s_offsets`."""
    if SPLIT:
        q, lo, scale = _quantize_split_rows(h.to(tl.float32))
        tl.store(lo_ptr + offsets, lo, mask=mask)
    else:
        q, scale = _quantize_rows(h.to(tl.float32))
    tl.store(q_ptr + offsets, q, mask=mask)
    tl.store(s_ptr + s_offsets, scale, mask=s_mask)


@triton.jit
def _scaled_rows(x):
    """x [R, GROUP] fp32 → (x / scale clamped to ±448, fp32; scale [R] = amax / 448), as the reference."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, _AMAX_FLOOR), _FP8_MAX)
    if _INTERPRETED:
        q = tl.math.div_rn(x, scale[:, None])
    else:
        q = _div_rows(x, scale)
    return tl.minimum(tl.maximum(q, -_FP8_MAX), _FP8_MAX), scale


@triton.jit
def _to_e4m3(q):
    """fp32 |q| ≤ 448 → e4m3, rounded to nearest even."""
    if _INTERPRETED:
        return _e4m3(q)
    else:
        return q.to(tl.float8e4nv)


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, lo_ptr, s_ptr, M, K, stride_xm, stride_sm,
    BLOCK_M: tl.constexpr, GROUP: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """x [M, K] quantised per token and GROUP inputs into q [M, K] (SPLIT: hi and lo) and the scales."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    rk = g * GROUP + tl.arange(0, GROUP)
    mask = (rm < M)[:, None] & (rk < K)[None, :]
    rows = rm.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows * stride_xm + rk[None, :], mask=mask, other=0.0)
    _store_quantized_rows(x, q_ptr, lo_ptr, s_ptr, rows * K + rk[None, :], mask, rm.to(tl.int64) * stride_sm + g,
                          rm < M, SPLIT)  # fmt: skip


@triton.jit
def _dequantize_kernel(
    w_ptr, s_ptr, out_ptr, N, K, bn, stride_wn, stride_sn, stride_on, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    rk = g * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    rows = rn.to(tl.int64)[:, None]
    w = tl.load(w_ptr + rows * stride_wn + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(s_ptr + (rn // bn).to(tl.int64) * stride_sn + g, mask=rn < N, other=0.0)
    tl.store(out_ptr + rows * stride_on + rk[None, :], (w * scale[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=_EXTRA_RUNTIME_ARGS)
def _gemm_kernel(
    a_ptr,  # [M, K] e4m3, or x itself when FUSE_QUANT or WEIGHT_ONLY
    as_ptr,  # [M, K / BLOCK_K] fp32 (unused when FUSE_QUANT or WEIGHT_ONLY)
    a2_ptr,  # LO: x's second e4m3 term [M, K] (a's strides and scales); else a_ptr again, not read
    b_ptr,  # [N, K] e4m3
    bs_ptr,  # [N / bn, K / BLOCK_K]
    c_ptr,  # [M, N (+ E)] out, or [split, M, N] fp32 partials
    M, N, K, bn, groups_per_split,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_cm, stride_cs,
    ex_ptr, ew_ptr, ec_ptr, E, stride_exm, stride_ewn, stride_ecm, stride_ecs, ec_col0,  # HAS_EXTRA: `_extra_tile`
    extra_programs, extra_per_split, extra_chunk, y_ptr, stride_ym, cnt_ptr,  # FOLD: `_finish_tile`
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SWAP_AB: tl.constexpr, FUSE_QUANT: tl.constexpr, WEIGHT_ONLY: tl.constexpr, EVEN_K: tl.constexpr,
    ONE_B_SCALE: tl.constexpr, LO: tl.constexpr, HAS_EXTRA: tl.constexpr, PRECISION: tl.constexpr,
    FOLD: tl.constexpr,
):  # fmt: skip
    split = tl.program_id(1)
    kb0 = split * groups_per_split
    kb1 = tl.minimum(kb0 + groups_per_split, tl.cdiv(K, BLOCK_K))
    pid = tl.program_id(0) - extra_programs  # the extra rows' programs come first: short, they finish early
    if pid >= 0:
        pid_m, pid_n = _tile_ids(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        om = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        on = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = (om % M).to(tl.int64)
        rn = (on % N).to(tl.int64)
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :]  # group 0; group kb at + kb * BLOCK_K
        a2_ptrs = a2_ptr + rm[:, None] * stride_am + rk[None, :]
        b_ptrs = b_ptr + rn[:, None] * stride_bn + rk[None, :]
        as_ptrs = as_ptr + rm * stride_asm
        if ONE_B_SCALE:  # the tile's rows share one scale row (rows past N are not stored)
            bs_ptrs = bs_ptr + (pid_n * BLOCK_N // bn).to(tl.int64) * stride_bsn
        else:
            bs_ptrs = bs_ptr + (rn // bn) * stride_bsn

        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # whole groups unmasked, a partial last group (K % BLOCK_K) masked after the loop: the mask
        # varies along the contiguous dimension, which would cost the loop's loads their vector width
        for kb in range(kb0, tl.minimum(kb1, K // BLOCK_K)):
            a = tl.load(a_ptrs + kb * BLOCK_K)
            b = tl.load(b_ptrs + kb * BLOCK_K)
            a2 = tl.load(a2_ptrs + kb * BLOCK_K) if LO else a
            acc = _accumulate(
                acc, a, b, as_ptrs + kb, bs_ptrs + kb, a2, SWAP_AB, FUSE_QUANT, WEIGHT_ONLY, ONE_B_SCALE, LO,
                PRECISION,
            )  # fmt: skip
        if not EVEN_K:  # noqa: SIM102 (a constexpr test, then a runtime one)
            if kb1 * BLOCK_K > K:  # this split holds the partial group
                kb = kb1 - 1
                k_in = (rk < K - kb * BLOCK_K)[None, :]
                a = tl.load(a_ptrs + kb * BLOCK_K, mask=k_in, other=0.0)
                b = tl.load(b_ptrs + kb * BLOCK_K, mask=k_in, other=0.0)
                a2 = tl.load(a2_ptrs + kb * BLOCK_K, mask=k_in, other=0.0) if LO else a
                acc = _accumulate(
                    acc, a, b, as_ptrs + kb, bs_ptrs + kb, a2, SWAP_AB, FUSE_QUANT, WEIGHT_ONLY, ONE_B_SCALE, LO,
                    PRECISION,
                )  # fmt: skip
        _finish_tile(
            acc, c_ptr, stride_cs, split, tl.num_programs(1), cnt_ptr + pid, y_ptr, stride_ym, om, on, M, N,
            stride_cm, SWAP_AB, FOLD,
        )  # fmt: skip
    else:
        if HAS_EXTRA:  # noqa: SIM102 (the grid holds these programs only then)
            _extra_tile(
                ex_ptr, ew_ptr, ec_ptr, tl.program_id(0), M, E, K, stride_exm, stride_ewn, stride_ecm,
                stride_ecs, ec_col0, extra_per_split, extra_chunk, y_ptr + N, stride_ym,
                cnt_ptr + tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N),  # the extra tiles' counters follow the main's
                BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, PRECISION, FOLD,
            )  # fmt: skip


@triton.jit(do_not_specialize=_EXTRA_RUNTIME_ARGS)
def _gemm_tma_kernel(
    a_desc,  # [M, K] e4m3, tiles [BLOCK_M, BLOCK_K]; rows past M and inputs past K read as zeros
    as_ptr,  # [M, K / BLOCK_K] fp32
    a2_desc,  # LO: x's second e4m3 term (a's scales), as a_desc; else a_desc again, not read
    b_desc,  # [N, K] e4m3, tiles [BLOCK_N, BLOCK_K]
    bs_ptr,  # [N / bn, K / BLOCK_K]
    c_ptr,  # [M, N (+ E)] out, or [split, M, N] fp32 partials
    M, N, bn, groups_per_split, stride_asm, stride_bsn, stride_cm, stride_cs,
    ex_ptr, ew_ptr, ec_ptr, E, stride_exm, stride_ewn, stride_ecm, stride_ecs, ec_col0,  # HAS_EXTRA: `_extra_tile`
    extra_programs, extra_per_split, extra_chunk, y_ptr, stride_ym, cnt_ptr,  # FOLD: `_finish_tile`
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SWAP_AB: tl.constexpr, ONE_B_SCALE: tl.constexpr, WEIGHT_ONLY: tl.constexpr, LO: tl.constexpr,
    HAS_EXTRA: tl.constexpr, PRECISION: tl.constexpr, FOLD: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):  # fmt: skip
    """`_gemm_kernel` with both tiles loaded by TMA (x's e4m3 tile, or with WEIGHT_ONLY x's 16-bit
    tile itself): no address arithmetic or vector loads in the loop, and the zero fill past K and N
    replaces the masked last group. The extra rows' tiles are loaded by pointers (a few tiles)."""
    split = tl.program_id(1)
    K = a_desc.shape[1]
    kb0 = split * groups_per_split
    kb1 = tl.minimum(kb0 + groups_per_split, tl.cdiv(K, BLOCK_K))
    pid = tl.program_id(0) - extra_programs  # the extra rows' programs come first: short, they finish early
    if pid >= 0:
        pid_m, pid_n = _tile_ids(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        om = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        on = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        as_ptrs = as_ptr + (om % M).to(tl.int64) * stride_asm  # rows past M: a real row's scale times zeros
        if ONE_B_SCALE:
            bs_ptrs = bs_ptr + (pid_n * BLOCK_N // bn).to(tl.int64) * stride_bsn
        else:
            bs_ptrs = bs_ptr + ((on % N) // bn).to(tl.int64) * stride_bsn
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in tl.range(kb0, kb1, warp_specialize=WARP_SPECIALIZE):
            a = a_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
            b = b_desc.load([pid_n * BLOCK_N, kb * BLOCK_K])
            a2 = a2_desc.load([pid_m * BLOCK_M, kb * BLOCK_K]) if LO else a
            acc = _accumulate(
                acc, a, b, as_ptrs + kb, bs_ptrs + kb, a2, SWAP_AB, False, WEIGHT_ONLY, ONE_B_SCALE, LO, "tf32"
            )
        _finish_tile(
            acc, c_ptr, stride_cs, split, tl.num_programs(1), cnt_ptr + pid, y_ptr, stride_ym, om, on, M, N,
            stride_cm, SWAP_AB, FOLD,
        )  # fmt: skip
    else:
        if HAS_EXTRA:  # noqa: SIM102 (the grid holds these programs only then)
            _extra_tile(
                ex_ptr, ew_ptr, ec_ptr, tl.program_id(0), M, E, K, stride_exm, stride_ewn, stride_ecm,
                stride_ecs, ec_col0, extra_per_split, extra_chunk, y_ptr + N, stride_ym,
                cnt_ptr + tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N),  # the extra tiles' counters follow the main's
                BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, PRECISION, FOLD,
            )  # fmt: skip


@triton.jit
def _extra_tile(
    x_ptr, w_ptr, c_ptr, pid, M, E, K, stride_xm, stride_wn, stride_cm, stride_cs, col0, per_split, chunk,
    y_ptr, stride_ym, cnt_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr, PRECISION: tl.constexpr, FOLD: tl.constexpr,
):  # fmt: skip
    """Output columns [pid's BLOCK_N of E] = x · wᵀ over one chunk of K (`_extra_split`): 16-bit rows (an
    unquantised tail, every slot's LoRA A) served in the FP8 GEMM's launch; 16-bit dots, fp32 sums.
    c: y itself from column col0 (one chunk), or chunk c's fp32 partial at c_ptr + c * stride_cs; FOLD: the
    tile's last chunk to finish sums them into y_ptr (y from column N) with counter cnt_ptr + tile."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tile = pid // per_split
    c = (pid % per_split) * tl.num_programs(1) + tl.program_id(1)  # this program's chunk of K
    kb0 = c * chunk
    kb1 = tl.minimum(kb0 + chunk, tl.cdiv(K, BLOCK_K))
    if kb0 < kb1:  # the last programs may hold no chunk
        om = (tile % tiles_m) * BLOCK_M + tl.arange(0, BLOCK_M)
        oe = (tile // tiles_m) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + (om % M).to(tl.int64)[:, None] * stride_xm + rk[None, :]
        w_ptrs = w_ptr + (oe % E).to(tl.int64)[:, None] * stride_wn + rk[None, :]
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # not pipelined: the FP8 tiles' shared memory budget (and with it their CTAs per SM) stays as it is
        for kb in tl.range(kb0, tl.minimum(kb1, K // BLOCK_K), num_stages=1):
            x = tl.load(x_ptrs + kb * BLOCK_K)
            w = tl.load(w_ptrs + kb * BLOCK_K)
            acc = _accumulate_unquantised(acc, x, w, 1.0, SWAP_AB, True, PRECISION)
        if kb1 * BLOCK_K > K:  # this chunk holds a partial last group
            kb = kb1 - 1
            k_in = (rk < K - kb * BLOCK_K)[None, :]
            x = tl.load(x_ptrs + kb * BLOCK_K, mask=k_in, other=0.0)
            w = tl.load(w_ptrs + kb * BLOCK_K, mask=k_in, other=0.0)
            acc = _accumulate_unquantised(acc, x, w, 1.0, SWAP_AB, True, PRECISION)
        chunks = tl.cdiv(tl.cdiv(K, BLOCK_K), chunk)
        _finish_tile(
            acc, c_ptr, stride_cs, c, chunks, cnt_ptr + tile, y_ptr, stride_ym, om, col0 + oe, M, col0 + E,
            stride_cm, SWAP_AB, FOLD,
        )  # fmt: skip


@triton.jit
def _tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(M tile, N tile) of program pid: GROUP_M M tiles swept together per N tile (L2 reuse)."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * tiles_n
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % width) % group_size, (pid % width) // group_size


@triton.jit
def _tile_ptrs(c_base, om, on, M, N, stride_cm, SWAP_AB: tl.constexpr):
    """Pointers to c's rows om, columns on (laid out as acc: [BLOCK_N, BLOCK_M] when SWAP_AB, else
    [BLOCK_M, BLOCK_N]) and the mask of those inside [M, N]."""
    if SWAP_AB:
        mask = (on < N)[:, None] & (om < M)[None, :]
        c_ptrs = c_base + om.to(tl.int64)[None, :] * stride_cm + on[:, None]
    else:
        mask = (om < M)[:, None] & (on < N)[None, :]
        c_ptrs = c_base + om.to(tl.int64)[:, None] * stride_cm + on[None, :]
    return c_ptrs, mask


@triton.jit
def _store_tile(acc, c_base, om, on, M, N, stride_cm, SWAP_AB: tl.constexpr):
    c_ptrs, mask = _tile_ptrs(c_base, om, on, M, N, stride_cm, SWAP_AB)
    tl.store(c_ptrs, acc.to(c_base.dtype.element_ty), mask=mask)


@triton.jit
def _finish_tile(
    acc, c_ptr, stride_cs, part, parts, counter_ptr, y_ptr, stride_ym, om, on, M, N, stride_cm,
    SWAP_AB: tl.constexpr, FOLD: tl.constexpr,
):  # fmt: skip
    """Store acc as part `part` of the tile's `parts` (at c_ptr + part * stride_cs: y itself when parts
    is 1). FOLD: the tile's last program to arrive (its counter) sums the fp32 partials in part order,
    the sum launch's order, so the same bits whichever program finishes last, into y (rows stride_ym),
    and sets the counter back to 0 for the next launch. The partials are read past L1, which the
    other SMs' writes do not reach."""
    _store_tile(acc, c_ptr + part.to(tl.int64) * stride_cs, om, on, M, N, stride_cm, SWAP_AB)
    if FOLD:  # noqa: SIM102 (a constexpr test, then a runtime one)
        if parts > 1:
            tl.debug_barrier()  # every thread's partial is stored before thread 0 counts the arrival
            arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
            if arrived == parts - 1:
                total = tl.zeros_like(acc)
                offset = tl.zeros([], dtype=tl.int64)  # of the part read next
                for _ in range(parts):
                    p_ptrs, mask = _tile_ptrs(c_ptr + offset, om, on, M, N, stride_cm, SWAP_AB)
                    total += tl.load(p_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                    offset += stride_cs
                _store_tile(total, y_ptr, om, on, M, N, stride_ym, SWAP_AB)
                tl.store(counter_ptr, 0)


@triton.jit
def _accumulate(
    acc, a, b, as_ptrs, bs_ptrs, a2, SWAP_AB: tl.constexpr, FUSE_QUANT: tl.constexpr, WEIGHT_ONLY: tl.constexpr,
    ONE_B_SCALE: tl.constexpr, LO: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """acc + dot over one group of BLOCK_K inputs, times its activation and weight scales (ONE_B_SCALE:
    bs_ptrs is one pointer, the tile's weight rows share a scale: one FMA per element). LO: x's second
    e4m3 term a2 (a's scales) meets the same weight tile in a second dot, summed with the first."""
    b_scale = tl.load(bs_ptrs).to(tl.float32)
    if WEIGHT_ONLY:
        acc = _accumulate_unquantised(acc, a, b, b_scale, SWAP_AB, ONE_B_SCALE, PRECISION)
    else:
        acc = _accumulate_quantised(acc, a, b, as_ptrs, b_scale, a2, SWAP_AB, FUSE_QUANT, ONE_B_SCALE, LO)
    return acc


@triton.jit
def _accumulate_quantised(
    acc, a, b, as_ptrs, b_scale, a2, SWAP_AB: tl.constexpr, FUSE_QUANT: tl.constexpr, ONE_B_SCALE: tl.constexpr,
    LO: tl.constexpr,
):  # fmt: skip
    """The group with x quantised: its e4m3 tile (quantised here when FUSE_QUANT) and scales; LO: plus
    its second term a2 under the same scales."""
    if FUSE_QUANT:
        a, a_scale = _quantize_rows(a.to(tl.float32))
    else:
        a_scale = tl.load(as_ptrs)
    if SWAP_AB:
        part = tl.dot(b, tl.trans(a))  # [BLOCK_N, BLOCK_M]
        if LO:  # the second term under the same scales: summed before them
            part += tl.dot(b, tl.trans(a2))
        if ONE_B_SCALE:
            acc += part * (a_scale * b_scale)[None, :]
        else:
            acc += part * b_scale[:, None] * a_scale[None, :]
    else:
        part = tl.dot(a, tl.trans(b))  # [BLOCK_M, BLOCK_N]
        if LO:
            part += tl.dot(a2, tl.trans(b))
        if ONE_B_SCALE:
            acc += part * (a_scale * b_scale)[:, None]
        else:
            acc += part * a_scale[:, None] * b_scale[None, :]
    return acc


@triton.jit
def _accumulate_unquantised(
    acc, x, b, b_scale, SWAP_AB: tl.constexpr, ONE_B_SCALE: tl.constexpr, PRECISION: tl.constexpr
):
    """The weight-only group: x as it is, the e4m3 tile converted to x's dtype (exact), so only the
    weight scale applies."""
    w = b.to(x.dtype)
    if SWAP_AB:
        part = tl.dot(w, tl.trans(x), input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
        if ONE_B_SCALE:
            acc += part * b_scale
        else:
            acc += part * b_scale[:, None]
    else:
        part = tl.dot(x, tl.trans(w), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        if ONE_B_SCALE:
            acc += part * b_scale
        else:
            acc += part * b_scale[None, :]
    return acc


@triton.jit
def _sum_splits_kernel(part_ptr, y_ptr, size, N, stride_ym, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < size
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    part_ptrs = part_ptr + i
    for _ in tl.static_range(SPLIT):
        acc += tl.load(part_ptrs, mask=mask, other=0.0)
        part_ptrs += size
    tl.store(y_ptr + (i // N) * stride_ym + i % N, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "N", "E", "main_programs", "split_main", "split_extra"])
def _sum_with_extra_kernel(
    main_ptr, extra_ptr, y_ptr, M, N, E, stride_ym, main_programs, split_main, split_extra,
    SPLIT_EXTRA: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """y[:, :N] = the sum of the FP8 columns' split_main partials [split_main, M, N] (main_programs
    programs, none when the FP8 GEMM wrote y itself), y[:, N:] = the sum of the extra columns'
    split_extra partials [split_extra, M, E] (SPLIT_EXTRA: a power of two at least as large): those
    are many (one per K chunk), so a program loads all of them at once and sums them in registers."""
    pid = tl.program_id(0)
    if pid < main_programs:
        i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < M * N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(split_main):
            acc += tl.load(main_ptr + s * M * N + i, mask=mask, other=0.0)
        tl.store(y_ptr + (i // N) * stride_ym + i % N, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        j = (pid - main_programs).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
        chunk = tl.arange(0, SPLIT_EXTRA)
        j_in = j < M * E
        parts = tl.load(
            extra_ptr + chunk[:, None].to(tl.int64) * M * E + j[None, :],
            mask=(chunk < split_extra)[:, None] & j_in[None, :],
            other=0.0,
        )  # [SPLIT_EXTRA, BLOCK_E]
        total = tl.sum(parts, axis=0)
        tl.store(y_ptr + (j // E) * stride_ym + N + j % E, total.to(y_ptr.dtype.element_ty), mask=j_in)

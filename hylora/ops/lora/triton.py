"""Batched LoRA shrink/expand in Triton (SGMV style: tokens grouped by adapter slot on the device).

Same maths as `reference.py`. `LoRAKernelMeta.build` sorts the tokens by slot on the device (no
host sync, CUDA-graph safe); `LoRAKernelMeta.tile_map(BLOCK_M)` then lists, on the device too, the
M tiles (up to BLOCK_M tokens of ONE slot) that hold tokens, in a tensor of a size known on the host
(`max_tiles`): the grids run over those tiles only, not over slots × all tiles.

- shrink, grid tiles × SPLIT_K × slices (slices vary fastest: the programs reading one x tile run
  together, x comes from DRAM about once): h_part[split, t, i] = x[t, K range] · A_i[slot]ᵀ, full
  rank in one tile (r ≤ 64 → BLOCK_R ≤ 64). Split K writes separate fp32 partials, summed by the
  expand — no atomics, deterministic.
- expand, grid tiles × column groups of all slices (no program for a slice narrower than the
  widest): y[t, slice i] = round(y + Σ_split h_part · B_i). A program sums h's partials once and
  reuses them over its N_PER_PROGRAM tiles of BLOCK_N columns, loading the next tile's y before it
  stores the current one. Each slice's columns of y come as their own pointer, so that the
  launcher's 16-byte alignment specialization vectorizes the y accesses.

- `lora_apply_stacked` (decode steps): no shrink launch; h of every slot comes from the base GEMM
  over [W; A] (`Linear.stack_lora_a`), in the model dtype, and the expand reads each token's own
  slot's h through a slot stride. That h is already 16-bit, so the expand's dot takes it and B as
  they are (products exact, fp32 sums) instead of tf32x3 on fp32 copies: the same sums, one MMA
  instead of three and no conversions. Its launch is `DECODE_EXPAND` (choose_config(T < 128, 0)).
- `lora_apply_delta_first` (long prefill steps): the shrink, then cuBLAS writes the delta and the
  base GEMM accumulates onto it: y is read in a compute-bound GEMM's epilogue, not by the expand's
  bandwidth-bound read-modify-write (H200, 8192 tokens, 8 slots: 15-43 % less LoRA time).

Rules from the Hopper NaN reports on other engines' LoRA kernels: fp32 accumulation rounded once
into y, fp32 h stays fp32 in the expand dot (no cast down before a dot; tf32x3 ≈ fp32 on 16-bit
models, ieee on fp32 models), int64 row offsets, every load masked with other=0, no split-K atomics.
Base tokens (slot -1) belong to no tile: their rows of y are untouched bit for bit. Programs of the
tile list's unused tail exit at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

MAX_SLICES = 4  # slices per launch (pointer arguments); a linear with more takes several launches


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # tokens of one slot per expand program (and per shrink program, unless shrink_block_m)
    block_n: int  # output columns per expand step
    block_k: int  # input features per shrink step
    split_k: int  # shrink programs along the input features (partials summed by the expand)
    num_warps: int = 4  # expand (and shrink, unless shrink_num_warps)
    n_per_program: int = 1  # BLOCK_N tiles per expand program: h loaded and summed once for them all
    num_stages: int | None = None  # expand launch; None: Triton's default
    shrink_block_m: int | None = None  # None: block_m
    shrink_num_warps: int | None = None  # None: num_warps
    shrink_num_stages: int | None = None  # None: Triton's default

    @property
    def shrink_m(self) -> int:
        return self.shrink_block_m or self.block_m


# Few tokens (decode, short prefill): small M tiles, split K so that a handful of adapters still
# fill the GPU. Many tokens: the expand (a read-modify-write of y, bandwidth bound) takes 32-token M
# tiles and 8 column tiles of 64 per program, the next one's y loads in flight while one is stored; the
# shrink (a stream over x) takes tall M tiles, split K and pipelined K steps. H200, rank 16, 8 slots,
# T 2048-8192 (docs/BASELINE.md run 29): shrink + expand 1.4-1.9x the bytes floor, 8-18 % faster than
# with 16-token expand tiles, within 2 % of the best candidate on each linear and spill-free at rank
# 64 (32 x 128 tiles spill there); cuBLAS's addmm on the same read-modify-write is no faster.
SMALL = KernelConfig(block_m=16, block_n=64, block_k=128, split_k=8, n_per_program=4)
LONG_K_FROM = 16384  # in_features from which a decode shrink takes K steps of 64 over 16 splits
LARGE = KernelConfig(
    block_m=32, block_n=64, block_k=64, split_k=4, num_warps=4, n_per_program=8,
    shrink_block_m=128, shrink_num_warps=8, shrink_num_stages=4,
)  # fmt: skip
LARGE_FROM = 128  # tokens
# The expand alone at decode sizes (`lora_apply_stacked`). H200, 8 rank-16 slots, batch 32 / 64
# (BASELINE run 28 a): its 64 launches in a 16-layer step take 265 / 277 us, 3.3-6.1 us each, the
# 5120-wide ones ~7x their bytes: each program's chain of dependent loads (tile row -> token order
# -> h, y, B) is most of a launch. The former launch (64 x 4) took 268 / 284 us; on fp32 h, 453 / 470.
DECODE_EXPAND = KernelConfig(block_m=16, block_n=128, block_k=0, split_k=1, n_per_program=2)


def _large(**changes) -> KernelConfig:
    return dataclasses.replace(LARGE, **changes)


# Candidates for a GPU sweep (the defaults among them compile for sm_90 without register spills at
# ranks 16 and 64: tests/test_triton_sm90_compile.py). "large-*": prefill (T 2048-8192, in 5120, out up to
# 34816, rank 16, 8 slots): expand variants with LARGE's shrink, then shrink variants with LARGE's
# expand. "small-*": decode (T 1-64); choose_config caps their split_k at in_features // 640. The
# name, not block_m, tells the two kinds apart.
SWEEP_CONFIGS: dict[str, KernelConfig] = {
    "large-default": LARGE,
    "large-old": KernelConfig(block_m=64, block_n=64, block_k=64, split_k=1, num_warps=8),  # the first LARGE
    "large-m16n128x8": _large(block_m=16, block_n=128),  # the LARGE of runs 10-28
    "large-m32n64x16": _large(n_per_program=16),
    "large-m32n128x8-w8": _large(block_n=128, num_warps=8),
    "large-m64n64x8": _large(block_m=64),
    "large-m32n128x4-w8": _large(block_n=128, n_per_program=4, num_warps=8),
    "large-shrink128-nostages": _large(shrink_num_stages=None),
    "large-shrink64k128-split2": _large(shrink_block_m=64, block_k=128, split_k=2),
    "large-shrink32k128-split2-w4": _large(shrink_block_m=32, block_k=128, split_k=2, shrink_num_warps=4),
    "small-default": SMALL,
    "small-old": dataclasses.replace(SMALL, n_per_program=1),
    "small-m16n64x2": dataclasses.replace(SMALL, n_per_program=2),  # the default of run 10
    "small-m16n128x2": dataclasses.replace(SMALL, block_n=128, n_per_program=2),
    "small-m16n64x4-k64-split16": dataclasses.replace(SMALL, block_k=64, split_k=16),
}


def choose_config(num_tokens: int, in_features: int) -> KernelConfig:
    """The configuration for a batch of `num_tokens` tokens through a linear of `in_features` inputs
    (0: the expand alone, which only reads the M/N fields). From the H200 sweep of docs/BASELINE.md
    run 10 at rank 16, 8 slots: at 32-64 tokens, 4 column tiles per expand program and split K 8
    (in 5120) or K steps of 64 over 16 splits (in 17408) were the fastest candidates."""
    if num_tokens >= LARGE_FROM:
        return LARGE
    if in_features == 0:
        return DECODE_EXPAND
    if in_features >= LONG_K_FROM:
        return dataclasses.replace(SMALL, block_k=64, split_k=16)
    return dataclasses.replace(SMALL, split_k=max(1, min(SMALL.split_k, in_features // 640)))


def max_tiles(num_tokens: int, num_slots: int, block_m: int) -> int:
    """How many M tiles `num_tokens` tokens spread over `num_slots` slots can need, at most: with k
    non-empty slots, Σ cdiv(count, BLOCK_M) = k + Σ (count - 1) // BLOCK_M ≤ k + (T - k) // BLOCK_M,
    which grows with k ≤ min(L, T) (reached: k - 1 slots of one token, one slot of the rest)."""
    k = min(num_slots, num_tokens)
    return k + (num_tokens - k) // block_m


@dataclass
class LoRAKernelMeta:
    """Tokens grouped by slot, built on the device: compute once per step, share across linears."""

    order: torch.Tensor  # [T] int64 token indices sorted by slot (base tokens first)
    counts: torch.Tensor  # [L] int32 tokens of each slot
    starts: torch.Tensor  # [L] int32 where each slot's tokens begin in `order`
    num_slots: int
    token_slots: torch.Tensor | None = None  # [T] int64 each token's slot, -1 = base
    tile_maps: dict[int, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)
    columns: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, token_slots: torch.Tensor, num_slots: int) -> LoRAKernelMeta:
        slots = token_slots.long()
        order = torch.sort(slots, stable=True).indices
        ones = torch.ones_like(slots, dtype=torch.int32)
        counts = torch.zeros(num_slots + 1, dtype=torch.int32, device=slots.device).scatter_add_(0, slots + 1, ones)
        starts = (torch.cumsum(counts, 0, dtype=torch.int32) - counts).to(torch.int32)
        return cls(
            order=order, counts=counts[1:].contiguous(), starts=starts[1:].contiguous(), num_slots=num_slots,
            token_slots=slots,
        )  # fmt: skip

    def slot_columns(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For a step whose tokens use `k` slots: those slots in ascending order [k], and a mask
        [T, k] of each token's own one (all False for base tokens). On the device, no host sync
        (a tensor made from a host list would wait for the stream); memoized per k."""
        if k not in self.columns:
            used = self.counts > 0
            chosen = torch.sort(used.to(torch.int8), descending=True, stable=True).indices[:k]
            column_of_slot = torch.cumsum(used, 0) - 1  # [L]: the column of each used slot
            column = torch.where(self.token_slots >= 0, column_of_slot[self.token_slots.clamp(min=0)], -1)
            mine = column[:, None] == torch.arange(k, device=column.device)[None, :]  # [T, k]
            self.columns[k] = (chosen, mine)
        return self.columns[k]

    def tile_map(self, block_m: int) -> torch.Tensor:
        """[max_tiles(T, L, block_m), 4] int32, one row per M tile: (slot, tile of the slot, lo, hi),
        the tile's tokens being order[lo:hi] (hi - lo ≤ block_m). Tiles of slot 0 first, then slot 1...;
        the rows past the last tile are (L, 0, 0, 0): empty. Built on the device with no host sync
        (CUDA-graph safe), memoized per block_m."""
        tiles = self.tile_maps.get(block_m)
        if tiles is None:
            tiles = self.tile_maps[block_m] = _tile_map(self.counts, self.starts, self.order.shape[0], block_m)
        return tiles


def _tile_map(counts: torch.Tensor, starts: torch.Tensor, num_tokens: int, block_m: int) -> torch.Tensor:
    L = counts.shape[0]
    n = max_tiles(num_tokens, L, block_m)
    if n == 0:
        return torch.zeros(0, 4, dtype=torch.int32, device=counts.device)
    counts, starts = counts.long(), starts.long()
    per_slot = (counts + block_m - 1) // block_m
    ends = torch.cumsum(per_slot, 0)  # tile list index past each slot's last tile
    j = torch.arange(n, device=counts.device)
    slot = torch.searchsorted(ends, j, right=True)  # L past the last tile
    live = slot < L
    s = slot.clamp(max=L - 1)
    index = j - (ends[s] - per_slot[s])
    lo = starts[s] + index * block_m
    hi = torch.minimum(lo + block_m, starts[s] + counts[s])
    columns = [slot, index, lo, hi]
    return torch.stack([torch.where(live, c, 0) if k else c for k, c in enumerate(columns)], 1).to(torch.int32)


def lora_apply(
    x: torch.Tensor,  # [T, in]
    y: torch.Tensor,  # [T, out], updated in place
    a: list[torch.Tensor],  # per slice [L, r, in]
    b: list[torch.Tensor],  # per slice [L, r, rows]
    offsets: list[tuple[int, int]],  # per slice (first column of y, rows)
    meta: LoRAKernelMeta,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """y[:, slice] += each token's adapter delta for the given slices: shrink, then expand (the
    reference is `reference.lora_apply`)."""
    if not a:
        return y
    config = config or choose_config(x.shape[0], x.shape[1])
    return lora_expand(lora_shrink(x, a, meta, config), b, offsets, y, meta, config)


def lora_shrink(
    x: torch.Tensor, a: list[torch.Tensor], meta: LoRAKernelMeta, config: KernelConfig | None = None
) -> torch.Tensor:
    """x [T, in], a per slice [L, r, in] → h partials [split_k, T, slices, r] fp32 (rows of base
    tokens unwritten: only the expand reads h, and only for adapter tokens)."""
    T, in_features = x.shape
    L, R, _ = a[0].shape
    _check(x, a, in_features, L)
    if meta.num_slots != L:
        raise ValueError(f"lora_shrink: metadata for {meta.num_slots} slots, stack of {L}")
    config = config or choose_config(T, in_features)
    h = torch.empty(config.split_k, T, len(a), R, dtype=torch.float32, device=x.device)
    tiles = meta.tile_map(config.shrink_m)
    if tiles.shape[0] == 0:
        return h
    k_per_split = triton.cdiv(triton.cdiv(in_features, config.split_k), config.block_k) * config.block_k
    options = _options(config.shrink_num_warps or config.num_warps, config.shrink_num_stages)
    for first in range(0, len(a), MAX_SLICES):
        chunk = a[first : first + MAX_SLICES]
        ptrs = chunk + [chunk[0]] * (MAX_SLICES - len(chunk))
        grid = (tiles.shape[0] * config.split_k * len(chunk),)  # slices vary fastest: x tiles shared in L2
        _shrink_kernel[grid](
            x, *ptrs, h[:, :, first:], meta.order, tiles,
            in_features, R, x.stride(0), a[0].stride(0), a[0].stride(1),
            h.stride(0), h.stride(1), h.stride(2), len(chunk), config.split_k, k_per_split,
            BLOCK_M=config.shrink_m, BLOCK_R=_block_r(R), BLOCK_K=config.block_k,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # 16-bit: exact products anyway
            **options,
        )  # fmt: skip
    return h


def lora_apply_stacked(
    x: torch.Tensor,  # [T, in]
    stacked_weight: torch.Tensor,  # [out + slices * L * r, in]: W, then each slice's A [L, r, in]
    out_features: int,
    b: list[torch.Tensor],  # per slice [L, r, rows]
    offsets: list[tuple[int, int]],  # per slice (first column of y, rows)
    meta: LoRAKernelMeta,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """y = x Wᵀ + each token's adapter delta on every slice, with the shrink inside the base GEMM:
    one GEMM over [W; A] gives y and every slot's h = x·Aᵀ (rounded to x's dtype, fp32-accumulated),
    and the expand reads each token's own slot from it. One launch less per linear than
    `lora_shrink` + `lora_expand`, for ~slices·L·r extra weight rows (~3% at the 27B shapes). Returns
    a [T, out] view (row stride out + slices·L·r) of the GEMM's output."""
    L, R, _ = b[0].shape
    T = x.shape[0]
    full = torch.nn.functional.linear(x, stacked_weight)  # [T, out + slices * L * r]
    h = full[:, out_features:].view(1, T, len(b), L, R)  # [split 1, T, slices, L, r]
    return lora_expand(h, b, offsets, full[:, :out_features], meta, config)


def lora_apply_delta_first(
    x: torch.Tensor,  # [T, in]
    weight: torch.Tensor,  # [out, in], the base weight
    a: list[torch.Tensor],  # per slice [L, r, in]
    b: list[torch.Tensor],  # per slice [L, r, rows]
    offsets: list[tuple[int, int]],  # per slice (first column of y, rows)
    meta: LoRAKernelMeta,
    num_used: int,  # how many slots the step's tokens use (known on the host)
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """y = x Wᵀ + each token's adapter delta for a step of many tokens, without the expand's
    read-modify-write of y: the delta is written first, by cuBLAS (per slice, h of the step's k used slots
    in x's dtype, zero but each token's own, times those slots' B: a GEMM with K = k·r), and the base
    GEMM then accumulates onto it (beta 1: y is read in the epilogue of a compute-bound GEMM).

    Arithmetic: y = round(x Wᵀ + round(h · B)), h rounded once to x's dtype (as in decode steps),
    against the expand's round(round(x Wᵀ) + h · B) on fp32 h. Every token reads the B of every used
    slot (with h 0 for the others): the registry keeps B finite (validated at load, free slots
    zero), so a token's non-finite h reaches its own row only. Slices left out of `offsets` get 0."""
    T, N = x.shape[0], weight.shape[0]
    k = num_used
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    covered = 0
    for first, n in sorted(offsets):  # columns no given slice covers: zero before the accumulating GEMM
        y[:, covered:first].zero_()
        covered = first + n
    y[:, covered:].zero_()
    if a:  # (a step's adapters may target none of this linear's slices)
        L, R, _ = a[0].shape
        chosen, mine = meta.slot_columns(k)  # [k], [T, k]
        h = lora_shrink(x, a, meta, config).sum(0).to(x.dtype)  # [T, slices, r]; base rows unwritten
        h_all = torch.where(mine[:, None, :, None], h[:, :, None, :], 0.0)  # [T, slices, k, r]
        for i, ((first, n), bi) in enumerate(zip(offsets, b, strict=True)):
            b_used = bi if k == L else bi[chosen]  # [k, r, rows]
            torch.mm(h_all[:, i].reshape(T, k * R), b_used.reshape(k * R, n), out=y[:, first : first + n])
    return y.addmm_(x, weight.t())


def lora_expand(
    h: torch.Tensor,  # [split_k, T, slices, r] fp32 from lora_shrink, or [1, T, slices, L, r] (every slot's)
    b: list[torch.Tensor],  # per slice [L, r, rows], contiguous
    offsets: list[tuple[int, int]],  # per slice (first column of y, rows)
    y: torch.Tensor,  # [T, out], updated in place
    meta: LoRAKernelMeta,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    split_k, T, R = h.shape[0], h.shape[1], h.shape[-1]
    s_hl = h.stride(3) if h.ndim == 5 else 0  # per-slot h: each token reads its own slot's
    L = b[0].shape[0]
    if meta.num_slots != L:
        raise ValueError(f"lora_expand: metadata for {meta.num_slots} slots, stack of {L}")
    if y.stride(1) != 1 or any(not bi.is_contiguous() or bi.shape[:2] != (L, R) for bi in b):
        raise ValueError("lora_expand: y needs contiguous rows and B contiguous [L, r, rows] tensors")
    if any(bi.shape[2] != n for bi, (_, n) in zip(b, offsets, strict=True)):
        raise ValueError("lora_expand: B widths differ from the slice offsets")
    h_native = h_is_native(h, y.dtype)
    if h_native and split_k != 1:
        raise ValueError("lora_expand: a 16-bit h comes whole from one GEMM (split_k 1); partials are fp32")
    config = config or choose_config(T, 0)
    tiles = meta.tile_map(config.block_m)
    if tiles.shape[0] == 0:
        return y
    columns = config.block_n * config.n_per_program  # per program
    options = _options(config.num_warps, config.num_stages)
    for first in range(0, len(b), MAX_SLICES):
        chunk, offs = b[first : first + MAX_SLICES], offsets[first : first + MAX_SLICES]
        pad = MAX_SLICES - len(chunk)
        # Padding repeats slice 0 (no program picks it): alignment specializations stay those of real slices.
        ptrs = chunk + [chunk[0]] * pad
        ys = [y[:, start:] for start, _ in offs] + [y[:, offs[0][0] :]] * pad  # y's slice columns, each a view
        rows = [n for _, n in offs] + [offs[0][1]] * pad
        groups = [triton.cdiv(n, columns) for _, n in offs]  # column groups of each slice, one program each
        group_starts = [sum(groups[:i]) for i in range(1, MAX_SLICES)]
        if not sum(groups):
            continue
        grid = (tiles.shape[0] * sum(groups),)
        _expand_kernel[grid](
            h[:, :, first:], *ptrs, *ys, meta.order, tiles,
            *rows, *group_starts, sum(groups), R, split_k, h.stride(0), h.stride(1), h.stride(2), s_hl, y.stride(0),
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_R=_block_r(R),
            N_PER_PROGRAM=config.n_per_program,
            PRECISION="ieee" if y.dtype == torch.float32 else "tf32x3",  # ≈ fp32 on the tensor cores
            H_NATIVE=h_native,
            **options,
        )  # fmt: skip
    return y


def h_is_native(h: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether an expand dots h as it is (a 16-bit h of the output's dtype) rather than in fp32.
    (Triton 3.7's CPU interpreter reads bf16 dot operands wrongly: there bf16 takes the fp32 dot.)"""
    interpreted = isinstance(_expand_kernel, InterpretedFunction)  # (TRITON_INTERPRET=1 when triton was imported)
    return h.dtype == dtype and (h.dtype == torch.float16 or (h.dtype == torch.bfloat16 and not interpreted))


def _options(num_warps: int, num_stages: int | None) -> dict[str, int]:
    return {"num_warps": num_warps} | ({} if num_stages is None else {"num_stages": num_stages})


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))  # ≥ 16: the K of the expand dot


def _check(x: torch.Tensor, a: list[torch.Tensor], in_features: int, num_slots: int) -> None:
    if x.stride(1) != 1:
        raise ValueError("lora_shrink: x needs contiguous rows")
    for ai in a:
        if ai.dtype != x.dtype:
            raise TypeError(f"lora_shrink: A is {ai.dtype}, x is {x.dtype}")
        if ai.shape != a[0].shape or ai.shape[0] != num_slots or ai.shape[2] != in_features or ai.stride(2) != 1:
            raise ValueError("lora_shrink: every slice's A must be [L, r, in] with contiguous rows")
        if ai.stride() != a[0].stride():
            raise ValueError("lora_shrink: the slices' A tensors need one layout")


@triton.jit
def _pick(i, p0, p1, p2, p3):
    """The i-th of four slice pointers (kernel arguments keep their alignment; a table would not)."""
    p = p0
    if i == 1:
        p = p1
    if i == 2:
        p = p2
    if i == 3:
        p = p3
    return p


@triton.jit
def _pick_int(i, v0, v1, v2, v3):
    return tl.where(i == 0, v0, tl.where(i == 1, v1, tl.where(i == 2, v2, v3)))


@triton.jit
def _tile_tokens(order_ptr, lo, hi, BLOCK_M: tl.constexpr):
    """Token indices (int64) of the tile order[lo:hi], and their mask."""
    mm = lo + tl.arange(0, BLOCK_M)
    mask = mm < hi
    tokens = tl.load(order_ptr + mm, mask=mask, other=0).to(tl.int64)
    return tokens, mask


@triton.jit
def _tile_h(h_ptrs, h_mask, split_k, s_hs, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, H_NATIVE: tl.constexpr):
    """An expand tile's h [BLOCK_M, BLOCK_R]: a 16-bit h (the stacked GEMM's) as it is, or the shrink's
    fp32 K partials summed in a fixed order (deterministic)."""
    if H_NATIVE:
        h = tl.load(h_ptrs, mask=h_mask, other=0.0)
    else:
        h = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for split in range(split_k):
            h += tl.load(h_ptrs + split * s_hs, mask=h_mask, other=0.0).to(tl.float32)
    return h


@triton.jit
def _tile_delta(h, b, H_NATIVE: tl.constexpr, PRECISION: tl.constexpr):
    """h · B in fp32: a 16-bit h and B as they are (exact products, fp32 sums), else fp32 at PRECISION."""
    if H_NATIVE:
        delta = tl.dot(h, b, out_dtype=tl.float32)
    else:
        delta = tl.dot(h, b.to(tl.float32), input_precision=PRECISION)
    return delta


@triton.jit
def _shrink_kernel(
    x_ptr, a0, a1, a2, a3, h_ptr, order_ptr, tiles_ptr,
    IN, R, s_xt, s_al, s_ar, s_hs, s_ht, s_hi, slices, split_k, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0) % slices
    split = tl.program_id(0) // slices % split_k
    tile = tl.program_id(0) // slices // split_k
    lo = tl.load(tiles_ptr + tile * 4 + 2)
    hi = tl.load(tiles_ptr + tile * 4 + 3)
    if lo >= hi:  # past the last tile
        return
    slot = tl.load(tiles_ptr + tile * 4)
    tokens, m_mask = _tile_tokens(order_ptr, lo, hi, BLOCK_M)
    a_ptr = _pick(i, a0, a1, a2, a3) + slot.to(tl.int64) * s_al
    rr = tl.arange(0, BLOCK_R)
    r_mask = rr < R
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, IN)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < k_hi
        x = tl.load(x_ptr + tokens[:, None] * s_xt + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptr + rr[None, :] * s_ar + kk[:, None], mask=r_mask[None, :] & k_mask[:, None], other=0.0)
        acc = tl.dot(x, a, acc, input_precision=PRECISION)  # [M, K] x [K, R], fp32 accumulation
    h = h_ptr + split * s_hs + tokens[:, None] * s_ht + i * s_hi + rr[None, :]
    tl.store(h, acc, mask=m_mask[:, None] & r_mask[None, :])  # zeros where the split's K range is empty


@triton.jit
def _expand_kernel(
    h_ptr, b0, b1, b2, b3, y0, y1, y2, y3, order_ptr, tiles_ptr,
    n0, n1, n2, n3, g1, g2, g3, groups, R, split_k, s_hs, s_ht, s_hi, s_hl, s_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, N_PER_PROGRAM: tl.constexpr,
    PRECISION: tl.constexpr, H_NATIVE: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0) // groups
    group = tl.program_id(0) % groups  # column groups of slice 0, then of slice 1 (from g1)...
    lo = tl.load(tiles_ptr + tile * 4 + 2)
    hi = tl.load(tiles_ptr + tile * 4 + 3)
    if lo >= hi:  # past the last tile
        return
    slot = tl.load(tiles_ptr + tile * 4)
    i = (group >= g1).to(tl.int32) + (group >= g2).to(tl.int32) + (group >= g3).to(tl.int32)
    rows = _pick_int(i, n0, n1, n2, n3)
    n_lo = (group - _pick_int(i, 0, g1, g2, g3)) * (BLOCK_N * N_PER_PROGRAM)
    n_hi = tl.minimum(n_lo + BLOCK_N * N_PER_PROGRAM, rows)
    tokens, m_mask = _tile_tokens(order_ptr, lo, hi, BLOCK_M)
    rr = tl.arange(0, BLOCK_R)
    r_mask = rr < R
    h_mask = m_mask[:, None] & r_mask[None, :]
    h_ptrs = h_ptr + tokens[:, None] * s_ht + i * s_hi + slot.to(tl.int64) * s_hl + rr[None, :]
    h = _tile_h(h_ptrs, h_mask, split_k, s_hs, BLOCK_M, BLOCK_R, H_NATIVE)

    b_row = _pick(i, b0, b1, b2, b3) + slot.to(tl.int64) * R * rows + rr[:, None] * rows
    y_ptr = _pick(i, y0, y1, y2, y3)
    y_row = y_ptr + tokens[:, None] * s_yt
    nn = n_lo + tl.arange(0, BLOCK_N)
    y_next = tl.load(y_row + nn[None, :], mask=m_mask[:, None] & (nn < n_hi)[None, :], other=0.0)
    b_next = tl.load(b_row + nn[None, :], mask=r_mask[:, None] & (nn < n_hi)[None, :], other=0.0)
    for n_start in range(n_lo, n_hi, BLOCK_N):  # h summed once, reused for every column tile
        nn = n_start + tl.arange(0, BLOCK_N)
        n_mask = nn < n_hi
        y = y_next
        b = b_next
        nn_next = nn + BLOCK_N  # in flight while this tile is computed and stored
        y_next = tl.load(y_row + nn_next[None, :], mask=m_mask[:, None] & (nn_next < n_hi)[None, :], other=0.0)
        b_next = tl.load(b_row + nn_next[None, :], mask=r_mask[:, None] & (nn_next < n_hi)[None, :], other=0.0)
        delta = _tile_delta(h, b, H_NATIVE, PRECISION)  # [M, R] x [R, N]
        y_mask = m_mask[:, None] & n_mask[None, :]
        tl.store(y_row + nn[None, :], (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=y_mask)

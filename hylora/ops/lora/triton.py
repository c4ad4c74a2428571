"""Batched LoRA shrink/expand in Triton (SGMV style: tokens grouped by adapter slot on the device).

Same maths as `reference.py`. `LoRAKernelMeta.build` sorts the tokens by slot on the device (no
host sync, CUDA-graph safe); then every program works on up to BLOCK_M tokens of ONE slot:

- shrink, grid (M tiles × SPLIT_K, slices, slots): h_part[split, t, i] = x[t, K range] · A_i[slot]ᵀ,
  full rank in one tile (r ≤ 64 → BLOCK_R ≤ 64). Split K writes separate fp32 partials, summed by
  the expand — no atomics, deterministic.
- expand, grid (M tiles × N tiles, slices, slots): y[t, slice i] = round(y + Σ_split h_part · B_i).

Rules from the Hopper NaN reports on other engines' LoRA kernels: fp32 accumulation rounded once
into y, h stays fp32 into the expand dot (no cast down before a dot; tf32x3 ≈ fp32 on 16-bit
models, ieee on fp32 models), int64 row offsets, every load masked with other=0, no split-K
atomics. Base tokens (slot -1) get no program: their rows of y are untouched bit for bit.
Programs of a slot with fewer tokens than their tile exit at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hylora.lora.apply import LoRABatch, LoRAStack

MAX_SLICES = 4  # slices per launch (pointer arguments); a linear with more takes several launches


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # tokens of one slot per program
    block_n: int  # output columns per expand program
    block_k: int  # input features per shrink step
    split_k: int  # shrink programs along the input features (partials summed by the expand)
    num_warps: int = 4


# Few tokens (decode, short prefill): small M tiles, split K so that a handful of adapters still
# fill the GPU. Many tokens: bigger tiles, one K pass. sm_90 bf16 rank 64 (ptxas), no spills:
# SMALL shrink 64 / expand 138 registers; LARGE 60 / 148 (64 x 128 tiles at 4 warps spill).
SMALL = KernelConfig(block_m=16, block_n=64, block_k=128, split_k=8)
LARGE = KernelConfig(block_m=64, block_n=64, block_k=64, split_k=1, num_warps=8)
LARGE_FROM = 128  # tokens


def choose_config(num_tokens: int, in_features: int) -> KernelConfig:
    if num_tokens >= LARGE_FROM:
        return LARGE
    split = max(1, min(SMALL.split_k, in_features // 1024))
    return KernelConfig(SMALL.block_m, SMALL.block_n, SMALL.block_k, split, SMALL.num_warps)


@dataclass
class LoRAKernelMeta:
    """Tokens grouped by slot, built on the device: compute once per step, share across linears."""

    order: torch.Tensor  # [T] int64 token indices sorted by slot (base tokens first)
    counts: torch.Tensor  # [L] int32 tokens of each slot
    starts: torch.Tensor  # [L] int32 where each slot's tokens begin in `order`
    num_slots: int

    @classmethod
    def build(cls, token_slots: torch.Tensor, num_slots: int) -> LoRAKernelMeta:
        slots = token_slots.long()
        order = torch.sort(slots, stable=True).indices
        ones = torch.ones_like(slots, dtype=torch.int32)
        counts = torch.zeros(num_slots + 1, dtype=torch.int32, device=slots.device).scatter_add_(0, slots + 1, ones)
        starts = (torch.cumsum(counts, 0, dtype=torch.int32) - counts).to(torch.int32)
        return cls(order=order, counts=counts[1:].contiguous(), starts=starts[1:].contiguous(), num_slots=num_slots)


def lora_apply(
    x: torch.Tensor,
    y: torch.Tensor,
    stack: LoRAStack,
    batch: LoRABatch,
    meta: LoRAKernelMeta | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """`lora_apply_grouped`'s signature. Slices that no adapter of this batch targets are skipped
    (decided on the host from `batch.groups`, like `lora_apply_masked`); the others go through
    the kernels. For a CUDA graph call `lora_shrink` / `lora_expand` on all slices instead."""
    used = [slot for slot, _ in batch.groups]
    active = [i for i in range(len(stack.a)) if any(stack.present[slot][i] for slot in used)]
    if not active:
        return y
    if meta is None:
        meta = LoRAKernelMeta.build(batch.token_slots, stack.a[0].shape[0])
    config = config or choose_config(x.shape[0], x.shape[1])
    h = lora_shrink(x, [stack.a[i] for i in active], meta, config)
    return lora_expand(h, [stack.b[i] for i in active], [stack.offsets[i] for i in active], y, meta, config)


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
    if T == 0:
        return h
    k_per_split = triton.cdiv(triton.cdiv(in_features, config.split_k), config.block_k) * config.block_k
    for first in range(0, len(a), MAX_SLICES):
        chunk = a[first : first + MAX_SLICES]
        ptrs = chunk + [chunk[0]] * (MAX_SLICES - len(chunk))
        grid = (triton.cdiv(T, config.block_m) * config.split_k, len(chunk), L)
        _shrink_kernel[grid](
            x, *ptrs, h[:, :, first:], meta.order, meta.counts, meta.starts,
            in_features, R, x.stride(0), a[0].stride(0), a[0].stride(1),
            h.stride(0), h.stride(1), h.stride(2), config.split_k, k_per_split,
            BLOCK_M=config.block_m, BLOCK_R=_block_r(R), BLOCK_K=config.block_k,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # 16-bit: exact products anyway
            num_warps=config.num_warps,
        )  # fmt: skip
    return h


def lora_expand(
    h: torch.Tensor,  # [split_k, T, slices, r] fp32 from lora_shrink
    b: list[torch.Tensor],  # per slice [L, r, rows], contiguous
    offsets: list[tuple[int, int]],  # per slice (first column of y, rows)
    y: torch.Tensor,  # [T, out], updated in place
    meta: LoRAKernelMeta,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    split_k, T, _, R = h.shape
    L = b[0].shape[0]
    if meta.num_slots != L:
        raise ValueError(f"lora_expand: metadata for {meta.num_slots} slots, stack of {L}")
    if y.stride(1) != 1 or any(not bi.is_contiguous() or bi.shape[:2] != (L, R) for bi in b):
        raise ValueError("lora_expand: y needs contiguous rows and B contiguous [L, r, rows] tensors")
    if any(bi.shape[2] != n for bi, (_, n) in zip(b, offsets, strict=True)):
        raise ValueError("lora_expand: B widths differ from the slice offsets")
    config = config or choose_config(T, 0)
    if T == 0:
        return y
    for first in range(0, len(b), MAX_SLICES):
        chunk, offs = b[first : first + MAX_SLICES], offsets[first : first + MAX_SLICES]
        pad = MAX_SLICES - len(chunk)
        ptrs = chunk + [chunk[0]] * pad
        cols = [start for start, _ in offs] + [0] * pad
        rows = [n for _, n in offs] + [0] * pad
        n_tiles = triton.cdiv(max(rows), config.block_n)
        grid = (triton.cdiv(T, config.block_m) * n_tiles, len(chunk), L)
        _expand_kernel[grid](
            h[:, :, first:], *ptrs, y, meta.order, meta.counts, meta.starts,
            *rows, *cols, R, n_tiles, split_k, h.stride(0), h.stride(1), h.stride(2), y.stride(0),
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_R=_block_r(R),
            PRECISION="ieee" if y.dtype == torch.float32 else "tf32x3",  # ≈ fp32 on the tensor cores
            num_warps=config.num_warps,
        )  # fmt: skip
    return y


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
def _slot_tokens(order_ptr, counts_ptr, starts_ptr, slot, tile, BLOCK_M: tl.constexpr):
    """Token indices (int64) of tile `tile` of `slot`'s tokens, and their mask."""
    mm = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = mm < tl.load(counts_ptr + slot)
    tokens = tl.load(order_ptr + tl.load(starts_ptr + slot) + mm, mask=mask, other=0).to(tl.int64)
    return tokens, mask


@triton.jit
def _shrink_kernel(
    x_ptr, a0, a1, a2, a3, h_ptr, order_ptr, counts_ptr, starts_ptr,
    IN, R, s_xt, s_al, s_ar, s_hs, s_ht, s_hi, split_k, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0) // split_k
    split = tl.program_id(0) % split_k
    i = tl.program_id(1)
    slot = tl.program_id(2)
    if tile * BLOCK_M >= tl.load(counts_ptr + slot):
        return
    tokens, m_mask = _slot_tokens(order_ptr, counts_ptr, starts_ptr, slot, tile, BLOCK_M)
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
    tl.store(h, acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _expand_kernel(
    h_ptr, b0, b1, b2, b3, y_ptr, order_ptr, counts_ptr, starts_ptr,
    n0, n1, n2, n3, c0, c1, c2, c3, R, n_tiles, split_k, s_hs, s_ht, s_hi, s_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0) // n_tiles
    n_tile = tl.program_id(0) % n_tiles
    i = tl.program_id(1)
    slot = tl.program_id(2)
    rows = _pick_int(i, n0, n1, n2, n3)
    if (tile * BLOCK_M >= tl.load(counts_ptr + slot)) | (n_tile * BLOCK_N >= rows):
        return
    tokens, m_mask = _slot_tokens(order_ptr, counts_ptr, starts_ptr, slot, tile, BLOCK_M)
    rr = tl.arange(0, BLOCK_R)
    r_mask = rr < R
    h_mask = m_mask[:, None] & r_mask[None, :]
    h_ptrs = h_ptr + tokens[:, None] * s_ht + i * s_hi + rr[None, :]
    h = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for split in range(split_k):  # the shrink's K partials, in a fixed order: deterministic
        h += tl.load(h_ptrs + split * s_hs, mask=h_mask, other=0.0)

    nn = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = nn < rows
    b_ptr = _pick(i, b0, b1, b2, b3) + slot.to(tl.int64) * R * rows
    b = tl.load(b_ptr + rr[:, None] * rows + nn[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
    delta = tl.dot(h, b.to(tl.float32), input_precision=PRECISION)  # [M, R] x [R, N]
    y_ptrs = y_ptr + tokens[:, None] * s_yt + _pick_int(i, c0, c1, c2, c3) + nn[None, :]
    y_mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=y_mask)

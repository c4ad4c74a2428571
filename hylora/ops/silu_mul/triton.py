"""`reference.silu_mul` in one Triton launch: reads [gate | up] once, writes [T, I] once.
`silu_mul_quantized`: the same values quantised for an FP8 down projection in that launch (bit-equal
to `fp8_linear.triton.quantize_activation` of `silu_mul`; with `split`, to its two-term
`quantize_activation_split`): the [T, I] activation is neither written (unless kept for LoRA) nor read
back by a quantisation launch of its own.
`silu_mul_lora`: either, with the gate_up projection's LoRA expand in the same launch (the twin of
`reference.silu_mul_lora`): the adapter tokens' [gate | up] rows plus h · B, rounded, then the
activation, so the expand's read-modify-write of [T, 2I] goes (prefill: ~57 % of the expand's bytes
at the 27B's shapes, gate_up being the widest projection) and a decode step launches one kernel
for both. Programs over the LoRA's M tiles (tokens of one slot, `LoRAKernelMeta.tile_map`) add the
delta; programs over the base tokens (order[:starts[0]]) apply the activation alone; each over a
column group of 128 (the FP8 group)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylora.ops.fp8_linear.reference import FP8_DTYPE, GROUP, QuantizedActivation
from hylora.ops.fp8_linear.triton import (
    QUANT_BLOCK_M,
    _check_group,
    _quantize_rows,
    _quantize_split_rows,
    _store_quantized_rows,
)
from hylora.ops.lora.triton import LoRAKernelMeta, _block_r, _tile_delta, _tile_h, _tile_tokens, h_is_native

BLOCK = 2048


@triton.jit
def _silu_times(gate, up):
    """silu(gate) * up in gate's dtype, rounded as the torch ops are: F.silu to the input dtype, then
    the product."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(gate.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    T, two_i = gate_up.shape
    if two_i % 2 or gate_up.stride(1) != 1:
        raise ValueError("silu_mul: needs [T, 2I] with unit stride along the last dimension")
    inner = two_i // 2
    out = torch.empty(T, inner, dtype=gate_up.dtype, device=gate_up.device)
    n = T * inner
    if n:
        _silu_mul_kernel[(triton.cdiv(n, BLOCK),)](gate_up, out, n, inner, gate_up.stride(0), BLOCK=BLOCK)
    return out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n, inner, stride_t, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = i < n
    t, c = i // inner, i % inner
    gate = tl.load(x_ptr + t * stride_t + c, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_t + inner + c, mask=mask, other=0.0)
    tl.store(out_ptr + i, _silu_times(gate, up), mask=mask)


def silu_mul_quantized(
    gate_up: torch.Tensor, group: int = GROUP, keep: bool = False, split: bool = False
) -> QuantizedActivation:
    T, two_i = gate_up.shape
    if two_i % 2 or gate_up.stride(1) != 1:
        raise ValueError("silu_mul_quantized: needs [T, 2I] with unit stride along the last dimension")
    _check_group(group)
    inner = two_i // 2
    q = torch.empty(T, inner, dtype=FP8_DTYPE, device=gate_up.device)
    lo = torch.empty_like(q) if split else None
    s = torch.empty(T, triton.cdiv(inner, group), dtype=torch.float32, device=gate_up.device)
    h = torch.empty(T, inner, dtype=gate_up.dtype, device=gate_up.device) if keep else q
    if T and inner:
        grid = (triton.cdiv(T, QUANT_BLOCK_M), triton.cdiv(inner, group))
        _silu_mul_quant_kernel[grid](
            gate_up, h, q, q if lo is None else lo, s, T, inner, gate_up.stride(0),
            BLOCK_M=QUANT_BLOCK_M, GROUP=group, KEEP=keep, SPLIT=split,
        )  # fmt: skip
    return QuantizedActivation(q, s, gate_up.dtype, h if keep else None, lo)


@triton.jit
def _silu_mul_quant_kernel(
    x_ptr, h_ptr, q_ptr, lo_ptr, s_ptr, T, inner, stride_t,
    BLOCK_M: tl.constexpr, GROUP: tl.constexpr, KEEP: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    rt = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    rc = g * GROUP + tl.arange(0, GROUP)
    mask = (rt < T)[:, None] & (rc < inner)[None, :]
    rows = rt.to(tl.int64)[:, None]
    gate = tl.load(x_ptr + rows * stride_t + rc[None, :], mask=mask, other=0.0)
    up = tl.load(x_ptr + rows * stride_t + inner + rc[None, :], mask=mask, other=0.0)
    h = _silu_times(gate, up)  # the unfused op's [T, I] output, rounded as it is
    out = rows * inner + rc[None, :]
    if KEEP:
        tl.store(h_ptr + out, h, mask=mask)
    scales = rt.to(tl.int64) * tl.cdiv(inner, GROUP) + g
    _store_quantized_rows(h, q_ptr, lo_ptr, s_ptr, out, mask, scales, rt < T, SPLIT)


def silu_mul_lora(
    gate_up: torch.Tensor,  # [T, 2I] the base GEMM's [gate | up] (rows may be strided), without the delta
    h: torch.Tensor,  # [split, T, 2, r] fp32 shrink partials, or [1, T, 2, L, r] every slot's (16-bit)
    b: list[torch.Tensor],  # [B_gate, B_up], each [L, r, I] contiguous
    meta: LoRAKernelMeta,
    group: int | None = None,  # quantise for an FP8 down projection, groups of `group` inputs
    keep: bool = False,
    split: bool = False,  # with group: as two e4m3 terms
) -> torch.Tensor | QuantizedActivation:
    T, two_i = gate_up.shape
    inner = two_i // 2
    if two_i % 2 or gate_up.stride(1) != 1:
        raise ValueError("silu_mul_lora: needs [T, 2I] with unit stride along the last dimension")
    L, R = b[0].shape[0], b[0].shape[1]
    if len(b) != 2 or any(not bi.is_contiguous() or bi.shape != (L, R, inner) for bi in b):
        raise ValueError(f"silu_mul_lora: needs B of gate and up, each contiguous [L, r, {inner}]")
    if h.shape[1] != T or h.shape[2] != 2 or h.shape[-1] != R or (h.ndim == 5 and h.shape[3] != L) or h.stride(-1) != 1:
        raise ValueError(f"silu_mul_lora: h {list(h.shape)} is not [split, {T}, 2, {R}] or [1, {T}, 2, {L}, {R}]")
    if meta.num_slots != L:
        raise ValueError(f"silu_mul_lora: metadata for {meta.num_slots} slots, stack of {L}")
    columns = GROUP if group is None else group
    _check_group(columns)
    native = h_is_native(h, gate_up.dtype)
    dev, dt = gate_up.device, gate_up.dtype
    split = split and group is not None
    if group is None:
        out = q = torch.empty(T, inner, dtype=dt, device=dev)
        s = torch.empty(0, dtype=torch.float32, device=dev)
    else:
        q = torch.empty(T, inner, dtype=FP8_DTYPE, device=dev)
        s = torch.empty(T, triton.cdiv(inner, group), dtype=torch.float32, device=dev)
        out = torch.empty(T, inner, dtype=dt, device=dev) if keep else q
    lo = torch.empty_like(q) if split else None
    if T and inner:
        block_m = 16  # (32-token tiles held ~200 registers a thread at rank 64: one CTA an SM)
        tiles = meta.tile_map(block_m)
        # LoRA tiles first, then the base tokens' (most of which exit at once when few tokens are base)
        grid = (tiles.shape[0] + triton.cdiv(T, block_m), triton.cdiv(inner, columns))
        s_hl = h.stride(3) if h.ndim == 5 else 0
        _silu_mul_lora_kernel[grid](
            gate_up, h, b[0], b[1], meta.order, tiles, meta.starts, out, q, q if lo is None else lo, s,
            inner, gate_up.stride(0), R, h.shape[0], h.stride(0), h.stride(1), h.stride(2), s_hl, tiles.shape[0],
            BLOCK_M=block_m, BLOCK_R=_block_r(R), COLUMNS=columns, QUANT=group is not None, SPLIT=split,
            STORE_OUT=group is None or keep, H_NATIVE=native,
            PRECISION="ieee" if dt == torch.float32 else "tf32x3",
        )  # fmt: skip
    if group is None:
        return out
    return QuantizedActivation(q, s, dt, out if keep else None, lo)


@triton.jit
def _silu_mul_lora_kernel(
    x_ptr, h_ptr, bg_ptr, bu_ptr, order_ptr, tiles_ptr, starts_ptr, out_ptr, q_ptr, lo_ptr, s_ptr,
    inner, stride_t, R, split_k, s_hs, s_ht, s_hi, s_hl, num_tiles,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, COLUMNS: tl.constexpr, QUANT: tl.constexpr,
    SPLIT: tl.constexpr, STORE_OUT: tl.constexpr, H_NATIVE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    g = tl.program_id(1)
    is_lora = pid < num_tiles
    if is_lora:  # tokens order[lo:hi], all of one slot
        lo = tl.load(tiles_ptr + pid * 4 + 2)
        hi = tl.load(tiles_ptr + pid * 4 + 3)
        slot = tl.load(tiles_ptr + pid * 4).to(tl.int64)
    else:  # base tokens: order[:starts[0]] (the sort puts slot -1 first)
        lo = (pid - num_tiles) * BLOCK_M
        hi = tl.minimum(lo + BLOCK_M, tl.load(starts_ptr))
        slot = tl.zeros((), dtype=tl.int64)
    if lo >= hi:  # past the last tile, or past the base tokens
        return
    tokens, m_mask = _tile_tokens(order_ptr, lo, hi, BLOCK_M)
    cols = g * COLUMNS + tl.arange(0, COLUMNS)
    c_mask = cols < inner
    mask = m_mask[:, None] & c_mask[None, :]
    rows = x_ptr + tokens[:, None] * stride_t
    rr = tl.arange(0, BLOCK_R)
    r_mask = rr < R
    h_mask = m_mask[:, None] & r_mask[None, :]
    h_ptrs = h_ptr + tokens[:, None] * s_ht + slot * s_hl + rr[None, :]  # slice 0 (gate); + s_hi: up
    b_off = slot * R * inner + rr[:, None] * inner + cols[None, :]
    b_mask = r_mask[:, None] & c_mask[None, :]
    # gate and its delta, then up and its: one slice's h and B live at a time (both at once spilled at rank 64)
    gate = tl.load(rows + cols[None, :], mask=mask, other=0.0)
    if is_lora:
        hg = _tile_h(h_ptrs, h_mask, split_k, s_hs, BLOCK_M, BLOCK_R, H_NATIVE)
        bg = tl.load(bg_ptr + b_off, mask=b_mask, other=0.0)
        gate = (gate.to(tl.float32) + _tile_delta(hg, bg, H_NATIVE, PRECISION)).to(gate.dtype)  # rounded once
    up = tl.load(rows + inner + cols[None, :], mask=mask, other=0.0)
    if is_lora:
        hu = _tile_h(h_ptrs + s_hi, h_mask, split_k, s_hs, BLOCK_M, BLOCK_R, H_NATIVE)
        bu = tl.load(bu_ptr + b_off, mask=b_mask, other=0.0)
        up = (up.to(tl.float32) + _tile_delta(hu, bu, H_NATIVE, PRECISION)).to(up.dtype)  # as the expand does
    h = _silu_times(gate, up)
    out = tokens[:, None] * inner + cols[None, :]
    if STORE_OUT:
        tl.store(out_ptr + out, h, mask=mask)
    if QUANT:
        if SPLIT:
            q, lo, scale = _quantize_split_rows(h.to(tl.float32))
        else:
            q, scale = _quantize_rows(h.to(tl.float32))
        if STORE_OUT:  # q's offsets declared 8-contiguous (they are 128-contiguous): the e4m3 store takes
            # h's store layout (8 a thread) instead of its own (16), so q is computed there from the one
            # conversion of h (no conversion of q through shared memory; the scale's amax stays in the MMA layout)
            out = tl.max_contiguous(out, [1, 8])
        tl.store(q_ptr + out, q, mask=mask)
        if SPLIT:
            tl.store(lo_ptr + out, lo, mask=mask)
        tl.store(s_ptr + tokens * tl.cdiv(inner, COLUMNS) + g, scale, mask=m_mask)

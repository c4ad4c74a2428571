"""`reference.causal_conv1d_by_slot` in two Triton launches, the conv state read and written in
place in the pool by slot (no gather / scatter copies), every sequence of the step at once.
out[t, c] = silu(sum_j w[c, j] * in[pos - K + 1 + j]), where inputs before the chunk's first token
come from the sequence's conv state, accumulated in fp32 in the reference's order. With `splits`
(the GDN layer's q | k | v), each group of channels is stored as its own contiguous [T, width]
tensor, which fla's kernels take without the copy they would make of a strided view; channel blocks
are numbered group by group, so a program's channels share one group and its stores stay contiguous.

1. `_conv_kernel`, grid (token block, channel block): every row at position K-1 or later in its
   chunk, whose K taps are all inputs of that chunk — all but K-1 rows of each chunk, read from x
   alone with no per-element choice between x and the state.
2. `_chunk_head_kernel`, grid (sequence, channel block): each chunk's first K-1 rows, whose taps reach
   into the conv state; then the state becomes the last K-1 inputs of [old state | chunk]. A barrier
   keeps every read of the old state before the first write of the new one.

Per-token sequence indices come from the step's lengths, built once per step (`_token_meta`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from hylora.ops.causal_conv1d.reference import check_splits, spec_columns
from hylora.ops.host_to_device import host_to_device
from hylora.ops.varlen import device_seq_starts

BLOCK_T, BLOCK_C = 16, 256


def causal_conv1d_by_slot(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, K]
    conv_state: torch.Tensor,  # [S, C, K-1], in place
    slots: torch.Tensor,  # [N]
    seq_lens: list[int],
    block_t: int = BLOCK_T,
    block_c: int = BLOCK_C,
    splits: Sequence[int] | None = None,
    layout: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """`layout` (token_seq [T], starts [N + 1] on the device): the sequences as the device holds them
    (a CUDA graph's padded step, whose `seq_lens` fix only T and N); None: built from `seq_lens`."""
    T, C = x.shape
    K = weight.shape[1]
    N = len(seq_lens)
    if conv_state.shape[1:] != (C, K - 1) or weight.shape[0] != C or slots.shape != (N,) or sum(seq_lens) != T:
        raise ValueError("causal_conv1d_by_slot: inconsistent shapes")
    if x.stride(1) != 1 or not conv_state.is_contiguous():
        raise ValueError("causal_conv1d_by_slot: x needs unit stride along C and the state pool must be contiguous")
    if splits is not None:
        check_splits(splits, C)
    # channel groups written one after the other, each [T, width] contiguous: [0, B1), [B1, B2), [B2, C)
    firsts = list(itertools.accumulate(splits or [C], initial=0))[:-1]
    bounds = (firsts[1:] + [C, C])[:2]
    out = torch.empty(T * C, dtype=x.dtype, device=x.device)
    parts = tuple(out[T * lo : T * (lo + n)].view(T, n) for lo, n in zip(firsts, splits or [C], strict=True))
    if T > 0:
        token_seq, starts = layout if layout is not None else _token_meta(tuple(seq_lens), x.device)
        channel_blocks = sum(triton.cdiv(hi - lo, block_c) for lo, hi in zip((0, *bounds), (*bounds, C), strict=True))
        w = weight.contiguous()
        _conv_kernel[(triton.cdiv(T, block_t), channel_blocks)](
            x, w, conv_state, token_seq, starts, out, T, C, x.stride(0), *bounds,
            K=K, BLOCK_T=block_t, BLOCK_C=block_c,
        )  # fmt: skip
        _chunk_head_kernel[(N, channel_blocks)](
            x, w, conv_state, slots, starts, out, T, C, x.stride(0), *bounds,
            K=K, BLOCK_C=block_c, BLOCK_K=triton.next_power_of_2(K - 1),
        )  # fmt: skip
    return parts if splits is not None else parts[0]


@functools.lru_cache(maxsize=1)  # every GDN layer of a step asks with the same lengths
def _token_meta(seq_lens: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence of each token [T] int32, first token of each sequence [N + 1] int64), on `device`."""
    # numpy, not torch: torch's CPU ops wake its thread pool (~2 ms a call on a busy host)
    token_seq = torch.from_numpy(np.repeat(np.arange(len(seq_lens), dtype=np.int32), seq_lens))
    return host_to_device(token_seq, device), device_seq_starts(seq_lens, device)


@triton.jit
def _channel_block(pid, B1, B2, C, BLOCK_C: tl.constexpr):
    """Channel blocks are numbered group by group ([0, B1), [B1, B2), [B2, C); an empty group has no
    blocks), so a program's channels share one group. Returns (group's first channel, its end, the
    block's channels [BC])."""
    blocks1 = tl.cdiv(B1, BLOCK_C)
    blocks2 = blocks1 + tl.cdiv(B2 - B1, BLOCK_C)
    first = tl.where(pid >= blocks2, B2, tl.where(pid >= blocks1, B1, 0))
    end = tl.where(pid >= blocks2, C, tl.where(pid >= blocks1, B2, B1))
    local = pid - tl.where(pid >= blocks2, blocks2, tl.where(pid >= blocks1, blocks1, 0))
    return first, end, first + local * BLOCK_C + tl.arange(0, BLOCK_C)


@triton.jit
def _conv_kernel(
    x_ptr, w_ptr, state_ptr, token_seq_ptr, starts_ptr, out_ptr, T, C, stride_xt, B1, B2,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    first, end, c = _channel_block(tl.program_id(1), B1, B2, C, BLOCK_C)  # [BC]
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    seq = tl.load(token_seq_ptr + t, mask=t < T, other=0)
    pos = t - tl.load(starts_ptr + seq, mask=t < T, other=0).to(tl.int32)  # position within this chunk
    # rows whose K taps are all inputs of their own chunk; `_chunk_head_kernel` writes the others
    mask = ((t < T) & (pos >= K - 1))[:, None] & (c < end)[None, :]
    x_rows = x_ptr + t.to(tl.int64)[:, None] * stride_xt + c[None, :]  # [BT, BC]
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        xv = tl.load(x_rows + (j - (K - 1)) * stride_xt, mask=mask, other=0.0)
        wj = tl.load(w_ptr + c * K + j, mask=c < end, other=0.0).to(tl.float32)
        acc += xv.to(state_ptr.dtype.element_ty).to(tl.float32) * wj[None, :]  # x as the state holds it
    y = tl.fdiv(acc, 1.0 + tl.exp(-acc), ieee_rounding=False)
    out = out_ptr + first.to(tl.int64) * T + t.to(tl.int64)[:, None] * (end - first) + (c - first)[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_head_kernel(
    x_ptr, w_ptr, state_ptr, slots_ptr, starts_ptr, out_ptr, T, C, stride_xt, B1, B2,
    K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    first, end, c = _channel_block(tl.program_id(1), B1, B2, C, BLOCK_C)  # [BC]
    i = tl.arange(0, BLOCK_K)  # [BK] the chunk's first K-1 rows, then the state's K-1 positions
    start = tl.load(starts_ptr + n)
    length = tl.load(starts_ptr + n + 1) - start
    slot = tl.load(slots_ptr + n).to(tl.int64)
    c_ok = c < end
    state_rows = state_ptr + slot * C * (K - 1) + c * (K - 1)  # [BC]
    row_ok = (i < K - 1) & (i < length)
    acc = tl.zeros([BLOCK_K, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        src = i - (K - 1) + j  # [BK] input index within the chunk; < 0: in the carried state
        from_x = (src >= 0) & row_ok
        from_state = (src < 0) & row_ok & (slot >= 0)
        xv = tl.load(x_ptr + (start + src)[:, None] * stride_xt + c[None, :], mask=from_x[:, None] & c_ok[None, :])
        sv = tl.load(state_rows[None, :] + (K - 1 + src)[:, None], mask=from_state[:, None] & c_ok[None, :], other=0.0)
        value = tl.where(from_x[:, None], xv.to(state_ptr.dtype.element_ty), sv).to(tl.float32)
        wj = tl.load(w_ptr + c * K + j, mask=c_ok, other=0.0).to(tl.float32)
        acc += value * wj[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    t = (start + i).to(tl.int64)
    out = out_ptr + first.to(tl.int64) * T + t[:, None] * (end - first) + (c - first)[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & c_ok[None, :])

    # the state becomes the last K-1 inputs of [old state | chunk]: every thread's reads of the old
    # state above are done before any thread of the program overwrites it
    tl.debug_barrier()
    live = c_ok[:, None] & (i < K - 1)[None, :] & (slot >= 0)  # [BC, BK]
    src = length - (K - 1) + i  # [BK] index within the chunk of the input that lands at state[i]
    xv = tl.load(x_ptr + (start + src)[None, :] * stride_xt + c[:, None], mask=live & (src >= 0)[None, :], other=0.0)
    sv = tl.load(state_rows[:, None] + (i + length)[None, :], mask=live & (src < 0)[None, :], other=0.0)
    new = tl.where((src >= 0)[None, :], xv.to(state_ptr.dtype.element_ty), sv)  # all loaded before the store
    tl.debug_barrier()
    tl.store(state_rows[:, None] + i[None, :], new, mask=live)


def save_conv_states(
    x: torch.Tensor,  # [T, C]
    conv_state: torch.Tensor,  # [S, C, K-1] the state pool, before the conv updates it
    slots: torch.Tensor,  # [N]
    seq_lens: list[int],
    spec_slots: torch.Tensor,  # [N, J], J >= max(seq_lens) - 1
    starts: torch.Tensor | None = None,  # [N + 1] on the device (a CUDA graph's padded step); None: from seq_lens
    columns: int | None = None,  # only spec_slots[:, :columns] may hold a slot (the rest are -1); None: all
    block_c: int = BLOCK_C,
) -> None:
    """`reference.save_conv_states` in one launch, grid (sequence, spec column, channel block): the
    program of (i, j) writes conv_state[spec_slots[i, j]] = the last K-1 inputs of [conv_state[slots[i]]
    | the chunk's first j + 1 tokens] when j < n_i - 1, spec_slots[i, j] >= 0 and slots[i] >= 0, and
    nothing otherwise (the reference rewrites such entries with the values they hold; here they are
    masked off). Spec slots must be distinct and differ from every slot in `slots`: programs read
    the main slots and write only spec slots."""
    N, T = len(seq_lens), x.shape[0]
    J = spec_columns(seq_lens, spec_slots, columns)
    if J <= 0 or T == 0:
        return
    S, C, km1 = conv_state.shape
    if x.shape[1] != C or x.stride(1) != 1 or slots.shape != (N,):
        raise ValueError("save_conv_states: x [T, C] with unit stride along C and one slot per sequence")
    if starts is None:
        starts = device_seq_starts(tuple(seq_lens), x.device)
    _save_states_kernel[(N, J, triton.cdiv(C, block_c))](
        x, conv_state, slots, starts, spec_slots, C, x.stride(0), *conv_state.stride(), *spec_slots.stride(),
        KM1=km1, BLOCK_C=block_c,
    )  # fmt: skip


@triton.jit
def _save_states_kernel(
    x_ptr, state_ptr, slots_ptr, starts_ptr, spec_ptr, C, stride_xt, s_ss, s_sc, s_sk, s_pn, s_pj,
    KM1: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)  # [BC]
    start = tl.load(starts_ptr + n).to(tl.int64)
    length = tl.load(starts_ptr + n + 1).to(tl.int64) - start
    slot = tl.load(slots_ptr + n).to(tl.int64)
    spec = tl.load(spec_ptr + n * s_pn + j * s_pj).to(tl.int64)
    mask = (c < C) & (j < length - 1) & (spec >= 0) & (slot >= 0)
    src = state_ptr + tl.maximum(slot, 0) * s_ss + c * s_sc
    dst = state_ptr + tl.maximum(spec, 0) * s_ss + c * s_sc
    for m in tl.static_range(KM1):
        # element m of the saved state is element w of the window [held state (K-1) | the chunk's inputs]
        w = j + 1 + m
        held = tl.load(src + tl.minimum(w, KM1 - 1) * s_sk, mask=mask & (w < KM1), other=0.0)
        t = start + tl.maximum(w - KM1, 0)
        new = tl.load(x_ptr + t * stride_xt + c, mask=mask & (w >= KM1), other=0.0)
        tl.store(dst + m * s_sk, tl.where(w < KM1, held, new.to(state_ptr.dtype.element_ty)), mask=mask)

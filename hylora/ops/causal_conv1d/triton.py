"""`reference.causal_conv1d_by_slot` in two Triton launches, the conv state read and written in
place in the pool by slot (no gather / scatter copies), every sequence of the step at once.

1. `_conv_kernel`, grid (token block, channel block): out[t, c] = silu(sum_j w[c, j] * in[pos - K + 1
   + j]) where inputs before the chunk's first token come from the sequence's conv state.
   Accumulated in fp32 in the reference's order. With `splits` (the GDN layer's q | k | v), each
   group of channels is stored as its own contiguous [T, width] tensor, which fla's kernels take
   without the copy they would make of a strided view.
2. `_state_kernel`, grid (sequence, channel block): the state becomes the last K-1 inputs (of the
   old state followed by the chunk). It runs after (1) on the stream, so (1) reads the old state;
   each program loads all K-1 values before it stores any, so its in-place shift is safe.

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
        _conv_kernel[(triton.cdiv(T, block_t), triton.cdiv(C, block_c))](
            x, weight.contiguous(), conv_state, slots, token_seq, starts, out, T, C, x.stride(0), *bounds,
            K=K, BLOCK_T=block_t, BLOCK_C=block_c,
        )  # fmt: skip
        _state_kernel[(N, triton.cdiv(C, block_c))](
            x, conv_state, slots, starts, C, x.stride(0), K=K, BLOCK_C=block_c, BLOCK_K=triton.next_power_of_2(K - 1),
        )  # fmt: skip
    return parts if splits is not None else parts[0]


@functools.lru_cache(maxsize=1)  # every GDN layer of a step asks with the same lengths
def _token_meta(seq_lens: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence of each token [T] int32, first token of each sequence [N + 1] int64), on `device`."""
    # numpy, not torch: torch's CPU ops wake its thread pool (~2 ms a call on a busy host)
    token_seq = torch.from_numpy(np.repeat(np.arange(len(seq_lens), dtype=np.int32), seq_lens))
    return token_seq.to(device, non_blocking=True), device_seq_starts(seq_lens, device)


@triton.jit
def _conv_kernel(
    x_ptr, w_ptr, state_ptr, slots_ptr, token_seq_ptr, starts_ptr, out_ptr, T, C, stride_xt, B1, B2,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)  # [BT]
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)  # [BC]
    t_ok, c_ok = t < T, c < C
    seq = tl.load(token_seq_ptr + t, mask=t_ok, other=0)
    pos = t - tl.load(starts_ptr + seq, mask=t_ok, other=0)  # position within this chunk
    slot = tl.load(slots_ptr + seq, mask=t_ok, other=-1).to(tl.int64)
    state_row = slot * C * (K - 1)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        src = pos - (K - 1) + j  # [BT] input index within the chunk; < 0: in the carried state
        from_x = (src >= 0) & t_ok
        from_state = (src < 0) & t_ok & (slot >= 0)
        xv = tl.load(
            x_ptr + (t - (K - 1) + j)[:, None] * stride_xt + c[None, :],
            mask=from_x[:, None] & c_ok[None, :],
            other=0.0,
        )
        sv = tl.load(
            state_ptr + state_row[:, None] + c[None, :] * (K - 1) + (K - 1 + src)[:, None],
            mask=from_state[:, None] & c_ok[None, :],
            other=0.0,
        )
        value = tl.where(from_x[:, None], xv.to(state_ptr.dtype.element_ty), sv).to(tl.float32)
        wj = tl.load(w_ptr + c * K + j, mask=c_ok, other=0.0).to(tl.float32)
        acc += value * wj[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    # channel c's group [first, first + width) is stored [T, width] from element T * first
    first = tl.where(c >= B2, B2, tl.where(c >= B1, B1, 0)).to(tl.int64)
    width = tl.where(c >= B2, C, tl.where(c >= B1, B2, B1)).to(tl.int64) - first
    out = out_ptr + T * first[None, :] + t[:, None] * width[None, :] + (c - first)[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])


@triton.jit
def _state_kernel(
    x_ptr, state_ptr, slots_ptr, starts_ptr, C, stride_xt,
    K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)  # [BC]
    i = tl.arange(0, BLOCK_K).to(tl.int64)  # [BK] state position
    start = tl.load(starts_ptr + n)
    length = tl.load(starts_ptr + n + 1) - start
    slot = tl.load(slots_ptr + n).to(tl.int64)
    live = (c < C)[:, None] & (i < K - 1)[None, :] & (slot >= 0)
    src = length - (K - 1) + i  # [BK] index within the chunk of the input that lands at state[i]
    row = state_ptr + slot * C * (K - 1) + c[:, None] * (K - 1)  # [BC, 1]
    xv = tl.load(x_ptr + (start + src)[None, :] * stride_xt + c[:, None], mask=live & (src >= 0)[None, :], other=0.0)
    sv = tl.load(row + (i + length)[None, :], mask=live & (src < 0)[None, :], other=0.0)
    new = tl.where((src >= 0)[None, :], xv.to(state_ptr.dtype.element_ty), sv)  # all loaded before the store
    tl.store(row + i[None, :], new, mask=live)


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

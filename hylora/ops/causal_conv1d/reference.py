"""Depthwise causal conv1d + SiLU over a flat varlen batch, carrying a per-sequence conv state.

The conv state of a sequence holds its last K-1 inputs (zeros before the first token), so a
prefill split into chunks, or a decode step, sees exactly the inputs one full pass would.
Computed as K shifted multiply-adds accumulated in fp32 (no cuDNN: its fp32 convolutions default
to TF32 on GPUs). Single-token sequences (decode) are done together.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from hylora.ops.varlen import device_seq_starts, live_sequences, seq_starts, single_token_seqs


def causal_conv1d_varlen(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, K]
    conv_states: torch.Tensor,  # [N, C, K-1]
    seq_lens: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (silu(conv(x)) [T, C], new conv states [N, C, K-1])."""
    out = torch.empty_like(x)
    new_states = torch.empty_like(conv_states)
    w = weight.float()
    starts = seq_starts(seq_lens)
    single = single_token_seqs(seq_lens)
    if single:
        seq = torch.tensor(single, device=x.device)
        rows = torch.tensor([starts[i] for i in single], device=x.device)
        window = torch.cat([conv_states[seq], x[rows, :, None].to(conv_states.dtype)], dim=2)  # [B, C, K]
        out[rows] = F.silu((window.float() * w).sum(-1)).to(x.dtype)
        new_states[seq] = window[:, :, 1:]
    for i, n in enumerate(seq_lens):
        if n == 1:
            continue
        window = torch.cat([conv_states[i], x[starts[i] : starts[i + 1]].T.to(conv_states.dtype)], dim=1)  # [C, K-1+n]
        out[starts[i] : starts[i + 1]] = F.silu(_shifted_sum(window.float(), w, n)).T.to(x.dtype)
        new_states[i] = window[:, window.shape[1] - (weight.shape[1] - 1) :]
    return out, new_states


def _shifted_sum(window: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    """y[:, t] = sum_j w[:, j] * window[:, t + j] for t < n."""
    y = window[:, :n] * w[:, :1]
    for j in range(1, w.shape[1]):
        y = y + window[:, j : j + n] * w[:, j : j + 1]
    return y


def causal_conv1d_by_slot(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, K]
    conv_state: torch.Tensor,  # [S, C, K-1] the state pool, updated in place
    slots: torch.Tensor,  # [N] pool slot of each sequence
    seq_lens: list[int],
    splits: Sequence[int] | None = None,
    layout: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """`causal_conv1d_varlen` reading and writing the pool's rows at `slots` (the signature of the
    fused kernel, `triton.causal_conv1d_by_slot`). Returns silu(conv(x)) [T, C], or with `splits`
    (channel counts summing to C, at most 3) one contiguous [T, split] tensor per group of channels.
    A negative slot reads and writes no state (its tokens' outputs are zeros here; the kernel's are
    unspecified). `layout` is the kernel's device copy of `seq_lens`; the reference reads `seq_lens`."""
    live = live_sequences(slots, seq_lens)
    if live is None:
        out, new_states = causal_conv1d_varlen(x, weight, conv_state[slots], seq_lens)
        conv_state[slots] = new_states
    else:
        keep, rows = live
        out = torch.zeros_like(x)
        if keep:
            out[rows] = causal_conv1d_by_slot(x[rows], weight, conv_state, slots[keep], [seq_lens[i] for i in keep])
    if splits is None:
        return out
    check_splits(splits, x.shape[1])
    return tuple(part.contiguous() for part in out.split(list(splits), dim=-1))


def save_conv_states(
    x: torch.Tensor,  # [T, C]
    conv_state: torch.Tensor,  # [S, C, K-1] the state pool, before the conv updates it
    slots: torch.Tensor,  # [N]
    seq_lens: list[int],
    spec_slots: torch.Tensor,  # [N, J], J >= max(seq_lens) - 1
    starts: torch.Tensor | None = None,  # [N + 1] on the device (a CUDA graph's padded step); None: from seq_lens
    columns: int | None = None,  # only spec_slots[:, :columns] may hold a slot (the rest are -1); None: all
) -> None:
    """For a speculative verify step: writes into conv_state[spec_slots[i, j]] the conv state sequence i
    has after its token j < n_i - 1 (its last K-1 inputs up to token j); -1 entries and rows whose slot
    is negative write nothing. Call it before the conv, which moves conv_state[slots] past the chunk.
    `columns` bounds the work (a padded step's spec slots are as wide as its longest chunk, its drafts
    only `columns` wide).

    Spec slots must be distinct and differ from every slot in `slots`. No host sync (a CUDA graph
    captures it): which entries write follows from `starts` on the device; entries that write nothing
    rewrite a live row's own slot (or slot 0 if no row is live) with the value it holds."""
    T = x.shape[0]
    J = spec_columns(seq_lens, spec_slots, columns)
    spec_slots = spec_slots[:, :J]
    if J <= 0 or T == 0:
        return
    if starts is None:
        starts = device_seq_starts(tuple(seq_lens), x.device)
    j = torch.arange(J, device=x.device)
    rows = (starts[:-1, None] + j).clamp_max(T - 1)  # [N, J]; past n_i: unused
    writes = j[None, :] < (starts[1:] - starts[:-1] - 1)[:, None]
    live = slots.long() >= 0
    keep = torch.where(live, slots.long(), slots.long().max()).clamp_min(0)  # [N]
    held = conv_state[keep]  # [N, C, K-1]
    window = torch.cat([held, x[rows].transpose(1, 2).to(conv_state.dtype)], dim=2)  # [N, C, K-1+J]
    after = window.unfold(2, conv_state.shape[2], 1)[:, :, 1:].transpose(1, 2)  # [N, J, C, K-1]
    spec = spec_slots.long()
    valid = writes & (spec >= 0) & live[:, None]
    dst = torch.where(valid, spec, keep[:, None])
    conv_state[dst] = torch.where(valid[..., None, None], after, held[:, None])


def spec_columns(seq_lens: list[int], spec_slots: torch.Tensor, columns: int | None) -> int:
    """The spec-slot columns `save_conv_states` works over; ValueError if the table does not fit."""
    if (
        spec_slots.dim() != 2
        or spec_slots.shape[0] != len(seq_lens)
        or max(seq_lens, default=0) - 1 > spec_slots.shape[1]
    ):
        raise ValueError(f"save_conv_states: spec_slots {tuple(spec_slots.shape)} do not fit lengths {seq_lens}")
    return spec_slots.shape[1] if columns is None else min(spec_slots.shape[1], columns)


def check_splits(splits: Sequence[int], channels: int) -> None:
    if len(splits) > 3 or sum(splits) != channels or min(splits) <= 0:
        raise ValueError(f"causal_conv1d_by_slot: splits {list(splits)} are not 1-3 positive parts of {channels}")

"""Bookkeeping shared by the varlen ops: where each sequence's tokens start, which are decodes."""

from __future__ import annotations

import functools

import numpy as np
import torch

from hylora.ops.host_to_device import host_to_device

# the longest chunk a step may hold for the GDN layers to run it token by token
# (ops.gated_delta_rule.triton, fla's chunk size) instead of through fla's chunked kernels
RECURRENT_MAX_TOKENS = 64


def seq_starts(seq_lens: list[int]) -> list[int]:
    """[N + 1] offsets of each sequence's tokens in the flat batch (cu_seqlens)."""
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    return starts


def single_token_seqs(seq_lens: list[int]) -> list[int]:
    """Sequences with exactly one new token (decode steps): the ops handle these all at once."""
    return [i for i, n in enumerate(seq_lens) if n == 1]


@functools.lru_cache(maxsize=1)  # every layer of a step asks with the same lengths
def device_seq_starts(seq_lens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """`seq_starts` as an int64 tensor on `device` (cu_seqlens), built once per step."""
    return host_to_device(np.asarray(seq_starts(list(seq_lens)), dtype=np.int64), device)


def live_sequences(slots: torch.Tensor, seq_lens: list[int]) -> tuple[list[int], torch.Tensor] | None:
    """For the by-slot references: None when every sequence has a state slot; else (the sequences with
    one, their tokens' flat rows [T_live]). A negative slot is a padded step's padding sequence
    (engine/short_step.py): it reads no state, writes none, and its tokens' outputs are zeros."""
    live = (slots >= 0).tolist()
    if all(live):
        return None
    starts = seq_starts(seq_lens)
    keep = [i for i, ok in enumerate(live) if ok]
    rows = [t for i in keep for t in range(starts[i], starts[i + 1])]
    return keep, host_to_device(np.asarray(rows, dtype=np.int64), slots.device)

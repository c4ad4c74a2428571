"""`reference.scan_logits` in two Triton launches, reading the logits once.

1. `_scan_chunk_kernel`, grid (row, chunk of CHUNK columns): the chunk's first largest value, its
   index and its flags, into [N, chunks] partials. Splitting the row keeps every SM streaming at
   decode batch sizes (32 rows of a 248k vocabulary would be 32 programs).
2. `_merge_chunks_kernel`, grid (row,): the first chunk holding the row's largest value wins (so ties go to
   the lowest index, as torch.argmax), and the chunks' flags are OR-ed.

A row of -inf only (every token forbidden) gives token 0, as torch.argmax does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylora.ops.logits_scan.reference import HAS_FINITE, HAS_NAN, NOT_FINITE

# columns a program of the first launch scans (31 chunks a row of a 248k vocabulary), and loads at once:
# fastest of six on an H200 (13.1 / 24.2 us at batch 32 / 64 against 181 / 316 us for the torch ops it
# replaced; bench/kernel_sweep_gpu.py --only logits, docs/BASELINE.md run 27)
CHUNK = 8192
BLOCK = 2048


def scan_logits(logits: torch.Tensor, chunk: int = CHUNK, block: int = BLOCK) -> torch.Tensor:
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("scan_logits: needs fp32 [N, V] logits with unit stride along V")
    if chunk % block:
        raise ValueError("scan_logits: the chunk must be a whole number of blocks")
    N, V = logits.shape
    out = torch.empty(2, N, dtype=torch.int64, device=logits.device)
    if N == 0:
        return out
    chunks = triton.cdiv(V, chunk)
    values = torch.empty(N, chunks, dtype=torch.float32, device=logits.device)
    index = torch.empty(N, chunks, dtype=torch.int64, device=logits.device)
    flags = torch.empty(N, chunks, dtype=torch.int32, device=logits.device)
    _scan_chunk_kernel[(N, chunks)](
        logits, values, index, flags, V, logits.stride(0), chunks,
        CHUNK=chunk, BLOCK=block, HAS_NAN=HAS_NAN, NOT_FINITE=NOT_FINITE, HAS_FINITE=HAS_FINITE,
    )  # fmt: skip
    _merge_chunks_kernel[(N,)](values, index, flags, out, chunks, N, BLOCK=triton.next_power_of_2(chunks))
    return out


@triton.jit
def _scan_chunk_kernel(
    x_ptr, values_ptr, index_ptr, flags_ptr, V, stride_n, chunks,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, HAS_NAN: tl.constexpr, NOT_FINITE: tl.constexpr,
    HAS_FINITE: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    start = c * CHUNK
    row = x_ptr + n * stride_n
    best = tl.full((), float("-inf"), tl.float32)
    best_at = start.to(tl.int64)
    nan = tl.zeros((), tl.int32)
    not_finite = tl.zeros((), tl.int32)
    finite = tl.zeros((), tl.int32)
    for off in tl.static_range(0, CHUNK, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(row + cols, mask=mask, other=float("-inf"))
        is_nan = x != x
        is_finite = tl.abs(x) < float("inf")  # False for NaN as well
        nan |= tl.max(is_nan.to(tl.int32))
        not_finite |= tl.max((mask & ~is_finite).to(tl.int32))
        finite |= tl.max(is_finite.to(tl.int32))
        x = tl.where(is_nan, float("-inf"), x)  # a NaN row is flagged; its token is not used
        m, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = m > best  # strictly: an earlier block keeps a tie
        best_at = tl.where(better, (start + off + at).to(tl.int64), best_at)
        best = tl.where(better, m, best)
    tl.store(values_ptr + n * chunks + c, best)
    tl.store(index_ptr + n * chunks + c, best_at)
    tl.store(flags_ptr + n * chunks + c, nan * HAS_NAN | not_finite * NOT_FINITE | finite * HAS_FINITE)


@triton.jit
def _or_bits(a, b):
    return a | b


@triton.jit
def _merge_chunks_kernel(values_ptr, index_ptr, flags_ptr, out_ptr, chunks, N, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < chunks
    v = tl.load(values_ptr + n * chunks + c, mask=mask, other=float("-inf"))
    at = tl.load(index_ptr + n * chunks + c, mask=mask, other=0)
    f = tl.load(flags_ptr + n * chunks + c, mask=mask, other=0)
    _, first = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
    token = tl.sum(tl.where(c == first, at, 0))
    tl.store(out_ptr + n, token)
    tl.store(out_ptr + N + n, tl.reduce(f, 0, _or_bits))

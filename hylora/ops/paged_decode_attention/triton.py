"""Split-KV (flash-decoding) decode attention over the paged KV cache, in Triton.

Same signature and result as `reference.paged_decode_attention` (padding rows: `seq_lens == 0`
gives zeros). Grid (sequence, KV head, partition): each program reads `PARTITION` tokens of one KV
head once for all H / Hkv query heads of its group (padded to 16 rows for the tensor cores), with
an online softmax in fp32 (exp2, scale folded in) and, for 16-bit caches, p rounded to the cache's
dtype for P @ V (PV_16BIT). A second kernel, grid (sequence, query head),
merges the partitions. With a single partition the first kernel writes the output directly.

The number of partitions comes from static shapes (`block_table` width, or `max_seq_len` when the
caller knows a bound), never from the lengths on the device: no host sync, CUDA-graph safe.
Programs past a sequence's length exit at once; the merge reads only partitions that were written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens per program. Fixed, never derived from the batch's length bound: a sequence's partitions, and
# so its bits, must not depend on its neighbours' lengths or on graph vs eager (whose bounds differ).
# H200, bench/kernel_sweep_gpu.py --only attention (docs/BASELINE.md run 46): with the 16-bit P @ V and
# 32-token steps, 256 was the fastest or within 1 % of it at batch 32 / 64 x 576 tokens and 24 x 9000,
# and 0.3 % behind 512 at 8 x 8192.
PARTITION = 256
# sm_90, D 256, GQA 6, bf16 (ptxas): 117 registers a thread at 4 warps with the 16-bit P @ V, no spills
# (184 with tf32x3 at BLOCK_T 16, the earlier default). 4 warps level with 8 (run 46; run 10: 4 beat 8).
BLOCK_T = 32  # tokens per inner step: K and V tiles of 32 x 256 bf16 = 16 KiB each
NUM_WARPS = 4
MERGE_CHUNK = 16  # partitions merged per step of the merge kernel's loop
# 16-bit caches: P @ V with p cast to the cache dtype (one 16-bit MMA, as FlashAttention does: p in [0, 1]
# rounded to 8 bits; 2.2e-3 from the fp32 reference at bf16), or with p in fp32 and V upcast (tf32x3: three
# MMAs a step, exact to fp32 products, 4-7e-5). Run 46: the whole kernel 1.5-1.7x faster with the 16-bit one
# (24 x 9000 tokens: 386 -> 236 us, 1.15x its KV read; batch 32 x 576: 44.8 -> 29.4 us).
PV_16BIT = True
LOG2E = 1.4426950408889634


def paged_decode_attention(
    q: torch.Tensor,  # [N, H, D]
    k_cache: torch.Tensor,  # [num_pages * page_size, Hkv, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [N, max_pages] int
    seq_lens: torch.Tensor,  # [N] int, 0 = padding row
    page_size: int,
    scale: float,
    max_seq_len: int | None = None,  # bound on seq_lens known to the host; default: the table's width
    out: torch.Tensor | None = None,
    partition: int = PARTITION,
    block_t: int = BLOCK_T,
    num_warps: int = NUM_WARPS,
    pv_16bit: bool = PV_16BIT,
    num_stages: int | None = None,  # the partition kernel's software pipelining (None: Triton's default)
) -> torch.Tensor:
    N, H, D = q.shape
    hkv = k_cache.shape[1]
    if H % hkv or k_cache.shape != v_cache.shape or k_cache.shape[2] != D:
        raise ValueError("paged_decode_attention: inconsistent head shapes")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise TypeError("paged_decode_attention: q and the caches need one dtype")
    if block_t < 16 or partition % block_t:
        raise ValueError("block_t must be >= 16 (tensor-core K) and divide the partition")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or block_table.stride(1) != 1:
        raise ValueError("paged_decode_attention: head_dim and block-table rows must be contiguous")
    if out is None:
        out = torch.empty_like(q)
    if N == 0:
        return out
    bound = block_table.shape[1] * page_size if max_seq_len is None else max_seq_len
    num_parts = max(1, triton.cdiv(bound, partition))
    group = H // hkv
    fp32 = q.dtype == torch.float32
    meta = dict(
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        D=D,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        BLOCK_T=block_t,
        PARTITION=partition,
        DIRECT=num_parts == 1,
        QK_PRECISION="ieee" if fp32 else "tf32",  # 16-bit inputs: exact products, fp32 accumulation
        PV_PRECISION="ieee" if fp32 else "tf32x3",  # p stays fp32, v upcast (no cast down before a dot)
        PV_16BIT=pv_16bit and not fp32,
    )
    stages = {} if num_stages is None else {"num_stages": num_stages}
    if num_parts == 1:
        part_o = part_ml = out  # unused
    else:
        part_o = torch.empty(N, H, num_parts, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(N, H, num_parts, 2, dtype=torch.float32, device=q.device)
    _partition_kernel[(N, hkv, num_parts)](
        q, k_cache, v_cache, block_table, seq_lens, out, part_o, part_ml,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_table.stride(0), out.stride(0), out.stride(1),
        scale * LOG2E, num_parts,
        PAGE_SIZE=page_size, num_warps=num_warps, **stages, **meta,
    )  # fmt: skip
    if num_parts > 1:
        _merge_kernel[(N, H)](
            seq_lens, part_o, part_ml, out, out.stride(0), out.stride(1), num_parts,
            D=D, BLOCK_D=meta["BLOCK_D"], PARTITION=partition,
            BLOCK_P=min(MERGE_CHUNK, triton.next_power_of_2(num_parts)), num_warps=NUM_WARPS,
        )  # fmt: skip
    return out


@triton.jit
def _partition_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, o_ptr, part_o_ptr, part_ml_ptr,
    s_qn, s_qh, s_kt, s_kh, s_vt, s_vh, s_bt, s_on, s_oh,
    scale_log2, num_parts,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr, PARTITION: tl.constexpr, DIRECT: tl.constexpr,
    QK_PRECISION: tl.constexpr, PV_PRECISION: tl.constexpr, PV_16BIT: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    length = tl.load(lens_ptr + n).to(tl.int32)
    start = part * PARTITION
    gg = tl.arange(0, BLOCK_G)
    dd = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + gg
    g_mask = gg < GROUP
    d_mask = dd < D
    hd_mask = g_mask[:, None] & d_mask[None, :]
    o_ptrs = o_ptr + n * s_on + heads[:, None] * s_oh + dd[None, :]
    if start >= length:
        if DIRECT:  # empty sequence (padding row): zeros; with partitions the merge writes them
            tl.store(o_ptrs, tl.zeros([BLOCK_G, BLOCK_D], dtype=o_ptr.dtype.element_ty), mask=hd_mask)
        return
    end = tl.minimum(start + PARTITION, length)

    q = tl.load(q_ptr + n * s_qn + heads[:, None] * s_qh + dd[None, :], mask=hd_mask, other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for t0 in range(start, end, BLOCK_T):
        tt = t0 + tl.arange(0, BLOCK_T)
        t_mask = tt < end
        page = tl.load(bt_ptr + n * s_bt + tt // PAGE_SIZE, mask=t_mask, other=0).to(tl.int64)
        rows = page * PAGE_SIZE + tt % PAGE_SIZE  # int64: rows x stride overflows int32 on big caches
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + rows[:, None] * s_kt + kvh * s_kh + dd[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=QK_PRECISION) * scale_log2  # [BLOCK_G, BLOCK_T]
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every step has a valid token
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + rows[:, None] * s_vt + kvh * s_vh + dd[None, :], mask=kv_mask, other=0.0)
        if PV_16BIT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PV_PRECISION)
        m = m_new

    if DIRECT:
        tl.store(o_ptrs, (acc / l[:, None]).to(o_ptr.dtype.element_ty), mask=hd_mask)
    else:
        row = (n * tl.num_programs(1) * GROUP + heads) * num_parts + part  # [N, H, parts] flattened
        tl.store(part_o_ptr + row[:, None] * D + dd[None, :], acc, mask=hd_mask)
        tl.store(part_ml_ptr + row * 2, m, mask=g_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l, mask=g_mask)


@triton.jit
def _merge_kernel(
    lens_ptr, part_o_ptr, part_ml_ptr, o_ptr, s_on, s_oh, num_parts,
    D: tl.constexpr, BLOCK_D: tl.constexpr, PARTITION: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """o = sum_p exp2(m_p - M) acc_p / sum_p exp2(m_p - M) l_p over the partitions holding tokens,
    BLOCK_P partitions per step (one [BLOCK_P, D] load, not one load per partition)."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    used = tl.cdiv(tl.load(lens_ptr + n).to(tl.int32), PARTITION)  # partitions written this call; 0 for padding
    row0 = (n * tl.num_programs(1) + h) * num_parts
    pp = tl.arange(0, BLOCK_P)
    dd = tl.arange(0, BLOCK_D)
    top = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
    for p0 in range(0, used, BLOCK_P):  # the largest m over every written partition
        m = tl.load(part_ml_ptr + (row0 + p0 + pp) * 2, mask=p0 + pp < used, other=float("-inf"))
        top = tl.maximum(top, m)
    top = tl.where(used > 0, tl.max(top, axis=0), 0.0)
    total = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for p0 in range(0, used, BLOCK_P):
        p_mask = p0 + pp < used
        rows = row0 + p0 + pp
        w = tl.where(p_mask, tl.exp2(tl.load(part_ml_ptr + rows * 2, mask=p_mask, other=0.0) - top), 0.0)
        total += tl.sum(w * tl.load(part_ml_ptr + rows * 2 + 1, mask=p_mask, other=0.0), axis=0)
        pd_mask = p_mask[:, None] & (dd < D)[None, :]
        part = tl.load(part_o_ptr + rows[:, None] * D + dd[None, :], mask=pd_mask, other=0.0)
        acc += tl.sum(w[:, None] * part, axis=0)
    o = tl.where(used > 0, acc / tl.where(used > 0, total, 1.0), 0.0)
    tl.store(o_ptr + n * s_on + h * s_oh + dd, o.to(o_ptr.dtype.element_ty), mask=dd < D)

"""The gated delta rule token by token in Triton, states in place in the pool by slot: for steps whose
chunks are all short (`ops.varlen.RECURRENT_MAX_TOKENS`), e.g. decode rows with the last few tokens of a prompt.

Same signature and result as `reference.recurrent_by_slot`. fla's chunked kernels are the fast form
for long chunks, but each call costs ~1 ms of host time in its Python launch path (several autotuned
launches, per GDN layer) and needs the states gathered out of the pool and scattered back; a step of a
few dozen tokens runs eagerly and spends most of its time there. Here one launch per layer does it.

Grid (sequence, value head, dv block): the program keeps its [dk, BLOCK_V] fp32 state tile in
registers across the sequence's tokens. Per token: q/k L2 norm, beta = sigmoid(b) rounded to the
model dtype, decay = exp(-exp(A_log) softplus(a + dt_bias)), the delta rule on the tile, o = Sᵀq.
fp32 arithmetic, int64 offsets, masked loads. A negative slot reads nothing, writes no state, and
outputs zeros. A sequence of 0 tokens leaves its state as it was.

With `spec_slots` [N, J] (a speculative verify step, as vLLM does it) the state after token j < n_i - 1
of sequence i is also stored to pool slot spec_slots[i, j] (-1: nowhere); the final state still goes
to slots[i]. Without it the kernel is compiled with HAS_SPEC=False and has no such stores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylora.ops.gdn_decode.triton import delta_rule, gates, l2norm, program_slot
from hylora.ops.varlen import device_seq_starts

BLOCK_V = 32
NUM_WARPS = 4


def recurrent_by_slot(
    q: torch.Tensor,  # [T, Hk, dk] raw
    k: torch.Tensor,  # [T, Hk, dk] raw
    v: torch.Tensor,  # [T, Hv, dv]
    b: torch.Tensor,  # [T, Hv]
    a: torch.Tensor,  # [T, Hv]
    A_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    state_pool: torch.Tensor,  # [S, Hv, dk, dv] fp32, in place
    slots: torch.Tensor,  # [N]
    seq_lens: list[int],
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hv, dv]
    block_v: int = BLOCK_V,
    num_warps: int = NUM_WARPS,
    *,
    spec_slots: torch.Tensor | None = None,  # [N, J] int32/int64, J >= max(seq_lens) - 1
    starts: torch.Tensor | None = None,  # [N + 1] on the device (a CUDA graph's padded step); None: from seq_lens
) -> torch.Tensor:
    """`reference.recurrent_by_slot` in one launch. Returns o [T, Hv, dv] (`out` if given)."""
    T, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if state_pool.dtype != torch.float32:
        raise TypeError(f"the recurrent state must be fp32, got {state_pool.dtype}")
    if k.shape != q.shape or v.shape[0] != T or b.shape != (T, hv) or a.shape != (T, hv) or hv % hk:
        raise ValueError("recurrent_by_slot: inconsistent shapes")
    if state_pool.shape[1:] != (hv, dk, dv) or len(seq_lens) != slots.shape[0] or sum(seq_lens) != T:
        raise ValueError("recurrent_by_slot: the state pool, slots or lengths do not fit the tokens")
    if any(x.stride(-1) != 1 for x in (q, k, v, b, a)):
        raise ValueError("recurrent_by_slot: q, k, v, b and a need unit stride along their last dimension")
    if state_pool.stride(3) != 1 or state_pool.stride(2) != dv:
        raise ValueError("recurrent_by_slot: each head's [dk, dv] state must be contiguous")
    if spec_slots is not None and (
        spec_slots.dim() != 2
        or spec_slots.shape[0] != len(seq_lens)
        or spec_slots.shape[1] < max(seq_lens, default=0) - 1
        or spec_slots.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"recurrent_by_slot: spec_slots must be int32/int64 [N={len(seq_lens)}, J >= max(seq_lens) - 1 = "
            f"{max(seq_lens, default=0) - 1}], got {spec_slots.dtype} {tuple(spec_slots.shape)}"
        )
    if out is None:
        out = torch.empty(T, hv, dv, dtype=v.dtype, device=v.device)
    N = len(seq_lens)
    if N == 0:
        return out
    block_v = min(block_v, triton.next_power_of_2(dv))
    spec = slots if spec_slots is None else spec_slots  # a dummy pointer without HAS_SPEC
    spec_strides = (0, 0) if spec_slots is None else spec_slots.stride()
    if starts is None:
        starts = device_seq_starts(tuple(seq_lens), v.device)
    _recurrent_kernel[(N, hv, triton.cdiv(dv, block_v))](
        q, k, v, b, a, A_log, dt_bias, state_pool, slots, starts, out, spec,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), b.stride(0), a.stride(0),
        state_pool.stride(0), state_pool.stride(1), out.stride(0), out.stride(1), *spec_strides, scale,
        HK=hk, HV=hv, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v,
        HAS_SPEC=spec_slots is not None, num_warps=num_warps,
    )  # fmt: skip
    return out


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, b_ptr, a_ptr, A_log_ptr, dt_bias_ptr, rec_ptr, slots_ptr, cu_ptr, o_ptr, spec_ptr,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_bt, s_at,
    s_rs, s_rh,
    s_ot, s_oh,
    s_pn, s_pj,
    scale,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_SPEC: tl.constexpr,
):  # fmt: skip
    n, h, kh, slot, live = program_slot(slots_ptr, HK, HV)
    start = tl.load(cu_ptr + n).to(tl.int64)
    end = tl.load(cu_ptr + n + 1).to(tl.int64)

    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask = kk < DK
    v_mask = vv < DV
    s_mask = (k_mask & live)[:, None] & v_mask[None, :]
    # compile-time tile offsets (each head's [dk, dv] state contiguous, checked): fewer registers
    s_ptr = (rec_ptr + slot * s_rs + h * s_rh) + (kk[:, None] * DV + vv[None, :])
    state = tl.load(s_ptr, mask=s_mask, other=0.0)
    neg_A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)

    for t in range(start, end):
        q = tl.load(q_ptr + t * s_qt + kh * s_qh + kk, mask=k_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * s_kt + kh * s_kh + kk, mask=k_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * s_vt + h * s_vh + vv, mask=v_mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + t * s_bt + h).to(tl.float32)
        x = tl.load(a_ptr + t * s_at + h).to(tl.float32) + dt_bias
        beta, decay = gates(b, x, neg_A, b_ptr)
        state, o = delta_rule(state, l2norm(q) * scale, l2norm(k), v, decay, beta)
        o = tl.where(live, o, 0.0)
        tl.store(o_ptr + t * s_ot + h * s_oh + vv, o.to(o_ptr.dtype.element_ty), mask=v_mask)
        if HAS_SPEC:
            spec = tl.load(spec_ptr + n * s_pn + (t - start) * s_pj, mask=t < end - 1, other=-1).to(tl.int64)
            tl.store(s_ptr + (tl.maximum(spec, 0) - slot) * s_rs, state, mask=s_mask & (spec >= 0))
    tl.store(s_ptr, state, mask=s_mask)

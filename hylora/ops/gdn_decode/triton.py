"""One Gated DeltaNet decode step in Triton, in place in the state pool by slot index.

Same signature and result as `reference.gdn_decode` (see there for the maths and the padding
convention: a negative slot reads nothing, writes nothing and outputs zeros). Two forms, each two
launches; all arithmetic in fp32.

The split form (the default, `v_blocks` 0), as vLLM's packed decode kernel splits it:
1. `_conv_step_kernel`, grid (sequence, channel block): silu(causal conv) of every channel into a
   scratch [N, conv_dim], and the conv state shifted by the new input.
2. `_delta_rule_step_kernel`, grid (sequence, value head, dv block): gating, q/k L2 norm and the delta
   rule on one [BLOCK_V, dk] tile (the state's transpose: loads still coalesced along dv).

The fused form (`v_blocks` >= 1):
1. `_gdn_decode_kernel`, grid (sequence, value head, group of V_BLOCKS dv blocks): the causal conv
   of the q/k channels of its key head and of its own v channels (read-only on the conv state),
   gating, q/k L2 norm, and the delta rule on each [dk, BLOCK_V] tile of the fp32 recurrent state,
   read and written in place at `slots[n]`.
2. `_conv_state_kernel`, grid (sequence, channel block): shifts the conv state by the new input. The
   conv state is written by a second launch because the q/k channels of one key head are read by every
   (value head, dv block) program of that head: writing them in the same launch would race.

Both address a head's state tile with compile-time offsets (its [dk, dv] state must be contiguous):
runtime strides cost the fused kernel 246 registers and every 1- and 2-warp launch spilled."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylora.ops.gdn_decode.reference import num_key_heads

# The default launch is the split form (V_BLOCKS 0: the conv in its own launch, then the delta rule one
# [64, dk] tile a program, 4 warps, 120 registers): at the 27B shape on an H200 61.2 / 115.6 us at batch
# 32 / 64, against 70.5 / 137.7 for the fused kernel's best launch (one program a value head walking four
# [dk, 32] tiles, loading each next one ahead); bench/kernel_sweep_gpu.py, docs/BASELINE.md run 27.
BLOCK_V = 64  # dv rows a program
BLOCK_C = 256  # channels per program of the conv launches
NUM_WARPS = 4
V_BLOCKS = 0  # 0: the split form; n >= 1: the fused kernel, each program walking n dv blocks
# (another card: `hylora serve --gdn-decode-launch block_v,num_warps[,v_blocks]` passes others to each
# call; bench/kernel_sweep_gpu.py --gdn-best-out writes the sweep's pick)


def gdn_decode(
    qkv: torch.Tensor,  # [N, conv_dim]
    b: torch.Tensor,  # [N, Hv]
    a: torch.Tensor,  # [N, Hv]
    conv_weight: torch.Tensor,  # [conv_dim, K]
    A_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    conv_state: torch.Tensor,  # [S, conv_dim, K-1], in place
    recurrent_state: torch.Tensor,  # [S, Hv, dk, dv] fp32, in place
    slots: torch.Tensor,  # [N] int, < 0 = padding row
    scale: float | None = None,
    out: torch.Tensor | None = None,  # [N, Hv, dv] to write into (e.g. a CUDA-graph buffer)
    block_v: int | None = None,
    block_c: int = BLOCK_C,
    num_warps: int | None = None,
    v_blocks: int | None = None,
) -> torch.Tensor:
    """`v_blocks` 0: the split form, the conv in a launch of its own (writing the conv outputs and
    shifting the conv state), then the delta rule one [block_v, dk] tile a program reading q, k and v
    from those outputs: fewer registers a program than the fused form, so more programs in flight."""
    N, hv = b.shape
    conv_dim, K = conv_weight.shape
    S, _, dk, dv = recurrent_state.shape
    hk = num_key_heads(conv_dim, hv, dk, dv)
    if recurrent_state.dtype != torch.float32:
        raise TypeError(f"the recurrent state must be fp32, got {recurrent_state.dtype}")
    if K & (K - 1):
        raise ValueError(f"gdn_decode: conv kernel size {K} is not a power of two")
    if conv_state.shape != (S, conv_dim, K - 1) or qkv.shape != (N, conv_dim) or a.shape != (N, hv):
        raise ValueError("gdn_decode: inconsistent shapes")
    if qkv.stride(1) != 1 or b.stride(1) != 1 or a.stride(1) != 1:
        raise ValueError("gdn_decode: qkv, b and a need unit stride along their last dimension")
    if recurrent_state.stride(3) != 1 or recurrent_state.stride(2) != dv:
        # the kernels address a state tile with compile-time offsets: vector loads, fewer registers
        raise ValueError("gdn_decode: each head's [dk, dv] recurrent state must be contiguous")
    scale = dk**-0.5 if scale is None else scale
    if out is None:
        out = torch.empty(N, hv, dv, dtype=qkv.dtype, device=qkv.device)
    if N == 0:
        return out
    block_k = triton.next_power_of_2(dk)
    block_v = min(BLOCK_V if block_v is None else block_v, triton.next_power_of_2(dv))
    num_warps = NUM_WARPS if num_warps is None else num_warps
    v_blocks = V_BLOCKS if v_blocks is None else v_blocks
    if v_blocks == 0:
        return _split_decode(
            qkv, b, a, conv_weight, A_log, dt_bias, conv_state, recurrent_state, slots, scale, out, hk,
            block_v, block_c, num_warps,
        )  # fmt: skip
    v_blocks = min(v_blocks, triton.cdiv(dv, block_v))
    _gdn_decode_kernel[(N, hv, triton.cdiv(dv, block_v * v_blocks))](
        qkv, b, a, conv_weight, A_log, dt_bias, conv_state, recurrent_state, slots, out,
        qkv.stride(0), b.stride(0), a.stride(0), conv_weight.stride(0), conv_weight.stride(1),
        *conv_state.stride(), recurrent_state.stride(0), recurrent_state.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        scale,
        HK=hk, HV=hv, DK=dk, DV=dv, K=K, BLOCK_K=block_k, BLOCK_V=block_v, V_BLOCKS=v_blocks,
        num_warps=num_warps,
    )  # fmt: skip
    _conv_state_kernel[(N, triton.cdiv(conv_dim, block_c))](
        qkv, conv_state, slots, qkv.stride(0), *conv_state.stride(), conv_dim,
        K=K, BLOCK_C=block_c, num_warps=4,
    )  # fmt: skip
    return out


def _split_decode(
    qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    hk: int,
    block_v: int,
    block_c: int,
    num_warps: int,
) -> torch.Tensor:
    N, hv = b.shape
    conv_dim, K = conv_weight.shape
    dk, dv = recurrent_state.shape[-2:]
    mixed = torch.empty(N, conv_dim, dtype=qkv.dtype, device=qkv.device)  # silu(conv), [q | k | v]
    _conv_step_kernel[(N, triton.cdiv(conv_dim, block_c))](
        qkv, conv_weight, conv_state, slots, mixed, qkv.stride(0), conv_weight.stride(0), conv_weight.stride(1),
        *conv_state.stride(), conv_dim, K=K, BLOCK_C=block_c, num_warps=4,
    )  # fmt: skip
    _delta_rule_step_kernel[(N, hv, triton.cdiv(dv, block_v))](
        mixed, b, a, A_log, dt_bias, recurrent_state, slots, out,
        b.stride(0), a.stride(0), recurrent_state.stride(0), recurrent_state.stride(1),
        out.stride(0), out.stride(1), out.stride(2), scale,
        HK=hk, HV=hv, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v, num_warps=num_warps,
    )  # fmt: skip
    return out


@triton.jit
def _conv_step_kernel(
    qkv_ptr, w_ptr, conv_ptr, slots_ptr, mixed_ptr, s_qkv, s_wc, s_wk, s_cs, s_cc, s_ck, C,
    K: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """mixed[n] = silu(conv of [conv[slot] | qkv[n]]) rounded to qkv's dtype, and conv[slot] shifted by
    qkv[n]: each channel read, then written, by one thread. A padding row writes zeros and no state."""
    n = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    live = slot >= 0
    mask = (ch < C) & live
    base = conv_ptr + tl.maximum(slot, 0) * s_cs + ch * s_cc
    x = tl.load(qkv_ptr + n * s_qkv + ch, mask=mask, other=0.0).to(conv_ptr.dtype.element_ty)
    y = x.to(tl.float32) * tl.load(w_ptr + ch * s_wc + (K - 1) * s_wk, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(K - 1):
        tap = tl.load(base + j * s_ck, mask=mask, other=0.0)
        y += tap.to(tl.float32) * tl.load(w_ptr + ch * s_wc + j * s_wk, mask=mask, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(base + (j - 1) * s_ck, tap, mask=mask)
    tl.store(base + (K - 2) * s_ck, x, mask=mask)
    y = y * tl.sigmoid(y)
    tl.store(mixed_ptr + n * C + ch, tl.where(live, y, 0.0).to(mixed_ptr.dtype.element_ty), mask=ch < C)


@triton.jit
def _delta_rule_step_kernel(
    mixed_ptr, b_ptr, a_ptr, A_log_ptr, dt_bias_ptr, rec_ptr, slots_ptr, o_ptr,
    s_b, s_a,
    s_rs, s_rh,
    s_on, s_oh, s_ov,
    scale,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One token of the delta rule on a [BLOCK_V, dk] tile, the state's transpose (loads coalesced
    along dv all the same): the sums over dk run along the tile's rows. A padding row writes zeros
    and returns before touching any state (no per-element liveness mask: fewer registers)."""
    n, h, kh, slot, live = program_slot(slots_ptr, HK, HV)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_mask = vv < DV
    o_row = o_ptr + n * s_on + h * s_oh + vv * s_ov
    if not live:
        tl.store(o_row, tl.zeros([BLOCK_V], tl.float32).to(o_ptr.dtype.element_ty), mask=v_mask)
        return
    kk = tl.arange(0, BLOCK_K)
    k_mask = kk < DK
    s_mask = v_mask[:, None] & k_mask[None, :]
    # int64 for the slot's offset only; the tile's own offsets are 32-bit and known at compile time
    s_ptr = (rec_ptr + slot * s_rs + h * s_rh) + (kk[None, :] * DV + vv[:, None])
    state = tl.load(s_ptr, mask=s_mask, other=0.0)
    row = mixed_ptr + n * (2 * HK * DK + HV * DV)
    q = tl.load(row + kh * DK + kk, mask=k_mask, other=0.0).to(tl.float32)
    k = tl.load(row + HK * DK + kh * DK + kk, mask=k_mask, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * HK * DK + h * DV + vv, mask=v_mask, other=0.0).to(tl.float32)
    q = l2norm(q) * scale
    k = l2norm(k)
    b = tl.load(b_ptr + n * s_b + h).to(tl.float32)
    x = tl.load(a_ptr + n * s_a + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    beta, decay = gates(b, x, -tl.exp(tl.load(A_log_ptr + h).to(tl.float32)), b_ptr)
    state = state * decay
    delta = (v - tl.sum(state * k[None, :], axis=1)) * beta
    state += delta[:, None] * k[None, :]
    tl.store(s_ptr, state, mask=s_mask)
    tl.store(o_row, tl.sum(state * q[None, :], axis=1).to(o_ptr.dtype.element_ty), mask=v_mask)


@triton.jit
def program_slot(slots_ptr, HK: tl.constexpr, HV: tl.constexpr):
    """(sequence n, value head h, its key head, state slot, live) of a program of grid (sequence,
    value head, ...). A negative slot is a padding row: the slot comes back as 0 and not live, and the
    caller masks every load and store of it off."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    return n, h, h // (HV // HK), tl.maximum(slot, 0), slot >= 0


@triton.jit
def l2norm(x):
    return x * tl.rsqrt(tl.sum(x * x) + 1e-6)


@triton.jit
def gates(b, x, neg_A, b_ptr):
    """fp32 (beta, decay) of one token and head: beta = sigmoid(b) rounded to b's dtype as the model
    rounds it, decay = exp(-exp(A_log) * softplus(x)) with x = a + dt_bias and torch's threshold."""
    beta = tl.sigmoid(b).to(b_ptr.dtype.element_ty).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    return beta, tl.exp(neg_A * softplus)


@triton.jit
def delta_rule(state, q, k, v, decay, beta):
    """One token of the gated delta rule on an fp32 [dk, BLOCK_V] state tile: (new state, o = Sᵀq)."""
    state = state * decay
    delta = (v - tl.sum(state * k[:, None], axis=0)) * beta
    state += k[:, None] * delta[None, :]
    return state, tl.sum(state * q[:, None], axis=0)


@triton.jit
def _conv(qkv_row, conv_ptr, w_ptr, slot, ch, mask, s_cs, s_cc, s_ck, s_wc, s_wk, K: tl.constexpr):
    """silu(depthwise causal conv) of channels `ch` over the window [conv state | new input], fp32,
    rounded to the input dtype like the reference's activations."""
    jj = tl.arange(0, K)[None, :]  # K is a power of two (4 in every released model)
    in_state = mask[:, None] & (jj < K - 1)
    window = tl.load(conv_ptr + slot * s_cs + ch[:, None] * s_cc + jj * s_ck, mask=in_state, other=0.0)
    x = tl.load(qkv_row + ch, mask=mask, other=0.0).to(conv_ptr.dtype.element_ty)
    window = tl.where(jj == K - 1, x[:, None], window).to(tl.float32)
    w = tl.load(w_ptr + ch[:, None] * s_wc + jj * s_wk, mask=mask[:, None], other=0.0).to(tl.float32)
    y = tl.sum(window * w, axis=1)
    y = y * tl.sigmoid(y)
    return y.to(qkv_row.dtype.element_ty).to(tl.float32)


@triton.jit
def _gdn_decode_kernel(
    qkv_ptr, b_ptr, a_ptr, w_ptr, A_log_ptr, dt_bias_ptr, conv_ptr, rec_ptr, slots_ptr, o_ptr,
    s_qkv, s_b, s_a, s_wc, s_wk,
    s_cs, s_cc, s_ck,
    s_rs, s_rh,
    s_on, s_oh, s_ov,
    scale,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, K: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, V_BLOCKS: tl.constexpr,
):  # fmt: skip
    n, h, kh, slot, live = program_slot(slots_ptr, HK, HV)

    kk = tl.arange(0, BLOCK_K)
    k_mask = (kk < DK) & live
    v0 = tl.program_id(2) * (BLOCK_V * V_BLOCKS)
    # The state tiles are this program's large reads: each is issued one tile ahead (the first
    # before the conv and gating) so that its latency overlaps the arithmetic before it.
    # the tile's offsets are 32-bit and known at compile time (each head's state contiguous): vector loads
    # and few registers for addresses (runtime strides cost this kernel its spill-free configurations)
    h_ptr = (rec_ptr + slot * s_rs + h * s_rh) + kk[:, None] * DV
    vv = v0 + tl.arange(0, BLOCK_V)
    s_mask = k_mask[:, None] & ((vv < DV) & live)[None, :]
    state = tl.load(h_ptr + vv[None, :], mask=s_mask, other=0.0)
    row = qkv_ptr + n * s_qkv
    q = _conv(row, conv_ptr, w_ptr, slot, kh * DK + kk, k_mask, s_cs, s_cc, s_ck, s_wc, s_wk, K)
    k = _conv(row, conv_ptr, w_ptr, slot, HK * DK + kh * DK + kk, k_mask, s_cs, s_cc, s_ck, s_wc, s_wk, K)
    q = l2norm(q) * scale
    k = l2norm(k)

    b = tl.load(b_ptr + n * s_b + h, mask=live, other=0.0).to(tl.float32)
    x = tl.load(a_ptr + n * s_a + h, mask=live, other=0.0).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    beta, decay = gates(b, x, -tl.exp(tl.load(A_log_ptr + h).to(tl.float32)), b_ptr)

    for i in tl.static_range(V_BLOCKS):
        vv = v0 + i * BLOCK_V + tl.arange(0, BLOCK_V)
        v_mask = (vv < DV) & live
        s_mask = k_mask[:, None] & v_mask[None, :]
        if i + 1 < V_BLOCKS:
            next_vv = vv + BLOCK_V
            next_mask = k_mask[:, None] & ((next_vv < DV) & live)[None, :]
            next_state = tl.load(h_ptr + next_vv[None, :], mask=next_mask, other=0.0)
        v = _conv(row, conv_ptr, w_ptr, slot, 2 * HK * DK + h * DV + vv, v_mask, s_cs, s_cc, s_ck, s_wc, s_wk, K)
        state, o = delta_rule(state, q, k, v, decay, beta)
        tl.store(h_ptr + vv[None, :], state, mask=s_mask)
        o = tl.where(live, o, 0.0)
        tl.store(o_ptr + n * s_on + h * s_oh + vv * s_ov, o.to(o_ptr.dtype.element_ty), mask=vv < DV)
        if i + 1 < V_BLOCKS:
            state = next_state


@triton.jit
def _conv_state_kernel(
    qkv_ptr, conv_ptr, slots_ptr, s_qkv, s_cs, s_cc, s_ck, C, K: tl.constexpr, BLOCK_C: tl.constexpr
):  # fmt: skip
    """conv[slot] <- [conv[slot, :, 1:] | qkv[n]]: each channel is read, then written, by one thread."""
    n = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    mask = (ch < C) & (slot >= 0)
    base = conv_ptr + tl.maximum(slot, 0) * s_cs + ch * s_cc
    for j in tl.static_range(K - 2):
        tl.store(base + j * s_ck, tl.load(base + (j + 1) * s_ck, mask=mask), mask=mask)
    x = tl.load(qkv_ptr + n * s_qkv + ch, mask=mask)
    tl.store(base + (K - 2) * s_ck, x.to(conv_ptr.dtype.element_ty), mask=mask)

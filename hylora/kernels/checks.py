"""Start-up checks of the fast kernels against their torch references.

Each `*_error` function runs one kernel and its reference on random inputs of the model's shapes
at boundary sizes and returns the max relative error (inf on any NaN/inf, on a write to a row it
does not own, or on an output element left unwritten). Outputs start NaN-filled, as do state
slots, KV pages and LoRA slots that the batch does not own, so a read of foreign memory or a
missed write shows. `hylora.kernels.select` runs them on CUDA and uses a kernel only if it passes.
Triton and fla are imported only when a check runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from hylora.lora import LoRABatch, LoRAStack
from hylora.model.layers import Linear
from hylora.ops.attention.reference import paged_attention as attention_prefill_reference
from hylora.ops.causal_conv1d.reference import causal_conv1d_by_slot as conv_reference
from hylora.ops.causal_conv1d.reference import save_conv_states as conv_save_reference
from hylora.ops.gated_delta_rule.reference import recurrent_by_slot as recurrent_reference
from hylora.ops.gated_delta_rule.reference import varlen_gated_delta_rule as delta_rule_reference
from hylora.ops.gdn_decode.reference import gdn_decode as gdn_decode_reference
from hylora.ops.logits_scan.reference import HAS_NAN
from hylora.ops.logits_scan.reference import scan_logits as scan_reference
from hylora.ops.lora.reference import lora_apply_grouped
from hylora.ops.output_gate.reference import output_gate as output_gate_reference
from hylora.ops.paged_decode_attention.reference import paged_decode_attention as attention_reference
from hylora.ops.rmsnorm.reference import gated_rms_norm as gated_reference
from hylora.ops.rmsnorm.reference import rms_norm as norm_reference
from hylora.ops.rotary.reference import rotate_half as rotary_reference
from hylora.ops.silu_mul.reference import silu_mul as silu_mul_reference

DECODE_BATCHES = (1, 2, 3, 31, 32, 33, 64)
LORA_TOKENS = (1, 64, 65, 127, 128, 129, 400, 474, 2048)
LORA_RANKS = (8, 16, 32, 64)
STACKED_TOKENS = (1, 64, 65, 127, 128, 129, 256)  # decode steps: eager below 128 tokens, graph buckets above
DELTA_FIRST_TOKENS = (1, 129, 2048)  # long prefill steps (the layer takes it from 4096 tokens; any count works)
NORM_TOKENS = (1, 3, 64, 129, 2048)
SCAN_ROWS = (1, 3, 32, 33, 64)  # decode batches of the logits scan
# sequence lengths of short prefill steps (the token-by-token GDN form): decode rows, a prompt's last
# tokens, empty chunks, up to an eager step's 64-token limit, and a prefill burst's long tail beside
# decode rows (a short step's chunk may be as long as its bucket)
RECURRENT_BATCHES = ((1,), (64,), (1, 1, 16, 1), (3, 0, 64, 1, 17, 2, 63), (1, 1, 106, 1))
# speculative verify steps (1 + k tokens a sequence, states after every token kept in spare slots)
SPEC_BATCHES = ((3, 1, 5, 2),)
# verify steps' conv states: chunks shorter and longer than the conv window, an empty one; the last row pads
SPEC_CONV_BATCHES = ((3, 1, 5, 2, 4), (2, 0, 7, 1))
# (cached tokens, new tokens) per sequence of one prefill batch: fresh prompts, chunks after a
# cached prefix across page boundaries, and a decode row mixed in
PREFILL_CASES = ((0, 2), (0, 17), (15, 33), (1, 1), (0, 300), (500, 700))
FAILED = float("inf")
# gated delta rule (fla) batches: lengths straddling fla's 64-token chunks, decode-only and mixed
GDN_BATCHES = ([1, 1, 1, 1, 1], [1, 63, 64, 65, 129, 1], [257], [2, 1, 511])


def lora_shapes(model: torch.nn.Module) -> list[tuple[int, tuple[int, ...]]]:
    """Distinct (in_features, slice rows) of the model's LoRA-capable linears."""
    return sorted({(m.in_features, tuple(m.slices.values())) for m in model.modules() if isinstance(m, Linear)})


@torch.inference_mode()
def gdn_decode_error(
    hk: int,
    hv: int,
    dk: int,
    dv: int,
    conv_kernel: int,
    dtype: torch.dtype,
    device: torch.device | str,
    batches: Sequence[int] = DECODE_BATCHES,
    kernel: Callable[..., torch.Tensor] | None = None,
    **kernel_args,
) -> float:
    if kernel is None:
        from hylora.ops.gdn_decode.triton import gdn_decode as kernel
    worst = 0.0
    for N in batches:
        g = _generator(device, N)
        C, S = 2 * hk * dk + hv * dv, N + 3

        def rand(*shape, scale=1.0, g=g):
            return torch.randn(*shape, generator=g, device=device) * scale

        slots = torch.randperm(S, generator=g, device=device)[:N]
        if N > 1:
            slots[-1] = -1  # a padding row, as a CUDA graph pads a batch to its bucket
        args = (
            rand(N, C).to(dtype),  # qkv
            rand(N, hv).to(dtype),  # b
            rand(N, hv).to(dtype),  # a
            rand(C, conv_kernel, scale=0.5).to(dtype),  # conv weight
            torch.rand(hv, generator=g, device=device).mul(4).add(0.01).log(),  # A_log
            rand(hv, scale=0.5),  # dt_bias
        )
        conv = _nan_unowned(rand(S, C, conv_kernel - 1).to(dtype), slots)
        recurrent = _nan_unowned(rand(S, hv, dk, dv, scale=0.1), slots)
        conv_ref, rec_ref = conv.clone(), recurrent.clone()
        o_ref = gdn_decode_reference(*args, conv_ref, rec_ref, slots)
        out = torch.full_like(o_ref, float("nan"))
        o = kernel(*args, conv, recurrent, slots, out=out, **kernel_args)
        worst = max(worst, _rel_error(o, o_ref), _rel_error(conv, conv_ref), _rel_error(recurrent, rec_ref))
        if o is not out:
            return FAILED
    return worst


@torch.inference_mode()
def gdn_recurrent_error(
    hk: int,
    hv: int,
    dk: int,
    dv: int,
    dtype: torch.dtype,
    device: torch.device | str,
    batches: Sequence[Sequence[int]] = RECURRENT_BATCHES,
    kernel: Callable[..., torch.Tensor] | None = None,
    spec_batches: Sequence[Sequence[int]] = SPEC_BATCHES,
    **kernel_args,
) -> float:
    """The short-prefill delta rule by slot: b and a strided as the layer's projection split gives
    them; pool slots the batch does not own are NaN and must stay so. `spec_batches` run with
    spec_slots: the state after each token but the last in a spare slot of its own, every third entry
    -1 (nothing written; those slots stay NaN)."""
    if kernel is None:
        from hylora.ops.gated_delta_rule.triton import recurrent_by_slot as kernel
    worst = 0.0
    for lens, spec in [*((lens, False) for lens in batches), *((lens, True) for lens in spec_batches)]:
        g = _generator(device, sum(lens) + len(lens))
        T, N = sum(lens), len(lens)
        J = max(lens, default=0)  # one more column than a verify step needs
        spares = N * J if spec else 0

        def rand(*shape, scale=1.0, g=g):
            return torch.randn(*shape, generator=g, device=device) * scale

        order = torch.randperm(N + 3 + spares, generator=g, device=device)
        slots = order[:N]
        ba = rand(T, 2 * hv + 5).to(dtype)
        args = (
            rand(T, hk, dk).to(dtype),  # q
            rand(T, hk, dk).to(dtype),  # k
            rand(T, hv, dv).to(dtype),  # v
            ba[:, :hv],  # b
            ba[:, hv : 2 * hv],  # a
            torch.rand(hv, generator=g, device=device).mul(4).add(0.01).log(),  # A_log
            rand(hv, scale=0.5),  # dt_bias
        )
        pool = _nan_unowned(rand(N + 3 + spares, hv, dk, dv, scale=0.1), slots)
        ref_pool = pool.clone()
        extra = {}
        if spec:
            spec_slots = order[N : N + spares].reshape(N, J).clone()
            spec_slots.view(-1)[::3] = -1
            extra = {"spec_slots": spec_slots.to(torch.int32)}
        o_ref = recurrent_reference(*args, ref_pool, slots, list(lens), dk**-0.5, **extra)
        out = torch.full_like(o_ref, float("nan"))
        o = kernel(*args, pool, slots, list(lens), dk**-0.5, out=out, **extra, **kernel_args)
        if o is not out:
            return FAILED
        worst = max(worst, _rel_error(o, o_ref), _rel_error(pool, ref_pool))
    return worst


@torch.inference_mode()
def paged_decode_attention_error(
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    batches: Sequence[int] = DECODE_BATCHES,
    lengths: Sequence[int] = (1, 2, 15, 16, 17, 31, 32, 33, 127, 128, 129, 255, 256, 257, 511, 512, 513, 1100),
    kernel: Callable[..., torch.Tensor] | None = None,
    **kernel_args,
) -> float:
    """Sequence lengths cycle through `lengths` (straddling the 16- and 32-token steps and the 128- and
    256-token partitions); with N > 1 the last row is padding (length 0). Unowned pages and the rows past
    each length in its last page are NaN."""
    if kernel is None:
        from hylora.ops.paged_decode_attention.triton import paged_decode_attention as kernel
    worst = 0.0
    for N in batches:
        g = _generator(device, N)
        lens = [lengths[(i + N) % len(lengths)] for i in range(N)]
        if N > 1:
            lens[-1] = 0
        pages_per = [-(-n // page_size) for n in lens]
        max_pages = max(1, *pages_per) + 1  # one spare column: entries past a length are never read
        num_pages = sum(pages_per) + 2  # two pages nobody owns, NaN-filled
        order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(N)).tolist()  # host-side table
        null_page, table = order.pop(), torch.full((N, max_pages), order.pop(), dtype=torch.int32)
        for i, n in enumerate(pages_per):
            table[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
        if N > 1:
            table[-1] = null_page  # the padding row points at a NaN page it must not read
        shape = (num_pages * page_size, kv_heads, head_dim)
        k_cache = torch.randn(*shape, generator=g, device=device).to(dtype)
        v_cache = torch.randn(*shape, generator=g, device=device).to(dtype)
        owned = torch.zeros(num_pages, dtype=torch.bool)
        owned[table[torch.arange(max_pages)[None, :] < torch.tensor(pages_per)[:, None]].long()] = True
        rows = (~owned).repeat_interleave(page_size)
        for i, n in enumerate(lens):  # the unwritten tail of each sequence's last page
            if n % page_size:
                last = int(table[i, pages_per[i] - 1]) * page_size
                rows[last + n % page_size : last + page_size] = True
        k_cache[rows.to(device)], v_cache[rows.to(device)] = float("nan"), float("nan")
        q = torch.randn(N, heads, head_dim, generator=g, device=device).to(dtype)
        table, seq_lens = table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)
        scale = head_dim**-0.5
        ref = attention_reference(q, k_cache, v_cache, table, seq_lens, page_size, scale)
        out = torch.full_like(q, float("nan"))
        o = kernel(q, k_cache, v_cache, table, seq_lens, page_size, scale, out=out, **kernel_args)
        worst = max(worst, _rel_error(o, ref) if o is out else FAILED)
    return worst


def triton_lora_apply(
    x: torch.Tensor, y: torch.Tensor, stack: LoRAStack, batch: LoRABatch, config=None
) -> torch.Tensor:
    """hylora's LoRA kernels on the slices the batch's adapters target, as the layer runs them
    (`config`: a launch configuration of ops.lora.triton, default its choice for the size)."""
    from hylora.ops.lora.triton import LoRAKernelMeta, lora_apply

    used = stack.slices_used_by(batch.slots)
    meta = LoRAKernelMeta.build(batch.token_slots, stack.num_slots)
    return lora_apply(x, y, *stack.pick(used), meta, config)


def stacked_lora_apply(x: torch.Tensor, y: torch.Tensor, stack: LoRAStack, batch: LoRABatch) -> torch.Tensor:
    """The decode steps' LoRA (`lora_apply_stacked`, Linear.stack_lora_a) with the base output given:
    every slot's h from one GEMM over the slices' A rows, the expand reading each token's own slot."""
    from hylora.ops.lora.triton import LoRAKernelMeta, lora_expand

    L, R, _ = stack.a[0].shape
    h = F.linear(x, torch.cat([a.reshape(L * R, -1) for a in stack.a]))  # [T, slices * L * r]
    h = h.view(1, x.shape[0], len(stack.a), L, R)
    return lora_expand(h, stack.b, stack.offsets, y, LoRAKernelMeta.build(batch.token_slots, L))


def delta_first_lora_apply(x: torch.Tensor, y: torch.Tensor, stack: LoRAStack, batch: LoRABatch) -> torch.Tensor:
    """The long prefill steps' LoRA (`lora_apply_delta_first`, delta first, then the base GEMM
    accumulating) on a zero base weight: its output, the rounded delta, added to y's adapter rows."""
    from hylora.ops.lora.triton import LoRAKernelMeta, lora_apply_delta_first

    meta = LoRAKernelMeta.build(batch.token_slots, stack.num_slots)
    zero_weight = x.new_zeros(y.shape[1], x.shape[1])
    a, b, offsets = stack.pick(stack.slices_used_by(batch.slots))
    delta = lora_apply_delta_first(x, zero_weight, a, b, offsets, meta, len(batch.slots))
    rows = batch.token_slots >= 0
    y[rows] = (y[rows].float() + delta[rows].float()).to(y.dtype)
    return y


@torch.inference_mode()
def lora_error(
    in_features: int,
    rows: Sequence[int],
    rank: int,
    dtype: torch.dtype,
    device: torch.device | str,
    tokens: Sequence[int] = LORA_TOKENS,
    kernel: Callable[..., torch.Tensor] | None = None,
    num_slots: int = 4,
) -> float:
    """Per token count: base tokens and three adapters (ranks rank, rank // 2, 1) in interleaved
    segments; slot 3 is unused and NaN-filled, as are y's base rows (which must stay bit-identical)."""
    kernel = kernel or triton_lora_apply
    g = _generator(device, in_features + rank)
    ranks = [rank, max(1, rank // 2), 1] + [0] * (num_slots - 3)
    a = [torch.zeros(num_slots, rank, in_features, device=device, dtype=dtype) for _ in rows]
    b = [torch.zeros(num_slots, rank, n, device=device, dtype=dtype) for n in rows]
    for slot, r in enumerate(ranks):
        for ai, bi in zip(a, b, strict=True):
            if r:
                ai[slot, :r] = (torch.randn(r, ai.shape[2], generator=g, device=device) / in_features**0.5).to(dtype)
                bi[slot, :r] = (torch.randn(r, bi.shape[2], generator=g, device=device) / r**0.5).to(dtype)
            else:
                ai[slot], bi[slot] = float("nan"), float("nan")  # an unused slot: must never be read
    offsets = [(sum(rows[:i]), n) for i, n in enumerate(rows)]
    stack = LoRAStack(a=a, b=b, offsets=offsets, present=[[r > 0] * len(rows) for r in ranks])
    worst = 0.0
    for T in tokens:
        seq_slots = [(i % 4) - 1 for i in range(8)]  # base, 0, 1, 2, base, 0, 1, 2
        cuts = sorted(torch.randint(0, T + 1, (7,), generator=g, device=device).tolist())
        seq_lens = [hi - lo for lo, hi in zip([0, *cuts], [*cuts, T], strict=True)]
        if all(s < 0 for s, n in zip(seq_slots, seq_lens, strict=True) if n):
            seq_slots[[bool(n) for n in seq_lens].index(True)] = 0  # at least one adapter token
        batch = LoRABatch.build(seq_slots, seq_lens, device)
        x = torch.randn(T, in_features, generator=g, device=device).to(dtype)
        y0 = torch.randn(T, sum(rows), generator=g, device=device).to(dtype)
        base = batch.token_slots < 0
        y0[base] = float("nan")
        ref = lora_apply_grouped(x, y0.clone(), stack.a, stack.b, stack.offsets, stack.present, batch.groups)
        y = kernel(x, y0.clone(), stack, batch)
        if not _same_bits(y[base], y0[base]):
            return FAILED
        worst = max(worst, _rel_error(y[~base], ref[~base]))
    return worst


@torch.inference_mode()
def rms_norm_error(
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    hv: int,
    dv: int,
    eps: float,
    dtype: torch.dtype,
    device: torch.device | str,
    tokens: Sequence[int] = NORM_TOKENS,
    kernels: tuple[Callable, Callable] | None = None,
    rotary_dim: int | None = None,
) -> float:
    """Every norm of the model as it is called: the hidden norm alone and with the residual add, the
    attention's q/k norms on their strided head views of the fused projection, alone and with the
    rotary embedding (over `rotary_dim`, default a quarter of the head), the GDN output's gated norm
    with its strided gate."""
    if kernels is None:
        from hylora.ops.rmsnorm.triton import gated_rms_norm, rms_norm

        kernels = (rms_norm, gated_rms_norm)
    norm, gated = kernels
    worst = 0.0
    for T in tokens:
        g = _generator(device, T)

        def rand(*shape, g=g):
            return torch.randn(*shape, generator=g, device=device).to(dtype)

        w, x, res = _norm_inputs(T, hidden, dtype, device, g)
        worst = max(worst, _rel_error(norm(x, w, eps), norm_reference(x, w, eps)))
        for got, ref in zip(norm(x, w, eps, res), norm_reference(x, w, eps, res), strict=True):
            worst = max(worst, _rel_error(got, ref))
        qkv = rand(T, heads * head_dim * 2 + 2 * kv_heads * head_dim)
        q = qkv[:, : heads * head_dim * 2].reshape(T, heads, 2 * head_dim).chunk(2, dim=-1)[0]
        k = qkv[:, heads * head_dim * 2 : heads * head_dim * 2 + kv_heads * head_dim].reshape(T, kv_heads, head_dim)
        wh = rand(head_dim) * 0.1
        r = rotary_dim or max(2, head_dim // 8 * 2)
        angles = torch.rand(T, r // 2, generator=g, device=device) * 1000
        angles = torch.cat([angles, angles], dim=-1)
        rotary = (angles.cos().to(dtype), angles.sin().to(dtype))
        for view in (q, k):
            worst = max(worst, _rel_error(norm(view, wh, eps), norm_reference(view, wh, eps)))
            got, ref = norm(view, wh, eps, rotary=rotary), norm_reference(view, wh, eps, rotary=rotary)
            worst = max(worst, _rel_error(got, ref))
        o, z = rand(T, hv, dv), rand(T, 2 * hv * dv)[:, hv * dv :].reshape(T, hv, dv)
        wv = rand(dv) + 1
        worst = max(worst, _rel_error(gated(o, z, wv, eps), gated_reference(o, z, wv, eps)))
    return worst


@torch.inference_mode()
def silu_mul_error(
    intermediate: int,
    dtype: torch.dtype,
    device: torch.device | str,
    tokens: Sequence[int] = NORM_TOKENS,
    kernel: Callable | None = None,
    quantized: bool = False,
    split: bool = False,
) -> float:
    """The activation vs the reference at every token count of `tokens`. `quantized`: the one that
    also quantises for an FP8 down projection (silu_mul_quantized; `split`: as two e4m3 terms), its
    quantised values (dequantised) and the unquantised ones it keeps."""
    from hylora.ops.silu_mul.reference import silu_mul_quantized as quantized_reference

    if kernel is None:
        from hylora.ops.silu_mul import triton

        kernel = triton.silu_mul_quantized if quantized else triton.silu_mul
    inputs = (
        (torch.randn(T, 2 * intermediate, generator=_generator(device, T), device=device).mul(3).to(dtype),)
        for T in tokens
    )
    reference = quantized_reference if quantized else silu_mul_reference
    return _producer_error(kernel, reference, inputs, quantized, split)


@torch.inference_mode()
def output_gate_error(
    heads: int,
    head_dim: int,
    kv_heads: int,
    dtype: torch.dtype,
    device: torch.device | str,
    tokens: Sequence[int] = NORM_TOKENS,
    kernel: Callable | None = None,
    quantized: bool = False,
    split: bool = False,
) -> float:
    """The attention's output gate vs the reference at every token count of `tokens`, the gate a view
    of a fused qkv output as the layer slices it. `quantized`: the one that also quantises for an FP8
    o_proj (output_gate_quantized; `split`: as two e4m3 terms), its quantised values (dequantised) and
    the unquantised ones it keeps."""
    from hylora.ops.output_gate.reference import output_gate_quantized as quantized_reference

    if kernel is None:
        from hylora.ops.output_gate import triton

        kernel = triton.output_gate_quantized if quantized else triton.output_gate

    def o_and_gate(T: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = _generator(device, T)
        qkv = torch.randn(T, heads * head_dim * 2 + 2 * kv_heads * head_dim, generator=g, device=device).mul(3)
        gate = qkv.to(dtype)[:, : heads * head_dim * 2].reshape(T, heads, 2 * head_dim).chunk(2, dim=-1)[1]
        return torch.randn(T, heads, head_dim, generator=g, device=device).to(dtype), gate

    reference = quantized_reference if quantized else output_gate_reference
    return _producer_error(kernel, reference, map(o_and_gate, tokens), quantized, split)


def _producer_error(
    kernel: Callable, reference: Callable, inputs: Iterable[tuple], quantized: bool, split: bool
) -> float:
    """The worst error of an op over `inputs` against its reference; `quantized`: one that quantises
    for the FP8 projection behind it (`split`: as two terms), its dequantised values and the
    unquantised ones it keeps."""
    worst = 0.0
    for args in inputs:
        if quantized:
            got, want = kernel(*args, keep=True, split=split), reference(*args, keep=True, split=split)
            worst = max(worst, _quantized_error(got, want))
        else:
            worst = max(worst, _rel_error(kernel(*args), reference(*args)))
    return worst


@torch.inference_mode()
def silu_mul_lora_error(
    intermediate: int,
    dtype: torch.dtype,
    device: torch.device | str,
    tokens: Sequence[int] = STACKED_TOKENS,
    ranks: Sequence[int] = LORA_RANKS,
    kernel: Callable | None = None,
    quantized: bool = True,
    split: bool = False,
) -> float:
    """The activation with gate_up's LoRA expand (silu_mul_lora) vs the expand then the activation, at
    every token count and rank: base tokens and three adapters (a fourth slot unused and NaN), h as
    the shrink's fp32 partials and as a decode step's 16-bit h of every slot; plain, and (`quantized`)
    quantised for an FP8 down projection (`split`: as two e4m3 terms; its quantised values
    dequantised, and the kept ones)."""
    from hylora.ops.fp8_linear.reference import GROUP
    from hylora.ops.lora.triton import LoRAKernelMeta
    from hylora.ops.silu_mul.reference import silu_mul_lora as reference_kernel

    if kernel is None:
        from hylora.ops.silu_mul.triton import silu_mul_lora as kernel
    L, worst = 4, 0.0
    for T in tokens:
        for R in ranks:
            g = _generator(device, T * 100 + R)

            def rand(*shape, g=g):
                return torch.randn(*shape, generator=g, device=device)

            runs = torch.tensor([-1, 0, 3, -1, 1, 0], device=device)
            slots = runs[torch.arange(T, device=device) * len(runs) // T]
            gate_up = rand(T, 2 * intermediate).mul(3).to(dtype)
            b = [rand(L, R, intermediate).div(R**0.5).to(dtype) for _ in range(2)]
            for bi in b:
                bi[2] = float("nan")
            meta = LoRAKernelMeta.build(slots, L)
            partials = rand(8, T, 2, R)  # the shrink's split-K partials
            stacked = rand(1, T, 2, L, R).to(dtype)  # a decode step's h of every slot
            stacked[:, :, :, 2] = float("nan")
            for h in (partials, stacked):
                got, want = kernel(gate_up, h, b, meta), reference_kernel(gate_up, h, b, slots)
                worst = max(worst, _rel_error(got, want))
                if quantized:
                    got = kernel(gate_up, h, b, meta, GROUP, True, split=split)
                    want = reference_kernel(gate_up, h, b, slots, GROUP, True, split=split)
                    worst = max(worst, _quantized_error(got, want))
    return worst


@torch.inference_mode()
def rms_norm_quantized_error(
    hidden: int,
    eps: float,
    dtype: torch.dtype,
    device: torch.device | str,
    tokens: Sequence[int] = NORM_TOKENS,
    kernel: Callable | None = None,
    heads: tuple[int, int] | None = None,
    gated_kernel: Callable | None = None,
    split: bool = False,
) -> float:
    """The decoder's norms quantised for an FP8 projection (`split`: as two e4m3 terms) vs their
    references: the hidden norm (rms_norm_quantized) alone and with the residual add, and with `heads`
    (Hv, dv) the GDN's gated norm (gated_rms_norm_quantized, its gate a strided view as the in_proj
    gives it) where dv holds whole input groups: the quantised values (dequantised), the kept norm, the sum."""
    from hylora.ops.fp8_linear.reference import GROUP
    from hylora.ops.rmsnorm import reference

    if kernel is None or gated_kernel is None:
        from hylora.ops.rmsnorm import triton

        kernel, gated_kernel = kernel or triton.rms_norm_quantized, gated_kernel or triton.gated_rms_norm_quantized
    quantized_reference = reference.rms_norm_quantized
    worst = 0.0
    for T in tokens:
        g = _generator(device, T)
        w, x, res = _norm_inputs(T, hidden, dtype, device, g)
        got, want = kernel(x, w, eps, keep=True, split=split), quantized_reference(x, w, eps, keep=True, split=split)
        worst = max(worst, _quantized_error(got, want))
        (got, got_sum), (want, want_sum) = (
            kernel(x, w, eps, res, split=split),
            quantized_reference(x, w, eps, res, split=split),
        )
        worst = max(worst, _quantized_error(got, want), _rel_error(got_sum, want_sum))
        if heads is not None and heads[1] % GROUP == 0:
            hv, dv = heads
            o = torch.randn(T, hv, dv, generator=g, device=device).to(dtype)
            z = torch.randn(T, 2 * hv * dv, generator=g, device=device).to(dtype)[:, hv * dv :].reshape(T, hv, dv)
            wv = torch.randn(dv, generator=g, device=device).to(dtype) + 1
            want = reference.gated_rms_norm_quantized(o, z, wv, eps, keep=True, split=split)
            worst = max(worst, _quantized_error(gated_kernel(o, z, wv, eps, keep=True, split=split), want))
    return worst


def _norm_inputs(
    T: int, hidden: int, dtype: torch.dtype, device: torch.device | str, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A hidden norm's weight, input and residual: the weight near zero (the norm scales by 1 + w)."""
    shapes = ((hidden,), (T, hidden), (T, hidden))
    w, x, res = (torch.randn(*shape, generator=g, device=device).to(dtype) for shape in shapes)
    return w * 0.1, x * 3, res


def _quantized_error(got, want) -> float:  # two QuantizedActivation: their values and the kept inputs
    if (got.lo is None) != (want.lo is None):  # one term where two were asked for, or the reverse
        return float("inf")
    kept = _rel_error(got.x, want.x) if want.x is not None else 0.0
    return max(_rel_error(got.dequantized(), want.dequantized()), kept)


@torch.inference_mode()
def logits_scan_error(
    vocab: int, device: torch.device | str, rows: Sequence[int] = SCAN_ROWS, kernel: Callable | None = None
) -> float:
    """0 when the scan gives the reference's greedy token and flags on every row, else inf. The rows
    hold ties (the first wins), a NaN, an inf, -inf only (a grammar forbidding all) and a top value in
    the vocabulary's last column."""
    if kernel is None:
        from hylora.ops.logits_scan.triton import scan_logits as kernel
    for N in rows:
        logits = torch.randn(N, vocab, generator=_generator(device, N), device=device)
        logits[0, -1] = 1e4
        specials = (("nan", 7), ("inf", vocab // 2), ("-inf", None), ("tie", None))
        for row, (kind, col) in zip(range(1, N), specials, strict=False):
            if kind == "-inf":
                logits[row] = float("-inf")
            elif kind == "tie":
                logits[row] = logits[row].round()
            else:
                logits[row, col] = float(kind)
        got, ref = kernel(logits), scan_reference(logits)
        same_token = (got[0] == ref[0]) | (ref[1] & HAS_NAN).bool()  # a NaN row's token is not used
        if not (torch.equal(got[1], ref[1]) and bool(same_token.all())):
            return FAILED
    return 0.0


@torch.inference_mode()
def tower_rotary_error(
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    tokens: Sequence[int] = NORM_TOKENS,
    kernel: Callable[..., torch.Tensor] | None = None,
) -> float:
    """The vision tower's rotary on the q and k heads of its fused qkv [T, 3H, d] (a strided view):
    into a NaN-filled output, and in place, where the v heads (NaN here) must stay as they were."""
    if kernel is None:
        from hylora.ops.rotary.triton import rotate_half as kernel
    worst = 0.0
    for T in tokens:
        g = _generator(device, T)
        qkv = torch.randn(T, 3 * heads, head_dim, generator=g, device=device).mul(3).to(dtype)
        x = qkv[:, : 2 * heads]
        half = head_dim // 2
        inv_freq = 1.0 / 10000.0 ** (torch.arange(half, device=device, dtype=torch.float32) / half)
        positions = torch.randint(0, 128, (T, half), generator=g, device=device)  # a patch row or column each
        angles = torch.cat([positions * inv_freq] * 2, dim=-1)  # [T, head_dim] fp32
        cos, sin = angles.cos(), angles.sin()
        ref = rotary_reference(x, cos, sin)
        out = torch.full_like(ref, float("nan"))
        got = kernel(x, cos, sin, out=out)
        worst = max(worst, _rel_error(got, ref) if got is out else FAILED)
        qkv[:, 2 * heads :] = float("nan")
        ref_qkv, got_qkv = qkv.clone(), qkv.clone()
        rotary_reference(ref_qkv[:, : 2 * heads], cos, sin, out=ref_qkv[:, : 2 * heads])
        kernel(got_qkv[:, : 2 * heads], cos, sin, out=got_qkv[:, : 2 * heads])
        worst = max(worst, _rel_error(got_qkv, ref_qkv))
    return worst


@torch.inference_mode()
def tower_attention_error(
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    backend: str,
    segments: Sequence[tuple[int, int]] = ((2, 64), (1, 100), (3, 33)),
) -> float:
    """The vision tower's attention under one SDPA backend against fp32 math: B segments of L rows of
    each, on [B, H, L, d] views of a fused qkv [B*L, 3H, d] as the tower passes them (strided)."""
    from hylora.model.vision import sdpa_backend

    worst = 0.0
    for B, L in segments:
        g = _generator(device, B * L)
        qkv = torch.randn(B * L, 3 * heads, head_dim, generator=g, device=device).to(dtype)
        views = [t.view(B, L, heads, head_dim).transpose(1, 2) for t in qkv.view(B * L, 3, heads, head_dim).unbind(1)]
        with sdpa_backend(backend):
            got = F.scaled_dot_product_attention(*views)
        with sdpa_backend("math"):
            ref = F.scaled_dot_product_attention(*(t.float() for t in views))
        worst = max(worst, _rel_error(got, ref))
    return worst


@torch.inference_mode()
def causal_conv1d_error(
    channels: int,
    conv_kernel: int,
    dtype: torch.dtype,
    device: torch.device | str,
    batches: Sequence[Sequence[int]] = ((1,), (2, 1, 3, 64), (700, 1, 1348)),
    kernel: Callable | None = None,
) -> float:
    """Chunks shorter and longer than the kernel and decode rows, by slot in a pool whose unowned
    slots are NaN (which must stay as they were)."""
    if kernel is None:
        from hylora.ops.causal_conv1d.triton import causal_conv1d_by_slot as kernel
    worst = 0.0
    for lens in batches:
        g = _generator(device, sum(lens))
        N, S = len(lens), len(lens) + 2
        slots = torch.randperm(S, generator=g, device=device)[:N]
        x = torch.randn(sum(lens), 2 * channels, generator=g, device=device).to(dtype)[:, :channels]  # strided
        weight = (torch.randn(channels, conv_kernel, generator=g, device=device) * 0.5).to(dtype)
        pool = _nan_unowned(torch.randn(S, channels, conv_kernel - 1, generator=g, device=device).to(dtype), slots)
        ref_pool = pool.clone()
        ref = conv_reference(x, weight, ref_pool, slots, list(lens))
        got = kernel(x, weight, pool, slots, list(lens))
        worst = max(worst, _rel_error(got, ref), _rel_error(pool, ref_pool))
        # the GDN layer's form: q | k | v channel groups, each a contiguous tensor
        splits = (channels // 4, channels // 4, channels - 2 * (channels // 4))
        pool.copy_(_nan_unowned(torch.randn(pool.shape, generator=g, device=device).to(dtype), slots))
        ref_pool = pool.clone()
        ref = conv_reference(x, weight, ref_pool, slots, list(lens), splits=splits)
        got = kernel(x, weight, pool, slots, list(lens), splits=splits)
        if not all(p.is_contiguous() for p in got):
            return FAILED
        worst = max(worst, *(_rel_error(a, b) for a, b in zip(got, ref, strict=True)), _rel_error(pool, ref_pool))
    return worst


@torch.inference_mode()
def save_conv_states_error(
    channels: int,
    conv_kernel: int,
    dtype: torch.dtype,
    device: torch.device | str,
    batches: Sequence[Sequence[int]] = SPEC_CONV_BATCHES,
    kernel: Callable[..., None] | None = None,
) -> float:
    """A verify step's conv state after each token: chunks shorter and longer than the kernel, an
    empty one and a padding row, every third spec entry -1; slots nobody writes are NaN and must stay
    so. The table is one column wider than the longest chunk needs and `columns` bounds it."""
    if kernel is None:
        from hylora.ops.causal_conv1d.triton import save_conv_states as kernel
    worst = 0.0
    for lens in batches:
        g = _generator(device, sum(lens) + 7)
        N, J = len(lens), max(lens)
        order = torch.randperm(N + N * J + 2, generator=g, device=device)
        slots = order[:N].clone()
        slots[-1] = -1  # a padding row
        spec = order[N : N + N * J].reshape(N, J).clone()
        spec.view(-1)[::3] = -1
        x = torch.randn(sum(lens), 2 * channels, generator=g, device=device).to(dtype)[:, :channels]  # strided
        pool = _nan_unowned(torch.randn(len(order), channels, conv_kernel - 1, generator=g, device=device), slots)
        pool = pool.to(dtype)
        for columns in (None, J - 1):
            ref_pool, got_pool = pool.clone(), pool.clone()
            conv_save_reference(x, ref_pool, slots, list(lens), spec, columns=columns)
            kernel(x, got_pool, slots, list(lens), spec.to(torch.int32), columns=columns)
            worst = max(worst, _rel_error(got_pool, ref_pool))
    return worst


@torch.inference_mode()
def prefill_attention_error(
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    cases: Sequence[tuple[int, int]] = PREFILL_CASES,
    kernel: Callable | None = None,
) -> float:
    """One varlen prefill batch of `cases` over a paged cache whose pages nobody owns are NaN."""
    if kernel is None:
        from hylora.ops.attention.flash import paged_attention as kernel
    g = _generator(device, len(cases))
    pages_per = [-(-(ctx + n) // page_size) for ctx, n in cases]
    num_pages = sum(pages_per) + 2
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(3)).tolist()
    table = torch.full((len(cases), max(pages_per)), order.pop(), dtype=torch.int32)  # spare entries: a NaN page
    for i, n in enumerate(pages_per):
        table[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    shape = (num_pages * page_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), device=device, dtype=dtype)
    v_cache = torch.full(shape, float("nan"), device=device, dtype=dtype)
    for i, (ctx, n) in enumerate(cases):
        pos = torch.arange(ctx + n)
        rows = (table[i, pos // page_size].long() * page_size + pos % page_size).to(device)
        k_cache[rows] = torch.randn(ctx + n, kv_heads, head_dim, generator=g, device=device).to(dtype)
        v_cache[rows] = torch.randn(ctx + n, kv_heads, head_dim, generator=g, device=device).to(dtype)
    q = torch.randn(sum(n for _, n in cases), heads, head_dim, generator=g, device=device).to(dtype)
    args = (q, k_cache, v_cache, table.to(device), [c for c, _ in cases], [n for _, n in cases], page_size)
    return _rel_error(kernel(*args, head_dim**-0.5), attention_prefill_reference(*args, head_dim**-0.5))


@torch.inference_mode()
def gated_delta_rule_error(
    hk: int,
    hv: int,
    dk: int,
    dv: int,
    dtype: torch.dtype,
    device: torch.device | str,
    batches: Sequence[Sequence[int]] = GDN_BATCHES,
    kernel: Callable | None = None,
) -> float:
    """The chunked gated delta rule of prefill (fla's, by default) on varlen batches."""
    if kernel is None:
        from hylora.ops.gated_delta_rule.fla import varlen_gated_delta_rule as kernel
    worst = 0.0
    for seq_lens in batches:
        g = _generator(device, sum(seq_lens))
        T, N = sum(seq_lens), len(seq_lens)

        def rand(*shape, g=g):
            return torch.randn(*shape, generator=g, device=device)

        q = rand(T, hk, dk).to(dtype)
        k = rand(T, hk, dk).to(dtype)
        v = rand(T, hv, dv).to(dtype)
        decay = -F.softplus(rand(T, hv)) * 0.5
        beta = torch.sigmoid(rand(T, hv)).to(dtype)
        states = rand(N, hv, dk, dv) * 0.1
        scale = dk**-0.5
        o_ref, s_ref = delta_rule_reference(q, k, v, decay, beta, states, list(seq_lens), scale)
        o, s = kernel(q, k, v, decay, beta, states.clone(), list(seq_lens), scale)
        if not all(torch.isfinite(x).all() for x in (o, s)):
            return FAILED
        errors = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in ((o, o_ref), (s, s_ref))]
        worst = max(worst, *errors)
    return worst


# decode rows to prefill chunks: each tile configuration of the Triton GEMM (compiled here, at start-up)
FP8_TOKENS = (1, 15, 16, 17, 33, 129, 1100)
FP8_EXTRA_ROWS = 5  # 16-bit rows served in the FP8 GEMM's launch (Linear._fp8_gemm); fewer than the 8 spare columns


def fp8_shapes(model: torch.nn.Module) -> list[tuple[int, int, tuple[int, int]]]:
    """Distinct (FP8 rows, in_features, scale block) of the model's FP8 projections."""
    fp8 = [m for m in model.modules() if isinstance(m, Linear) and m.is_fp8]
    return sorted({(m.weight.shape[0], m.in_features, m.quant_block) for m in fp8})


@torch.inference_mode()
def fp8_linear_error(
    rows: int,
    in_features: int,
    block: tuple[int, int],
    dtype: torch.dtype,
    device: torch.device | str,
    tokens: Sequence[int] = FP8_TOKENS,
    kernel: Callable[..., torch.Tensor] | None = None,
    activations: str = "dynamic",
) -> float:
    """The FP8 GEMM vs the reference on one projection's shape: weights with block magnitudes
    spread over 2^-6..2^6 (a scale read from the wrong block shows), every token count of FP8_TOKENS,
    outputs NaN-filled first. activations: the KernelsConfig.fp8_activations setting whose GEMM (and
    reference) this is."""
    from hylora.kernels.config import FP8_GEMMS
    from hylora.ops.fp8_linear import reference
    from hylora.ops.fp8_linear.reference import quantize_weight

    fp8_reference = getattr(reference, FP8_GEMMS[activations])
    if kernel is None:
        from hylora.ops.fp8_linear import triton as fp8_triton

        kernel = getattr(fp8_triton, FP8_GEMMS[activations])
    g = _generator(device, rows + in_features)
    w = torch.randn(rows, in_features, generator=g, device=device)
    magnitudes = torch.exp2(torch.randint(-6, 7, (-(-rows // 128), -(-in_features // 128)), generator=g, device=device))
    w = w * magnitudes.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :in_features]
    w8, scale = quantize_weight(w, (128, 128))
    if block[0] == 1:  # the per-row layout the loader gives fused projections with unaligned slices
        scale = scale.repeat_interleave(128, 0)[:rows]
    worst = 0.0
    for T in tokens:
        x = torch.randn(T, in_features, generator=g, device=device).to(dtype)
        # out: a column slice of a wider buffer (an in_proj's FP8 rows beside its unquantised tail)
        wider = torch.full((T, rows + 8), float("nan"), dtype=dtype, device=device)
        got = kernel(x, w8, scale, block, out=wider[:, :rows])
        want = fp8_reference(x, w8, scale, block)
        worst = max(worst, _rel_error(got, want), _rel_error(wider[:, rows:], wider[:, rows:].clone().fill_(math.nan)))
        # 16-bit rows in the same launch (an in_proj's unquantised tail, every slot's LoRA A), into a
        # column slice of a wider buffer whose other columns must stay as they were
        extra = (x, (torch.randn(FP8_EXTRA_ROWS, in_features, generator=g, device=device) / 8).to(dtype))
        got = kernel(x, w8, scale, block, out=wider[:, : rows + FP8_EXTRA_ROWS], extra=extra)
        full = fp8_reference(x, w8, scale, block, extra=extra)
        after = wider[:, rows + FP8_EXTRA_ROWS :]
        worst = max(worst, _rel_error(got[:, :rows], want), _rel_error(got[:, rows:], full[:, rows:]))
        worst = max(worst, _rel_error(after, after.clone().fill_(math.nan)))
        if activations == "dynamic":  # the input quantised by its producer (silu_mul_quantized)
            quantized = reference.QuantizedActivation(*reference.quantize_activation(x, block[1]), dtype)
            worst = max(worst, _rel_error(kernel(quantized, w8, scale, block), want))
    return worst


def _generator(device: torch.device | str, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _nan_unowned(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    unowned = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    unowned[slots[slots >= 0].long()] = False
    pool[unowned] = float("nan")
    return pool


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


def _rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """‖got - ref‖ / ‖ref‖ over the finite reference elements; inf where they differ in finiteness
    (NaN-filled unowned memory must stay exactly as it was, so it is compared bit for bit)."""
    ref_finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(got), ref_finite):
        return FAILED
    if not ref_finite.all() and not _same_bits(got[~ref_finite], ref[~ref_finite]):
        return FAILED
    diff = (got[ref_finite].float() - ref[ref_finite].float()).norm()
    return float(diff / ref[ref_finite].float().norm().clamp_min(1e-30))

"""Time every candidate configuration of hylora's decode kernels at the Qwen3.6-27B shapes (issue 10).

For each kernel and shape: every candidate's median GPU time per call (20 calls in one CUDA graph),
its bytes roofline at 4.3 TB/s, and its max relative error against the torch reference (a
candidate that is not exact to bf16 rounding is marked, never picked). The defaults in
`hylora/ops/*/triton.py` come from these tables (docs/BASELINE.md says which run).

- GDN decode step in place by slot: batch 32 and 64, each spill-free (BLOCK_V, num_warps, dv blocks
  a program).
- Paged decode attention: batch 32 and 64 at context 576 (bound 1024), batch 8 at 8k (bound 32k) and
  the video workload's batch 24 at ~9k (bound 10240); partition, BLOCK_T, num_warps, P @ V in 16 bits
  or tf32x3, software-pipelining stages (`--attention-configs`, `--attention-shapes`).
- LoRA shrink + expand, 8 rank-16 adapters mixed, on the 27B's linears (GDN in_proj, gate_up,
  down): decode (32, 64 tokens) and prefill (2048, 8192 tokens in 512-token sequences), each config
  of `hylora.ops.lora.triton.SWEEP_CONFIGS` beside the base GEMM of the same linear.

- The decode steps' LoRA expand alone (`--only expand`): every LoRA linear of the 27B at batch 32
  and 64, 'block_n,n_per_program,warps' candidates, each summed over a 16-layer decode step.

- The short steps' token-by-token GDN kernel (`--only recurrent`): 32 x 1, verify 1/8/32 x 3, 4 x 16.

- The logits scan (`--only logits`): batch 32 and 64 over the vocabulary, chunk x block, beside the
  torch ops it replaced.

    python bench/kernel_sweep_gpu.py [--out sweep.json] [--only gdn,attention,lora,expand,recurrent,logits,epilogue]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.shapes import QWEN36_27B, copy_rate  # noqa: E402
from hylora.config import ModelConfig  # noqa: E402
from hylora.lora import LoRABatch, LoRAStack  # noqa: E402
from hylora.model.layers import STACKED_LORA_BELOW  # noqa: E402
from hylora.ops.lora.reference import lora_apply_grouped  # noqa: E402

DEV, DT = "cuda", torch.bfloat16


def bench(fn, calls: int = 20, reps: int = 10) -> float:
    """Median ms per call of `fn`, `calls` calls captured in one CUDA graph and replayed: the GPU time
    alone (timing single eager launches with events measures Python's launch path instead)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return sorted(times)[len(times) // 2]


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


SUMMARY: list[str] = []  # the best candidate of every group, printed again at the end


def show(rows: list[dict], key: str, group: str) -> None:
    best = min((r for r in rows if r["ok"]), key=lambda r: r["ms"], default=None)
    for r in rows:
        mark = "  <- best" if r is best else ("" if r["ok"] else "  (NOT EXACT)")
        line = f"{r[key]:<44} {1e3 * r['ms']:8.1f} us  {r['ms'] / r['roofline_ms']:5.2f}x roofline  err {r['err']:.1e}"
        print(f"  {line}{mark}", flush=True)
        if r is best:
            SUMMARY.append(f"{group}: {line}")


@torch.inference_mode()
def gdn_sweep(cfg: ModelConfig, configs: list[tuple[int, int, int]] | None = None) -> list[dict]:
    from hylora.ops.gdn_decode.reference import gdn_decode as reference
    from hylora.ops.gdn_decode.triton import gdn_decode

    hv, dk, dv, C = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_dim
    rows = []
    for N in (32, 64):
        S = N + 1
        g = torch.Generator(DEV).manual_seed(N)
        slots = torch.randperm(S, device=DEV, generator=g)[:N]
        qkv, b, a = (torch.randn(N, n, device=DEV, dtype=DT, generator=g) for n in (C, hv, hv))
        w = torch.randn(C, 4, device=DEV, dtype=DT, generator=g) * 0.3
        A_log, dt_bias = torch.rand(hv, device=DEV, generator=g).log(), torch.zeros(hv, device=DEV)
        conv = torch.randn(S, C, 3, device=DEV, dtype=DT, generator=g)
        rec = torch.randn(S, hv, dk, dv, device=DEV, generator=g) * 0.1
        args = (qkv, b, a, w, A_log, dt_bias)
        c_ref0, r_ref0 = conv.clone(), rec.clone()
        c_ref, r_ref = conv.clone(), rec.clone()
        o_ref = reference(*args, c_ref, r_ref, slots)
        roofline = 1e3 * (2 * N * hv * dk * dv * 4 + 2 * N * C * 3 * 2) / copy_rate()
        print(f"gdn_decode, batch {N} (roofline {1e3 * roofline:.1f} us)", flush=True)
        batch_rows = []
        for block_v, warps, v_blocks in configs or GDN_CONFIGS:
            knobs = dict(block_v=block_v, num_warps=warps, v_blocks=v_blocks)
            c1, r1 = c_ref0.clone(), r_ref0.clone()  # the state before any timing loop ran
            err = rel_error(gdn_decode(*args, c1, r1, slots, **knobs), o_ref)
            err = max(err, rel_error(r1, r_ref))
            ms = bench(partial(gdn_decode, *args, conv, rec, slots, **knobs))
            form = "split: conv, then the delta rule" if v_blocks == 0 else f"{v_blocks} blocks a program"
            config = f"block_v {block_v}, {warps} warps, {form}"
            batch_rows.append(dict(kernel="gdn_decode", batch=N, config=config, knobs=(block_v, warps, v_blocks),
                                   ms=ms, roofline_ms=roofline, err=err, ok=err < 1e-4))  # fmt: skip
        show(batch_rows, "config", f"gdn_decode batch {N}")
        rows += batch_rows
    total: dict[tuple, float] = {}
    for r in rows:
        if r["ok"]:
            total[r["knobs"]] = total.get(r["knobs"], 0.0) + r["ms"]
    both = [k for k in total if sum(r["knobs"] == k and r["ok"] for r in rows) == 2]  # exact at batch 32 and 64
    best = min(both, key=total.get)
    SUMMARY.append(f"gdn_decode, batch 32 + 64, best: block_v {best[0]}, {best[1]} warps, {best[2]} blocks a program "
                   f"({1e3 * total[best]:.1f} us)")  # fmt: skip
    GDN_BEST.append(best)
    return rows


@torch.inference_mode()
def recurrent_sweep(cfg: ModelConfig) -> list[dict]:
    """The token-by-token GDN kernel of short steps (`ops/gated_delta_rule/triton.recurrent_by_slot`):
    decode-like rows (32 x 1), speculative verify chunks (b x 3 with spec slots) and a short prompt."""
    from hylora.ops.gated_delta_rule import triton as recurrent

    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    rows = []
    for N, L, spec in ((32, 1, False), (1, 3, True), (8, 3, True), (32, 3, True), (4, 16, False)):
        T, S = N * L, N * L + 1
        g = torch.Generator(DEV).manual_seed(T)
        q, k = (torch.randn(T, hk, dk, device=DEV, dtype=DT, generator=g) for _ in range(2))
        v = torch.randn(T, hv, dv, device=DEV, dtype=DT, generator=g)
        b, a = (torch.randn(T, hv, device=DEV, dtype=DT, generator=g) for _ in range(2))
        A_log, dt_bias = torch.rand(hv, device=DEV, generator=g).log(), torch.zeros(hv, device=DEV)
        perm = torch.randperm(S, device=DEV, generator=g)
        slots = perm[:N]
        spec_slots = perm[N : N + N * (L - 1)].view(N, L - 1) if spec else None
        pool0 = torch.randn(S, hv, dk, dv, device=DEV, generator=g) * 0.1
        lens = [L] * N
        kw = dict(q=q, k=k, v=v, b=b, a=a, A_log=A_log, dt_bias=dt_bias, slots=slots, seq_lens=lens, scale=dk**-0.5,
                  spec_slots=spec_slots)  # fmt: skip
        ref_pool = pool0.clone()
        o_ref = recurrent.recurrent_by_slot(**kw, state_pool=ref_pool, block_v=32, num_warps=4)
        writes = N * (1 + (L - 1 if spec else 0))
        roofline = 1e3 * ((N + writes) * hv * dk * dv * 4 + 4 * T * hv * dv * 2) / copy_rate()
        name = f"{N} x {L}" + (" verify" if spec else "")
        print(f"recurrent_by_slot, {name} (roofline {1e3 * roofline:.1f} us; the first config is the default)")
        group = []
        for block_v, warps in RECURRENT_CONFIGS:
            knobs = dict(block_v=block_v, num_warps=warps)
            pool = pool0.clone()
            err = rel_error(recurrent.recurrent_by_slot(**kw, state_pool=pool, **knobs), o_ref)
            err = max(err, rel_error(pool, ref_pool))
            ms = bench(partial(recurrent.recurrent_by_slot, **kw, state_pool=pool0.clone(), **knobs))
            config = f"block_v {block_v}, {warps} warps"
            group.append(dict(kernel="recurrent_by_slot", shape=name, config=config, knobs=(block_v, warps),
                              ms=ms, roofline_ms=roofline, err=err, ok=err < 1e-4))  # fmt: skip
        show(group, "config", f"recurrent_by_slot {name}")
        rows += group
    return rows


# (block_v, num_warps); the first is the default. Run 21 also timed programs that walk 2 or 4 dv tiles
# with the next tile's load ahead (as the decode kernel does; commit b4fb629): slower in every shape
RECURRENT_CONFIGS = [(32, 4), (16, 4), (64, 8), (16, 2), (8, 2)]


@torch.inference_mode()
def logits_sweep(cfg: ModelConfig) -> list[dict]:
    """The logits scan (greedy token + NaN / inf flags) against the torch ops it replaced in the decode
    step's guard and the sampler (isfinite.all; clone, isnan.any, isfinite.any, argmax)."""
    from hylora.ops.logits_scan.reference import scan_logits as reference
    from hylora.ops.logits_scan.triton import scan_logits

    def torch_path(x: torch.Tensor) -> torch.Tensor:
        finite = torch.isfinite(x).all(-1)
        work = x.clone()
        return torch.stack([work.argmax(-1), torch.isnan(work).any(-1) | ~torch.isfinite(work).any(-1) | finite])

    rows = []
    for N in (32, 64):
        x = torch.randn(N, cfg.vocab_size, device=DEV)
        x[1, 5] = float("nan")
        ref = reference(x)
        roofline = 1e3 * N * cfg.vocab_size * 4 / copy_rate()
        before = bench(partial(torch_path, x))
        batch_rows = [dict(kernel="logits_scan", batch=N, config="torch ops (before the scan)", ms=before,
                           roofline_ms=roofline, err=0.0, ok=True)]  # fmt: skip
        for chunk, block in ((2048, 512), (4096, 1024), (8192, 1024), (8192, 2048), (16384, 2048), (32768, 4096)):
            got = scan_logits(x, chunk=chunk, block=block)
            exact = torch.equal(got[1], ref[1]) and torch.equal(got[0][2:], ref[0][2:]) and bool(got[0][0] == ref[0][0])
            batch_rows.append(dict(kernel="logits_scan", batch=N, config=f"scan chunk {chunk}, block {block}",
                                   ms=bench(partial(scan_logits, x, chunk=chunk, block=block)), roofline_ms=roofline,
                                   err=0.0 if exact else float("inf"), ok=exact))  # fmt: skip
        show(batch_rows, "config", f"logits scan batch {N}")
        rows += batch_rows
    return rows


# (block_v, num_warps, dv blocks a program) that sm_90 compiles without register spills at the 27B
# shape (ptxas -v through tests/sm90_compile.py); the sweep times only these
GDN_CONFIGS = [
    (4, 1, 1), (8, 1, 1), (8, 2, 1), (16, 2, 1), (16, 4, 1), (16, 8, 1), (32, 2, 1), (32, 4, 1), (32, 8, 1),
    (64, 4, 1), (64, 8, 1), (128, 8, 1),
    (8, 1, 4), (8, 1, 8), (8, 1, 16), (8, 2, 4), (8, 2, 8), (8, 2, 16), (16, 2, 2), (16, 4, 2), (16, 4, 4),
    (16, 4, 8), (16, 8, 4), (16, 8, 8), (32, 4, 2), (32, 4, 4), (32, 8, 2), (32, 8, 4), (64, 8, 2),
]  # fmt: skip
GDN_BEST: list[tuple] = []


# 'partition,block_t,warps,pv16,stages' (stages 0: Triton's default); the first is the kernel before run 46,
# 256,32,4,1,0 its default since
ATTN_CONFIGS = (
    "128,16,4,0,0 128,16,4,1,0 128,32,4,0,0 128,32,4,1,0 128,64,4,1,0 128,64,8,1,0 256,32,4,1,0 256,64,4,1,0 "
    "256,64,8,1,0 512,64,8,1,0 128,32,4,1,2 128,32,4,1,4 128,64,4,1,2 128,64,4,1,4"
)
# 'batch:context:bound': the throughput workload's decode (576 tokens), one 8k prompt, the video workload's
# 24 requests of ~9k tokens (max model length 10240)
ATTN_SHAPES = "32:576:1024 64:576:1024 8:8192:32768 24:9000:10240"


@torch.inference_mode()
def attention_sweep(cfg: ModelConfig, configs: str = ATTN_CONFIGS, shapes: str = ATTN_SHAPES) -> list[dict]:
    from hylora.ops.paged_decode_attention.reference import paged_decode_attention as reference
    from hylora.ops.paged_decode_attention.triton import paged_decode_attention

    H, Hkv, D, page = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 16
    rows = []
    for N, ctx, bound in (tuple(int(k) for k in shape.split(":")) for shape in shapes.split()):
        pages = bound // page
        g = torch.Generator(DEV).manual_seed(N)
        table = torch.randperm(N * pages, device=DEV, generator=g).to(torch.int32).reshape(N, pages)
        kc = torch.randn(N * pages * page, Hkv, D, device=DEV, dtype=DT, generator=g)
        vc = torch.randn(N * pages * page, Hkv, D, device=DEV, dtype=DT, generator=g)
        q = torch.randn(N, H, D, device=DEV, dtype=DT, generator=g)
        lens = torch.full((N,), ctx, device=DEV, dtype=torch.int32)
        args = (q, kc, vc, table, lens, page, D**-0.5)
        ref = reference(*args)
        roofline = 1e3 * 2 * N * ctx * Hkv * D * 2 / copy_rate()
        print(f"paged_decode_attention, batch {N}, context {ctx}, bound {bound} (roofline {1e3 * roofline:.1f} us)")
        batch_rows = []
        for config in configs.split():
            partition, block_t, warps, pv16, stages = (int(k) for k in config.split(","))
            if bound // partition > 512:
                continue
            label = f"partition {partition}, block_t {block_t}, {warps} warps{', pv16' * pv16}"
            label += f", {stages} stages" if stages else ""
            call = partial(
                paged_decode_attention, *args, max_seq_len=bound, partition=partition, block_t=block_t,
                num_warps=warps, pv_16bit=bool(pv16), num_stages=stages or None,
            )  # fmt: skip
            try:
                err = rel_error(call(), ref)
                ms = bench(call)
            except Exception as e:  # e.g. out of shared memory for this tile
                print(f"  {label}: {type(e).__name__}: {e}"[:200])
                continue
            batch_rows.append(dict(kernel="paged_decode_attention", batch=N, context=ctx, bound=bound,
                                   config=label, ms=ms, roofline_ms=roofline, err=err, ok=err < 1e-2))  # fmt: skip
        show(batch_rows, "config", f"attention batch {N} ctx {ctx} bound {bound}")
        rows += batch_rows
    return rows


def lora_linears(cfg: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {
        "gdn in_proj": (h, [2 * hk * dk + hv * dv, hv * dv, hv, hv]),
        "mlp gate_up": (h, [inter, inter]),
        "mlp down": (inter, [h]),
    }


def lora_case(in_f: int, slices: list[int], tokens: int, L: int, r: int):
    """x, y, W, an 8-slot LoRA stack and the batch of a sweep row: decode (≤ 64 tokens, one token a
    sequence, adapters round robin) or prefill (512-token sequences, one adapter each)."""
    g = torch.Generator(DEV).manual_seed(tokens)
    offsets, start = [], 0
    for n in slices:
        offsets.append((start, n))
        start += n
    stack = LoRAStack(
        a=[torch.randn(L, r, in_f, device=DEV, dtype=DT, generator=g) * in_f**-0.5 for _ in slices],
        b=[torch.randn(L, r, n, device=DEV, dtype=DT, generator=g) * 0.01 for n in slices],
        offsets=offsets,
        present=[[True] * len(slices) for _ in range(L)],
    )
    if tokens <= 64:
        batch = LoRABatch.build([i % L for i in range(tokens)], [1] * tokens, DEV)
    else:
        batch = LoRABatch.build([i % L for i in range(tokens // 512)], [512] * (tokens // 512), DEV)
    x = torch.randn(tokens, in_f, device=DEV, dtype=DT, generator=g)
    y0 = torch.randn(tokens, start, device=DEV, dtype=DT, generator=g)
    w = torch.randn(start, in_f, device=DEV, dtype=DT, generator=g) * in_f**-0.5
    return x, y0, w, stack, batch


@torch.inference_mode()
def lora_sweep(cfg: ModelConfig, L: int = 8, r: int = 16, token_counts=(32, 64, 2048, 8192)) -> list[dict]:
    from hylora.ops.lora import triton as lt

    configs = getattr(lt, "SWEEP_CONFIGS", {"small": lt.SMALL, "large": lt.LARGE})
    rows = []
    for (name, (in_f, slices)), tokens in itertools.product(lora_linears(cfg).items(), token_counts):
        x, y0, w, stack, batch = lora_case(in_f, slices, tokens, L, r)
        offsets, start = stack.offsets, w.shape[0]
        zeros = torch.zeros_like(y0)  # the error on y = 0 + delta: the delta itself, rounded once
        ref = lora_apply_grouped(x, zeros.clone(), stack.a, stack.b, offsets, stack.present, batch.groups)
        base_ms = bench(partial(torch.nn.functional.linear, x, w))
        # bytes: y read + written, x read, each distinct adapter's A and B
        moved = tokens * (2 * start + in_f) * 2 + min(L, tokens) * r * (in_f * len(slices) + start) * 2
        roofline = 1e3 * moved / copy_rate()
        print(f"lora {name} ({in_f} -> {slices}), {tokens} tokens: base GEMM {1e3 * base_ms:.1f} us, "
              f"LoRA roofline {1e3 * roofline:.1f} us", flush=True)  # fmt: skip
        meta = lt.LoRAKernelMeta.build(batch.token_slots, L)
        batch_rows = []
        for label, config in configs.items():
            if label.startswith("large-") != (tokens >= lt.LARGE_FROM):
                continue  # decode candidates at decode sizes, prefill candidates at prefill sizes
            try:
                err = rel_error(lt.lora_apply(x, zeros.clone(), stack.a, stack.b, offsets, meta, config), ref)
                y = y0.clone()
                ms = bench(partial(lt.lora_apply, x, y, stack.a, stack.b, offsets, meta, config))
            except Exception as e:
                print(f"  {label}: {type(e).__name__}: {e}"[:200])
                continue
            batch_rows.append(dict(kernel="lora", linear=name, tokens=tokens, config=label, ms=ms,
                                   roofline_ms=roofline, base_gemm_ms=base_ms, err=err, ok=err < 1e-2))  # fmt: skip
        if tokens < STACKED_LORA_BELOW:  # decode: the shrink inside the base GEMM (Linear.stack_lora_a)
            stacked_w = torch.cat([w] + [a.reshape(L * r, in_f) for a in stack.a])
            views = stacked_w[start:].view(len(slices), L, r, in_f)
            stacked = LoRAStack(a=[views[i] for i in range(len(slices))], b=stack.b, offsets=offsets,
                                present=stack.present)  # fmt: skip
            zero_w = torch.cat([torch.zeros_like(w), stacked_w[start:]])  # y = 0 + delta, as ref
            err = rel_error(lt.lora_apply_stacked(x, zero_w, start, stacked.b, offsets, meta), ref)
            ms = bench(partial(lt.lora_apply_stacked, x, stacked_w, start, stacked.b, offsets, meta)) - base_ms
            batch_rows.append(
                dict(kernel="lora", linear=name, tokens=tokens, config="stacked: GEMM over [W; A] + expand, minus base",
                     ms=ms, roofline_ms=roofline, base_gemm_ms=base_ms, err=err, ok=err < 1e-2)
            )  # fmt: skip
        else:  # prefill: what cuBLAS makes of the same read-modify-write (bf16 h of every slot, zero but its own)
            h = lt.lora_shrink(x, stack.a, meta, lt.LARGE).sum(0).to(DT)  # [T, slices, r]
            onehot = torch.nn.functional.one_hot(batch.token_slots.long(), L).to(DT)  # [T, L]
            h_all = [(onehot[:, :, None] * h[:, i, None, :]).reshape(tokens, L * r) for i in range(len(slices))]
            b_all = [bi.reshape(L * r, n) for bi, n in zip(stack.b, slices, strict=True)]

            def cublas_expand(y, offsets=offsets, h_all=h_all, b_all=b_all):
                for (start_col, n), hi, bi in zip(offsets, h_all, b_all, strict=True):
                    y[:, start_col : start_col + n].addmm_(hi, bi)
                return y

            err = rel_error(cublas_expand(zeros.clone()), ref)
            y = y0.clone()
            batch_rows.append(
                dict(kernel="lora", linear=name, tokens=tokens, config="cuBLAS addmm expand only (bf16 h, all slots)",
                     ms=bench(partial(cublas_expand, y)), roofline_ms=roofline, base_gemm_ms=base_ms, err=err,
                     ok=False)
            )  # fmt: skip
            y = y0.clone()
            batch_rows.append(
                dict(kernel="lora", linear=name, tokens=tokens, config="triton expand only (LARGE)",
                     ms=bench(partial(lt.lora_expand, lt.lora_shrink(x, stack.a, meta, lt.LARGE), stack.b, offsets,
                                      y, meta, lt.LARGE)),
                     roofline_ms=roofline, base_gemm_ms=base_ms, err=0.0, ok=False)
            )  # fmt: skip
        default = lt.choose_config(tokens, in_f)  # what the engine runs at this size
        y = y0.clone()
        batch_rows.append(
            dict(kernel="lora", linear=name, tokens=tokens, config=f"choose_config (block_m {default.block_m})",
                 ms=bench(partial(lt.lora_apply, x, y, stack.a, stack.b, offsets, meta)), roofline_ms=roofline,
                 base_gemm_ms=base_ms, err=0.0, ok=True)
        )  # fmt: skip
        show(batch_rows, "config", f"lora {name} {tokens} tokens")
        rows += batch_rows
    return rows


@torch.inference_mode()
def epilogue_sweep(cfg: ModelConfig, L: int = 8, r: int = 16, token_counts=(2048, 8192)) -> list[dict]:
    """The prefill LoRA without the expand's read-modify-write of y (`lora_apply_delta_first`: the delta
    first, then the base GEMM accumulating onto it, C read in its epilogue) beside base GEMM + shrink +
    expand, the plain base GEMM and the same GEMM with beta 1. (Runs 29 b and d also timed the delta
    first in torch glue, before the op existed.)"""
    from hylora.ops.lora import triton as lt

    rows = []
    for (name, (in_f, slices)), tokens in itertools.product(lora_linears(cfg).items(), token_counts):
        x, y0, w, stack, batch = lora_case(in_f, slices, tokens, L, r)
        meta = lt.LoRAKernelMeta.build(batch.token_slots, L)
        out = torch.empty_like(y0)

        def engine_path(out=out, x=x, w=w, stack=stack, meta=meta):
            torch.nn.functional.linear(x, w, out=out)
            return lt.lora_apply(x, out, stack.a, stack.b, stack.offsets, meta)

        delta_first = partial(lt.lora_apply_delta_first, x, w, stack.a, stack.b, stack.offsets, meta, len(batch.slots))
        err = rel_error(delta_first(), engine_path().double())  # against the shrink + expand path
        timings = {
            "base GEMM": bench(partial(torch.nn.functional.linear, x, w, out=out)),
            "base GEMM with beta 1 (addmm onto y)": bench(partial(torch.addmm, y0, x, w.t(), out=out)),
            "engine: base + shrink + expand": bench(engine_path),
            "lora_apply_delta_first": bench(delta_first),  # inside a CUDA graph: a host sync would fail
        }
        base = timings["base GEMM"]
        print(f"lora epilogue {name} ({in_f} -> {slices}), {tokens} tokens (delta first vs shrink + expand: "
              f"rel. err {err:.1e}):")  # fmt: skip
        for label, ms in timings.items():
            print(f"  {label:<44} {1e3 * ms:8.1f} us   base + {1e3 * (ms - base):7.1f} us", flush=True)
        extra = [f"{label} +{1e3 * (ms - base):.0f} us" for label, ms in list(timings.items())[1:]]
        SUMMARY.append(f"epilogue {name} {tokens}: " + "; ".join(extra))
        rows.append(dict(kernel="lora-epilogue", linear=name, tokens=tokens, err=err, timings_ms=timings))
    return rows


def decode_lora_linears(cfg: ModelConfig) -> dict[str, tuple[list[int], int]]:
    """Every LoRA-capable linear of a decode step: name -> (its slices' widths, how many a 16-layer cut has)."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    heads, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    gdn_layers, attn_layers = 12, 4
    return {
        "gdn in_proj": ([2 * hk * dk + hv * dv, hv * dv, hv, hv], gdn_layers),
        "gdn out_proj": ([h], gdn_layers),
        "attn qkv": ([2 * heads * hd, kv * hd, kv * hd], attn_layers),
        "attn o": ([h], attn_layers),
        "mlp gate_up": ([inter, inter], gdn_layers + attn_layers),
        "mlp down": ([h], gdn_layers + attn_layers),
    }


EXPAND_CONFIGS = (
    "64,4,4 128,2,4 32,1,1 32,1,2 32,2,2 64,1,1 64,1,2 64,1,4 64,2,2 64,2,4 "
    "128,1,2 128,1,4 128,1,8 128,2,8 256,1,4 256,1,8"
)


@torch.inference_mode()
def expand_sweep(cfg: ModelConfig, configs: str = EXPAND_CONFIGS, L: int = 8, r: int = 16,
                 token_counts=(32, 64)) -> list[dict]:  # fmt: skip
    """The decode steps' expand alone (`lora_apply_stacked` after its GEMM: h in bf16, every slot's),
    8 rank-16 adapters round robin, on every LoRA linear; then each candidate's total over a 16-layer
    decode step (12 GDN + 4 attention layers), the number the step profile's `_expand_kernel` shows.
    Candidates: 'block_n,n_per_program,num_warps'; "fp32-h" is the default launch on an fp32 h (the
    tf32x3 dot the stacked path ran before)."""
    from hylora.ops.lora import triton as lt

    candidates = {"default": lt.DECODE_EXPAND}
    for c in configs.split():
        block_n, per, warps = (int(k) for k in c.split(","))
        candidates[f"n{block_n}x{per} w{warps}"] = lt.KernelConfig(
            block_m=16, block_n=block_n, block_k=0, split_k=1, n_per_program=per, num_warps=warps
        )
    rows = []
    for tokens in token_counts:
        totals: dict[str, float] = {}
        slots = torch.tensor([i % L for i in range(tokens)], device=DEV)
        meta = lt.LoRAKernelMeta.build(slots, L)
        for name, (widths, count) in decode_lora_linears(cfg).items():
            g = torch.Generator(DEV).manual_seed(tokens + len(widths))
            offsets = [(sum(widths[:i]), n) for i, n in enumerate(widths)]
            out = sum(widths)
            b = [torch.randn(L, r, n, device=DEV, dtype=DT, generator=g) * 0.05 for n in widths]
            h = torch.randn(1, tokens, len(widths), L, r, device=DEV, dtype=DT, generator=g)
            y0 = torch.randn(tokens, out, device=DEV, dtype=DT, generator=g)
            own = h[0, torch.arange(tokens, device=DEV), :, slots].float()  # [T, slices, r]
            ref = torch.zeros(tokens, out, device=DEV)  # the delta on y = 0: rounded once, as lora_sweep
            for i, (start, n) in enumerate(offsets):
                ref[:, start : start + n] = torch.einsum("tr,trn->tn", own[:, i], b[i][slots].float())
            roofline = 1e3 * (tokens * out * 2 * 2 + L * r * out * 2) / copy_rate()
            batch_rows = []
            for label, config in [*candidates.items(), ("fp32-h", lt.DECODE_EXPAND)]:
                hh = h.float() if label == "fp32-h" else h
                try:
                    err = rel_error(lt.lora_expand(hh, b, offsets, torch.zeros_like(y0), meta, config), ref)
                    y = y0.clone()
                    ms = bench(partial(lt.lora_expand, hh, b, offsets, y, meta, config))
                except Exception as e:
                    print(f"  {label}: {type(e).__name__}: {e}"[:200])
                    continue
                totals[label] = totals.get(label, 0.0) + count * ms
                batch_rows.append(dict(kernel="expand", linear=name, tokens=tokens, config=label, ms=ms,
                                       roofline_ms=roofline, err=err, ok=err < 1e-2))  # fmt: skip
            print(f"expand {name} ({widths}), {tokens} tokens: roofline {1e3 * roofline:.2f} us", flush=True)
            show(batch_rows, "config", f"expand {name} {tokens} tokens")
            rows += batch_rows
        print(f"expand, one 16-layer decode step at batch {tokens} (sum over its 64 launches):")
        for label, total in sorted(totals.items(), key=lambda kv: kv[1]):
            print(f"  {label:<16} {1e3 * total:7.1f} us")
        SUMMARY.append(f"expand step total, batch {tokens}: " + ", ".join(
            f"{k} {1e3 * v:.0f} us" for k, v in sorted(totals.items(), key=lambda kv: kv[1])[:4]))  # fmt: skip
        rows.append(dict(kernel="expand-step", tokens=tokens, totals_ms=totals))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="gdn,attention,lora")
    ap.add_argument("--out")
    ap.add_argument("--gdn-best-out", help="write the GDN sweep's pick as --gdn-decode-launch's value")
    ap.add_argument("--gdn-configs", help="GDN candidates as 'block_v,warps,v_blocks ...' (default: GDN_CONFIGS)")
    ap.add_argument("--lora-tokens", default="32,64,2048,8192", help="token counts of the LoRA sweep")
    ap.add_argument("--expand-configs", default=EXPAND_CONFIGS, help="'block_n,n_per_program,warps ...'")
    ap.add_argument("--attention-configs", default=ATTN_CONFIGS, help="'partition,block_t,warps,pv16,stages ...'")
    ap.add_argument("--attention-shapes", default=ATTN_SHAPES, help="'batch:context:bound ...'")
    args = ap.parse_args()
    copy_rate()  # measured before anything takes the GPU's memory (cached for the rooflines)
    cfg = ModelConfig.from_hf(QWEN36_27B)
    result = {"card": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    tokens = tuple(int(t) for t in args.lora_tokens.split(","))
    gdn_configs = [tuple(int(k) for k in c.split(",")) for c in args.gdn_configs.split()] if args.gdn_configs else None
    sweeps = {
        "gdn": partial(gdn_sweep, configs=gdn_configs),
        "logits": logits_sweep,
        "recurrent": recurrent_sweep,
        "attention": partial(attention_sweep, configs=args.attention_configs, shapes=args.attention_shapes),
        "lora": partial(lora_sweep, token_counts=tokens),
        "epilogue": epilogue_sweep,
        "expand": partial(expand_sweep, configs=args.expand_configs),
    }
    for name in args.only.split(","):
        t0 = time.perf_counter()
        result[name] = sweeps[name](cfg)
        print(f"[{name} sweep: {time.perf_counter() - t0:.0f} s]", flush=True)
    print("best per group:", *SUMMARY, sep="\n")
    if args.gdn_best_out and GDN_BEST:
        Path(args.gdn_best_out).write_text(",".join(str(k) for k in GDN_BEST[0]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()

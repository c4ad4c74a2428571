"""GPU check and timing of hylora's Triton decode kernels (issue 10, part 1) on the 27B shape.

1. Start-up checks (`select_kernels`) on a 27B-shape model cut to `--layers` layers (bf16).
2. Kernel timings at the 27B shape, one layer, batch 32 and 64: the GDN decode step in place by slot
   (Triton) vs fla's fused recurrent kernel with the slot gather/scatter around it (today's path) vs
   the torch reference; paged decode attention (Triton vs the torch gather path); LoRA on the MLP's
   gate/up linear with 8 rank-16 adapters mixed (Triton vs masked vs grouped), decode (32 tokens)
   and prefill (2048 tokens). Each beside its bytes roofline at 4.3 TB/s.
3. DESIGN.md's workload (32 x 512-token prompts + 64 greedy tokens) through the engine, base and 8
   mixed adapters: Triton kernels + CUDA graphs for decode, Triton kernels eager, references eager;
   fault isolation with graphs on.
4. CUDA graphs (issue 10, part 3): a graph replay equals the same padded step run eagerly, bit for
   bit; the engine with graphs vs eager (tokens, logprobs); the decode step alone at batch 1, 8, 32,
   64 (context 576), base and 8 mixed adapters, graph vs eager, beside its bytes roofline (weights
   without the embedding table + distinct adapters + KV + GDN state + logits).
5. Short prefill steps (decode rows with a prompt's last tokens, short prompts), one GDN layer: the
   token-by-token delta rule by slot vs fla's chunked kernel with the gating and the state
   gather/scatter around it, device and host ms.

    python bench/decode_gpu.py [--layers 16] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_gpu import QWEN36_27B, _run_workload, fault_check, random_adapters, random_model  # noqa: E402
from bench.shapes import copy_rate  # noqa: E402
from hylora.config import ModelConfig  # noqa: E402
from hylora.demo import write_tokenizer  # noqa: E402
from hylora.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from hylora.engine.decode_batch import DecodeRow  # noqa: E402
from hylora.engine.padded_decode import PaddedDecode  # noqa: E402
from hylora.kernels import as_text  # noqa: E402
from hylora.lora import LoRABatch, LoRAStack  # noqa: E402
from hylora.model.forward_batch import ForwardBatch, SequenceChunk  # noqa: E402
from hylora.model.kernels import ModelKernels  # noqa: E402
from hylora.model.layers import (
    Linear,  # noqa: E402
    add_lora,  # noqa: E402
)
from hylora.ops.gdn_decode.reference import gdn_decode as gdn_reference  # noqa: E402
from hylora.ops.paged_decode_attention.reference import paged_decode_attention as attention_reference  # noqa: E402


def bench(fn, reps: int = 50) -> float:
    """Median ms of `fn` over CUDA-graph-free replays (events)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def kernel_timings(cfg: ModelConfig) -> list[dict]:
    rows = []
    for n in (32, 64):
        rows += [_gdn_row(cfg, n), _attention_row(cfg, n)]
        print(rows[-2], rows[-1], sep="\n", flush=True)
    for tokens in (32, 2048):
        rows.append(_lora_row(cfg, tokens))
        print(rows[-1], flush=True)
    return rows


def _gdn_row(cfg: ModelConfig, N: int, dev: str = "cuda", dt: torch.dtype = torch.bfloat16) -> dict:
    from hylora.ops.gdn_decode.triton import gdn_decode

    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, C, S = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_dim, 2 * N
    slots = torch.randperm(S, device=dev)[:N]
    qkv, b, a = (torch.randn(N, n, device=dev, dtype=dt) for n in (C, hv, hv))
    w = torch.randn(C, 4, device=dev, dtype=dt) * 0.3
    A_log, dt_bias = torch.rand(hv, device=dev).log(), torch.zeros(hv, device=dev)
    conv = torch.randn(S, C, 3, device=dev, dtype=dt)
    rec = torch.randn(S, hv, dk, dv, device=dev) * 0.1
    args = (qkv, b, a, w, A_log, dt_bias, conv, rec, slots)
    row = {
        "kernel": "gdn_decode (one layer)",
        "batch": N,
        "triton_ms": bench(lambda: gdn_decode(*args)),
        "reference_ms": bench(lambda: gdn_reference(*args), reps=10),
        "roofline_ms": 1e3 * (2 * N * hv * dk * dv * 4 + 2 * N * C * 3 * 2) / copy_rate(),
    }
    try:  # today's CUDA path: gather the slots, fla's fused recurrent kernel, scatter back
        from hylora.ops.gated_delta_rule.fla import varlen_gated_delta_rule

        q = torch.randn(N, hk, dk, device=dev, dtype=dt)
        v = torch.randn(N, hv, dv, device=dev, dtype=dt)
        g = -torch.rand(N, hv, device=dev)

        def fla_step() -> None:
            _, final = varlen_gated_delta_rule(q, q, v, g, b, rec[slots], [1] * N, dk**-0.5)
            rec[slots] = final

        row["fla_gather_scatter_ms"] = bench(fla_step)
    except Exception as e:  # fla not installed
        row["fla_gather_scatter_ms"] = f"n/a ({type(e).__name__})"
    return row


SHORT_STEPS = {  # chunk lengths of one step: decode rows with a prompt's last tokens, short prompts
    "31 x 1 + 16": [1] * 31 + [16],
    "1 x 64": [64],
    "8 x 64": [64] * 8,
    "32 x 16": [16] * 32,
    "32 x 64": [64] * 32,
}


@torch.inference_mode()
def short_prefill_timings(cfg: ModelConfig) -> list[dict]:
    """One GDN layer's delta rule on a short step: the token-by-token kernel by slot against what runs
    without it (the gating, the states gathered, fla's chunked kernel, scattered back). Device ms
    (events) and host ms per call (enqueue time of 20 calls, no sync between)."""
    rows = []
    for name, lens in SHORT_STEPS.items():
        rows.append(_short_prefill_row(cfg, name, lens))
        print(rows[-1], flush=True)
    return rows


def _short_prefill_row(cfg: ModelConfig, name: str, lens: list[int], dev: str = "cuda") -> dict:
    from hylora.ops.gated_delta_rule.reference import gating
    from hylora.ops.gated_delta_rule.triton import recurrent_by_slot

    hk, hv, dk, dv = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )
    T, N, dt = sum(lens), len(lens), torch.bfloat16
    slots = torch.randperm(2 * N, device=dev)[:N]
    q, k = (torch.randn(T, hk, dk, device=dev, dtype=dt) for _ in range(2))
    v = torch.randn(T, hv, dv, device=dev, dtype=dt)
    ba = torch.randn(T, 2 * hv, device=dev, dtype=dt)
    b, a = ba[:, :hv], ba[:, hv:]
    A_log, dt_bias = torch.rand(hv, device=dev).log(), torch.zeros(hv, device=dev, dtype=dt)
    pool = torch.randn(2 * N, hv, dk, dv, device=dev) * 0.1
    scale = dk**-0.5

    def short() -> None:
        recurrent_by_slot(q, k, v, b, a, A_log, dt_bias, pool, slots, lens, scale)

    row = {"step": name, "tokens": T, "short_ms": bench(short), "short_host_ms": host_ms(short)}
    try:
        from hylora.ops.gated_delta_rule.fla import varlen_gated_delta_rule
    except Exception as e:  # fla not installed
        return row | {"fla_ms": f"n/a ({type(e).__name__})"}

    def chunked() -> None:
        g, beta = gating(b, a, A_log, dt_bias)
        _, final = varlen_gated_delta_rule(q, k, v, g, beta, pool[slots], lens, scale)
        pool[slots] = final

    return row | {"fla_ms": bench(chunked), "fla_host_ms": host_ms(chunked)}


def host_ms(fn, reps: int = 20) -> float:
    """Host ms per call to enqueue `fn` (the device may still be running when the clock stops)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    return 1e3 * host


def _attention_row(cfg: ModelConfig, N: int, ctx: int = 576, dev: str = "cuda") -> dict:
    from hylora.ops.paged_decode_attention.triton import paged_decode_attention

    H, Hkv, D, page, dt = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 16, torch.bfloat16
    pages = -(-ctx // page)
    table = torch.arange(N * pages, device=dev, dtype=torch.int32).reshape(N, pages)
    kc = torch.randn(N * pages * page, Hkv, D, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    q = torch.randn(N, H, D, device=dev, dtype=dt)
    lens = torch.full((N,), ctx, device=dev, dtype=torch.int32)
    args = (q, kc, vc, table, lens, page, D**-0.5)
    return {
        "kernel": "paged_decode_attention (one layer)",
        "batch": N,
        "context": ctx,
        "triton_ms": bench(lambda: paged_decode_attention(*args, max_seq_len=ctx)),
        "reference_ms": bench(lambda: attention_reference(*args), reps=10),
        "roofline_ms": 1e3 * 2 * N * ctx * Hkv * D * 2 / copy_rate(),
    }


def _lora_row(cfg: ModelConfig, tokens: int, L: int = 8, r: int = 16, dev: str = "cuda") -> dict:
    from hylora.ops.lora.triton import LoRAKernelMeta
    from hylora.ops.lora.triton import lora_apply as lora_triton

    dt, h, inter = torch.bfloat16, cfg.hidden_size, cfg.intermediate_size
    stack = LoRAStack(
        a=[torch.randn(L, r, h, device=dev, dtype=dt) * h**-0.5 for _ in range(2)],
        b=[torch.randn(L, r, inter, device=dev, dtype=dt) * 0.01 for _ in range(2)],
        offsets=[(0, inter), (inter, inter)],
        present=[[True, True] for _ in range(L)],
    )
    per_seq = max(1, tokens // 32)
    batch = LoRABatch.build([i % L for i in range(32)], [per_seq] * 32, dev)
    x = torch.randn(32 * per_seq, h, device=dev, dtype=dt)
    y = torch.randn(32 * per_seq, 2 * inter, device=dev, dtype=dt)
    w = torch.randn(2 * inter, h, device=dev, dtype=dt)
    meta = LoRAKernelMeta.build(batch.token_slots, L)
    return {
        "kernel": f"lora gate_up ({L} adapters mixed, r{r})",
        "tokens": 32 * per_seq,
        "triton_ms": bench(lambda: lora_triton(x, y, stack.a, stack.b, stack.offsets, meta)),
        "masked_ms": bench(lambda: add_lora(x, y, stack, batch, "masked")),
        "grouped_ms": bench(lambda: add_lora(x, y, stack, batch, "grouped"), reps=10),
        "base_gemm_ms": bench(lambda: torch.nn.functional.linear(x, w)),
        "adapter_bytes_roofline_ms": 1e3 * L * r * (h + 2 * inter) * 2 * 2 / copy_rate(),
    }


def step_bytes(engine: LLMEngine, batch: int, context: int, adapters: int) -> dict[str, float]:
    """Bytes one decode step must move: weights (not the embedding table: a step reads `batch` rows of
    it), each distinct adapter's A and B, the KV it attends to, the GDN state read and written, logits."""
    model, c = engine.model, engine.model.config
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("embed"))
    per_adapter = 0
    for m in model.layers.modules():
        if isinstance(m, Linear) and m.lora is not None:
            slices = zip(m.lora.a, m.lora.b, strict=True)
            per_adapter += sum(a[0].numel() * a.element_size() + b[0].numel() * b.element_size() for a, b in slices)
    kv_token = 2 * len(c.attention_layers) * c.num_key_value_heads * c.head_dim * model.dtype.itemsize
    state = len(c.gdn_layers) * (
        c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
        + c.linear_conv_dim * (c.linear_conv_kernel_dim - 1) * model.dtype.itemsize
    )
    return {
        "weights": weights,
        "adapters": adapters * per_adapter,
        "kv": batch * (context + 1) * kv_token,
        "state": 2 * batch * state,
        "logits": batch * c.vocab_size * 4,
    }


def eager_step(engine: LLMEngine, rows: list[DecodeRow]) -> torch.Tensor:
    """The runner's eager decode path: ForwardBatch.build, forward, logits, finiteness to the host."""
    seqs = [SequenceChunk([r.token_id], r.context_len, r.state_slot, r.pages, lora_slot=r.lora_slot) for r in rows]
    batch = ForwardBatch.build(seqs, engine.kv.page_size, engine.model.device)
    hidden = engine.model(batch, engine.kv, engine.states)
    logits = engine.model.logits(hidden)
    finite = torch.isfinite(hidden).all(-1) & torch.isfinite(logits).all(-1)
    finite.cpu()
    return logits


def wall_ms(fn, reps: int = 30) -> float:
    """Median wall ms of `fn` (which ends with a device→host copy, as an engine step does)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def decode_steps(engine: LLMEngine, batches=(1, 8, 32, 64), context: int = 576) -> list[dict]:
    """Decode step alone, CUDA graph vs eager, base and 8 mixed adapters, beside its bytes roofline;
    and at batch 32 (bucket 32) and 27 (bucket 32, 5 padding rows) a graph replay vs the same padded
    step run eagerly: logits and the rows' caches compared bit for bit."""
    graphs, kv, states = engine.runner.decode, engine.kv, engine.states
    leases = [engine.adapters.acquire(f"a{i}") for i in range(8)]
    rows_out = []
    try:
        for n in (*batches, 27):
            slots = [states.allocate() for _ in range(n)]
            pages = [kv.allocate(kv.pages_needed(context + 1)) for _ in range(n)]
            for mixed in (False, True):
                rows = [
                    DecodeRow(100 + i, context, slots[i], pages[i], leases[i % 8].slot if mixed else -1)
                    for i in range(n)
                ]
                if n in (27, 32):
                    rows_out.append(_bitwise_check(engine, rows, slots, pages, context, mixed))
                    print(rows_out[-1], flush=True)
                if n == 27:
                    continue
                nbytes = step_bytes(engine, n, context, min(n, 8) if mixed else 0)
                roofline = 1e3 * sum(nbytes.values()) / copy_rate()
                row = {
                    "decode step": f"batch {n}, {'8 adapters mixed' if mixed else 'base'}",
                    "graph_ms": wall_ms(lambda rows=rows: graphs.run(rows)),
                    "eager_ms": wall_ms(lambda rows=rows: eager_step(engine, rows)),
                    "roofline_ms": roofline,
                    "bytes_gb": {k: v / 1e9 for k, v in nbytes.items()},
                }
                row["graph_over_roofline"] = row["graph_ms"] / roofline
                rows_out.append(row)
                print(row, flush=True)
            for p in pages:
                kv.free(p)
            for slot in slots:
                states.free(slot)
    finally:
        for lease in leases:
            engine.adapters.release(lease)
    return rows_out


def _bitwise_check(engine, rows, slots, pages, context, mixed) -> dict:
    kv, states, ps = engine.kv, engine.states, engine.kv.page_size
    kv_rows = torch.tensor([p[context // ps] * ps + context % ps for p in pages], device="cuda")

    def caches() -> list[torch.Tensor]:  # what the step writes for these rows, copied to the host: at 64
        # layers and batch 32 the GDN states alone are ~4.8 GB, more than the KV budget leaves free
        return [
            t.cpu() for t in (states.conv[:, slots], states.recurrent[:, slots], kv.k[:, kv_rows], kv.v[:, kv_rows])
        ]

    saved = caches()
    graphed = engine.runner.decode.run(rows)
    after_graph = caches()
    states.conv[:, slots], states.recurrent[:, slots] = saved[0].cuda(), saved[1].cuda()
    kv.k[:, kv_rows], kv.v[:, kv_rows] = saved[2].cuda(), saved[3].cuda()
    eager = PaddedDecode(engine.model, kv, states, engine.config.max_num_seqs, engine.config.max_model_len).run(rows)
    same_caches = all(torch.equal(a, b) for a, b in zip(after_graph, caches(), strict=True))
    same = torch.equal(graphed.logits, eager.logits) and same_caches
    return {
        "check": f"graph replay == eager padded step, batch {len(rows)}, {'8 adapters mixed' if mixed else 'base'}",
        "bit_identical": same,
        "finite": all(graphed.finite_hidden) and all(graphed.finite_logits),
    }


def graph_equivalence(engine: LLMEngine, adapter_of, label: str) -> dict:
    """The engine with CUDA graphs vs eager (same Triton kernels): 16 requests x 32 greedy tokens."""
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(20, 300, (16,), generator=g).tolist()
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(max_tokens=32, temperature=0, logprobs=0, ignore_eos=True)
    graphs, outs = engine.runner.decode, {}
    for use_graphs in (True, False):
        engine.runner.decode = graphs if use_graphs else None
        for i, p in enumerate(prompts):
            engine.add_request(f"eq{use_graphs}{label}{i}", p, params, adapter_of(i))
        done = {}
        while engine.has_unfinished():
            done |= {o.request_id: o for o in engine.step() if o.finished}
        outs[use_graphs] = [done[f"eq{use_graphs}{label}{i}"] for i in range(len(prompts))]
    engine.runner.decode = graphs
    same_tokens, diffs, first_divergence = 0, [], []
    for a, b in zip(outs[True], outs[False], strict=True):
        k = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), len(a.token_ids))
        same_tokens += k == len(a.token_ids)
        first_divergence.append(k)
        diffs += [abs(x.logprob - y.logprob) for x, y in zip(a.logprobs[:k], b.logprobs[:k], strict=True)]
    return {
        "check": f"engine, CUDA graphs vs eager, {label}",
        "requests_with_identical_tokens": f"{same_tokens}/{len(prompts)}",
        "first_divergence": first_divergence,
        "max_abs_logprob_diff_before_divergence": max(diffs),
        "errors": sum(o.error is not None for o in outs[True] + outs[False]),
    }


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("hylora.engine.cuda_graphs").setLevel(logging.INFO)  # capture time and memory
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--out")
    ap.add_argument("--skip-kernel-timings", action="store_true", help="skip part 2 (one-layer kernel timings)")
    ap.add_argument(
        "--step-tokens",
        default="2048,8192",
        help="max_num_batched_tokens for the workload: the first for every mode, the others with graphs only",
    )
    ap.add_argument("--skip-eager", action="store_true", help="workload with CUDA graphs only (no eager rows)")
    args = ap.parse_args()
    copy_rate()  # measured before anything takes the GPU's memory (cached for the rooflines)
    step_tokens = [int(t) for t in args.step_tokens.split(",")]
    shape = dict(QWEN36_27B, num_hidden_layers=args.layers)
    cfg = ModelConfig.from_hf(shape)
    work = Path(tempfile.mkdtemp())
    demo = work / "tokenizer"  # the engine needs a tokenizer; the model is built in memory
    demo.mkdir()
    write_tokenizer(demo, 1024)
    result: dict = {"card": torch.cuda.get_device_name(), "layers": args.layers, "date": time.strftime("%Y-%m-%d")}
    result["kernel_timings"] = [] if args.skip_kernel_timings else kernel_timings(cfg)
    result["short_prefill"] = short_prefill_timings(cfg)
    model = random_model(cfg, "cuda", torch.bfloat16)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    adapters = random_adapters(work, cfg)
    t0 = time.perf_counter()
    engine = LLMEngine(  # max_num_seqs 64: decode graphs for buckets up to 64 (the workload runs 32)
        demo,
        EngineConfig(
            max_model_len=1024,
            max_num_seqs=64,
            max_num_batched_tokens=max(step_tokens),
            max_loras=8,
            max_lora_rank=16,
            fault_injection=True,  # the fault-isolation check at the end
            enable_prefix_caching=False,  # every mode runs the same prompts: none may find them cached
        ),  # fmt: skip
        adapters,
        progress=False,
        model=model,
    )
    result["engine_setup_s"] = time.perf_counter() - t0
    print(f"kernels: {as_text(engine.kernels)}; engine set-up {result['engine_setup_s']:.1f} s", flush=True)
    result["kernels"] = as_text(engine.kernels)
    graphs = engine.runner.decode
    if graphs is None:
        raise SystemExit("no CUDA graphs were captured (see the log)")
    fast = model.kernels  # what passed its start-up check
    no_fast = ModelKernels(delta_rule=fast.delta_rule)  # the references, fla's delta rule kept
    mixes = [("base", lambda i: None, 1), ("8 adapters mixed", lambda i: f"a{i % 8}", 8)]
    result["graph_checks"] = [graph_equivalence(engine, adapter_of, label) for label, adapter_of, _ in mixes]
    print(*result["graph_checks"], sep="\n", flush=True)
    result["decode_steps"] = decode_steps(engine)
    runs = []

    def measure(mode: str) -> None:  # the workload, base and 8 mixed adapters
        for label, adapter_of, warm in mixes:
            row = _run_workload(engine, f"{label}, {mode}", adapter_of, warm)
            row["decode_weight_roofline_ms"] = 1e3 * weight_bytes / copy_rate()
            runs.append(row)
            print(row, flush=True)

    engine.scheduler.config.max_num_batched_tokens = step_tokens[0]
    modes = ["triton kernels + CUDA graphs"] + ([] if args.skip_eager else ["triton kernels", "references"])
    for mode in modes:
        model.use_kernels(no_fast if mode == "references" else fast)
        engine.runner.decode = graphs if mode.endswith("graphs") else None
        measure(mode)
    model.use_kernels(fast)
    engine.runner.decode = graphs
    for tokens in step_tokens[1:]:  # other prefill step sizes (vLLM's serving default is 8192)
        engine.scheduler.config.max_num_batched_tokens = tokens
        measure(f"triton kernels + CUDA graphs, {tokens} tokens per step")
    engine.config.async_scheduling = False  # the same, each step read before the next is queued
    for tokens in step_tokens:
        engine.scheduler.config.max_num_batched_tokens = tokens
        measure(f"triton kernels + CUDA graphs, {tokens} tokens per step, no decode ahead")
    engine.config.async_scheduling = True
    engine.scheduler.config.max_num_batched_tokens = step_tokens[0]
    runs.append(fault_check(engine, 8) | {"run": "fault isolation (CUDA graphs)"})
    print(runs[-1], flush=True)
    result["workload"] = runs
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()

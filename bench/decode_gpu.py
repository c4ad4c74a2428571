"""GPU check and timing of hylora's Triton decode kernels (issue 10, part 1) on the 27B shape.

1. Start-up checks (`select_kernels`) on a 27B-shape model cut to `--layers` layers (bf16).
2. Kernel timings at the 27B shape, one layer, batch 32 and 64: the GDN decode step in place by slot
   (Triton) vs fla's fused recurrent kernel with the slot gather/scatter around it (today's path) vs
   the torch reference; paged decode attention (Triton vs the torch gather path); LoRA on the MLP's
   gate/up linear with 8 rank-16 adapters mixed (Triton vs masked vs grouped), decode (32 tokens)
   and prefill (2048 tokens). Each beside its bytes roofline at 4.3 TB/s.
3. DESIGN.md's workload (32 x 512-token prompts + 64 greedy tokens) through the engine, base and 8
   mixed adapters, with the Triton kernels installed vs the references; fault isolation with them on.

    python bench/decode_gpu.py [--layers 16] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_gpu import QWEN36_27B, _run_workload, fault_check, random_model, write_random_adapter  # noqa: E402
from hylora.config import ModelConfig  # noqa: E402
from hylora.demo import write_tokenizer  # noqa: E402
from hylora.engine import EngineConfig, LLMEngine  # noqa: E402
from hylora.lora.apply import LoRABatch, LoRAStack, lora_apply_grouped, lora_apply_masked  # noqa: E402
from hylora.ops.gdn_decode.reference import gdn_decode as gdn_reference  # noqa: E402
from hylora.ops.kernel_check import install_triton_kernels  # noqa: E402
from hylora.ops.paged_decode_attention.reference import paged_decode_attention as attention_reference  # noqa: E402

BW = 4.3e12  # bytes/s, measured copy rate on this card (KINDS.md)


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
        "roofline_ms": 1e3 * (2 * N * hv * dk * dv * 4 + 2 * N * C * 3 * 2) / BW,
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
        "roofline_ms": 1e3 * 2 * N * ctx * Hkv * D * 2 / BW,
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
        "triton_ms": bench(lambda: lora_triton(x, y, stack, batch, meta=meta)),
        "masked_ms": bench(lambda: lora_apply_masked(x, y, stack, batch)),
        "grouped_ms": bench(lambda: lora_apply_grouped(x, y, stack, batch), reps=10),
        "base_gemm_ms": bench(lambda: torch.nn.functional.linear(x, w)),
        "adapter_bytes_roofline_ms": 1e3 * L * r * (h + 2 * inter) * 2 * 2 / BW,
    }


def uninstall(model) -> None:
    for layer in model.layers:
        if layer.is_linear:
            layer.linear_attn.decode_step = None
        else:
            layer.self_attn.decode_attention = None
    for m in model.modules():
        if hasattr(m, "lora_backend"):
            m.lora_backend = None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--out")
    args = ap.parse_args()
    shape = dict(QWEN36_27B, num_hidden_layers=args.layers)
    cfg = ModelConfig.from_hf(shape)
    work = Path(tempfile.mkdtemp())
    demo = work / "tokenizer"  # the engine needs a tokenizer; the model is built in memory
    demo.mkdir()
    write_tokenizer(demo, 1024)
    result: dict = {"card": torch.cuda.get_device_name(), "layers": args.layers, "date": time.strftime("%Y-%m-%d")}
    result["kernel_timings"] = kernel_timings(cfg)
    model = random_model(cfg, "cuda", torch.bfloat16)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    adapters = {}
    for i in range(8):
        write_random_adapter(work / f"a{i}", cfg, rank=16, seed=i)
        adapters[f"a{i}"] = work / f"a{i}"
    engine = LLMEngine(
        demo,
        EngineConfig(max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=2048, max_loras=8, max_lora_rank=16),
        adapters,
        progress=False,
        model=model,
    )
    print(f"kernels: {engine.kernels}", flush=True)
    result["kernels"] = engine.kernels
    installed = [k for k, v in engine.kernels.items() if v.startswith("triton")]
    runs = []
    for fast in (True, False):
        uninstall(model)
        if fast:
            install_triton_kernels(model, installed)
        for label, adapter_of, warm in [("base", lambda i: None, 1), ("8 adapters mixed", lambda i: f"a{i % 8}", 8)]:
            row = _run_workload(engine, f"{label}, {'triton kernels' if fast else 'references'}", adapter_of, warm)
            row["decode_weight_roofline_ms"] = 1e3 * weight_bytes / BW
            runs.append(row)
            print(row, flush=True)
    uninstall(model)
    install_triton_kernels(model, installed)
    runs.append(fault_check(engine, 8))
    print(runs[-1], flush=True)
    result["workload"] = runs
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()

"""FP8 weights on the GPU: fidelity on the demo, speed on the Qwen3.6-27B shape, bf16 beside it.

`fidelity`: the demo checkpoint written as FP8 (`hylora quantize`) and served on CUDA in bf16 with
FP8 GEMMs and each task adapter dynamically, against the fp32 reference of the dequantised base with
the adapter merged (CPU, the exact path tests/test_fp8.py proves), with activations quantised (the
checkpoint's scheme), unquantised (`--fp8-activations none`) and split into two e4m3 terms
(`--fp8-activations split`, the prompt in 64-token chunks so that every GEMM splits); beside it the bf16 dynamic path of
the unquantised model against its own fp32 merged reference (the precision yardstick), and the
merged-then-requantised FP8 checkpoint (what `merge` into FP8 would give). Mean and max |Δ logprob|
over the prompt, every adapter. Also a 32k-token prompt through the FP8 engine with an adapter (27B
shape, `--layers`): finite.

`speed --weights bf16|fp8`: random weights of the 27B text shape cut to `--layers` layers (fp8:
quantised in memory exactly as an FP8 checkpoint loads), 8 random rank-16 adapters; the decode step
(CUDA graph) at batch 1/8/32 beside its weight-read floor and its whole floor (+ the fp32 GDN state read
and written, the KV, the logits), both at the card's measured copy rate; one 8k-token prefill, DESIGN.md's workload
(32 x 512 + 64 greedy) base and 8 mixed adapters at 2048 and 8192 batched tokens (`--step-tokens`). Run both and
`compare` in one device call; each writes JSON.

    python bench/fp8_gpu.py fidelity --out fid.json
    python bench/fp8_gpu.py speed --weights bf16 --out bf16.json
    python bench/fp8_gpu.py speed --weights fp8 --out fp8.json
    python bench/fp8_gpu.py speed --weights fp8 --fp8-activations none --out w8.json   # weight-only
    python bench/fp8_gpu.py speed --weights fp8 --fp8-activations split --out split.json
    python bench/fp8_gpu.py speed --weights fp8 --fold off --out nofold.json   # split-K sums in a launch of their own
    python bench/fp8_gpu.py speed --weights fp8 --fused-quant off ...   # the GEMMs quantise (split) their own inputs
    python bench/fp8_gpu.py compare bf16.json fp8.json [w8.json]
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

from bench.decode_gpu import step_bytes, wall_ms  # noqa: E402
from bench.engine_gpu import QWEN36_27B, _run_workload, random_adapters, random_model, write_random_adapter  # noqa: E402
from bench.shapes import copy_rate  # noqa: E402
from hylora.adapters.merge import merge_adapter  # noqa: E402
from hylora.config import ModelConfig  # noqa: E402
from hylora.demo import DEMO_ADAPTERS, write_demo, write_tokenizer  # noqa: E402
from hylora.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from hylora.engine.decode_batch import DecodeRow  # noqa: E402
from hylora.kernels import KernelsConfig, as_text  # noqa: E402
from hylora.kernels.config import FP8_ACTIVATIONS, parse_kernel_overrides  # noqa: E402
from hylora.model.fp8 import quantize_checkpoint, quantize_linears  # noqa: E402
from hylora.ops.fp8_linear import triton as fp8_triton  # noqa: E402

FIDELITY_PROMPT = 1500
SPLIT_CHUNK = 64  # tokens per prefill step of the split engine in the fidelity run


def prompt_logprobs(engine: LLMEngine, ids: list[int], adapter: str | None) -> torch.Tensor:
    rid = f"p{time.monotonic_ns()}"
    engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), adapter)
    while True:
        out = next((o for o in engine.step() if o.request_id == rid and o.finished), None)
        if out is not None:
            break
    if out.error:
        raise RuntimeError(out.error)
    return torch.tensor([p.logprob if p is not None else float("nan") for p in out.prompt_logprobs[1:]])


def gap(served: torch.Tensor, reference: torch.Tensor) -> dict:
    d = (served - reference).abs()
    return {"mean_abs": float(d.mean()), "max_abs": float(d.max()), "finite": bool(torch.isfinite(served).all())}


def fidelity(args) -> dict:
    work = Path(tempfile.mkdtemp())
    demo = write_demo(work / "demo", media=False)  # text only (the device image has no PyAV)
    fp8 = quantize_checkpoint(demo, work / "demo-fp8", progress=False)
    lora = {name: demo / "adapters" / name for name in DEMO_ADAPTERS}
    vocab = ModelConfig.from_dir(demo).vocab_size
    ids = torch.randint(0, vocab, (FIDELITY_PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    ref_config = EngineConfig(device="cpu", dtype="float32", max_num_seqs=1, max_model_len=FIDELITY_PROMPT + 8)
    gpu = dict(dtype="bfloat16", max_num_seqs=2, max_model_len=FIDELITY_PROMPT + 8, num_pages=256)
    served_fp8 = LLMEngine(fp8, EngineConfig(**gpu), lora_modules=lora, progress=False)
    weight_only = KernelsConfig(fp8_activations="none")
    served_w8 = LLMEngine(fp8, EngineConfig(**gpu, kernels=weight_only), lora_modules=lora, progress=False)
    # split activations in 64-token chunks: every GEMM of the prompt takes the split path (below SPLIT_BELOW)
    split = EngineConfig(**gpu, kernels=KernelsConfig(fp8_activations="split"), max_num_batched_tokens=SPLIT_CHUNK)
    served_split = LLMEngine(fp8, split, lora_modules=lora, progress=False)
    served_bf16 = LLMEngine(demo, EngineConfig(**gpu), lora_modules=lora, progress=False)
    print(f"fp8 engine: {served_fp8.quantization}, kernels {as_text(served_fp8.kernels)}", flush=True)
    rows = []
    for name in [None, *DEMO_ADAPTERS]:
        refs = {}
        for label, model_dir in (("fp8", fp8), ("bf16", demo)):
            merged = model_dir
            if name is not None:
                merged = merge_adapter(model_dir, lora[name], work / f"m-{label}-{name}", progress=False)
            refs[label] = prompt_logprobs(
                LLMEngine(merged, replace_quant(ref_config, "dequantized"), progress=False), ids, None
            )
        row = {
            "target": name or "base",
            "fp8 dynamic vs dequantised+merged fp32": gap(prompt_logprobs(served_fp8, ids, name), refs["fp8"]),
            "fp8 weight-only dynamic vs dequantised+merged fp32": gap(
                prompt_logprobs(served_w8, ids, name), refs["fp8"]
            ),
            f"fp8 split ({SPLIT_CHUNK}-token chunks) dynamic vs dequantised+merged fp32": gap(
                prompt_logprobs(served_split, ids, name), refs["fp8"]
            ),
            "bf16 dynamic vs merged fp32": gap(prompt_logprobs(served_bf16, ids, name), refs["bf16"]),
        }
        if name is not None:  # merged into the FP8 base and requantised: the delta rounded block by block
            requant = quantize_checkpoint(work / f"m-fp8-{name}", work / f"rq-{name}", progress=False)
            requant_engine = LLMEngine(requant, EngineConfig(**gpu), progress=False)
            row["merged+requantised fp8 vs dequantised+merged fp32"] = gap(
                prompt_logprobs(requant_engine, ids, None), refs["fp8"]
            )
            del requant_engine
        rows.append(row)
        print(json.dumps(row), flush=True)
    del served_fp8, served_w8, served_split, served_bf16
    torch.cuda.empty_cache()
    return {"fidelity": rows, "long_prompt": long_prompt_finite(args.layers, work)}


def replace_quant(config: EngineConfig, quantization: str) -> EngineConfig:
    from dataclasses import replace

    return replace(config, quantization=quantization)


def long_prompt_finite(layers: int, work: Path, n: int = 32768) -> dict:
    cfg = ModelConfig.from_hf(dict(QWEN36_27B, num_hidden_layers=layers))
    model = random_model(cfg, "cuda", torch.bfloat16)
    quantize_linears(model)
    tok = work / "tok"
    tok.mkdir(exist_ok=True)
    write_tokenizer(tok, 1024)
    write_random_adapter(work / "task", cfg, rank=16, seed=0)
    config = EngineConfig(max_model_len=n + 8, max_num_seqs=1, max_num_batched_tokens=8192, max_lora_rank=16,
                          num_pages=-(-(n + 8) // 16) + 8)  # fmt: skip
    engine = LLMEngine(tok, config, {"task": work / "task"}, progress=False, model=model)
    ids = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(2)).tolist()
    t0 = time.perf_counter()
    lp = prompt_logprobs(engine, ids, "task")
    row = {"prompt_tokens": n, "layers": layers, "adapter": "rank-16", "finite": bool(torch.isfinite(lp).all()),
           "seconds": time.perf_counter() - t0}  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads for weights: parameters and buffers (FP8 scales, unquantised tails),
    not the embedding table (a step reads a row of it per token)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return sum(t.numel() * t.element_size() for n, t in tensors if not n.startswith("embed") and t is not None)


@torch.inference_mode()
def decode_steps(engine: LLMEngine, floor_bytes: int, batches=(1, 8, 32), context: int = 576) -> list[dict]:
    graphs, kv, states = engine.runner.decode, engine.kv, engine.states
    rows = []
    for n in batches:
        slots = [states.allocate() for _ in range(n)]
        pages = [kv.allocate(kv.pages_needed(context + 1)) for _ in range(n)]
        decode_rows = [DecodeRow(100 + i, context, slots[i], pages[i], -1) for i in range(n)]
        ms = wall_ms(lambda r=decode_rows: graphs.run(r))
        floor = 1e3 * floor_bytes / copy_rate()
        # the step's own floor: the weights, the fp32 GDN state read and written, the KV, the logits
        moved = step_bytes(engine, n, context, adapters=0)
        step_floor = floor + 1e3 * (moved["state"] + moved["kv"] + moved["logits"]) / copy_rate()
        rows.append({
            "batch": n, "graph_ms": ms, "weight_floor_ms": floor, "over_floor": ms / floor,
            "step_floor_ms": step_floor, "over_step_floor": ms / step_floor,
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        for p in pages:
            kv.free(p)
        for s in slots:
            states.free(s)
    return rows


def prefill_8k(engine: LLMEngine) -> dict:
    """One 8192-token prompt (one step at 8192 batched tokens), timed the second time (the first
    compiles what this step size needs; another prompt, so the prefix cache has none of it)."""
    for attempt in range(2):
        ids = torch.randint(0, 1000, (8192,), generator=torch.Generator().manual_seed(3 + attempt)).tolist()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rid = f"prefill8k-{attempt}"
        engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0), None)
        while not any(o.request_id == rid and o.finished for o in engine.step()):
            pass
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    return {"prompt_tokens": 8192, "seconds": seconds, "tok_s": 8192 / seconds}


def speed(args) -> dict:
    fp8_triton.FOLD_SPLITS = args.fold == "on"  # the A/B of the split-K partials' sum (folded, or a launch)
    cfg = ModelConfig.from_hf(dict(QWEN36_27B, num_hidden_layers=args.layers))
    work = Path(tempfile.mkdtemp())
    tok = work / "tok"
    tok.mkdir()
    write_tokenizer(tok, 1024)
    model = random_model(cfg, "cuda", torch.bfloat16)
    if args.weights == "fp8":
        quantize_linears(model)
        torch.cuda.empty_cache()
    floor_bytes = weight_bytes(model)
    adapters = random_adapters(work, cfg)
    t0 = time.perf_counter()
    engine = LLMEngine(
        tok,
        EngineConfig(
            max_model_len=9000,
            max_num_seqs=32,
            max_num_batched_tokens=8192,
            max_loras=8,
            max_lora_rank=16,
            enable_prefix_caching=False,  # the workload runs the same prompts at each step size
            kernels=KernelsConfig(
                fp8_activations=args.fp8_activations, fp8_fused_quant=args.fused_quant == "on", **args.kernels
            ),
        ),  # fmt: skip
        adapters,
        progress=False,
        model=model,
    )
    result = {
        "card": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "layers": args.layers,
        "weights": args.weights, "served_as": engine.quantization or "bf16", "weight_gb": floor_bytes / 1e9,
        "fp8_activations": args.fp8_activations, "fold": args.fold, "fused_quant": args.fused_quant,
        "kernels_config": args.kernels, "engine_setup_s": time.perf_counter() - t0, "kernels": as_text(engine.kernels),
        "copy_rate_tb_s": copy_rate() / 1e12,
    }  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "kernels"}), flush=True)
    print("fp8_linear:", result["kernels"].get("fp8_linear"), flush=True)
    result["decode_steps"] = decode_steps(engine, floor_bytes)
    result["prefill_8k"] = prefill_8k(engine)
    print(json.dumps(result["prefill_8k"]), flush=True)
    runs = []
    for tokens in args.step_tokens:
        engine.scheduler.config.max_num_batched_tokens = tokens
        for label, adapter_of, warm in (("base", lambda i: None, 1), ("8 adapters mixed", lambda i: f"a{i % 8}", 8)):
            row = _run_workload(engine, f"{label}, {tokens} tokens per step", adapter_of, warm)
            row.pop("prefill_steps")
            runs.append(row)
            print(json.dumps(row), flush=True)
    result["workload"] = runs
    return result


def compare(bf16_path: str, *fp8_paths: str) -> None:
    """One table: bf16, then each FP8 run (dynamic, weight-only, ...) with its ratio to bf16."""
    bf16, *fp8s = (json.loads(Path(p).read_text()) for p in (bf16_path, *fp8_paths))
    names = [f"fp8 ({r.get('fp8_activations', 'dynamic')} activations) | / bf16" for r in fp8s]
    rate = f", copy rate {bf16['copy_rate_tb_s']:.2f} TB/s" if "copy_rate_tb_s" in bf16 else ""
    print(f"| {bf16['card']}{rate}, {bf16['layers']} layers, {bf16['date']} | bf16 | {' | '.join(names)} |")
    print("| --- | --- |" + " --- | --- |" * len(fp8s))

    def row(label: str, value) -> None:  # value(run) -> (number, its text)
        a = value(bf16)
        cells = [f"{value(r)[1]} | {value(r)[0] / a[0]:.2f}" for r in fp8s]
        print(f"| {label} | {a[1]} | {' | '.join(cells)} |")

    row("weights read per decode step (GB)", lambda r: (r["weight_gb"], f"{r['weight_gb']:.1f}"))

    def decode(r: dict, i: int) -> tuple[float, str]:
        step = r["decode_steps"][i]
        whole = f", {step['over_step_floor']:.2f}x" if "over_step_floor" in step else ""
        return step["graph_ms"], f"{step['graph_ms']:.2f} ({step['over_floor']:.2f}x{whole})"

    for i, step in enumerate(bf16["decode_steps"]):
        label = f"decode step, batch {step['batch']} (ms; x its weight floor, x weights + state + KV)"
        row(label, lambda r, i=i: decode(r, i))
    row("prefill 8k tokens (tok/s)", lambda r: (r["prefill_8k"]["tok_s"], f"{r['prefill_8k']['tok_s']:.0f}"))
    for i, run in enumerate(bf16["workload"]):
        row(f"workload {run['run']} (out tok/s)",
            lambda r, i=i: (r["workload"][i]["out_tok_s"], f"{r['workload'][i]['out_tok_s']:.0f}"))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["fidelity", "speed", "compare"])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--weights", choices=["bf16", "fp8"], default="fp8")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--fp8-activations", choices=FP8_ACTIVATIONS, default="dynamic", help="speed: FP8 GEMM inputs")
    ap.add_argument("--step-tokens", type=lambda s: [int(t) for t in s.split(",")], default=[2048, 8192],
                    help="speed: the workload's batched-token settings")  # fmt: skip
    ap.add_argument("--fold", choices=["on", "off"], default="on", help="speed: split-K sums in the FP8 GEMM's launch")
    ap.add_argument(
        "--fused-quant", choices=["on", "off"], default="on",
        help="speed: the norms and the activation quantise (split) the FP8 GEMMs' inputs in their launch",
    )  # fmt: skip
    ap.add_argument(
        "--kernels", type=parse_kernel_overrides, default={},
        help="speed: more KernelsConfig switches, e.g. fp8_deepgemm=1 (DeepGEMM where importable)",
    )  # fmt: skip
    ap.add_argument("--out")
    args = ap.parse_args()
    copy_rate()  # measured before anything takes the GPU's memory (cached for the rooflines)
    if args.part == "compare":
        compare(*args.files)
        return
    result = fidelity(args) if args.part == "fidelity" else speed(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""Prefill speed beside its FLOP floor, and a long prompt with an adapter (issue 10), on the 27B shape.

1. One prompt of 2k and of 16k tokens through the engine (base and a rank-16 adapter on every
   linear), timed until its first token: tok/s beside the FLOP floor (2 x linear weights per
   token, plus causal attention's QK and PV, at the card's dense bf16 peak).
2. A `--long`-token prompt (default 32k) with prompt logprobs: the merged-weights model in fp32 (the
   reference), the merged model in bf16 (the bf16 yardstick) and dynamic LoRA in bf16. Served right
   when every logprob is finite and dynamic LoRA's mean error is no larger than the bf16 merged
   model's own (10% slack, as bench/vision_gpu.py).

    python bench/prefill_gpu.py [--layers 16] [--long-layers 4] [--long 32768] [--out prefill.json]
    python bench/prefill_gpu.py --smoke --device cpu     # the script's logic on tiny shapes
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_gpu import QWEN36_27B, SMALL, random_model, write_random_adapter  # noqa: E402
from bench.vision_gpu import fold  # noqa: E402
from hylora.config import ModelConfig  # noqa: E402
from hylora.demo import write_tokenizer  # noqa: E402
from hylora.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from hylora.kernels import as_text  # noqa: E402
from hylora.model.decoder import HybridDecoder  # noqa: E402
from hylora.model.layers import Linear  # noqa: E402

PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()  # the engine holds reference cycles: free its KV cache and model now
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def flop_floor_s(model: HybridDecoder, tokens: int) -> float:
    """Seconds at the dense bf16 peak for the prefill's GEMMs and causal attention (GDN's chunked
    recurrence and the elementwise work are left out: the floor is a lower bound)."""
    c = model.config
    linear = sum(m.weight.numel() for m in model.layers.modules() if isinstance(m, Linear))
    attention = len(c.attention_layers) * 2 * c.num_attention_heads * c.head_dim * tokens * tokens  # QK + PV, causal
    return (2 * linear * tokens + attention + 2 * c.hidden_size * c.vocab_size) / PEAK_BF16_FLOPS


def engine_for(model, tokdir: Path, adapter_dir: Path, max_len: int, chunk: int) -> LLMEngine:
    pages = 2 * -(-(max_len + 8) // 16) + 8  # two sequences: not 90% of the card, other models follow
    config = EngineConfig(
        max_model_len=max_len + 8, max_num_seqs=2, max_num_batched_tokens=chunk, max_lora_rank=16, num_pages=pages
    )
    return LLMEngine(tokdir, config, {"task": adapter_dir}, progress=False, model=model)


def one_prompt(engine: LLMEngine, ids: list[int], adapter: str | None, prompt_logprobs: bool = False):
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0 if prompt_logprobs else None)
    rid = f"p{time.monotonic_ns()}"
    engine.add_request(rid, ids, params, adapter)
    sync()
    t0 = time.perf_counter()
    out = None
    while out is None:
        out = next((o for o in engine.step() if o.request_id == rid and o.finished), None)
    sync()
    if out.error:
        raise RuntimeError(out.error)
    return out, time.perf_counter() - t0


def prefill_speed(cfg: ModelConfig, work: Path, device: str, lengths: list[int], chunk: int) -> list[dict]:
    model = random_model(cfg, device, torch.bfloat16)
    engine = engine_for(model, work, work / "task", max(lengths), chunk)
    print(f"kernels: {as_text(engine.kernels)}", flush=True)
    rows = []
    g = torch.Generator().manual_seed(0)
    for n in lengths:
        ids = torch.randint(0, 1000, (n,), generator=g).tolist()
        for adapter in (None, "task"):
            one_prompt(engine, ids[:64], adapter)  # warm-up (kernels compiled, adapter placed)
            _, seconds = one_prompt(engine, ids, adapter)
            floor = flop_floor_s(model, n)
            rows.append(
                {
                    "prefill": f"{n} tokens, {'rank-16 adapter' if adapter else 'base'}",
                    "seconds": seconds,
                    "tok_s": n / seconds,
                    "flop_floor_s": floor,
                    "over_floor": seconds / floor,
                }
            )
            print(rows[-1], flush=True)
    del engine, model
    free_memory()
    return rows


def long_prompt(cfg: ModelConfig, work: Path, device: str, n: int, chunk: int) -> dict:
    ids = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    runs = {}
    for label, dtype, merged in [
        ("merged fp32 (reference)", torch.float32, True),
        ("merged bf16", torch.bfloat16, True),
        ("dynamic LoRA bf16", torch.bfloat16, False),
    ]:
        model = random_model(cfg, device, dtype)
        if merged:
            fold(model, work / "task")
        engine = engine_for(model, work, work / "task", n, chunk)
        out, seconds = one_prompt(engine, ids, None if merged else "task", prompt_logprobs=True)
        runs[label] = (torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]], dtype=torch.float64), seconds)
        print(f"{label}: {seconds:.2f} s", flush=True)
        del engine, model
        free_memory()
    ref = runs["merged fp32 (reference)"][0]
    table = {
        label: {
            "finite": bool(torch.isfinite(lp).all()),
            "mean_abs_dlogprob": float((lp - ref).abs().mean()),
            "max_abs_dlogprob": float((lp - ref).abs().max()),
            "prefill_s": s,
        }
        for label, (lp, s) in runs.items()
    }
    dyn, yardstick = table["dynamic LoRA bf16"], table["merged bf16"]
    verdict = dyn["finite"] and dyn["mean_abs_dlogprob"] <= 1.1 * yardstick["mean_abs_dlogprob"]
    print(json.dumps(table, indent=1), f"\ndynamic LoRA within the bf16 yardstick at {n} tokens: {verdict}", flush=True)
    return {"tokens": n, "layers": cfg.num_layers, "runs": table, "dynamic_within_yardstick": verdict}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--long-layers", type=int, default=4, help="layers of the model for the long-prompt check")
    ap.add_argument("--long", type=int, default=32768)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and lengths (a CPU run of the logic)")
    ap.add_argument("--out")
    args = ap.parse_args()
    shape, lengths, long_n = QWEN36_27B, [2048, 16384], args.long
    if args.smoke:
        shape, lengths, long_n = SMALL, [200, 700], 600
    work = Path(tempfile.mkdtemp())
    write_tokenizer(work, 1024)
    cfg = ModelConfig.from_hf(dict(shape, num_hidden_layers=args.layers if not args.smoke else 4))
    write_random_adapter(work / "task", cfg, rank=16, seed=3)
    result = {
        "card": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "layers": cfg.num_layers,
        "prefill": prefill_speed(cfg, work, args.device, lengths, args.max_num_batched_tokens),
    }
    long_cfg = ModelConfig.from_hf(dict(shape, num_hidden_layers=args.long_layers))
    write_random_adapter(work / "task", long_cfg, rank=16, seed=3)
    result["long_prompt"] = long_prompt(long_cfg, work, args.device, long_n, args.max_num_batched_tokens)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

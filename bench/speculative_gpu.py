"""MTP speculative decoding on the 27B shape (issue 26): decode throughput with and without it.

    python3 bench/speculative_gpu.py --layers 16 --out spec.json     # H200, bf16, random weights
    python3 bench/speculative_gpu.py --tiny                          # CPU smoke run of the same code
    python3 bench/speculative_gpu.py --layers 16 --short-step-tokens 0   # verify and drafting eager (run 18)
    python3 bench/speculative_gpu.py --layers 64 --batches 1,8 --profile  # where a speculative step's time goes

The weights are arranged (tests/spec_helpers.py's "arranged" checkpoint, with a large margin): the
residual stream carries the token's embedding (scaled up; the layers' output projections scaled
down, so every layer still computes at full size), the lm_head maps a token's embedding to the next
token of a fixed permutation, and the MTP layer passes the next token's embedding through (fc =
[I | 0], zero o_proj and down_proj): its drafts are the model's own next tokens, and bf16 rounding
turns no greedy choice. (Plain random bf16 weights, `--no-arranged`, are full of near-ties: the
verify step's rounding turns the output aside within a few tokens, and no draft is accepted.) The
drafts' *acceptance* is then set by an oracle: the MTP layer drafts as in serving (its cost is paid),
and each draft is made wrong with probability 1 - p (acceptance stops at the first wrong one), on
the device where the drafts are made, so the drafts of a verify step planned ahead, which the host
never reads, follow it too (drafting eagerly, `--short-step-tokens 0`: on the host, from the plain
run's continuation).
The output must equal the plain run's (checked). Per batch size: the plain decode's output tokens/s
(CUDA graphs and decode ahead, as served), and with speculation (k drafts) at per-draft acceptance
p = 0.6 / 0.8 / 0.9 / 1.0: tokens/s, tokens per step, and the mean step time against the plain
decode step's: the cost of a verify step of k + 1 tokens per sequence. The row "head" uses the MTP
layer's own drafts (no oracle).
`--adapters N`: request i runs on random rank-16 adapter i mod N (the verify and
drafting steps with LoRA; the MTP layer runs on the base weights).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_gpu import QWEN36_27B, SMALL, random_adapters, random_model  # noqa: E402
from bench.prefix_cache_gpu import TINY, random_ids  # noqa: E402
from hylora.config import ModelConfig  # noqa: E402
from hylora.demo import write_tokenizer  # noqa: E402
from hylora.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from hylora.engine.speculative import Drafter  # noqa: E402


def arrange(model: torch.nn.Module, layer_scale: float = 0.01, embed_rms: float = 1.0, top_logit: float = 30.0) -> None:
    """Arrange random weights in place so that greedy decoding follows a fixed permutation of the
    vocabulary with a large margin and the MTP layer drafts it exactly (the module docstring)."""
    embed = model.embed_tokens.weight
    embed.mul_(embed_rms / embed.float().pow(2).mean().sqrt())
    for name, p in model.named_parameters():
        if not name.startswith("mtp.") and name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            p.mul_(layer_scale)
    vocab, hidden = embed.shape
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(0)).to(embed.device)
    # logit of token j for hidden h: lm_head[j] . norm(h); with lm_head[j] = c * embed[perm[j]] the
    # largest is the j with perm[j] = the current token, about c * embed_rms * hidden
    model.lm_head.weight.copy_(embed[perm] * (top_logit / (embed_rms * hidden)))
    mtp = model.mtp
    with torch.no_grad():
        mtp.fc.weight.zero_()
        mtp.fc.weight[:, :hidden].copy_(torch.eye(hidden, dtype=mtp.fc.weight.dtype))
        for name, p in mtp.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")) or name.endswith("norm.weight"):
                p.zero_()


def generate(
    engine: LLMEngine,
    prompts: list[list[int]],
    max_tokens: int,
    adapters: list[str],
    on_started: Callable[[], None] = lambda: None,
) -> tuple[dict, float, int]:
    """All prompts at once; (outputs, seconds from the last first token to the end, decode steps).
    `on_started` is called when the timing starts (every prompt prefilled)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params, adapter=adapters[i % len(adapters)] if adapters else None)
    done, started, t0, steps0 = {}, set(), None, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                started.add(out.request_id)
            if out.finished:
                done[out.request_id] = out
        if t0 is None and len(started) == len(prompts):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            on_started()
            t0, steps0 = time.perf_counter(), engine.step_count
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return done, time.perf_counter() - t0, engine.step_count - steps0


def oracle(engine: LLMEngine, reference: dict, accept: float, seed: int) -> None:
    """Drafts: the MTP layer's own (on arranged weights, the model's next tokens), each made wrong
    (the next token id) with probability 1 - accept. With padded drafting (the GPU's graphs) on the
    device where they are made, so the drafts of a verify step planned ahead, which the host never
    reads, follow the oracle too; drafting eagerly, on the host: the reference continuation, each
    draft wrong with that probability (`restore` undoes either)."""
    drafter = engine.drafter
    assert drafter is not None
    if drafter.padded is None:
        rng = random.Random(seed)

        def assign(req, drafts):
            truth = reference[req.request_id].token_ids[len(req.output_ids) :]
            wrong = [t if rng.random() < accept else (t + 1) % 1000 for t in truth[: len(drafts)]]
            Drafter.assign(drafter, req, wrong)

        drafter.assign = assign  # type: ignore[method-assign]
        return
    vocab = engine.model.config.vocab_size
    generator = torch.Generator(device=engine.model.device).manual_seed(seed)
    real_run = drafter.padded.run

    def run(*args):
        tokens, finite = real_run(*args)
        keep = torch.rand(tokens.shape, generator=generator, device=tokens.device) < accept
        return torch.where(keep, tokens, (tokens + 1) % vocab), finite

    drafter.padded.run = run  # type: ignore[method-assign]


def restore(drafter: Drafter) -> None:
    drafter.__dict__.pop("assign", None)
    if drafter.padded is not None:
        drafter.padded.__dict__.pop("run", None)


def profile_steps(engine: LLMEngine, prompts: list[list[int]], names: list[str], steps: int = 12) -> dict:
    """Where a speculative step's time goes: `steps` engine steps of the batch (the MTP layer's own
    drafts, after every prompt is prefilled) under torch.profiler. Prints the wall time per step, the
    GPU's busy time per step (kernels summed: wall - busy is the device idle while the host works),
    the kernels and the host-side ops that take the most."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    params = SamplingParams(max_tokens=steps * 4 + 16, temperature=0, ignore_eos=True)
    ids = [f"profile{i}" for i in range(len(prompts))]
    for rid, p, i in zip(ids, prompts, range(len(prompts)), strict=True):
        engine.add_request(rid, p, params, adapter=names[i % len(names)] if names else None)
    started: set[str] = set()
    while len(started) < len(ids):  # prefill, and one speculative step to warm
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    engine.step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    wall_ms = 1e3 * (time.perf_counter() - t0) / steps
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    events = prof.key_averages()
    device = sorted(((getattr(e, "self_device_time_total", 0.0), e.key) for e in events), reverse=True)
    host = sorted(((e.self_cpu_time_total, e.key) for e in events), reverse=True)
    busy_ms = sum(t for t, _ in device) / 1e3 / steps
    print(f"\n{len(prompts)} requests, {steps} speculative steps: {wall_ms:.2f} ms wall per step, "
          f"GPU busy {busy_ms:.2f} ms per step (idle {wall_ms - busy_ms:.2f})", flush=True)  # fmt: skip
    if cuda:
        print("| kernel | ms per step |\n| --- | --- |")
        for t, name in device[:12]:
            print(f"| {name[:90]} | {t / 1e3 / steps:.3f} |")
    print("| host op (self CPU time) | ms per step |\n| --- | --- |")
    for t, name in host[:12]:
        print(f"| {name[:90]} | {t / 1e3 / steps:.3f} |")
    return {"requests": len(prompts), "steps": steps, "wall_ms": wall_ms, "gpu_busy_ms": busy_ms,
            "kernels": [(n, t / 1e3 / steps) for t, n in device[:30]],
            "host_ops": [(n, t / 1e3 / steps) for t, n in host[:30]]}  # fmt: skip


def phase_times(engine: LLMEngine, prompts: list[list[int]], names: list[str], max_tokens: int) -> dict:
    """Host milliseconds per decode step (the prefill excluded) spent in the engine's phases (nested: `_launch` holds
    `execute` and `_queue_drafts`; `_finish_step` holds `_read_step` and the drafts; `wait` is every
    wait for the device, wherever it happens), for one speculating run of `prompts`."""
    table: dict[str, float] = {}

    def timed(owner, name, key=None, cls=False):
        real = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                table[key or name] = table.get(key or name, 0.0) + time.perf_counter() - t

        setattr(owner, name, wrapper)
        return real

    patched = [
        (engine, n)
        for n in (
            "_launch",
            "_queue_drafts",
            "_verify_ahead",
            "_finish_step",
            "_read_step",
            "_collect_drafts",
            "_draft",
        )
    ]
    patched += [(engine.scheduler, "schedule"), (engine.runner, "execute")]
    reals = [(o, n, timed(o, n)) for o, n in patched]
    real_sync = torch.cuda.Event.synchronize if torch.cuda.is_available() else None
    if real_sync is not None:
        timed(torch.cuda.Event, "synchronize", "wait")
    try:
        _, secs, steps = generate(engine, prompts, max_tokens, names, table.clear)
    finally:
        for o, n, _ in reals:
            del o.__dict__[n]  # the class's method again
        if real_sync is not None:
            torch.cuda.Event.synchronize = real_sync
    out = {k: 1e3 * v / steps for k, v in table.items()}
    out["wall"] = 1e3 * secs / steps
    print(" | ".join(f"{k} {v:.2f}" for k, v in sorted(out.items())), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--batches", default="1,4,8,32")
    ap.add_argument("--accept", default="0.6,0.8,0.9,1.0")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks the bench runs")
    ap.add_argument("--small", action="store_true", help="bench/engine_gpu.py's SMALL shape (a quick GPU check)")
    ap.add_argument("--fp32", action="store_true", help="fp32 weights: speculation must then change no token")
    ap.add_argument(
        "--short-step-tokens",
        type=int,
        default=128,
        help="EngineConfig.max_short_step_tokens: verify and drafting steps as CUDA graphs (0: eager, as in run 18)",
    )
    ap.add_argument(
        "--arranged",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="arranged weights (default); --no-arranged: plain random weights (run 18: no draft is accepted)",
    )
    ap.add_argument(
        "--queue-drafts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="EngineConfig.queue_drafts: drafting queued behind the verify step (--no-queue-drafts: after it is read)",
    )
    ap.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="EngineConfig.async_scheduling: decode ahead, and while speculating the next verify step planned ahead",
    )
    ap.add_argument("--adapters", type=int, default=0, help="requests round-robin over N random adapters")
    ap.add_argument("--profile", action="store_true", help="profile speculative steps at each batch size instead")
    ap.add_argument("--phases", action="store_true", help="print host ms per step in each engine phase instead")
    ap.add_argument("--out")
    args = ap.parse_args()
    arranged = True if args.arranged is None else args.arranged
    device = "cpu" if args.tiny else "cuda"
    big = SMALL if args.small else dict(QWEN36_27B, num_hidden_layers=args.layers)
    shape = dict(TINY if args.tiny else big, mtp_num_hidden_layers=1)
    cfg = ModelConfig.from_hf(shape)
    work = Path(tempfile.mkdtemp())
    write_tokenizer(work, 1024)
    model = random_model(cfg, device, torch.float32 if args.tiny or args.fp32 else torch.bfloat16, mtp=True)
    if arranged:
        arrange(model)
    adapter_dirs = random_adapters(work / "adapters", cfg, n=args.adapters) if args.adapters else {}
    names = list(adapter_dirs)
    batches = [int(b) for b in args.batches.split(",")]
    config = EngineConfig(
        max_model_len=args.prompt + args.max_tokens + 16, max_num_seqs=max(batches), device=device,
        num_speculative_tokens=args.k, enable_prefix_caching=False, max_short_step_tokens=args.short_step_tokens,
        padded_decode=args.tiny, queue_drafts=args.queue_drafts, async_scheduling=args.async_scheduling,
        max_loras=max(1, args.adapters), max_lora_rank=16,
    )  # fmt: skip
    t0 = time.perf_counter()
    engine = LLMEngine(work, config, adapter_dirs, progress=False, model=model)
    drafter = engine.drafter
    result = {
        "card": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "layers": cfg.num_layers,
        "k": args.k,
        "short_step_tokens": args.short_step_tokens,
        "queue_drafts": args.queue_drafts,
        "async_scheduling": args.async_scheduling,
        "arranged": arranged,
        "adapters": args.adapters,
        "date": time.strftime("%Y-%m-%d"),
        "engine_setup_s": time.perf_counter() - t0,
        "rows": [],
    }
    print(f"engine set-up {result['engine_setup_s']:.1f} s", flush=True)
    print("| batch | mode | out tok/s | tokens/step/seq | step ms | step vs plain | tok/s vs plain |", flush=True)
    print("| --- | --- | --- | --- | --- | --- | --- |", flush=True)
    if args.profile:
        result["profiles"] = [
            profile_steps(engine, [random_ids(args.prompt, seed=100 * b + i) for i in range(b)], names) for b in batches
        ]
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
        return
    if args.phases:
        result["phases"] = []
        for b in batches:
            prompts = [random_ids(args.prompt, seed=100 * b + i) for i in range(b)]
            generate(engine, prompts[:1], 8, names)  # warm-up
            print(f"batch {b}, queue_drafts={engine.config.queue_drafts}: ", end="", flush=True)
            result["phases"].append({"batch": b, **phase_times(engine, prompts, names, args.max_tokens)})
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
        return
    for b in batches:
        prompts = [random_ids(args.prompt, seed=100 * b + i) for i in range(b)]
        engine.drafter = None  # plain decoding: CUDA graphs and decode ahead
        generate(engine, prompts[:1], 8, names)  # warm-up
        plain, secs, steps = generate(engine, prompts, args.max_tokens, names)
        tokens = b * (args.max_tokens - 1)  # (the first token of each comes from its prefill)
        plain_tok_s, plain_ms = tokens / secs, 1e3 * secs / steps
        result["rows"].append({"batch": b, "mode": "plain", "tok_s": plain_tok_s, "step_ms": plain_ms})
        print(f"| {b} | plain | {plain_tok_s:.0f} | 1.00 | {plain_ms:.2f} | 1.00 | 1.00 |", flush=True)
        engine.drafter = drafter
        for accept in [float(a) for a in args.accept.split(",")] + ["head"]:
            mode = "head" if accept == "head" else f"p={accept}"
            if accept != "head":
                oracle(engine, plain, accept, seed=b)
            done, secs, steps = generate(engine, prompts, args.max_tokens, names)
            restore(drafter)
            same = all(done[r].token_ids == plain[r].token_ids for r in plain)
            diverge = [_first_difference(done[r].token_ids, plain[r].token_ids) for r in plain]
            row = {
                "batch": b, "mode": f"k={args.k} {mode}", "tok_s": tokens / secs, "step_ms": 1e3 * secs / steps,
                "tokens_per_step": tokens / b / steps, "speedup": tokens / secs / plain_tok_s, "same_output": same,
                "first_difference": diverge,
            }  # fmt: skip
            result["rows"].append(row)
            print(
                f"| {b} | {row['mode']} | {row['tok_s']:.0f} | {row['tokens_per_step']:.2f} | {row['step_ms']:.2f} | "
                f"{row['step_ms'] / plain_ms:.2f} | {row['speedup']:.2f} |"
                + ("" if same else f" output differs from token {min(d for d in diverge if d is not None)}"),
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


if __name__ == "__main__":
    main()

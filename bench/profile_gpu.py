"""Where an engine step's time goes, on the 27B shape (GPU): prefill and decode, base and mixed adapters.

For DESIGN.md's workload (32 x 512-token prompts + 64 greedy tokens) on the 27B text shape cut to
`--layers` layers (random bf16 weights, 8 random rank-16 adapters), this prints:

1. every engine step's wall time, split into prefill and decode steps;
2. one prefill step under torch.profiler: the top kernels by GPU time, GPU busy time vs wall;
3. decode steps under cProfile: the host functions that take the time (cumulative);
4. one decode step under torch.profiler: GPU busy time vs wall.

5. with --decode-kernels, the workload once more with 20 decode steps under torch.profiler: a per-kernel
   table (µs and calls a step), as bench/peer/throughput_peer.py --profile-decode prints for both engines.

    python bench/profile_gpu.py [--layers 16] [--max-num-batched-tokens 2048] [--fp8] [--decode-kernels]
        [--out profile.json]

--fp8 quantises the random model's projections at load (128 x 128 blocks, as `--quantization fp8`).
"""

from __future__ import annotations

import argparse
import cProfile
import faulthandler
import io
import json
import logging
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_gpu import QWEN36_27B, random_adapters, random_model  # noqa: E402
from bench.peer import decode_profile  # noqa: E402
from hylora.config import ModelConfig  # noqa: E402
from hylora.demo import write_tokenizer  # noqa: E402
from hylora.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from hylora.kernels import KernelsConfig, as_text  # noqa: E402
from hylora.model.fp8 import quantize_linears  # noqa: E402


def gpu_busy_ms(prof) -> float:
    """Sum of device kernel time in a profile (CUDA graph replays included as their kernels)."""
    total = 0.0
    for e in prof.key_averages():
        total += getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))
    return total / 1e3


# glue around the GEMMs and kernels: copies, fills, small elementwise ops, indexing, host waits
WATCHED = (
    "aten::zero_", "aten::fill_", "aten::copy_", "aten::cat", "aten::index", "aten::index_put_", "aten::mul",
    "aten::add", "aten::sub", "aten::neg", "aten::exp", "aten::sigmoid", "aten::softplus", "aten::where",
    "cudaStreamSynchronize", "aten::item",
)  # fmt: skip


def call_sites(prof, frames: int = 2, rows: int = 30) -> str:
    """The watched ops of a profile by op, first input's shape and the innermost Python frames that
    called them (a watched op inside another, e.g. the copy_ of a to(), counts with the outer one),
    sorted by device time. Needs a profile taken with with_stack=True and record_shapes=True."""
    sites: dict[tuple[str, str, str], list[float]] = {}
    for e in prof.events():
        if e.name not in WATCHED:
            continue
        parent, chain, nested = e.cpu_parent, [], False
        while parent is not None:
            nested |= parent.name in WATCHED
            if ".py(" in parent.name:
                chain.append("/".join(parent.name.split("/")[-2:]))
            parent = parent.cpu_parent
        if nested:
            continue
        shape = str(e.input_shapes[0]) if e.input_shapes else ""
        entry = sites.setdefault((e.name, shape, " < ".join(chain[:frames]) or "?"), [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += e.cpu_time_total / 1e3
        entry[2] += e.device_time_total / 1e3
    top = sorted(sites.items(), key=lambda kv: (-kv[1][2], -kv[1][1]))[:rows]
    return "\n".join(
        f"{n:5d} calls {dev:7.2f} ms device {host:7.2f} ms host  {name:22s} {shape:22s} {where}"
        for (name, shape, where), (n, host, dev) in top
    )


enqueue: list[float] = []  # host ms of the last model forward (the kernels enqueued, not finished)


def time_forward(model) -> None:
    forward = model.forward

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        enqueue.append(1e3 * (time.perf_counter() - t0))
        return out

    model.forward = timed


def timed_step(engine: LLMEngine) -> tuple[float, list]:
    t0 = time.perf_counter()
    outs = engine.step()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0), outs


def profile_workload(engine: LLMEngine, label: str, adapter_of, rows: int = 25) -> dict:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1000, (512,), generator=g).tolist() for _ in range(32)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{label}{i}", p, params, adapter_of(i))
    result: dict = {"run": label}
    # 2. the first prefill step under the profiler
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True, record_shapes=True) as prof:
        wall, _ = timed_step(engine)
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70)
    print(f"\n=== {label}: one prefill step ({wall:.1f} ms wall, {gpu_busy_ms(prof):.1f} ms GPU busy)\n{table}")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70)
    print(f"\n=== {label}: the same prefill step by host time\n{table}")
    result["prefill_step_profiled"] = {"wall_ms": wall, "gpu_busy_ms": gpu_busy_ms(prof)}
    print(f"\n=== {label}: where that step's fills, copies and host waits come from\n{call_sites(prof)}")
    # the second prefill step under cProfile: which Python functions take the host's time
    profiler = cProfile.Profile()
    profiler.enable()
    wall, _ = timed_step(engine)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    print(f"\n=== {label}: the next prefill step ({wall:.1f} ms wall) under cProfile, by own time\n{text.getvalue()}")
    # 1. the remaining steps, timed; 3. decode steps under cProfile
    prefill, decode, forward_host = [], [], []
    profiler = cProfile.Profile()
    while engine.has_unfinished():
        in_decode = all(r.num_computed >= len(r.prompt_ids) for r in engine.requests.values())
        if in_decode and 10 <= len(decode) < 30:
            profiler.enable()
            wall, _ = timed_step(engine)
            profiler.disable()
            decode.append(wall)
            continue
        if in_decode and len(decode) == 30:  # 4. one decode step under torch.profiler
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                wall, _ = timed_step(engine)
            busy = gpu_busy_ms(prof)
            print(f"\n=== {label}: one decode step: {wall:.2f} ms wall, {busy:.2f} ms GPU busy")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=70))
            result["decode_step_profiled"] = {"wall_ms": wall, "gpu_busy_ms": busy}
            decode.append(wall)
            continue
        enqueue.clear()
        wall, _ = timed_step(engine)
        (decode if in_decode else prefill).append(wall)
        if not in_decode:
            forward_host.append(enqueue[0] if enqueue else float("nan"))
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(rows)
    print(f"\n=== {label}: 20 decode steps under cProfile (host time, cumulative)\n{text.getvalue()}")
    plain = decode[:10] + decode[31:]
    print(f"=== {label}: host time to enqueue each prefill forward (ms) {[round(x, 1) for x in forward_host]}")
    result |= {
        "prefill_forward_enqueue_ms": forward_host,
        "prefill_steps_ms": prefill,
        "decode_step_ms_median": sorted(plain)[len(plain) // 2],
        "decode_steps": len(decode),
    }
    print(f"=== {label}: prefill steps (ms) {[round(x, 1) for x in prefill]}; decode step median "
          f"{result['decode_step_ms_median']:.2f} ms over {len(plain)} unprofiled steps")  # fmt: skip
    return result


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--fp8", action="store_true", help="quantise the projections to FP8 at load")
    ap.add_argument(
        "--fp8-unfused", action="store_true", help="FP8: each projection quantises its own input (no fused producer)"
    )
    ap.add_argument("--fp8-fused-norms", action="store_true", help="FP8: the norms quantise the projections' inputs")
    ap.add_argument(
        "--no-fused-lora-expand", action="store_true", help="gate_up's LoRA expand in its own kernel (not the act.)"
    )
    ap.add_argument(
        "--fused-lora-expand-quantized", action="store_true", help="FP8: the fused expand also where the act. quantises"
    )
    ap.add_argument("--decode-kernels", action="store_true", help="also a per-kernel table of 20 decode steps")
    ap.add_argument("--out")
    ap.add_argument("--watchdog", type=float, default=0, help="print every thread's stack and exit after this many s")
    args = ap.parse_args()
    if args.watchdog:
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    cfg = ModelConfig.from_hf(dict(QWEN36_27B, num_hidden_layers=args.layers))
    work = Path(tempfile.mkdtemp())
    demo = work / "tokenizer"
    demo.mkdir()
    write_tokenizer(demo, 1024)
    model = random_model(cfg, "cuda", torch.bfloat16)
    if args.fp8:
        print(f"fp8: {quantize_linears(model)} projections quantised", flush=True)
    adapters = random_adapters(work, cfg)
    t0 = time.perf_counter()
    kernels = KernelsConfig(
        fp8_fused_quant=not args.fp8_unfused,
        fp8_fused_norm_quant=args.fp8_fused_norms,
        fused_lora_expand=not args.no_fused_lora_expand,
        fused_lora_expand_quantized=args.fused_lora_expand_quantized,
    )
    config = EngineConfig(
        max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=args.max_num_batched_tokens, max_loras=8,
        max_lora_rank=16, kernels=kernels,
    )  # fmt: skip
    engine = LLMEngine(demo, config, adapters, progress=False, model=model)
    print(f"kernels: {as_text(engine.kernels)}; engine set-up {time.perf_counter() - t0:.1f} s", flush=True)
    for i in range(8):  # warm-up: every adapter loaded, every kernel compiled
        engine.add_request(f"warm{i}", list(range(1, 40)), SamplingParams(max_tokens=3), f"a{i}")
    engine.add_request("warm-base", list(range(1, 600)), SamplingParams(max_tokens=3))
    while engine.has_unfinished():
        engine.step()
    time_forward(engine.model)
    results = [
        profile_workload(engine, "base", lambda i: None),
        profile_workload(engine, "8 adapters mixed", lambda i: f"a{i % 8}"),
    ]
    if args.decode_kernels:
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, 1000, (512,), generator=g).tolist() for _ in range(32)]
        runs = (("base", "base", lambda i: None), ("8 adapters mixed", "mixed", lambda i: f"a{i % 8}"))
        for label, tag, adapter_of in runs:
            rows = decode_profile.hylora_decode_profile(engine, prompts, adapter_of, work / f"{tag}.trace.json.gz", tag)
            print("\n" + decode_profile.summary_md(f"hylora{' fp8' * args.fp8}, {label}, batch 32", rows), flush=True)
            results.append({"run": f"decode kernels, {label}", "kernels": rows})
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

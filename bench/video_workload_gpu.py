"""The users' video workload (issue 29, item 3): video analysis by task adapters, end to end
through the engine (LLMEngine driven directly, no HTTP).

Workload: 8 synthetic 10 s 720p videos at 2 fps (20 frames of 1280x720 each, distinct content,
deterministic), each analysed by the three task adapters `relic`, `tomb` and `mural` (random
rank-16 adapters on every text linear): 24 requests of ~8.9k prompt tokens (8800 of them visual:
10 temporal patches of 880) and 128 greedy output tokens each (ignore_eos). The three requests of a
video share its prompt; only the adapter differs. Model: random weights of the Qwen3.6-27B text
shape (`--layers` of its 64) with the real-size vision tower (depth 27, hidden 1152), bf16, or with
`--fp8` the text projections quantised in memory as an FP8 checkpoint loads; engine defaults
otherwise (8192 batched tokens per step on CUDA, 1 GB encoder cache, prefix caching on,
max_num_seqs = 24 so every request may run at once).

Two arrival patterns, each on new videos (so neither cache carries over from the other):
- `all`: the 24 requests at once, in video order (a video's three requests back to back);
- `poisson`: the same kind of requests arriving as a Poisson process of `--rate` requests/s
  (default 0.5: about half the engine's prefill capacity at 64 bf16 layers, ~1 s per 9k-token
  prompt, so it is loaded but keeps up), in video order, fixed `--seed`.
Videos are preprocessed (resize, patchify) before the clock starts; a warm-up (one short 720p video
request per adapter) runs first so Triton compilation and autotuning are not in the numbers (CUDA
graphs are captured at engine start).

Numbers, per pattern (times from the request's arrival, as a client that sent it then sees them):
- output tok/s, prompt tok/s: all output (prompt) tokens / wall time from the first arrival to the
  last finish (under `poisson` output tok/s is bounded by the arrival rate: read the latencies);
- TTFT p50 / p99: arrival → the step that hands out its first token; E2E p50 / p99: arrival → its
  final output; TPOT: (E2E - TTFT) / (output tokens - 1), the time per later token; queue p50 / p99:
  arrival → its first prefill chunk is scheduled (with 24 requests p99 is close to the maximum);
- encoder cache hits / misses: media segments (one temporal patch of a video) taken from the
  encoder cache / encoded by the tower; ideal: each video encoded once (10 misses per video) and
  reused by its other two adapters (20 hits);
- prefix cache: prompt tokens looked up / served from it (0 expected: entries are per adapter);
- preemptions; the step mix (forwards with prefill chunks only, with prefill and decode, decode
  only) and device time in them and in the vision tower (CUDA events, no added sync).

    python bench/video_workload_gpu.py [--layers 64] [--fp8] [--arrivals all|poisson|both] [--rate 0.5]
                                       [--seed 0] [--out results.json]
    python bench/video_workload_gpu.py --tiny --device cpu   # the demo model, 4 small videos: the logic on a CPU

Prints a markdown table; `--out FILE` writes every number, the settings and each request as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_gpu import QWEN36_27B, write_random_adapter  # noqa: E402
from bench.vision_gpu import VIDEO, VISION_27B, prompt_for, random_vl_model, synthetic_video  # noqa: E402
from hylora.config import ModelConfig, VisionConfig  # noqa: E402
from hylora.demo import DEMO_ADAPTERS, ensure_demo  # noqa: E402
from hylora.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from hylora.engine.multimodal import build_multimodal_prompt  # noqa: E402
from hylora.engine.observer import StepObserver  # noqa: E402
from hylora.engine.scheduler import ScheduledChunk  # noqa: E402
from hylora.kernels import as_text  # noqa: E402
from hylora.media import MediaConfig, MediaLimits  # noqa: E402
from hylora.media.processor import ProcessedMedia, process_frames  # noqa: E402
from hylora.model.fp8 import quantize_linears  # noqa: E402
from hylora.tokenizer import load_tokenizer  # noqa: E402

ADAPTERS = tuple(DEMO_ADAPTERS)  # relic, tomb, mural
FPS = 2.0


@dataclass(frozen=True)
class Workload:
    videos: int  # per arrival pattern
    frames: int
    height: int
    width: int
    max_tokens: int
    warm_frames: int  # the warm-up video
    rate: float  # default Poisson rate, requests/s


FULL = Workload(videos=8, frames=20, height=720, width=1280, max_tokens=128, warm_frames=8, rate=0.5)
TINY = Workload(videos=4, frames=4, height=96, width=128, max_tokens=16, warm_frames=4, rate=4.0)


@dataclass
class Job:
    request_id: str
    video: int
    adapter: str
    ids: list[int]
    item: ProcessedMedia
    arrival: float = 0.0  # seconds after the run starts


def video_frames(base: np.ndarray, index: int, count: int, frames: int) -> np.ndarray:
    """Video `index` of `count`: the base clip's first `frames` frames, shifted sideways by index/count of
    its width and tinted (colour channels rotated), so that every video has content of its own."""
    shifted = np.roll(base[:frames], index * base.shape[2] // count, axis=2)
    return np.ascontiguousarray(np.roll(shifted, index % 3, axis=3))


def video_jobs(
    base: np.ndarray, indices: range, count: int, frames: int, vision: VisionConfig, text_limit: int, tag: str
) -> list[Job]:
    """The three adapters' requests for each video in `indices` (of `count`), in video order, preprocessed."""
    keep = {vision.vision_start_token_id, vision.vision_end_token_id, vision.video_token_id}
    jobs = []
    for v in indices:
        item = process_frames(video_frames(base, v, count, frames), FPS, MediaConfig(video=VIDEO), MediaLimits())
        # prompt_for's random text, folded below the tokenizer's special tokens (the tiny demo's vocabulary)
        ids = [t if t in keep else t % text_limit for t in prompt_for(item, vision, seed=v)]
        jobs += [Job(f"{tag}-v{v}-{a}", v, a, ids, item) for a in ADAPTERS]
    return jobs


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """`n` arrival times of a Poisson process of `rate` per second, the first at 0."""
    gaps = np.random.default_rng(seed).exponential(1 / rate, n)
    return (np.cumsum(gaps) - gaps[0]).tolist()


class Clock:
    """Marks on the device's timeline: CUDA events (no sync) on a GPU, the host clock elsewhere."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


class StepMix(StepObserver):
    """What each forward ran (prefill chunks, decode tokens) and its device time, and the vision
    tower's calls, while attached to an engine."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.clock = engine, Clock(engine.model.device.type == "cuda")
        self.forwards: list[tuple[int, int, Any, Any]] = []  # prefill tokens, decode tokens, start, end
        self.tower: list[tuple[int, Any, Any, float]] = []  # output rows, start, end, host seconds
        visual = engine.model.visual
        self._real = visual.forward

        def timed(*args: Any, **kwargs: Any) -> torch.Tensor:
            host, start = time.perf_counter(), self.clock.mark()
            out = self._real(*args, **kwargs)
            self.tower.append((out.shape[0], start, self.clock.mark(), time.perf_counter() - host))
            return out

        visual.forward = timed
        engine.add_observer(self)

    def before_forward(self, chunks: list[ScheduledChunk]) -> None:
        self._start = self.clock.mark()

    def after_forward(self, chunks: list[ScheduledChunk]) -> None:
        decode = sum(c.num_tokens for c in chunks if c.ahead or c.start >= len(c.request.prompt_ids))
        prefill = sum(c.num_tokens for c in chunks) - decode
        self.forwards.append((prefill, decode, self._start, self.clock.mark()))

    def detach(self) -> dict:
        """Stop watching; the mix and the device times (waits for the device)."""
        self.engine.remove_observer(self)
        self.engine.model.visual.forward = self._real
        return self.totals()

    def totals(self) -> dict:
        """The mix and the device times so far (waits for the device)."""
        if self.clock.cuda:
            torch.cuda.synchronize()
        seconds = [self.clock.seconds(a, b) for _, _, a, b in self.forwards]
        decode_only = [s for (p, _, _, _), s in zip(self.forwards, seconds, strict=True) if p == 0]
        return {
            "forwards": len(self.forwards),
            "prefill_only": sum(1 for p, d, _, _ in self.forwards if p and not d),
            "mixed": sum(1 for p, d, _, _ in self.forwards if p and d),
            "decode_only": len(decode_only),
            "prefill_tokens": sum(p for p, _, _, _ in self.forwards),
            "decode_tokens": sum(d for _, d, _, _ in self.forwards),
            "with_prefill_device_s": sum(seconds) - sum(decode_only),
            "decode_only_device_s": sum(decode_only),
            "decode_step_ms": 1e3 * sum(decode_only) / max(len(decode_only), 1),
            "tower_calls": len(self.tower),
            "tower_tokens": sum(rows for rows, _, _, _ in self.tower),
            "tower_device_s": sum(self.clock.seconds(a, b) for _, a, b, _ in self.tower),
            "tower_host_s": sum(h for _, _, _, h in self.tower),
            # per call: (output rows, device ms, host ms), to see small calls and host-bound ones
            "tower_per_call": [
                (rows, round(1e3 * self.clock.seconds(a, b), 2), round(1e3 * h, 2)) for rows, a, b, h in self.tower
            ],
        }


def drive(engine: LLMEngine, jobs: list[Job], max_tokens: int) -> tuple[list[dict], float]:
    """Add each job when its arrival time has come, step until all finish. Per request: times from
    its arrival (first token, finish, first scheduled), tokens, error; and the wall time."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    jobs = sorted(jobs, key=lambda j: j.arrival)
    vision = engine.model.config.vision
    first: dict[str, float] = {}
    done: dict[str, tuple[float, Any]] = {}
    i = 0
    t0 = time.monotonic()
    while i < len(jobs) or engine.has_unfinished():
        now = time.monotonic() - t0
        while i < len(jobs) and jobs[i].arrival <= now:
            j = jobs[i]
            mm = build_multimodal_prompt(j.ids, [j.item], vision)
            engine.add_request(j.request_id, j.ids, params, j.adapter, mm=mm)
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, jobs[i].arrival - now))
            continue
        outputs = engine.step()
        now = time.monotonic() - t0
        for out in outputs:
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = (now, out)
    records = []
    for j in jobs:
        end, out = done[j.request_id]
        scheduled = out.timing.scheduled if out.timing is not None else None
        ttft = first[j.request_id] - j.arrival if j.request_id in first else None
        tokens = out.num_output_tokens
        records.append(
            {
                "request": j.request_id,
                "video": j.video,
                "adapter": j.adapter,
                "arrival_s": j.arrival,
                "ttft_s": ttft,
                "e2e_s": end - j.arrival,
                "tpot_s": None if ttft is None or tokens < 2 else (end - j.arrival - ttft) / (tokens - 1),
                "queue_s": None if scheduled is None else scheduled - t0 - j.arrival,
                "prompt_tokens": len(out.prompt_token_ids),
                "output_tokens": tokens,
                "cached_tokens": out.num_cached_tokens,
                "preemptions": out.num_preemptions,
                "error": out.error,
            }
        )
    return records, max(end for end, _ in done.values())


def percentiles(values: list[float | None]) -> dict:
    v = [x for x in values if x is not None]
    if not v:
        return {}
    p50, p99 = np.percentile(v, [50, 99])
    return {"p50": float(p50), "p99": float(p99), "mean": float(np.mean(v)), "max": float(max(v))}


def run_pattern(engine: LLMEngine, name: str, jobs: list[Job], max_tokens: int, rate: float | None) -> dict:
    """One arrival pattern, timed, with the engine's cache counters and the step mix over it."""
    before = engine.stats()
    mix = StepMix(engine)
    records, wall = drive(engine, jobs, max_tokens)
    steps = mix.detach()
    after = engine.stats()
    ok = [r for r in records if r["error"] is None]
    lookups = sum(j.item.grid_thw[0] for j in jobs)  # one per request and temporal patch
    segments = len({(j.video, t) for j in jobs for t in range(j.item.grid_thw[0])})
    out_tokens, prompt_tokens = sum(r["output_tokens"] for r in ok), sum(r["prompt_tokens"] for r in ok)
    return {
        "arrivals": name,
        "rate_per_s": rate,
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r["error"] for r in records if r["error"] is not None}),
        "wall_s": wall,
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "out_tok_s": out_tokens / wall,
        "prompt_tok_s": prompt_tokens / wall,
        "ttft_s": percentiles([r["ttft_s"] for r in ok]),
        "e2e_s": percentiles([r["e2e_s"] for r in ok]),
        "tpot_s": percentiles([r["tpot_s"] for r in ok]),
        "queue_s": percentiles([r["queue_s"] for r in ok]),
        "encoder": {
            "hits": after.encoder_hits - before.encoder_hits,
            "misses": after.encoder_misses - before.encoder_misses,
            "ideal_misses": segments,
            "ideal_hits": lookups - segments,
        },
        "prefix_cache": {
            "looked_up_tokens": after.prefix_cache_queries - before.prefix_cache_queries,
            "hit_tokens": after.prefix_cache_hits - before.prefix_cache_hits,
        },
        "preemptions": after.preemptions - before.preemptions,
        "engine_steps": after.engine_steps - before.engine_steps,
        "steps_ahead": after.steps_ahead - before.steps_ahead,
        "steps": steps,
        "per_request": records,
    }


def build_engine(
    args: argparse.Namespace, w: Workload, cfg: ModelConfig, demo: Path, max_model_len: int, work: Path
) -> LLMEngine:
    """The tiny demo model from its checkpoint, or random 27B-shape weights with three random
    rank-16 adapters written to `work` (`--fp8`: text projections quantised in memory)."""
    config = dict(max_model_len=max_model_len, max_num_seqs=w.videos * len(ADAPTERS), max_lora_rank=16)
    config |= dict(max_loras=len(ADAPTERS), device=args.device)
    if args.tiny:
        dtype = "float32" if args.device == "cpu" else "bfloat16"
        quant = "fp8" if args.fp8 else None
        lora = {a: demo / "adapters" / a for a in ADAPTERS}
        return LLMEngine(demo, EngineConfig(dtype=dtype, quantization=quant, **config), lora, progress=False)
    t0 = time.perf_counter()
    model = random_vl_model(cfg, torch.bfloat16, args.device)
    if args.fp8:
        count = quantize_linears(model)
        torch.cuda.empty_cache()
        print(f"quantised {count} text projections to FP8", flush=True)
    for i, a in enumerate(ADAPTERS):
        write_random_adapter(work / a, cfg, rank=16, seed=i)
    print(f"model built and adapters written in {time.perf_counter() - t0:.1f}s", flush=True)
    lora = {a: work / a for a in ADAPTERS}
    return LLMEngine(demo, EngineConfig(dtype="bfloat16", **config), lora, progress=False, model=model)


def cell(stats: dict, scale: float = 1.0) -> str:
    return f"{scale * stats['p50']:.2f} / {scale * stats['p99']:.2f}" if stats else "-"


def table(runs: list[dict]) -> str:
    head = ["all at once" if r["arrivals"] == "all" else f"Poisson {r['rate_per_s']:g} req/s" for r in runs]
    rows = {
        "requests (failed)": [f"{r['requests']} ({r['failed']})" for r in runs],
        "wall s": [f"{r['wall_s']:.1f}" for r in runs],
        "output tok/s": [f"{r['out_tok_s']:.1f}" for r in runs],
        "prompt tok/s": [f"{r['prompt_tok_s']:.0f}" for r in runs],
        "TTFT p50 / p99 s": [cell(r["ttft_s"]) for r in runs],
        "E2E p50 / p99 s": [cell(r["e2e_s"]) for r in runs],
        "TPOT p50 / p99 ms": [cell(r["tpot_s"], 1e3) for r in runs],
        "queue p50 / p99 s": [cell(r["queue_s"]) for r in runs],
        "encoder hits / misses (ideal)": [
            "{hits} / {misses} ({ideal_hits} / {ideal_misses})".format(**r["encoder"]) for r in runs
        ],
        "prefix-cache hit / looked-up tokens": [
            "{hit_tokens} / {looked_up_tokens}".format(**r["prefix_cache"]) for r in runs
        ],
        "preemptions": [str(r["preemptions"]) for r in runs],
        "forwards prefill / mixed / decode": [
            "{prefill_only} / {mixed} / {decode_only}".format(**r["steps"]) for r in runs
        ],
        "device s: with prefill / decode / tower": [
            "{with_prefill_device_s:.1f} / {decode_only_device_s:.1f} / {tower_device_s:.2f}".format(**r["steps"])
            for r in runs
        ],
        "decode-only step ms": [f"{r['steps']['decode_step_ms']:.1f}" for r in runs],
    }
    lines = ["| | " + " | ".join(head) + " |", "| --- |" + " --- |" * len(runs)]
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows.items()]
    return "\n".join(lines)


def benchmark(args: argparse.Namespace, work: Path) -> dict:
    """Videos, engine, warm-up, then each arrival pattern: the settings and the runs."""
    w = TINY if args.tiny else FULL
    rate = args.rate or w.rate
    patterns = ["all", "poisson"] if args.arrivals == "both" else [args.arrivals]
    demo = ensure_demo()
    if args.tiny:
        cfg = ModelConfig.from_dir(demo)
    else:
        shape = dict(QWEN36_27B, num_hidden_layers=args.layers)
        cfg = ModelConfig.from_hf({"model_type": "qwen3_5", "text_config": shape, "vision_config": VISION_27B})
    assert cfg.vision is not None
    text_limit = min(load_tokenizer(demo).all_special_ids)

    t0 = time.perf_counter()
    base = synthetic_video(w.frames, w.height, w.width)
    n, count = w.videos, len(patterns) * w.videos + 1  # new videos for each pattern, one for the warm-up
    jobs = {
        p: video_jobs(base, range(k * n, (k + 1) * n), count, w.frames, cfg.vision, text_limit, p)
        for k, p in enumerate(patterns)
    }
    warm = video_jobs(base, range(count - 1, count), count, w.warm_frames, cfg.vision, text_limit, "warm")
    preprocess_s = time.perf_counter() - t0
    if "poisson" in jobs:
        for job, at in zip(jobs["poisson"], poisson_arrivals(len(jobs["poisson"]), rate, args.seed), strict=True):
            job.arrival = at
    item = jobs[patterns[0]][0].item
    prompt_tokens = max(len(j.ids) for js in jobs.values() for j in js)
    print(
        f"{count} videos ({w.frames} frames of {w.width}x{w.height}) made and preprocessed in {preprocess_s:.1f}s: "
        f"grid {item.grid_thw}, {item.num_tokens} visual tokens, prompts of {prompt_tokens} tokens",
        flush=True,
    )

    t0 = time.perf_counter()
    engine = build_engine(args, w, cfg, demo, prompt_tokens + w.max_tokens, work)
    setup_s = time.perf_counter() - t0
    print(
        f"engine set up in {setup_s:.1f}s (model, adapters, kernel checks, cache plan, CUDA graphs): "
        f"KV pages {engine.kv.num_pages}, {engine.config.max_num_batched_tokens} tokens per step, "
        f"quantization {engine.quantization}; kernels {as_text(engine.kernels)}",
        flush=True,
    )
    t0 = time.perf_counter()
    drive(engine, warm, 4)
    print(f"warm-up: {len(warm)} requests of {len(warm[0].ids)} tokens in {time.perf_counter() - t0:.1f}s", flush=True)

    runs = []
    for p in patterns:
        runs.append(run_pattern(engine, p, jobs[p], w.max_tokens, rate if p == "poisson" else None))
        print(json.dumps({k: v for k, v in runs[-1].items() if k not in ("per_request", "steps")}), flush=True)
    dtype = str(engine.model.dtype).removeprefix("torch.")
    settings = {
        "card": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "tiny": args.tiny,
        "layers": cfg.num_layers,
        "dtype": dtype,
        "weights": engine.quantization or dtype,
        "adapters": list(ADAPTERS),
        "videos_per_pattern": n,
        "frames": w.frames,
        "size": [w.height, w.width],
        "fps": FPS,
        "grid_thw": list(item.grid_thw),
        "visual_tokens": item.num_tokens,
        "prompt_tokens": prompt_tokens,
        "max_tokens": w.max_tokens,
        "arrivals": patterns,
        "rate_per_s": rate,
        "seed": args.seed,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "max_num_seqs": engine.config.max_num_seqs,
        "kv_pages": engine.kv.num_pages,
        "kernels": as_text(engine.kernels),
        "preprocess_s": preprocess_s,
        "engine_setup_s": setup_s,
    }
    return {"settings": settings, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=64, help="decoder layers of the 27B shape")
    ap.add_argument("--fp8", action="store_true", help="text projections in FP8 (quantised in memory)")
    ap.add_argument("--arrivals", choices=["all", "poisson", "both"], default="both")
    ap.add_argument("--rate", type=float, help=f"Poisson arrivals, requests/s (default {FULL.rate}; tiny {TINY.rate})")
    ap.add_argument("--seed", type=int, default=0, help="of the Poisson arrivals")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the demo model and 4 small videos (the logic on a CPU)")
    ap.add_argument("--out")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:  # the adapters' files, read again if evicted from host memory
        result = benchmark(args, Path(tmp))
    s = result["settings"]
    print(
        f"\n{s['card']}, {s['layers']} layers, {s['weights']}, {s['videos_per_pattern']} videos x {len(ADAPTERS)} "
        f"adapters, {s['prompt_tokens']}-token prompts, {s['max_tokens']} output tokens\n"
    )
    result["table"] = table(result["runs"])
    print(result["table"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""vLLM 0.20.2 beside hylora on the users' video workload (issue 29, items 3 and 4): video analysis by
task adapters, both engines driven alike through their offline engine APIs.

- Checkpoint: random bf16 weights of the Qwen3.6-27B text shape cut to 16 layers (`--layers 64`: all
  of them; a 55 GB checkpoint, so ckpt and each engine in calls of their own, with --reuse) with the real-size
  vision tower (depth 27, hidden 1152), Hugging Face VL layout, hylora's 1024-token byte-level BPE
  tokenizer (its vision tokens named in config.json), Qwen3.5's processor configs (video: fps 2, pixel
  budget 4096 … 25,165,824 over all frames, so 720p frames keep their size); vLLM's config.json.
- Adapters: `relic`, `tomb`, `mural`, random rank-16 on every text linear (the VL wrapper's keys).
- Workload (`bench/video_workload_gpu.py`'s): 8 synthetic 10 s 720p videos at 2 fps (20 frames of
  1280x720, decoded: no file is read), each analysed by the three adapters, 128 greedy tokens each
  (ignore_eos): 24 requests of ~8.9k prompt tokens (8800 visual). Two arrival patterns on new videos
  each: `all` (at once, in video order) and `poisson` (0.5 requests/s, seed 0). A warm-up first: the `all`
  pattern on videos of its own, 4 tokens a request (`--no-full-warm-up`: one short video, as up to run 63).
- Both engines: max_num_seqs 24, max_num_batched_tokens 8192, max model length 10240, prefix caching off
  (its entries are per adapter: the workload has no hits), 3 adapters on the GPU. Each engine turns a
  request's frames into the tower's input itself, inside the clock: resize, normalise, patchify, once
  per video (vLLM's processor cache, keyed by `multi_modal_uuids`; hylora's driver keeps the processed
  video, as its server's media cache does), so both pay the same preprocessing.
- Prompts: the same token ids for both, `<|im_start|>user` + the video placeholder + a question; each
  engine expands the placeholder itself; both drop the template's outer `<|vision_start|>` … `<|vision_end|>`
  (hylora since 2026-12-07, as transformers 5.25; before, its prompts were 2 tokens longer; the table shows
  both lengths).
- The driver adds each request when its arrival time has come and steps the engine until all finish;
  times are host times from arrival: TTFT (first token seen), E2E (finished), TPOT. vLLM through
  `LLM.llm_engine` (`add_request` / `step`, outputs as deltas; its engine core, a process of its own,
  steps while the driver preprocesses the next requests); hylora through `LLMEngine`, each video
  preprocessed on a worker thread while the engine steps (as `hylora serve` and `LLM.chat` do on their
  media pools) and its requests added in arrival order once it is ready.

Phases (each writes WORK/results/video-<engine>.json, rewritten after every pattern):

    ckpt                      the checkpoint and adapters (--reuse keeps what an earlier call completed)
    vllm / hylora             one engine, every pattern; --dry-run (vllm): vLLM's checks of its arguments
    table [--results DIR ...] the markdown table from every result found
    run STEP ...              steps in their own process groups under --budget, then the table
    --profile (hylora)        then `all` once more on new videos under torch.profiler: OUT/profiles/video-hylora.md

    bash bench/peer/video_gpu.sh       # H200, .vllm and .peerwhl carried: run ckpt vllm hylora
    python bench/peer/video_peer.py run ckpt hylora --tiny --device cpu --out /tmp/videopeer   # CPU dry run
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.peer import engine_phases as ep  # noqa: E402
from bench.peer import throughput_peer as tp  # noqa: E402

VERSION = "1"  # bump when the checkpoint changes: a reused work dir with another stamp is rewritten
ADAPTERS = ("relic", "tomb", "mural")
RANK = 16
MNBT = 8192
MAX_NUM_SEQS = 24  # every request of a pattern (8 videos x 3 adapters) may run at once
MAX_MODEL_LEN = 10240
PATTERNS = ("all", "poisson")
WEIGHTS = ("bf16", "fp8")
PROFILED = "all-profiled"  # --profile: the all-at-once pattern once more, on new videos, under torch.profiler
SEED = 0
MIN_LEFT_S = {"ckpt": 60, "vllm": 280, "hylora": 120}
# Qwen3.5's released processor configs (docs: VISION.md): patch 16, temporal 2, merge 2, mean = std = 0.5
COMMON = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
PROCESSOR_CONFIGS = {
    "preprocessor_config.json": COMMON
    | {"image_processor_type": "Qwen2VLImageProcessorFast", "size": {"shortest_edge": 65536, "longest_edge": 16777216}},
    "video_preprocessor_config.json": COMMON
    | {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "size": {"shortest_edge": 4096, "longest_edge": 25165824},
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768,
    },
}
TINY_TOWER = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2)
QUESTION = "List the objects in this video, when each appears, and any text on them."


def log(*parts: object) -> None:
    tp.log(*parts)


def shapes(tiny: bool, layers: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(text config, vision config) of the checkpoint: the 27B shape cut to `layers` layers with its
    tower, or (tiny) the bench's small shape, 4 layers, with a 2-block tower."""
    from bench import engine_gpu as eg
    from bench.vision_gpu import VISION_27B

    text = tp.model_shape(True) if tiny else dict(eg.QWEN36_27B, num_hidden_layers=layers)
    vision = dict(TINY_TOWER, out_hidden_size=text["hidden_size"]) if tiny else dict(VISION_27B)
    return text, vision


def workload(tiny: bool) -> Any:
    from bench import video_workload_gpu as vw

    return vw.TINY if tiny else vw.FULL


def ckpt_dir(work: Path, weights: str = "bf16") -> Path:
    """The checkpoint of `weights`: bf16, or its block-FP8 copy (`hylora.model.fp8.quantize_checkpoint`)."""
    return work / ("ckpt-video" if weights == "bf16" else f"ckpt-video-{weights}")


def complete_marker(work: Path, weights: str) -> Path:
    return work / f"{ckpt_dir(work, weights).name}.complete"


def adapters_dir(work: Path) -> Path:
    return work / "video-adapters"


def stamp(args: argparse.Namespace) -> str:
    return f"{VERSION} {'tiny' if args.tiny else f'27b-{args.layers}'}"


PREFIX = "video"  # results: WORK/results/video-<engine>.json (bf16), video_fp8-<engine>.json


def result_prefix(base: str, weights: str) -> str:
    """The results' file prefix of a run on `weights` (`base` for bf16)."""
    return base if weights == "bf16" else f"{base}_{weights}"


def save(work: Path, data: dict[str, Any]) -> None:
    ep.save(work, result_prefix(PREFIX, data["weights"]), data)


# --------------------------------------------------------------------------------------------
# the workload, alike for both engines


@dataclass
class Job:
    request_id: str
    video: int  # index into the videos
    adapter: str
    arrival: float = 0.0  # seconds after the pattern starts


@dataclass
class Videos:
    """Every video's frames (uint8 [T, H, W, 3]) and the jobs of each pattern and of the warm-up."""

    frames: dict[int, Any]
    jobs: dict[str, list[Job]]
    fps: float
    max_tokens: int


def make_videos(tiny: bool, rate: float | None = None, profile: bool = False, full_warm_up: bool = False) -> Videos:
    """`bench/video_workload_gpu.py`'s videos: new ones for each pattern, a short one for the warm-up;
    `profile`: also PROFILED's jobs, all at once on new videos of their own (after the timed patterns);
    `full_warm_up`: the warm-up is the all-at-once pattern on full-size videos of its own (the last indices),
    so that most step sizes the patterns run have run once before the clock (kernels compiled at first use; the
    Poisson pattern's chunk sizes follow its arrivals, so not every one: run 64 a)."""
    from bench import video_workload_gpu as vw
    from bench.vision_gpu import synthetic_video

    w = workload(tiny)
    base = synthetic_video(w.frames, w.height, w.width)
    n, count = w.videos, len(PATTERNS) * w.videos + 1
    frames = {v: vw.video_frames(base, v, count, w.frames) for v in range(count - 1)}
    frames[count - 1] = vw.video_frames(base, count - 1, count, w.warm_frames)
    jobs = {
        p: [Job(f"{p}-v{v}-{a}", v, a) for v in range(k * n, (k + 1) * n) for a in ADAPTERS]
        for k, p in enumerate(PATTERNS)
    }
    jobs["warm"] = [Job(f"warm-{a}", count - 1, a) for a in ADAPTERS]
    if profile:  # indices after the warm-up's, so the timed patterns' videos stay as they were
        extra = range(count, count + n)
        frames |= {v: vw.video_frames(base, v, count + n, w.frames) for v in extra}
        jobs[PROFILED] = [Job(f"{PROFILED}-v{v}-{a}", v, a) for v in extra for a in ADAPTERS]
    if full_warm_up:
        start = max(frames) + 1
        extra = range(start, start + n)
        frames |= {v: vw.video_frames(base, v, start + n, w.frames) for v in extra}
        jobs["warm"] = [Job(f"warm-v{v}-{a}", v, a) for v in extra for a in ADAPTERS]
    for job, at in zip(jobs["poisson"], vw.poisson_arrivals(len(jobs["poisson"]), rate or w.rate, SEED), strict=True):
        job.arrival = at
    return Videos(frames, jobs, vw.FPS, w.max_tokens)


def prompt_ids(ckpt: Path, video: int) -> list[int]:
    """The chat turn's ids with one video placeholder, from the checkpoint's tokenizer (both engines
    get these ids and expand the placeholder themselves)."""
    text = (
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>"
        f"{QUESTION} (clip {video})<|im_end|>\n<|im_start|>assistant\n"
    )
    return _tokenizer(ckpt).encode(text, add_special_tokens=False).ids


@functools.cache
def _tokenizer(ckpt: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(ckpt / "tokenizer.json"))


@dataclass
class Event:
    """What one engine step told about one request."""

    request_id: str
    new_tokens: int
    finished: bool
    prompt_tokens: int | None = None
    error: str | None = None


@dataclass
class Side:
    """One engine as the driver sees it: `submit` adds a job (preprocessing included), `step` runs one
    engine step, `busy` says whether any request is unfinished."""

    submit: Callable[[Job], None]
    step: Callable[[], list[Event]]
    busy: Callable[[], bool]
    stats: Callable[[], dict[str, Any]] = field(default=lambda: {})


def drive(side: Side, jobs: list[Job]) -> tuple[list[dict[str, Any]], float]:
    """Add each job when its arrival time has come, step until all finish. Per request: times from its
    arrival (first token, finish), tokens, error; and the wall time to the last finish."""
    jobs = sorted(jobs, key=lambda j: j.arrival)
    first: dict[str, float] = {}
    end: dict[str, float] = {}
    tokens = {j.request_id: 0 for j in jobs}
    prompt: dict[str, int] = {}
    errors: dict[str, str] = {}
    adding: dict[str, float] = {}  # host seconds inside the engine's add (preprocessing included)
    i = 0
    t0 = time.monotonic()
    while i < len(jobs) or side.busy():
        now = time.monotonic() - t0
        while i < len(jobs) and jobs[i].arrival <= now:
            t_add = time.monotonic()
            side.submit(jobs[i])
            adding[jobs[i].request_id] = time.monotonic() - t_add
            i += 1
        if not side.busy():
            time.sleep(max(0.0, jobs[i].arrival - (time.monotonic() - t0)))
            continue
        events = side.step()
        now = time.monotonic() - t0
        for e in events:
            tokens[e.request_id] += e.new_tokens
            if e.new_tokens:
                first.setdefault(e.request_id, now)
            if e.prompt_tokens is not None:
                prompt[e.request_id] = e.prompt_tokens
            if e.error:
                errors[e.request_id] = e.error
            if e.finished:
                end[e.request_id] = now
    records = []
    for j in jobs:
        ttft = first[j.request_id] - j.arrival if j.request_id in first else None
        e2e = end[j.request_id] - j.arrival
        n = tokens[j.request_id]
        records.append({
            "request": j.request_id, "video": j.video, "adapter": j.adapter, "arrival_s": j.arrival,
            "ttft_s": ttft, "e2e_s": e2e,
            "tpot_s": None if ttft is None or n < 2 else (e2e - ttft) / (n - 1),
            "prompt_tokens": prompt.get(j.request_id), "output_tokens": n, "error": errors.get(j.request_id),
            "add_s": adding[j.request_id],
        })  # fmt: skip
    return records, max(end.values())


def summary(pattern: str, records: list[dict[str, Any]], wall: float, **extra: Any) -> dict[str, Any]:
    from bench.video_workload_gpu import percentiles

    ok = [r for r in records if r["error"] is None]
    out_tokens = sum(r["output_tokens"] for r in ok)
    prompt_tokens = sum(r["prompt_tokens"] or 0 for r in ok)
    return {
        "arrivals": pattern,
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r["error"] for r in records if r["error"]}),
        "wall_s": wall,
        "out_tok_s": out_tokens / wall,
        "prompt_tok_s": prompt_tokens / wall,
        "prompt_tokens": sorted({r["prompt_tokens"] for r in ok if r["prompt_tokens"]}),
        "ttft_s": percentiles([r["ttft_s"] for r in ok]),
        "e2e_s": percentiles([r["e2e_s"] for r in ok]),
        "tpot_s": percentiles([r["tpot_s"] for r in ok]),
        "add_s": None if any(r["add_s"] is None for r in records) else sum(r["add_s"] for r in records),
        **extra,
        "per_request": records,
    }


def run_patterns(work: Path, data: dict[str, Any], side: Side, videos: Videos, patterns: list[str]) -> None:
    """The warm-up (its numbers kept apart), then each of `patterns`; the result saved after each."""
    t0 = time.perf_counter()
    drive(side, videos.jobs["warm"])
    data["warm_up_s"] = time.perf_counter() - t0
    log(f"{data['engine']} warm-up: {len(videos.jobs['warm'])} requests in {data['warm_up_s']:.1f}s")
    for p in patterns:
        before = side.stats()
        records, wall = drive(side, videos.jobs[p])
        after = side.stats()
        counters = {
            k: v[len(before.get(k, [])) :] if isinstance(v, list) else v - before.get(k, 0) for k, v in after.items()
        }
        row = summary(p, records, wall, counters=counters)
        data["runs"].append(row)
        e2e = row["e2e_s"]
        log(f"{data['engine']} {p}: {row['out_tok_s']:.0f} out tok/s, E2E p50 {e2e.get('p50', 0):.2f}s "
            f"p99 {e2e.get('p99', 0):.2f}s, {row['failed']} failed, prompts {row['prompt_tokens']}")  # fmt: skip
        c = row["counters"]
        if "tower_device_s" in c:  # hylora: where the device's time went, against the wall
            log(f"{data['engine']} {p}: device s in {c['forwards']} forwards with prefill "
                f"{c['with_prefill_device_s']:.2f}, decode only {c['decode_only_device_s']:.2f}, tower "
                f"{c['tower_device_s']:.2f}; wall {wall:.2f}")  # fmt: skip
            log(f"{data['engine']} {p}: {c['tower_calls']} tower calls, {c['tower_tokens']} rows, host s "
                f"{c['tower_host_s']:.2f}; per call (rows, device ms, host ms): {c['tower_per_call']}")  # fmt: skip
        save(work, data)
    data["complete"] = True
    save(work, data)


def new_result(engine: str, packages: tuple[str, ...], args: argparse.Namespace) -> dict[str, Any]:
    date = time.strftime("%Y-%m-%d %H:%M")
    layers = 4 if args.tiny else args.layers
    return {"engine": engine, "date": date, "tiny": args.tiny, "layers": layers, "weights": args.weights,
            "versions": tp.versions(packages), "runs": []}  # fmt: skip


# --------------------------------------------------------------------------------------------
# phase ckpt


def phase_ckpt(args: argparse.Namespace) -> None:
    """The bf16 checkpoint and the adapters, and with --weights fp8 the FP8 copy made from it; with
    --reuse, what an earlier call completed here is kept."""
    work = args.work
    if args.reuse and is_complete(work, "bf16", args):
        log(f"reusing {ckpt_dir(work)}")
    else:
        complete_marker(work, "fp8").unlink(missing_ok=True)  # made from the bf16 one
        write_bf16(args)
    if args.weights == "fp8":
        done = complete_marker(work, "fp8")
        if args.reuse and is_complete(work, "fp8", args):
            log(f"reusing {ckpt_dir(work, 'fp8')}")
        else:
            done.unlink(missing_ok=True)
            tp.quantize_copy(ckpt_dir(work), ckpt_dir(work, "fp8"), args.device)
            done.write_text(stamp(args) + "\n")


def is_complete(work: Path, weights: str, args: argparse.Namespace) -> bool:
    done = complete_marker(work, weights)
    return done.is_file() and done.read_text().strip() == stamp(args)


def write_bf16(args: argparse.Namespace) -> None:
    import torch

    from bench import engine_gpu as eg
    from bench.vision_gpu import random_vl_model
    from hylora.config import ModelConfig
    from hylora.demo import write_tokenizer

    work, ckpt = args.work, ckpt_dir(args.work)
    done = complete_marker(work, "bf16")
    done.unlink(missing_ok=True)
    t0 = time.perf_counter()
    text, vision = shapes(args.tiny, args.layers)
    tok = work / "tok"
    tok.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(tok, 1024)
    token_ids = {
        f"{role}_token_id": tokenizer.token_to_id(f"<|{role}|>") for role in ("vision_start", "vision_end")
    } | {f"{kind}_token_id": tokenizer.token_to_id(f"<|{kind}_pad|>") for kind in ("image", "video")}
    cfg = ModelConfig.from_hf({"model_type": "qwen3_5", "text_config": text, "vision_config": vision, **token_ids})
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = random_vl_model(cfg, dtype, args.device)
    shutil.rmtree(ckpt, ignore_errors=True)
    eg.write_checkpoint(model.to(torch.bfloat16), text, tok, ckpt)
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    tp.vllm_style_config(ckpt, vision, token_ids)
    for name, config in PROCESSOR_CONFIGS.items():
        (ckpt / name).write_text(json.dumps(config, indent=1))
    raw, adapters = work / "raw-video-adapters", adapters_dir(work)
    shutil.rmtree(adapters, ignore_errors=True)
    text_cfg = ModelConfig.from_hf(text)
    for i, name in enumerate(ADAPTERS):
        eg.write_random_adapter(raw / name, text_cfg, rank=RANK, seed=i)
        tp.to_vl_keys(raw / name, adapters / name)
    shutil.rmtree(raw)
    done.write_text(stamp(args) + "\n")
    log(f"checkpoint with its vision tower and {len(ADAPTERS)} adapters written to {work} in "
        f"{time.perf_counter() - t0:.0f}s")  # fmt: skip


def require_ckpt(args: argparse.Namespace) -> Path:
    """The checkpoint of --weights, complete for this run's shape."""
    if not is_complete(args.work, args.weights, args):
        raise SystemExit(
            f"no complete {args.weights} checkpoint for this run in {args.work}: run the ckpt step first "
            f"(with --weights {args.weights})"
        )
    return ckpt_dir(args.work, args.weights)


# --------------------------------------------------------------------------------------------
# phase vllm


def vllm_kwargs(ckpt: Path, attention_backend: str | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=str(ckpt),
        dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MNBT,
        enable_prefix_caching=False,
        gpu_memory_utilization=tp.GPU_MEMORY_UTILIZATION,
        gdn_prefill_backend="triton",
        enable_lora=True,
        max_loras=len(ADAPTERS),
        max_lora_rank=RANK,
        max_cpu_loras=len(ADAPTERS),
        limit_mm_per_prompt={"image": 0, "video": 1},
        disable_log_stats=False,
        seed=0,
    )
    if attention_backend:
        kwargs["attention_backend"] = attention_backend
    return kwargs


def phase_vllm(args: argparse.Namespace) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("vLLM is not importable here (bench/peer/video_gpu.sh installs the carried one)")
    work = args.work
    ckpt = require_ckpt(args)
    data = new_result("vllm", ("vllm", "torch", "torchvision", "transformers"), args)
    notes: Any = ep.Notes(data)  # takes the place of throughput_peer's Record
    backend = args.attention_backend or tp.attention_fallback(tp.Work(work), notes, write_stub=not args.dry_run)
    kwargs = vllm_kwargs(ckpt, backend)
    data["settings"] = {k: v for k, v in kwargs.items() if k != "model"}
    if args.dry_run:
        tp.check_vllm_args(kwargs)
        return
    if importlib.util.find_spec("torchvision") is None:
        raise SystemExit("torchvision is not importable: vLLM's Qwen3-VL video processor needs it")
    save(work, data)
    try:
        videos = make_videos(args.tiny, args.rate, full_warm_up=args.full_warm_up)
        run_vllm(work, ckpt, kwargs, data, videos, args.patterns)
    except BaseException as e:
        data["error"] = f"{type(e).__name__}: {e}"[:2000]
        save(work, data)
        raise


def run_vllm(
    work: Path, ckpt: Path, kwargs: dict[str, Any], data: dict[str, Any], videos: Videos, patterns: list[str]
) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind

    log("LLM(", kwargs, ")")
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    data.update(startup_s=time.perf_counter() - t0, card=tp.card("cuda"))
    save(work, data)
    engine = llm.llm_engine
    loras = {a: LoRARequest(a, i + 1, str(adapters_dir(work) / a)) for i, a in enumerate(ADAPTERS)}

    def submit(job: Job) -> None:
        frames = videos.frames[job.video]
        meta = {"fps": videos.fps, "total_num_frames": len(frames), "frames_indices": list(range(len(frames))),
                "duration": len(frames) / videos.fps, "video_backend": "opencv", "do_sample_frames": False}  # fmt: skip
        prompt = TokensPrompt(
            prompt_token_ids=prompt_ids(ckpt, job.video),
            multi_modal_data={"video": (frames, meta)},
            multi_modal_uuids={"video": [f"video-{job.video}"]},
        )
        params = SamplingParams(
            max_tokens=videos.max_tokens if not job.request_id.startswith("warm") else 4,
            temperature=0.0, ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.DELTA,
        )  # fmt: skip
        # as LLM.generate adds a request (the renderer runs the multimodal processor), one at a time
        rendered = llm._preprocess_cmpl_one(prompt)
        engine.add_request(job.request_id, rendered, params, lora_request=loras[job.adapter])

    def step() -> list[Event]:
        events = []
        for out in engine.step():
            n = sum(len(c.token_ids) for c in out.outputs)
            prompt = len(out.prompt_token_ids) if out.prompt_token_ids is not None else None
            events.append(Event(out.request_id, n, out.finished, prompt))
        return events

    def stats() -> dict[str, Any]:
        found: dict[str, float] = {}
        with contextlib.suppress(Exception):
            for m in llm.get_metrics():
                if ("mm_cache" in m.name or "encoder" in m.name or "preempt" in m.name) and hasattr(m, "value"):
                    found[m.name] = found.get(m.name, 0.0) + float(m.value)
        return found

    run_patterns(work, data, Side(submit, step, engine.has_unfinished_requests, stats), videos, patterns)
    with contextlib.suppress(Exception):
        engine.engine_core.shutdown()


# --------------------------------------------------------------------------------------------
# phase hylora


def phase_hylora(args: argparse.Namespace) -> None:
    import torch

    from bench.video_workload_gpu import StepMix
    from hylora.engine import EngineConfig, LLMEngine, SamplingParams
    from hylora.engine.multimodal import build_multimodal_prompt
    from hylora.kernels import KernelsConfig, as_text
    from hylora.media import MediaConfig, MediaLimits
    from hylora.media.processor import process_frames
    from hylora.media.prompt import VisionTokens, expand_prompt_ids
    from hylora.tokenizer import load_tokenizer

    work, device = args.work, args.device
    ckpt = require_ckpt(args)
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    data = new_result("hylora", ("torch", "triton", "transformers", "fla-core"), args)
    save(work, data)
    videos = make_videos(args.tiny, args.rate, profile=args.profile, full_warm_up=args.full_warm_up)
    config = EngineConfig(
        max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MNBT,
        max_loras=len(ADAPTERS), max_lora_rank=RANK, enable_prefix_caching=False, device=device,
        dtype="bfloat16" if device.startswith("cuda") else "float32", kernels=KernelsConfig(**args.kernels),
        encode_media_ahead=args.encode_media_ahead,
    )  # fmt: skip
    data["settings_asked"] = {"kernels": args.kernels, "encode_media_ahead": args.encode_media_ahead}
    t0 = time.perf_counter()
    engine = LLMEngine(ckpt, config, {a: adapters_dir(work) / a for a in ADAPTERS}, progress=False)
    tp.sync(device)
    data.update(startup_s=time.perf_counter() - t0, card=tp.card(device), kernels=as_text(engine.kernels))
    data["served_as"] = engine.quantization or config.dtype
    data["settings"] = {"max_num_batched_tokens": engine.config.max_num_batched_tokens, "kv_pages": engine.kv.num_pages}
    save(work, data)
    media, limits = MediaConfig.from_model_dir(ckpt), MediaLimits()
    tokenizer = load_tokenizer(ckpt)
    tokens = VisionTokens.from_tokenizer(tokenizer)
    vision = engine.model.config.vision
    # Each video's tower input is made once (the server's media cache does the same), on a worker thread
    # while the engine steps, as `hylora serve` and `LLM.chat` preprocess on their media pools; the
    # requests join the engine in arrival order once their video is ready.
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="video-prep")
    processed: dict[int, Future] = {}
    waiting: collections.deque[Job] = collections.deque()
    counted: set[int] = set()  # the videos whose worker seconds are in host["prepare_s"]
    host = {"prepare_s": 0.0, "engine_add_s": 0.0}  # worker seconds (overlapped); seconds the steps waited

    def prepare(video: int) -> tuple[Any, float]:
        """(the video's tower input, the worker's seconds on it)."""
        t = time.perf_counter()
        return process_frames(videos.frames[video], videos.fps, media, limits), time.perf_counter() - t

    def submit(job: Job) -> None:
        if job.video not in processed:
            processed[job.video] = pool.submit(prepare, job.video)
        waiting.append(job)

    def add_ready(block: bool) -> None:
        """Add the waiting requests whose video is ready, in order; `block`: wait for the first."""
        while waiting and (block or processed[waiting[0].video].done()):
            job = waiting.popleft()
            item, seconds = processed[job.video].result()
            if job.video not in counted:  # a video's preprocessing, once
                counted.add(job.video)
                host["prepare_s"] += seconds
            t = time.perf_counter()
            ids = expand_prompt_ids(prompt_ids(ckpt, job.video), [item], tokenizer, tokens)
            max_tokens = videos.max_tokens if not job.request_id.startswith("warm") else 4
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            mm = build_multimodal_prompt(ids, [item], vision)
            engine.add_request(job.request_id, ids, params, job.adapter, mm=mm)
            host["engine_add_s"] += time.perf_counter() - t
            block = False

    def step() -> list[Event]:
        add_ready(block=not engine.has_unfinished())
        return [
            Event(o.request_id, len(o.new_token_ids), o.finished, len(o.prompt_token_ids), o.error)
            for o in engine.step()
        ]

    mix = StepMix(engine)  # each forward's and tower call's device time (CUDA events), to set against the wall

    def stats() -> dict[str, Any]:
        s, m = engine.stats(), mix.totals()
        keys = ("forwards", "with_prefill_device_s", "decode_only_device_s", "tower_device_s", "tower_host_s")
        device = {k: m[k] for k in (*keys, "tower_calls", "tower_tokens", "tower_per_call")}
        return {
            "encoder_hits": s.encoder_hits, "encoder_misses": s.encoder_misses, "preemptions": s.preemptions,
            "engine_step_s": s.step_seconds, "engine_steps": s.engine_steps, **host, **device,
        }  # fmt: skip

    def busy() -> bool:
        return bool(waiting) or engine.has_unfinished()

    side = Side(submit, step, busy, stats)
    try:
        run_patterns(work, data, side, videos, args.patterns)
        if args.profile:
            profile_pattern(args.out, data, side, videos.jobs[PROFILED])
            save(work, data)
    finally:
        pool.shutdown(cancel_futures=True)


def profile_pattern(out: Path, data: dict[str, Any], side: Side, jobs: list[Job]) -> None:
    """The jobs (the all-at-once pattern on new videos: the tower runs) under torch.profiler: the kernels
    by name over the whole pattern and how busy the device was, into the result and
    OUT/profiles/video-hylora.md (video_fp8-hylora.md with --weights fp8), the Chrome trace beside it.
    The profiler slows the host: its wall is not the timed pattern's."""
    from bench.peer import decode_profile

    folder = out / "profiles"
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{result_prefix(PREFIX, data['weights'])}-{data['engine']}"  # video-hylora, video_fp8-hylora
    trace = folder / f"{name}.trace.json.gz"
    with decode_profile.profiling(trace):
        records, wall = drive(side, jobs)
    rows = decode_profile.kernel_summary(trace, 1)
    busy = decode_profile.device_busy(trace)
    failed = sum(r["error"] is not None for r in records)
    data["profile"] = {"pattern": PROFILED, "wall_s": wall, "failed": failed, "kernels": rows, **busy}
    title = (
        f"{data['engine']}, {len(jobs)} requests at once on new videos, under the profiler (wall {wall:.2f} s; "
        f"device busy {busy['busy_ms']:.0f} of {busy['span_ms']:.0f} ms)"
    )
    (folder / f"{name}.md").write_text(decode_profile.summary_md(title, rows, "pattern"))
    top = ", ".join(f"{r['kernel'][:40]} {r['us_per_step'] / 1e3:.0f} ms" for r in rows[:6])
    log(f"{data['engine']} profiled: device busy {busy['busy_ms']:.0f} of {busy['span_ms']:.0f} ms, {failed} of "
        f"{len(records)} requests failed; top: {top}")  # fmt: skip


# --------------------------------------------------------------------------------------------
# phase table


def run_of(data: dict[str, Any] | None, pattern: str) -> dict[str, Any] | None:
    runs = [r for r in (data or {}).get("runs", []) if r["arrivals"] == pattern]
    return runs[-1] if runs else None


def table_md(found: dict[str, dict[str, Any]], through: str | None = None) -> str:
    """The table of both engines' runs; `through`: how the requests went in, when not through the
    offline engines' add-request calls (video_server_peer.py)."""
    vl, hy = found.get("vllm"), found.get("hylora")
    cards = sorted({d["card"] for d in found.values() if d.get("card")})
    tiny = any(d.get("tiny") for d in found.values())
    layers = "/".join(str(n) for n in sorted({d.get("layers", tp.N_LAYERS) for d in found.values()}))
    weights = "/".join(sorted({d.get("weights", "bf16") for d in found.values()}))
    model = (
        "the bench's small shape, 4 layers, 2-block tower (CPU dry run)"
        if tiny
        else (f"random bf16 weights of the Qwen3.6-27B text shape cut to {layers} layers, the real-size tower")
    ) + (
        ""
        if weights == "bf16"
        else f"; served from its {weights} copy (hylora's `quantize_checkpoint`: e4m3 decoder projections with "
        "128 x 128 block scales; the tower, embeddings, LM head and GDN a / b rows in bf16), the same for both"
    )
    lines = [
        "# vLLM 0.20.2 beside hylora: the video workload" + (f", through {through}" if through else ""),
        "",
        f"Card: {', '.join(cards) or '–'}; measured {', '.join(sorted(d['date'][:10] for d in found.values()))}. "
        f"Model: {model}; adapters relic, tomb, mural (rank {RANK}). Each of 8 videos (20 frames of 1280x720 at "
        "2 fps; tiny: 4 frames of 128x96) analysed by each adapter, 128 greedy tokens; `all`: the 24 requests at "
        "once; `poisson`: 0.5 requests/s. Times in seconds from each request's arrival (host clock). "
        + (
            ""
            if through
            else "Adding: the host seconds in the engines' add request (vLLM: preprocessing included, while its "
            "engine core process steps on; hylora: prompt expansion, its media preprocessed on a worker thread "
            "as its server does, while its steps wait). "
        )
        + "Ratios: hylora / vLLM for throughput, vLLM / hylora for latency (> 1: hylora better).",
        "",
        "| arrivals | engine | out tok/s | prompt tok/s | TTFT p50 / p99 | E2E p50 / p99 | TPOT p50 (ms) "
        "| adding (s) | prompt tokens | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in PATTERNS:
        for engine, d in (("vLLM", vl), ("hylora", hy)):
            r = run_of(d, p)
            if r is None:
                lines.append(f"| {p} | {engine} | – | – | – | – | – | – | – | – |")
                continue
            t, e, tpot = r["ttft_s"], r["e2e_s"], r["tpot_s"]
            add_s = (r.get("counters") or {}).get("engine_add_s", r.get("add_s"))  # hylora: the steps' wait
            adding = f"{add_s:.2f}" if add_s is not None else "–"
            lines.append(
                f"| {p} | {engine} | {r['out_tok_s']:.0f} | {r['prompt_tok_s']:.0f} "
                f"| {t.get('p50', 0):.2f} / {t.get('p99', 0):.2f} | {e.get('p50', 0):.2f} / {e.get('p99', 0):.2f} "
                f"| {1e3 * tpot.get('p50', 0):.1f} | {adding} | {'/'.join(map(str, r['prompt_tokens']))} "
                f"| {r['failed']} |"
            )
        v, h = run_of(vl, p), run_of(hy, p)
        if v and h:
            thr = h["out_tok_s"] / v["out_tok_s"]
            p99 = v["e2e_s"]["p99"] / h["e2e_s"]["p99"]
            ttft = v["ttft_s"]["p99"] / h["ttft_s"]["p99"]
            lines.append(f"| {p} | ratio | {thr:.2f} | | p99 {ttft:.2f} | p99 {p99:.2f} | | | | |")
    warm_up = {"warm-up": lambda d: f"{d['warm_up_s']:.0f} s" if "warm_up_s" in d else "–"}
    lines += ["", *ep.status_rows(found, warm_up)]
    return "\n".join(lines) + "\n"


def phase_table(args: argparse.Namespace) -> None:
    prefix = result_prefix(PREFIX, args.weights)
    ep.phase_table(args, prefix, table_md, f"{prefix}_peer.md")


def child_flags(args: argparse.Namespace) -> list[str]:
    """add_args' flags as the run phase hands them to its steps."""
    extra = ["--layers", str(args.layers), "--patterns", ",".join(args.patterns), "--weights", args.weights]
    extra += ["--rate", str(args.rate)] if args.rate else []
    extra += ["--kernels", tp.kernel_switches(args.kernels)] if args.kernels else []
    return extra + ([] if args.encode_media_ahead else ["--no-encode-media-ahead"])


def phase_run(args: argparse.Namespace) -> None:
    ep.phase_run(args, Path(__file__).resolve(), MIN_LEFT_S, child_flags(args) + ["--profile"] * args.profile)
    phase_table(args)


PHASES = {
    "ckpt": phase_ckpt,
    "vllm": phase_vllm,
    "hylora": ep.guarded(phase_hylora, lambda args: result_prefix(PREFIX, args.weights), "runs"),
    "table": phase_table,
    "run": phase_run,
}


def patterns(text: str) -> list[str]:
    """--patterns: a comma-separated subset of PATTERNS, in the order given."""
    names = [p for p in text.split(",") if p]
    if not names or any(p not in PATTERNS for p in names):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated, each one of {', '.join(PATTERNS)}")
    return names


def add_args(ap: argparse.ArgumentParser) -> None:
    """This bench's own flags (video_server_peer.py takes them too)."""
    ap.add_argument(
        "--patterns",
        type=patterns,
        default=list(PATTERNS),
        help=f"the arrival patterns to run, comma-separated (default {','.join(PATTERNS)})",
    )
    ap.add_argument("--rate", type=float, default=None, help="poisson arrivals, requests/s (default 0.5; tiny 4)")
    ap.add_argument("--layers", type=int, default=tp.N_LAYERS, help="decoder layers of the 27B shape (ckpt)")
    ap.add_argument(
        "--weights",
        choices=WEIGHTS,
        default="bf16",
        help="the checkpoint both engines serve: bf16, or its block-FP8 copy (ckpt: written from the bf16 one; "
        "results video_fp8-<engine>.json, table video_fp8_peer.md)",
    )
    ap.add_argument(
        "--kernels",
        type=tp.kernel_overrides,
        default={},
        help="hylora: KernelsConfig fields, e.g. tower_attention=cudnn (a same-machine comparison)",
    )
    ap.add_argument(
        "--full-warm-up",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="warm up with the all-at-once pattern on full-size videos of its own (4 tokens each; "
        "--no-full-warm-up: one short video per adapter, as up to run 63): most kernels an engine compiles at "
        "first use compile before the clock, not all (vLLM's DeepGEMM with VLLM_DEEP_GEMM_WARMUP=skip met new "
        "configurations in run 64 a's measured steps: start it a second time on the machine, as run 64 c)",
    )
    ap.add_argument(
        "--encode-media-ahead",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="hylora: EngineConfig.encode_media_ahead (a video's later temporal patches with its first)",
    )


def add_own_args(ap: argparse.ArgumentParser) -> None:
    """add_args and the flags of this bench alone."""
    add_args(ap)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="hylora: after the timed patterns, the all-at-once pattern on new videos under torch.profiler "
        "(kernels by name into OUT/profiles/video-hylora.md)",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return ep.parse_args(__doc__, list(PHASES), "/tmp/videopeer_out", add_own_args, argv)


def main() -> None:
    tp.run_phase(PHASES, parse_args())


if __name__ == "__main__":
    main()

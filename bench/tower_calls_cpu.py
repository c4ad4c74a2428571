"""How the engine's schedule cuts the users' video workload into vision-tower calls, on a CPU.

The users' workload (bench/video_workload_gpu.py: 8 videos of 20 720p frames, 8,800 visual tokens in
10 temporal patches each, every video sent to the three task adapters, all at once) scheduled as on a
GPU (8192 batched tokens a step, 16384 encoder tokens, 24 sequences), with and without
`encode_media_ahead`. The demo model stands in for the 27B (its tower has the same patch, merge and
temporal sizes, so the same tokens and segments): which steps call the tower, and how many temporal
patches each call encodes, do not depend on the weights. The GPU time those calls cost is
bench/tower_gpu.py's (one call against one per temporal patch).

    python bench/tower_calls_cpu.py [--videos 8] [--max-tokens 4]      # ~3 min a setting on 2 cores

Prints one row per setting: tower calls, temporal patches per call, encoder-cache hits / misses.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.video_workload_gpu import ADAPTERS, FULL, StepMix, drive, synthetic_video, video_jobs  # noqa: E402
from hylora.config import ModelConfig  # noqa: E402
from hylora.demo import ensure_demo  # noqa: E402
from hylora.engine import EngineConfig, LLMEngine  # noqa: E402
from hylora.tokenizer import load_tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--videos", type=int, default=FULL.videos)
    ap.add_argument("--max-tokens", type=int, default=4, help="per request (the tower calls come in prefill)")
    args = ap.parse_args()
    demo = ensure_demo()
    cfg = ModelConfig.from_dir(demo)
    assert cfg.vision is not None
    text_limit = min(load_tokenizer(demo).all_special_ids)
    base = synthetic_video(FULL.frames, FULL.height, FULL.width)
    jobs = video_jobs(base, range(args.videos), args.videos, FULL.frames, cfg.vision, text_limit, "all")
    item = jobs[0].item
    segment_rows = item.tokens_per_frame
    print(
        f"{args.videos} videos x {len(ADAPTERS)} adapters, grid {item.grid_thw} ({item.num_tokens} visual tokens, "
        f"{segment_rows} a temporal patch), prompts of {len(jobs[0].ids)} tokens; {time.strftime('%Y-%m-%d')}",
        flush=True,
    )
    print("| encode_media_ahead | tower calls | temporal patches per call | encoder hits / misses | CPU s |")
    print("| --- | --- | --- | --- | --- |")
    for ahead in (False, True):
        config = EngineConfig(
            device="cpu", dtype="float32", max_model_len=len(jobs[0].ids) + args.max_tokens,
            max_num_seqs=len(jobs), max_num_batched_tokens=8192, max_num_encoder_tokens=16384,
            max_loras=len(ADAPTERS), max_lora_rank=16, encode_media_ahead=ahead,
        )  # fmt: skip
        engine = LLMEngine(demo, config, {a: demo / "adapters" / a for a in ADAPTERS}, progress=False)
        mix = StepMix(engine)
        t0 = time.perf_counter()
        records, _ = drive(engine, jobs, args.max_tokens)
        totals = mix.detach()
        failed = [r["request"] for r in records if r["error"]]
        assert not failed, failed
        patches = [rows // segment_rows for rows, _, _ in totals["tower_per_call"]]
        stats = engine.stats()
        print(
            f"| {'on' if ahead else 'off'} | {len(patches)} | {', '.join(map(str, patches))} | "
            f"{stats.encoder_hits} / {stats.encoder_misses} | {time.perf_counter() - t0:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

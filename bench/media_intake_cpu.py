"""The server's media intake under load, on this machine's CPU (no GPU, no model weights): what `hylora serve`
does between a video request's arrival and its submission to the engine, for many requests at once, and what
that costs an engine thread beside it.

The video workload's requests (docs/PEER.md): `--videos` videos of 20 frames of 1280x720, each sent as its
JPEG frames in one `data:video/jpeg;base64,...` URL (5.2 MB) by `--per-video` requests (the three task
adapters), all at once. Each request goes through what the server runs: `json.loads` of the body on the event
loop, `ChatCompletionRequest` validation on a worker thread, then `chat_input.multimodal_prompt` on the
server's media pools (base64, JPEG decoding, resizing, patch rows, the chat template, placeholder expansion;
the preprocessed-media cache shares a video between its requests). Qwen3.5's video processor config (720p
keeps its size), the demo's tokenizer.

Beside it, an engine-like thread: short torch ops that release the GIL, in rounds of 2000 (as a GPU step's
kernel launches do), timed alone and during the intake. Printed: when each request's prompt was ready, and
the rounds' times.

    python bench/media_intake_cpu.py [--videos 8] [--per-video 3] [--frame-threads N] [--frame-processes N]
        [--out media_intake.json]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.media_cpu import QWEN35_VIDEO, jpegs  # noqa: E402
from bench.video_workload_gpu import FULL, video_frames  # noqa: E402
from bench.vision_gpu import VISION_27B, synthetic_video  # noqa: E402
from hylora.config import VisionConfig  # noqa: E402
from hylora.demo import ensure_demo  # noqa: E402
from hylora.engine.chat_input import MediaSettings, multimodal_prompt  # noqa: E402
from hylora.media import MediaConfig, MediaPools, VisionTokens  # noqa: E402
from hylora.media.cache import ProcessedCache  # noqa: E402
from hylora.server.protocol import ChatCompletionRequest  # noqa: E402
from hylora.tokenizer import load_tokenizer  # noqa: E402

OPS = 2000  # GIL-releasing torch ops per round of the engine-like thread


def request_bodies(videos: int, per_video: int) -> list[bytes]:
    base = synthetic_video(FULL.frames, FULL.height, FULL.width)
    bodies = []
    for v in range(videos):
        parts = [base64.b64encode(j).decode() for j in jpegs(video_frames(base, v, videos, FULL.frames))]
        content = [
            {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64," + ",".join(parts)}},
            {"type": "text", "text": f"What is shown? (clip {v})"},
        ]
        body = {"model": "relic", "messages": [{"role": "user", "content": content}], "max_tokens": 128}
        bodies += [json.dumps(body).encode()] * per_video
    return bodies


def op_round(x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    for _ in range(OPS):
        x.add_(1)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--videos", type=int, default=8)
    ap.add_argument("--per-video", type=int, default=3)
    ap.add_argument("--frame-threads", type=int, default=None, help="the frame pool's size (default: one per core)")
    ap.add_argument("--frame-processes", type=int, default=None,
                    help="frame processes (default: the server's, one a core from 4 cores; 0: threads)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)

    demo = ensure_demo()
    tokenizer = load_tokenizer(demo)
    tokens = VisionTokens.from_tokenizer(tokenizer)
    ids = {"image_token_id": tokens.image_pad, "video_token_id": tokens.video_pad}
    ids |= {"vision_start_token_id": tokens.vision_start, "vision_end_token_id": tokens.vision_end}
    processes = "auto" if args.frame_processes is None else args.frame_processes
    settings = MediaSettings(
        config=MediaConfig(video=QWEN35_VIDEO),
        vision=VisionConfig.from_hf({"vision_config": VISION_27B} | ids),  # the real tower, the demo's token ids
        tokens=tokens,
        processor_kwargs={"fps": 2.0},
        pools=MediaPools(frame_threads=args.frame_threads, frame_processes=processes),
        cache=ProcessedCache.from_gb(4.0),
    )
    bodies = request_bodies(args.videos, args.per_video)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{len(bodies)} requests of {len(bodies[0]) / 1e6:.1f} MB ({args.videos} videos); {cpus} CPUs; "
          f"media pools {settings.pools.sizes}", flush=True)  # fmt: skip

    async def one(raw: bytes, t0: float) -> float:
        payload = json.loads(raw)  # the event loop's share, as Starlette's Request.json
        await asyncio.to_thread(ChatCompletionRequest.model_validate, payload)
        await multimodal_prompt(settings, tokenizer, payload["messages"])
        return time.perf_counter() - t0

    async def intake() -> list[float]:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(one(b, t0) for b in bodies)))

    x = torch.zeros(16)
    alone = [op_round(x) for _ in range(20)]
    done, ready = threading.Event(), []

    def run_intake() -> None:
        ready.extend(asyncio.run(intake()))
        done.set()

    thread = threading.Thread(target=run_intake)
    thread.start()
    beside = []
    while not done.is_set():
        beside.append(op_round(x))
    thread.join()
    settings.pools.close()

    def ms(seconds: float) -> float:
        return round(1e3 * seconds, 2)

    result = {
        "requests": len(bodies),
        "cpus": cpus,
        "ready_s": sorted(round(r, 3) for r in ready),
        "intake_s": max(ready),
        "ops_round_alone_ms": ms(statistics.median(alone)),
        "ops_round_beside_ms": {
            "median": ms(statistics.median(beside)),
            "mean": ms(statistics.mean(beside)),
            "max": ms(max(beside)),
            "rounds": len(beside),
        },  # fmt: skip
        "date": time.strftime("%Y-%m-%d"),
    }
    print(f"prompts ready after (s): {result['ready_s']}")
    print(f"all {len(bodies)} ready in {result['intake_s']:.2f} s; {OPS} GIL-releasing ops a round: "
          f"{result['ops_round_alone_ms']} ms alone, beside the intake {result['ops_round_beside_ms']}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

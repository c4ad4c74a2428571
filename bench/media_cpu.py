"""Host time to turn one video into the tower's input, on this machine's CPU: what a server spends per
new video before the GPU sees it (docs/MEDIA.md).

One synthetic clip (default: 10 s of 1280x720 at 30 fps, H.264, made once before timing; the frames of
`bench/vision_gpu.synthetic_video`), taken the ways a request brings a video:
- `process_video`: the mp4 bytes decoded with PyAV (every frame), sampled at the checkpoint's 2 fps,
  resized, patch rows;
- `process_frames`: the decoded frames (what `bench/peer/video_peer.py` hands the engine);
- `process_frame_list`: the sampled frames as JPEGs (vLLM's `data:video/jpeg;base64` frame list);
- the preprocessed-media cache's hit for the same bytes (the second adapter's request);
- what the server does with such a request before its frames decode, each with the GIL held, so the engine
  thread waits it out (docs/SERVING.md): parsing the JSON body, validating it (`ChatCompletionRequest`:
  its check for invalid Unicode walks every string), and splitting the frame list (base64);
- normalising one temporal patch's rows on the host (`ProcessedMedia.rows`; on a GPU it runs there);
- admitting its prompt (~8.9k ids, the video expanded as transformers' processor does): its segments
  and M-RoPE positions (`build_multimodal_prompt`, on the request's thread), and the engine's check of
  its token ids (on the engine thread, between steps).

Median of `--repeats` runs after one untimed. Qwen3.5's video processor config (fps 2, 720p keeps its
size). Prints a table; `--out FILE` writes the numbers as JSON.

    python bench/media_cpu.py [--seconds 10] [--fps 30] [--repeats 5] [--out media_cpu.json]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.vision_gpu import VISION_27B, prompt_for, synthetic_video  # noqa: E402
from hylora.config import VisionConfig  # noqa: E402
from hylora.engine.intake import _token_ids_in  # noqa: E402
from hylora.engine.multimodal import build_multimodal_prompt  # noqa: E402
from hylora.media import MediaConfig, MediaLimits, ProcessedCache, process_video  # noqa: E402
from hylora.media.config import VideoConfig  # noqa: E402
from hylora.media.fetch import frame_bytes, split_frame_list  # noqa: E402
from hylora.media.processor import process_frame_list, process_frames  # noqa: E402
from hylora.server.protocol import ChatCompletionRequest  # noqa: E402

QWEN35_VIDEO = VideoConfig(
    patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=4096, max_pixels=25_165_824,
    image_mean=(0.5,) * 3, image_std=(0.5,) * 3, fps=2, min_frames=4, max_frames=768,
)  # fmt: skip


def encode_mp4(frames: np.ndarray, fps: int) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options={"preset": "veryfast", "crf": "23"})
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def jpegs(frames: np.ndarray) -> list[bytes]:
    from PIL import Image

    out = []
    for frame in frames:
        buf = io.BytesIO()
        Image.fromarray(frame).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--fps", type=int, default=30, help="the clip's frame rate (the checkpoint samples 2 a second)")
    ap.add_argument("--height", type=int, default=720)
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    cfg, limits = MediaConfig(video=QWEN35_VIDEO), MediaLimits()
    t0 = time.perf_counter()
    all_frames = synthetic_video(args.seconds * args.fps, args.height, args.width)
    mp4 = encode_mp4(all_frames, args.fps)
    sampled = all_frames[:: max(1, args.fps // int(QWEN35_VIDEO.fps))]
    frame_jpegs = jpegs(sampled)
    print(f"clip: {len(all_frames)} frames of {args.width}x{args.height} at {args.fps} fps, {len(mp4) / 1e6:.1f} MB "
          f"H.264; {len(sampled)} sampled frames as JPEG {sum(map(len, frame_jpegs)) / 1e6:.1f} MB; "
          f"made in {time.perf_counter() - t0:.1f}s", flush=True)  # fmt: skip

    item = process_video(mp4, cfg, limits)
    cache = ProcessedCache(1 << 30)
    process_video(mp4, cfg, limits, cache=cache)
    _, h, w = item.grid_thw
    vision = VisionConfig.from_hf({"vision_config": VISION_27B})
    ids = prompt_for(item, vision)
    url = "data:video/jpeg;base64," + ",".join(base64.b64encode(j).decode() for j in frame_jpegs)
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What is shown?"}]
    body = json.dumps({"model": "relic", "messages": [{"role": "user", "content": content}]}).encode()
    payload = json.loads(body)
    rows = {
        "process_video (mp4 bytes: decode, sample, resize, rows)": lambda: process_video(mp4, cfg, limits),
        "process_frames (decoded frames)": lambda: process_frames(all_frames, args.fps, cfg, limits),
        "process_frame_list (sampled frames as JPEG, base64 in a data: URL)": lambda: process_frame_list(
            url, cfg, limits, {"fps": QWEN35_VIDEO.fps}
        ),
        "media cache hit (the same mp4 again)": lambda: process_video(mp4, cfg, limits, cache=cache),
        f"the frame list's request body ({len(body) / 1e6:.1f} MB): json.loads": lambda: json.loads(body),
        "... validated (ChatCompletionRequest)": lambda: ChatCompletionRequest.model_validate(payload),
        "... its frame list split and base64-decoded": lambda: [
            frame_bytes(parts, i) for parts in [split_frame_list(url, limits.max_bytes, 768)] for i in range(len(parts))
        ],
        "one temporal patch's rows normalised on the host": lambda: item.rows(0, h * w),
        f"its prompt's segments and positions ({len(ids)} ids)": lambda: build_multimodal_prompt(ids, [item], vision),
        "the engine's check of its prompt ids": lambda: _token_ids_in(ids, 248_320),
    }
    results = {name: timed(fn, args.repeats) for name, fn in rows.items()}
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    header = (f"{platform.processor() or platform.machine()}, {cpus} cores available; grid {item.grid_thw}, "
              f"{item.num_tokens} visual tokens; median of {args.repeats}, {time.strftime('%Y-%m-%d')}")  # fmt: skip
    print(f"\n{header}\n\n| step | host ms |\n| --- | --- |")
    for name, seconds in results.items():
        print(f"| {name} | {1e3 * seconds:.2f} |")
    if args.out:
        settings = vars(args) | {"out": str(args.out)}
        args.out.write_text(json.dumps({"host": header, "seconds": results, "args": settings}, indent=1))


if __name__ == "__main__":
    main()

"""GPU check for images and video (issue 9): a 27B-shape decoder (cut to few layers) with the real-size
vision tower (depth 27, hidden 1152) and a rank-16 task adapter on every text linear, random weights,
bf16. A synthetic 10 s 720p video at 2 fps (20 frames, thousands of visual tokens) goes through the
engine with prompt logprobs:

- dynamic LoRA in bf16 vs the merged-weights model in fp32 (the reference), beside
- the merged-weights model in bf16 vs the same reference (the bf16 yardstick):
  the adapter is served correctly when the first error is no larger than the second;
- every logprob finite; tower time (all segments) and prefill time.

    python bench/vision_gpu.py [--layers 8] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_gpu import QWEN36_27B, write_random_adapter  # noqa: E402
from hylora.adapters.files import read_adapter  # noqa: E402
from hylora.config import ModelConfig  # noqa: E402
from hylora.demo import write_tokenizer  # noqa: E402
from hylora.doctor.merged import touched_rows  # noqa: E402
from hylora.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from hylora.engine.multimodal import build_multimodal_prompt  # noqa: E402
from hylora.kernels import as_text  # noqa: E402
from hylora.media import MediaConfig, MediaLimits  # noqa: E402
from hylora.media.config import VideoConfig  # noqa: E402
from hylora.media.processor import process_frames  # noqa: E402
from hylora.model.decoder import HybridDecoder  # noqa: E402

VISION_27B = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=5120)
# Qwen3.5's video processor config (VISION.md): the pixel budget covers all frames together
VIDEO = VideoConfig(min_pixels=4096, max_pixels=25_165_824, image_mean=(0.5,) * 3, image_std=(0.5,) * 3)


def random_vl_model(cfg: ModelConfig, dtype: torch.dtype, device: str = "cuda") -> HybridDecoder:
    with torch.device("meta"):
        model = HybridDecoder(cfg, vision=True)
    g = torch.Generator(device=device).manual_seed(0)
    for name, p in list(model.named_parameters()):
        if name.endswith("A_log"):
            t = torch.empty(p.shape, device=device).uniform_(0.01, 16, generator=g).log()
        elif name.endswith("dt_bias") or name.startswith("visual.") and ("norm" in name) and name.endswith("weight"):
            t = torch.ones(p.shape, device=device)
        elif name.endswith("bias"):
            t = torch.zeros(p.shape, device=device)
        elif "norm" in name:
            t = torch.zeros(p.shape, device=device) + (1.0 if "linear_attn.norm" in name else 0.0)
        else:
            fan_in = math.prod(p.shape[1:]) if p.ndim > 1 else 1
            std = 0.02 if p.ndim < 2 or "embed" in name or "lm_head" in name else 1.0 / math.sqrt(fan_in)
            t = torch.randn(p.shape, device=device, generator=g) * std
        keep_fp32 = name.endswith(("A_log", "dt_bias"))
        module, _, attr = name.rpartition(".")
        value = torch.nn.Parameter(t if keep_fp32 else t.to(dtype), requires_grad=False)
        setattr(model.get_submodule(module), attr, value)
    return model.eval()


@torch.inference_mode()
def fold(model: HybridDecoder, adapter_dir: Path) -> None:
    """Merge the adapter into the weights for good (fp32 sum, one rounding), on the rows each
    projection owns (the placement doctor's in-place merge uses)."""
    params = dict(model.named_parameters())
    for rows, w in touched_rows(model, read_adapter(adapter_dir, model.config)):
        block = params[rows.param].data[rows.start : rows.start + rows.count]
        block.copy_((block.float() + w.delta(block.device).reshape(block.shape)).to(block.dtype))


def synthetic_video(frames: int = 20, height: int = 720, width: int = 1280) -> np.ndarray:
    """A lamp-lit corridor: a gradient, a bright block moving across, noise."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width]
    out = np.empty((frames, height, width, 3), dtype=np.uint8)
    for i in range(frames):
        base = (40 + 80 * x / width + 20 * np.sin(y / 37 + i / 3)).astype(np.float32)
        img = np.stack([base * 1.2, base, base * 0.7], axis=-1)
        x0 = 60 + i * 55
        img[200:520, x0 : x0 + 140] = (210, 180, 100)
        img += rng.normal(0, 6, img.shape)
        out[i] = np.clip(img, 0, 255).astype(np.uint8)
    return out


def prompt_for(item, vision, seed: int = 0) -> list[int]:
    """Text, then the video expanded as transformers' processor does (a timestamp, then each
    temporal patch inside its own start/end, all inside the template's outer start/end), then text."""
    g = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(0, 200_000, (n,), generator=g).tolist()

    ids = text(20) + [vision.vision_start_token_id]
    for _ in range(item.grid_thw[0]):
        ids += text(5) + [vision.vision_start_token_id] + [vision.video_token_id] * item.tokens_per_frame
        ids += [vision.vision_end_token_id]
    return ids + [vision.vision_end_token_id] + text(30)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(model, tokdir, adapter_dir, ids, mm_of, adapter: str | None, label: str) -> dict:
    lora = {"survey": adapter_dir} if adapter else None
    config = EngineConfig(
        max_model_len=16384, max_num_seqs=2, max_num_batched_tokens=4096, num_pages=1100, max_lora_rank=16
    )
    engine = LLMEngine(tokdir, config, lora, progress=False, model=model)
    tower_s = []
    real = model.visual.forward

    def timed(*args, **kwargs):
        sync()
        t0 = time.perf_counter()
        out = real(*args, **kwargs)
        sync()
        tower_s.append(time.perf_counter() - t0)
        return out

    model.visual.forward = timed
    engine.add_request("v", ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), adapter, mm=mm_of())
    sync()
    t0 = time.perf_counter()
    out = None
    while out is None:
        for o in engine.step():
            if o.finished:
                out = o
    sync()
    wall = time.perf_counter() - t0
    model.visual.forward = real
    if out.error:
        raise RuntimeError(out.error)
    logprobs = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]], dtype=torch.float64)
    print(f"{label}: kernels {as_text(engine.kernels)}", flush=True)
    return {
        "label": label,
        "logprobs": logprobs,
        "finite": bool(torch.isfinite(logprobs).all()),
        "tower_s": sum(tower_s),
        "tower_calls": len(tower_s),
        "prefill_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU run of the script's logic)")
    ap.add_argument("--out")
    args = ap.parse_args()
    shape = dict(QWEN36_27B, num_hidden_layers=args.layers)
    vision = VISION_27B
    frames = synthetic_video()
    if args.smoke:
        shape |= dict(hidden_size=256, intermediate_size=512, linear_num_value_heads=4, linear_num_key_heads=2)
        shape |= dict(
            num_attention_heads=4, head_dim=64, rope_parameters=dict(shape["rope_parameters"], mrope_section=[4, 2, 2])
        )
        vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=256)
        frames = synthetic_video(8, 96, 128)
    cfg = ModelConfig.from_hf({"model_type": "qwen3_5", "text_config": shape, "vision_config": vision})
    work = Path(tempfile.mkdtemp())
    write_tokenizer(work, 1024)
    (work / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": shape}))
    write_random_adapter(work / "survey", cfg, rank=16, seed=3)

    t0 = time.perf_counter()
    item = process_frames(frames, 2.0, MediaConfig(video=VIDEO), MediaLimits())
    preprocess_s = time.perf_counter() - t0
    ids = prompt_for(item, cfg.vision)
    visual = item.num_tokens
    print(
        f"video: grid {item.grid_thw}, {visual} visual tokens, prompt {len(ids)} tokens, preprocessed in "
        f"{preprocess_s:.2f}s",
        flush=True,
    )

    def mm_of():
        return build_multimodal_prompt(ids, [item], cfg.vision)

    rows = {}
    for label, dtype, merged, adapter in [
        ("merged fp32 (reference)", torch.float32, True, None),
        ("merged bf16", torch.bfloat16, True, None),
        ("dynamic LoRA bf16", torch.bfloat16, False, "survey"),
    ]:
        model = random_vl_model(cfg, dtype, args.device)
        if merged:
            fold(model, work / "survey")
        rows[label] = run(model, work, work / "survey", ids, mm_of, adapter, label)
        del model
        torch.cuda.empty_cache()
    ref = rows["merged fp32 (reference)"]["logprobs"]
    table = []
    for label, r in rows.items():
        err = (r["logprobs"] - ref).abs()
        table.append(
            {
                "run": label,
                "finite": r["finite"],
                "max_abs_dlogprob_vs_fp32_merged": float(err.max()),
                "mean_abs_dlogprob_vs_fp32_merged": float(err.mean()),
                "tower_s": round(r["tower_s"], 3),
                "tower_calls": r["tower_calls"],
                "prefill_s": round(r["prefill_s"], 3),
            }
        )
    print(f"{'run':28} {'finite':>6} {'max|dlp|':>10} {'mean|dlp|':>10} {'tower s':>8} {'prefill s':>9}")
    for t in table:
        print(
            f"{t['run']:28} {t['finite']!s:>6} {t['max_abs_dlogprob_vs_fp32_merged']:10.4f} "
            f"{t['mean_abs_dlogprob_vs_fp32_merged']:10.5f} {t['tower_s']:8.3f} {t['prefill_s']:9.3f}"
        )
    dyn, merged = table[2], table[1]
    verdict = dyn["mean_abs_dlogprob_vs_fp32_merged"] <= 1.1 * merged["mean_abs_dlogprob_vs_fp32_merged"]
    print(f"dynamic LoRA error within the bf16 yardstick (mean, 10% slack): {verdict}")
    result = {
        "card": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "layers": args.layers,
        "video": {"frames": 20, "size": [720, 1280], "grid_thw": list(item.grid_thw), "visual_tokens": visual},
        "prompt_tokens": len(ids),
        "preprocess_s": preprocess_s,
        "rows": table,
        "dynamic_within_yardstick": verdict,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

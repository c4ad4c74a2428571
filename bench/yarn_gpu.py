"""YaRN M-RoPE on the GPU: hylora's engine (its kernels as served) on a tiny random Qwen3.5 checkpoint with
`rope_type: yarn` (a 64-position context stretched 4x) against transformers' fp32 logits (on the GPU: with
fla installed, transformers on the CPU would route to its Triton kernels and fail); the same weights served
plain with `--hf-overrides` giving the YaRN model; and the plain model against transformers' plain one, for
the scale of the GPU's own fp32 / bf16 differences. Prints one table.

    python3 bench/yarn_gpu.py        (on the device: PYTHONPATH with .gpuwhl's packages, as doctor_gpu.sh)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from transformers import Qwen3_5ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hylora.engine import EngineConfig, LLMEngine  # noqa: E402
from tests.conftest import TEXT_CONFIG, write_causal  # noqa: E402
from tests.helpers import hylora_logits, random_ids  # noqa: E402

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def main() -> int:
    tmp = Path(tempfile.mkdtemp())
    yarn_ref = write_causal(
        tmp / "yarn", max_position_embeddings=64, rope_parameters=TEXT_CONFIG["rope_parameters"] | YARN
    )
    write_causal(tmp / "plain")  # the same weights (seed 0), plain M-RoPE in its config.json
    yarn_ref = yarn_ref.float().cuda()
    plain_ref = Qwen3_5ForCausalLM.from_pretrained(tmp / "plain", dtype=torch.float32).cuda()
    overrides = {"max_position_embeddings": 64, "rope_parameters": YARN}
    runs = [
        ("yarn checkpoint", tmp / "yarn", None, yarn_ref),
        ("plain + --hf-overrides", tmp / "plain", overrides, yarn_ref),
        ("plain, for scale", tmp / "plain", None, plain_ref),
    ]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| served | dtype | tokens | max abs diff vs transformers fp32 | max abs logit | finite |")
    print("| --- | --- | --- | --- | --- | --- |")
    worst = {}
    for served, path, over, reference in runs:
        for dtype in ("float32", "bfloat16"):
            # a few pages: by default an engine takes 90 % of the card and the next one would find none
            config = EngineConfig(device="cuda", dtype=dtype, max_model_len=256, num_pages=64, hf_overrides=over)
            engine = LLMEngine(path, config, progress=False)
            for n in (1, 65, 250):
                ids = random_ids(n, engine.model.config.vocab_size, seed=n)
                ours = hylora_logits(engine.model, ids).float().cpu()
                theirs = reference(torch.tensor([ids], device="cuda")).logits[0].float().cpu()
                diff = (ours - theirs).abs().max().item()
                key = (served, dtype)
                worst[key] = max(worst.get(key, 0.0), diff / theirs.abs().max().item())
                finite = bool(torch.isfinite(ours).all())
                print(f"| {served} | {dtype} | {n} | {diff:.2e} | {theirs.abs().max().item():.2f} | {finite} |")
            del engine
            torch.cuda.empty_cache()
    for key, value in worst.items():
        print(f"worst relative difference, {key[0]}, {key[1]}: {value:.2e}")
    # YaRN's rows no further from their reference than the plain model's from its own (+ 50 %)
    ok = all(worst[(s, d)] <= 1.5 * worst[("plain, for scale", d)] + 1e-6 for s, _, _, _ in runs[:2]
             for d in ("float32", "bfloat16"))  # fmt: skip
    print("YaRN within the plain model's own GPU difference:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

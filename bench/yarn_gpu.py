"""YaRN M-RoPE on the GPU: hylora's engine (its kernels as served) on a tiny random Qwen3.5 checkpoint with
`rope_type: yarn` (a 64-position context stretched 4x) against transformers' fp32 logits on the CPU, and the
same checkpoint served plain with `--hf-overrides` giving the YaRN model. Prints one table.

    python3 bench/yarn_gpu.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hylora.engine import EngineConfig, LLMEngine  # noqa: E402
from tests.conftest import TEXT_CONFIG, write_causal  # noqa: E402
from tests.helpers import hf_logits, hylora_logits, random_ids  # noqa: E402

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def main() -> int:
    tmp = Path(tempfile.mkdtemp())
    ref = write_causal(tmp / "yarn", max_position_embeddings=64, rope_parameters=TEXT_CONFIG["rope_parameters"] | YARN)
    write_causal(tmp / "plain")  # the same weights (seed 0), plain M-RoPE in its config.json
    overrides = {"max_position_embeddings": 64, "rope_parameters": YARN}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| served | dtype | tokens | max abs diff vs transformers fp32 | max abs logit | finite |")
    print("| --- | --- | --- | --- | --- | --- |")
    worst = 0.0
    for served, path, over in (
        ("yarn checkpoint", tmp / "yarn", None),
        ("plain + --hf-overrides", tmp / "plain", overrides),
    ):
        for dtype in ("float32", "bfloat16"):
            config = EngineConfig(device="cuda", dtype=dtype, max_model_len=256, hf_overrides=over)
            engine = LLMEngine(path, config, progress=False)
            for n in (1, 65, 250):
                ids = random_ids(n, ref.config.vocab_size, seed=n)
                ours = hylora_logits(engine.model, ids).float().cpu()
                theirs = hf_logits(ref, ids)
                diff = (ours - theirs).abs().max().item()
                if dtype == "float32":  # bf16 rows are shown against the same fp32 reference, for scale
                    worst = max(worst, diff / theirs.abs().max().item())
                print(
                    f"| {served} | {dtype} | {n} | {diff:.2e} | {theirs.abs().max().item():.2f} | "
                    f"{bool(torch.isfinite(ours).all())} |"
                )
            del engine
    print(f"worst relative difference in float32: {worst:.2e}")
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    raise SystemExit(main())

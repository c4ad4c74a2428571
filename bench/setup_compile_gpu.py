"""Where the FP8 engine's set-up time goes: Triton compiles by kernel, on a fresh Triton cache.

    python3 bench/setup_compile_gpu.py [--root DIR] [--layers 4]

Builds the 27B shape (cut to --layers) with random FP8 weights and 8 random rank-16 adapters, as
`bench/fp8_gpu.py speed` does, and times the engine's construction (start-up checks, CUDA graph
capture) with every Triton compile timed and counted by kernel name. A fresh TRITON_CACHE_DIR makes
the figure a first start on a new machine (later starts read Triton's cache). --root imports the
code from another checkout (e.g. `git archive main bench hylora | tar -x -C /tmp/main`), for a
comparison in one lease; run each root in its own process. Compiles are timed by Triton's
`knobs.runtime` jit hooks (run 38 c's figures came from a first form of this script that wrapped
Triton's private compile method instead; this form has not run on a GPU yet).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="the checkout to import")
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # before triton is imported
    sys.path.insert(0, os.path.abspath(args.root))
    import torch
    from triton import knobs

    stats: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])  # name -> [compiles, seconds]
    started = [0.0]  # compiles run one at a time: Triton's hooks before and after each

    def before(**_) -> bool:
        started[0] = time.perf_counter()
        return False  # compile it

    def after(*, fn, **_) -> None:
        stats[fn.name][0] += 1
        stats[fn.name][1] += time.perf_counter() - started[0]

    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before, after
    sys.argv = sys.argv[:1]
    import bench.fp8_gpu as B

    cfg = B.ModelConfig.from_hf(dict(B.QWEN36_27B, num_hidden_layers=args.layers))
    work = Path(tempfile.mkdtemp())
    (work / "tok").mkdir()
    B.write_tokenizer(work / "tok", 1024)
    model = B.random_model(cfg, "cuda", torch.bfloat16)
    B.quantize_linears(model)
    adapters = B.random_adapters(work, cfg)
    t0 = time.perf_counter()
    B.LLMEngine(
        work / "tok",
        B.EngineConfig(
            max_model_len=9000, max_num_seqs=32, max_num_batched_tokens=8192, max_loras=8, max_lora_rank=16,
            enable_prefix_caching=False, kernels=B.KernelsConfig(fp8_activations="dynamic"),
        ),
        adapters, progress=False, model=model,
    )  # fmt: skip
    summary = {
        "root": args.root, "layers": args.layers, "setup_s": round(time.perf_counter() - t0, 1),
        "compile_s": round(sum(s for _, s in stats.values()), 1), "compiles": sum(n for n, _ in stats.values()),
    }  # fmt: skip
    print(json.dumps(summary))
    for name, (n, s) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"  {name:32s} {n:4d} compiles {s:7.1f} s")


if __name__ == "__main__":
    main()

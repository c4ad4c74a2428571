"""The delta-first LoRA (docs/LORA.md) against shrink + expand in the engine's prefill, in one process.

DESIGN.md's workload prompts (32 x 512 random ids) with max_tokens=1, base and 8 mixed rank-16 adapters,
on the 27B text shape cut to `--layers`, at each max_num_batched_tokens. Between runs only the
threshold each Linear reads (`Linear.delta_first_from`, what `--lora-delta-first-from` sets) changes;
the thresholds take turns run by run, so drift on the card hits them alike. Prints the median prefill
wall (lowest-highest) per threshold and the share of first tokens equal to the threshold-0 run's
(h rounded to the model dtype vs fp32 h: a near-tie may flip on a random model).

    python bench/lora_prefill_gpu.py [--layers 16] [--mnbt 2048,8192] [--thresholds 0,2048,4096] [--repeats 7]
    python bench/lora_prefill_gpu.py --smoke --device cpu    # the script's logic on tiny shapes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_gpu import random_adapters, random_model  # noqa: E402
from bench.shapes import QWEN36_27B, SMALL  # noqa: E402
from hylora.config import ModelConfig  # noqa: E402
from hylora.demo import write_tokenizer  # noqa: E402
from hylora.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from hylora.kernels import as_text  # noqa: E402
from hylora.model.layers import Linear  # noqa: E402

N_ADAPTERS, RANK = 8, 16


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prompts(n: int, length: int) -> list[list[int]]:
    """bench/engine_gpu.py's workload prompts (seed 1, ids in [0, 1000))."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 1000, (length,), generator=g).tolist() for _ in range(n)]


def set_threshold(engine: LLMEngine, tokens: int) -> None:
    for m in engine.model.modules():
        if isinstance(m, Linear):
            m.delta_first_from = tokens


def prefill(engine: LLMEngine, batch: list[list[int]], mixed: bool, device: str, tag: str) -> tuple[float, list]:
    """Wall seconds until every prompt's first token, and those tokens."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    sync(device)
    t0 = time.perf_counter()
    for i, p in enumerate(batch):
        engine.add_request(f"{tag}-{i}", p, params, f"a{i % N_ADAPTERS}" if mixed else None)
    firsts: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.error:
                raise RuntimeError(out.error)
            if out.finished:
                firsts[out.request_id] = out.token_ids[0] if out.token_ids else -1
    sync(device)
    return time.perf_counter() - t0, [firsts[f"{tag}-{i}"] for i in range(len(batch))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--mnbt", default="2048,8192", help="max_num_batched_tokens settings, comma separated")
    ap.add_argument("--thresholds", default="0,2048,4096", help="delta-first thresholds (0: never)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and lengths (a CPU run of the logic)")
    ap.add_argument("--out")
    args = ap.parse_args()
    mnbts = sorted((int(v) for v in args.mnbt.split(",")), reverse=True)
    thresholds = [int(v) for v in args.thresholds.split(",")]
    shape, layers, n, length = QWEN36_27B, args.layers, 32, 512
    if args.smoke:
        shape, layers, n, length = SMALL, 4, 4, 48  # layer 3: attention
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    work = Path(tempfile.mkdtemp())
    write_tokenizer(work, 1024)
    cfg = ModelConfig.from_hf(dict(shape, num_hidden_layers=layers))
    adapters = random_adapters(work, cfg, N_ADAPTERS, RANK)
    config = EngineConfig(
        max_model_len=length + 64,
        max_num_seqs=n,
        max_num_batched_tokens=mnbts[0],
        max_loras=N_ADAPTERS,
        max_lora_rank=RANK,
        dtype=str(dtype).removeprefix("torch."),
        device=args.device,
        enable_prefix_caching=False,  # every run repeats the prompts
    )
    engine = LLMEngine(work, config, adapters, progress=False, model=random_model(cfg, args.device, dtype))
    print(f"kernels: {as_text(engine.kernels)}", flush=True)
    batch = prompts(n, length)
    rows = []
    for mnbt in mnbts:
        engine.config.max_num_batched_tokens = mnbt  # the scheduler reads it at every step
        for mixed in (False, True):
            prefill(engine, [p[:32] for p in batch[:N_ADAPTERS]], mixed, args.device, f"warm{mnbt}{mixed}")
            times: dict[int, list[float]] = {t: [] for t in thresholds}
            firsts: dict[int, list] = {}
            for r in range(args.repeats + 1):  # run 0 of each threshold: a warm-up (kernels compiled at new sizes)
                for t in thresholds if r % 2 == 0 else thresholds[::-1]:
                    set_threshold(engine, t)
                    seconds, tokens = prefill(engine, batch, mixed, args.device, f"{mnbt}-{mixed}-{t}-{r}")
                    if r:
                        times[t].append(seconds)
                    firsts.setdefault(t, tokens)
            for t in thresholds:
                same = sum(a == b for a, b in zip(firsts[t], firsts[thresholds[0]], strict=True)) / n
                s = times[t]
                rows.append(
                    {
                        "mnbt": mnbt,
                        "adapters": "8 mixed" if mixed else "base",
                        "delta_first_from": t,
                        "prefill_s_median": statistics.median(s),
                        "prefill_s_low": min(s),
                        "prefill_s_high": max(s),
                        "first_tokens_as_first_threshold": same,
                    }
                )
    card = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"\n{card}, {time.strftime('%Y-%m-%d')}: {layers} layers of the 27B text shape, {n} x {length} prompts,")
    print(f"{N_ADAPTERS} rank-{RANK} adapters; median of {args.repeats} runs (lowest-highest)\n")
    print("| mnbt | adapters | delta first from | prefill s | first tokens as the first threshold's |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row['mnbt']} | {row['adapters']} | {row['delta_first_from'] or 'never'} | "
            f"{row['prefill_s_median']:.3f} ({row['prefill_s_low']:.3f}-{row['prefill_s_high']:.3f}) | "
            f"{row['first_tokens_as_first_threshold']:.2f} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"card": card, "layers": layers, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

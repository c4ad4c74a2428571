"""How long the host takes to queue an eager prefill step, with the device kept busy (GPU).

At 2048 batched tokens a prefill step of the 16-layer cut runs ~40 ms of kernels, yet a step of
DESIGN.md's workload took ~54 ms on the device in run 41 a: the device waited for the host. This
measures the host alone. Before a step the device is given a long sleep kernel, so nothing the host
calls waits for it (a copy that would wait shows as the sleep's length), and the host's time to
queue the forward (`model.forward`) is its own cost. Printed:

- µs of host time per launch of a few small ops (torch, cuBLAS, a hylora Triton kernel, an fla one);
- the fifth step's forward by part (inclusive host ms; `--ab-fla`: again with fla's public entry);
- one step under cProfile; and each step until every first token, awake and with the device asleep.

    python bench/host_step_gpu.py [--layers 16] [--max-num-batched-tokens 2048] [--rows 35] [--ab-fla] [--quick]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_gpu import QWEN36_27B, random_adapters, random_model  # noqa: E402
from bench.peer.throughput_peer import workload_prompts  # noqa: E402
from bench.shapes import SMALL  # noqa: E402
from hylora.config import ModelConfig  # noqa: E402
from hylora.demo import write_tokenizer  # noqa: E402
from hylora.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from hylora.model.forward_batch import ForwardBatch as ForwardBatchBuild  # noqa: E402

SLEEP_CYCLES = 400_000_000  # ~0.2 s of device time at ~2 GHz: longer than any step's host work
CUDA = torch.cuda.is_available()  # (the CPU runs it as a dry run of the script: no sleep, no waits)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def run_prefill(engine: LLMEngine, tag: str, adapter_of, sleep: bool, profile_step: int | None) -> list[dict]:
    """The workload's steps until every first token (then the rest, untimed): per step the host's
    ms to queue the forward and the wall ms of the step."""
    forward = engine.model.forward
    queued: list[float] = []

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        queued.append(1e3 * (time.perf_counter() - t0))
        return out

    engine.model.forward = timed
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for i, p in enumerate(workload_prompts()):
        engine.add_request(f"{tag}{i}", p, params, adapter_of(i))
    rows, started, step = [], 0, 0
    try:
        while engine.has_unfinished() and started < 32:
            sync()
            if sleep and CUDA:
                torch.cuda._sleep(SLEEP_CYCLES)
            profiler = cProfile.Profile() if step == profile_step else None
            queued.clear()
            t0 = time.perf_counter()
            if profiler:
                profiler.enable()
            outs = engine.step()
            if profiler:
                profiler.disable()
            wall = 1e3 * (time.perf_counter() - t0)
            started = sum(1 for o in outs if o.num_output_tokens)
            rows.append({"step": step, "forward_queue_ms": sum(queued), "wall_ms": wall})
            if profiler:
                for order in ("tottime", "cumulative"):
                    text = io.StringIO()
                    pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(ARGS.rows)
                    body = text.getvalue().split("\n", 6)[-1]
                    print(f"\n=== {tag}: step {step} under cProfile (device asleep), by {order}\n{body}", flush=True)
            step += 1
    finally:
        engine.model.forward = forward
    while engine.has_unfinished():
        engine.step()
    sync()
    return rows


class HostClock:
    """Inclusive host time per label of wrapped callables (instance attributes, put back by `undo`)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, label: str, obj: object, attr: str) -> None:
        inner = getattr(obj, attr)
        own = vars(obj).get(attr, _ABSENT)  # what to put back: the object's own attribute, or none

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.ms[label] = self.ms.get(label, 0.0) + 1e3 * (time.perf_counter() - t0)

        setattr(obj, attr, timed)
        self._undo.append((obj, attr, own))

    def undo(self) -> None:
        for obj, attr, own in reversed(self._undo):
            if own is _ABSENT:
                delattr(obj, attr)  # the class's method shows again
            else:
                setattr(obj, attr, own)
        self._undo.clear()


_ABSENT = object()


def host_components(engine: LLMEngine, adapter_of, tag: str) -> None:
    """The workload's fifth step with the device asleep, its forward's host time by component."""
    from hylora.model.decoder import DecoderLayer

    clock = HostClock()
    for layer in engine.model.modules():
        if not isinstance(layer, DecoderLayer):
            continue
        kind = "gdn" if layer.is_linear else "attention"
        mixer = layer.linear_attn if layer.is_linear else layer.self_attn
        clock.wrap(f"{kind} mixer", mixer, "forward")
        if layer.is_linear:
            clock.wrap("gdn: delta rule (fla)", mixer, "delta_rule")
            clock.wrap("gdn: conv", mixer, "conv")
            clock.wrap("gdn: in_proj", mixer.in_proj, "forward")
            clock.wrap("gdn: out_proj", mixer.out_proj, "forward")
            clock.wrap("gdn: gated norm", mixer.norm, "forward")
        clock.wrap("mlp", layer.mlp, "forward")
        clock.wrap("layer norms", layer.input_layernorm, "forward")
        clock.wrap("layer norms", layer.post_attention_layernorm, "forward")
    clock.wrap("forward", engine.model, "forward")
    clock.wrap("ForwardBatch.build", ForwardBatchBuild, "build")
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for i, p in enumerate(workload_prompts()):
        engine.add_request(f"{tag}{i}", p, params, adapter_of(i))
    step = 0
    try:
        while engine.has_unfinished() and step < 5:
            sync()
            if CUDA:
                torch.cuda._sleep(SLEEP_CYCLES)
            if step == 4:
                before = dict(clock.ms)
            engine.step()
            step += 1
    finally:
        clock.undo()
    while engine.has_unfinished():
        engine.step()
    sync()
    print(f"\n=== {tag}: host ms of step 4's parts, device asleep (inclusive)")
    for label in clock.ms:
        took = clock.ms[label] - before.get(label, 0.0)
        print(f"| {label} | {took:.2f} ms |")


def launch_costs() -> None:
    """µs of host time per launch of small ops, the device asleep (nothing waits)."""
    from hylora.ops.rmsnorm.triton import rms_norm

    dev = "cuda" if CUDA else "cpu"
    x = torch.randn(4, 5120, device=dev, dtype=torch.bfloat16 if CUDA else torch.float32)
    w = torch.randn(5120, 5120, device=dev, dtype=x.dtype)
    norm_w = torch.ones(5120, device=dev, dtype=x.dtype)
    cases = {
        "torch add": lambda: x + x,
        "F.linear 4 x 5120 x 5120": lambda: torch.nn.functional.linear(x, w),
    }
    if CUDA:  # (Triton has no CPU driver outside its interpreter)
        cases["hylora rms_norm (Triton)"] = lambda: rms_norm(x, norm_w, 1e-6)
        from fla.modules.norm.l2norm import l2norm_fwd

        cases["fla l2norm_fwd"] = lambda: l2norm_fwd(x.view(1, 4, 40, 128))
    for name, fn in cases.items():
        fn()
        sync()
        if CUDA:
            torch.cuda._sleep(SLEEP_CYCLES // 4)
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        took = (time.perf_counter() - t0) / 200 * 1e6
        sync()
        print(f"| {name} | {took:.1f} µs a call |", flush=True)


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=35, help="cProfile rows printed")
    ap.add_argument("--profile-step", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="the small shape (a CPU dry run)")
    ap.add_argument("--ab-fla", action="store_true", help="also the base parts through fla's public entry")
    ap.add_argument("--quick", action="store_true", help="only each workload's step walls until every first token")
    ARGS = ap.parse_args()
    cfg = ModelConfig.from_hf(dict(SMALL if ARGS.tiny else QWEN36_27B, num_hidden_layers=ARGS.layers))
    work = Path(tempfile.mkdtemp())
    demo = work / "tokenizer"
    demo.mkdir()
    write_tokenizer(demo, 1024)
    model = random_model(cfg, "cuda", torch.bfloat16) if CUDA else random_model(cfg, "cpu", torch.float32)
    adapters = random_adapters(work, cfg)
    config = EngineConfig(
        max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=ARGS.max_num_batched_tokens, max_loras=8,
        max_lora_rank=16, enable_prefix_caching=False, device="cuda" if CUDA else "cpu",
        dtype="bfloat16" if CUDA else "float32",
    )  # fmt: skip
    engine = LLMEngine(demo, config, adapters, progress=False, model=model)
    for i in range(8):  # every adapter loaded, every kernel compiled
        engine.add_request(f"warm{i}", list(range(1, 40)), SamplingParams(max_tokens=3), f"a{i}")
    engine.add_request("warm-base", list(range(1, 600)), SamplingParams(max_tokens=3))
    while engine.has_unfinished():
        engine.step()
    if ARGS.quick:  # each workload's steps until every first token, awake only
        for label, adapter_of in (("base", lambda i: None), ("mixed8", lambda i: f"a{i % 8}")):
            run_prefill(engine, f"warm-{label}-", adapter_of, sleep=False, profile_step=None)
            rows = run_prefill(engine, f"{label}-awake-", adapter_of, sleep=False, profile_step=None)
            steps = ", ".join(f"{r['wall_ms']:.1f}" for r in rows)
            print(f"=== {label}: step walls until every first token (ms): {steps}", flush=True)
        return
    print("\n=== host time per launch, device asleep", flush=True)
    launch_costs()
    host_components(engine, lambda i: None, "parts-base-")
    if ARGS.ab_fla:  # the same parts with fla's public entry (its wrappers) in the delta rule's place
        from hylora.ops.gated_delta_rule import fla

        with mock.patch.object(fla, "_chunk_forward", lambda: None):
            host_components(engine, lambda i: None, "parts-base-fla-public-")
    host_components(engine, lambda i: f"a{i % 8}", "parts-mixed8-")
    for label, adapter_of in (("base", lambda i: None), ("mixed8", lambda i: f"a{i % 8}")):
        run_prefill(engine, f"warm-{label}-", adapter_of, sleep=False, profile_step=None)
        awake = run_prefill(engine, f"{label}-awake-", adapter_of, sleep=False, profile_step=None)
        asleep = run_prefill(engine, f"{label}-asleep-", adapter_of, sleep=True, profile_step=ARGS.profile_step)
        print(f"\n=== {label}, {ARGS.max_num_batched_tokens} tokens a step: ms per step until every first token")
        print("| step | awake: forward queued / step wall | device asleep: forward queued |")
        print("| --- | --- | --- |")
        for a, s in zip(awake, asleep, strict=False):
            # asleep, the step's wall is the sleep's: the host's own cost is the forward's queueing
            print(f"| {a['step']} | {a['forward_queue_ms']:.1f} / {a['wall_ms']:.1f} | {s['forward_queue_ms']:.1f} |")
        queued_awake, queued_asleep = (sum(r["forward_queue_ms"] for r in rows) for rows in (awake, asleep))
        wall = sum(a["wall_ms"] for a in awake)
        print(f"| sum | {queued_awake:.1f} / {wall:.1f} | {queued_asleep:.1f} |", flush=True)


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()

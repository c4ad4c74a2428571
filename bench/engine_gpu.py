"""GPU check and baseline for the serving engine.

Part 1 (correctness): the demo model with its three adapters. The CPU fp32 engine generates 16
tokens after each prompt; then the logits of prompt + generated tokens from hylora on CUDA (fp32
and bf16) and from transformers + PEFT in bf16 on CUDA (the bf16 yardstick) are compared with
hylora's CPU fp32 logits: relative error per position (max, mean), top-1 agreement, finiteness.
Part 2 (speed): random weights of the Qwen3.6-27B text shape built on the GPU, written as a
sharded VL-layout checkpoint (to /dev/shm or /tmp when there is room) and loaded back with
`load_model`; 8 random rank-16 adapters on every linear; DESIGN.md's workload (32 requests x
512-token prompts + 64 new tokens), base only vs. mixing the 8 adapters; then a fault-isolation
check. Prints a table; `--out FILE` also writes JSON.

    python bench/engine_gpu.py [--skip-correctness] [--skip-27b] [--compare-in-memory] [--shape small]
                               [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.shapes import QWEN36_27B, SMALL, copy_rate  # noqa: E402, F401  (re-exported: the benches import them from here)
from hylora.adapters.registry import AdapterRegistry  # noqa: E402
from hylora.config import ModelConfig  # noqa: E402
from hylora.demo import DEMO_ADAPTERS, write_demo  # noqa: E402
from hylora.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from hylora.engine.observer import StepObserver  # noqa: E402
from hylora.generate import CachedRunner  # noqa: E402
from hylora.kernels import as_text, select_kernels  # noqa: E402
from hylora.kernels.select import select_gdn_kernel  # noqa: E402
from hylora.model.decoder import HybridDecoder  # noqa: E402
from hylora.model.loader import checkpoint_layout, load_model  # noqa: E402
from hylora.model.packing import LORA_TARGETS, layer_sublayers, projection_shapes  # noqa: E402


def logits_of(model: HybridDecoder, registry: AdapterRegistry, ids: list[int], adapter: str | None) -> torch.Tensor:
    runner = CachedRunner(model, num_slots=1, num_pages=len(ids) // 16 + 2, adapters=registry)
    seq = runner.add(adapter)
    try:
        return runner.step([(seq, ids)], all_logits=True)[0].double().cpu()
    finally:
        runner.release(seq)


def correctness(workdir: Path) -> list[dict]:
    """Logits of prompt + 16 generated tokens: CUDA fp32 / bf16 and transformers(+PEFT) bf16 vs CPU fp32."""
    demo = write_demo(workdir / "demo", media=False)  # text only (the device image has no PyAV)
    lora = {n: demo / "adapters" / n for n in DEMO_ADAPTERS}
    variants = {
        "cpu-fp32": ("cpu", torch.float32),
        "cuda-fp32": ("cuda", torch.float32),
        "cuda-bf16": ("cuda", torch.bfloat16),
    }
    models = {}
    for name, (device, dtype) in variants.items():
        model = load_model(demo, dtype=dtype, device=device, progress=False)
        registry = AdapterRegistry(model, max_loras=len(lora), max_lora_rank=16)
        if device == "cuda":  # every fast kernel that passes its start-up check, as the engine serves
            print(f"{name}: kernels = {as_text(select_kernels(model, page_size=16))}", flush=True)
        else:
            print(f"{name}: gated delta rule kernel = {select_gdn_kernel(model)}", flush=True)
        for a, path in lora.items():
            registry.load(a, path)
        models[name] = (model, registry)
    generator = LLMEngine(
        demo,
        EngineConfig(device="cpu", dtype="float32", max_model_len=4096, max_num_seqs=2, num_pages=600),
        lora,
        progress=False,
    )
    hf = _transformers_bf16(demo, lora)
    rows = []
    g = torch.Generator().manual_seed(0)
    vocab = generator.model.config.vocab_size
    for n in (1, 64, 129, 513, 2000, 3000):
        for adapter in (None, *DEMO_ADAPTERS):
            prompt = torch.randint(0, vocab - 8, (n,), generator=g).tolist()
            generator.add_request("gen", prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), adapter)
            out = None
            while out is None:
                out = next((o for o in generator.step() if o.finished), None)
            ids = prompt + out.token_ids
            ref = logits_of(*models["cpu-fp32"], ids, adapter)
            row = {"tokens": len(ids), "adapter": adapter or "base"}
            results = {name: logits_of(*models[name], ids, adapter) for name in ("cuda-fp32", "cuda-bf16")}
            if hf is not None:
                results["transformers-bf16"] = hf(ids, adapter)
            for name, got in results.items():
                rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
                row[f"{name} rel max"] = float(rel.max())
                row[f"{name} rel mean"] = float(rel.mean())
                row[f"{name} top1"] = float((got.argmax(-1) == ref.argmax(-1)).double().mean())
                row[f"{name} finite"] = bool(torch.isfinite(got).all())
            rows.append(row)
    return rows


def _transformers_bf16(demo: Path, lora: dict[str, Path]):
    """transformers + PEFT in bf16 on the GPU, for the bf16 yardstick; None where unavailable."""
    try:
        from peft import PeftModel
        from transformers import Qwen3_5ForConditionalGeneration
    except ImportError as e:
        print(f"transformers/PEFT comparison skipped: {e}")
        return None
    base = Qwen3_5ForConditionalGeneration.from_pretrained(demo, dtype=torch.bfloat16).cuda().eval()  # the VL demo
    names = list(lora)
    peft = PeftModel.from_pretrained(base, lora[names[0]], adapter_name=names[0])
    for name in names[1:]:
        peft.load_adapter(lora[name], adapter_name=name)
    peft.eval()

    @torch.no_grad()
    def run(ids: list[int], adapter: str | None) -> torch.Tensor:
        x = torch.tensor([ids], device="cuda")
        if adapter is None:
            with peft.disable_adapter():
                return peft(x).logits[0].double().cpu()
        peft.set_adapter(adapter)
        return peft(x).logits[0].double().cpu()

    return run


def random_model(cfg: ModelConfig, device: str, dtype: torch.dtype, mtp: bool = False) -> HybridDecoder:
    """Random weights of `cfg`'s shape (`mtp`: with an MTP layer, cfg.mtp_num_hidden_layers of them)."""
    with torch.device("meta"):
        model = HybridDecoder(cfg, mtp=mtp)
    g = torch.Generator(device=device).manual_seed(0)
    for name, p in list(model.named_parameters()):
        if name.endswith("A_log"):
            t = torch.empty(p.shape, device=device).uniform_(0.01, 16, generator=g).log()
        elif name.endswith("dt_bias"):
            t = torch.ones(p.shape, device=device)
        elif "norm" in name:
            t = torch.zeros(p.shape, device=device, dtype=dtype) + (1.0 if "linear_attn.norm" in name else 0.0)
        else:
            std = 0.02 if p.ndim < 2 or "embed" in name or "lm_head" in name else 1.0 / math.sqrt(p.shape[-1])
            t = (torch.randn(p.shape, device=device, dtype=dtype, generator=g) * std).to(dtype)
        module, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module), attr, torch.nn.Parameter(t, requires_grad=False))
    return model.eval()


def write_random_adapter(path: Path, cfg: ModelConfig, rank: int, seed: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(cfg)
    tensors = {}
    for layer in range(cfg.num_layers):
        for sub in layer_sublayers(cfg, layer):
            for module in LORA_TARGETS[sub]:
                out_f, in_f = shapes[(sub, module)]
                key = f"base_model.model.model.layers.{layer}.{sub}.{module}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, in_f, generator=g) / math.sqrt(in_f)).bfloat16()
                tensors[f"{key}.lora_B.weight"] = (torch.randn(out_f, rank, generator=g) * 0.01).bfloat16()
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": "all-linear", "bias": "none"})
    )


def random_adapters(work: Path, cfg: ModelConfig, n: int = 8, rank: int = 16) -> dict[str, Path]:
    """n random adapters a0, a1, ... (write_random_adapter, seed i) under `work`: name → directory."""
    for i in range(n):
        write_random_adapter(work / f"a{i}", cfg, rank=rank, seed=i)
    return {f"a{i}": work / f"a{i}" for i in range(n)}


def write_checkpoint(model: HybridDecoder, shape: dict, demo: Path, path: Path, shard_bytes: int = 5 << 30) -> None:
    """The model as a Hugging Face VL-wrapper checkpoint: `model.language_model.` keys (`lm_head.` and
    an MTP layer's `mtp.` at the top level, a tower's `model.visual.`) in ~5 GB safetensors shards with an
    index, the demo's tokenizer. A model without a tower gets one vision tensor (to be skipped)."""
    path.mkdir(parents=True, exist_ok=True)
    weight_map, shard, size, n = {}, {}, 0, 0

    def flush() -> None:
        nonlocal shard, size, n
        n += 1
        name = f"model-{n:05d}.safetensors"
        save_file(shard, path / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard, size = {}, 0

    layout = checkpoint_layout(model)
    params = dict(model.named_parameters())
    for name, (dest, start, rows) in layout.items():
        top_level = name == "lm_head.weight" or name.startswith("mtp.")  # as Qwen's releases store them
        key = name if top_level else ("model." if name.startswith("visual.") else "model.language_model.") + name
        shard[key] = params[dest][start : start + rows].detach().cpu().contiguous()
        size += shard[key].numel() * shard[key].element_size()
        if size >= shard_bytes:
            flush()
    if model.visual is None:
        shard["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 16, 16, dtype=torch.bfloat16)
    if shard:
        flush()
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    text = {k: v for k, v in shape.items() if k != "model_type"} | {"model_type": "qwen3_5_text"}
    (path / "config.json").write_text(
        json.dumps({"model_type": "qwen3_5", "dtype": "bfloat16", "text_config": text, "vision_config": {"depth": 27}})
    )
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (path / f).write_bytes((demo / f).read_bytes())


def _roomy_dir(need_bytes: int) -> Path | None:
    for root in ("/dev/shm", "/tmp"):
        if Path(root).is_dir() and shutil.disk_usage(root).free > need_bytes:
            return Path(tempfile.mkdtemp(dir=root))
    return None


def throughput(
    workdir: Path,
    shape: dict,
    n_adapters: int = 8,
    compare_in_memory: bool = False,
    checkpoint: bool = True,
    step_tokens: int = 2048,
) -> list[dict]:
    cfg = ModelConfig.from_hf(shape)
    demo = workdir / "demo"
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model = random_model(cfg, "cuda", torch.bfloat16)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if compare_in_memory:  # the same workload on the in-memory model, to compare with the loaded one
        quick = LLMEngine(
            demo,
            EngineConfig(
                max_model_len=1024,
                max_num_seqs=32,
                max_num_batched_tokens=2048,
                dtype="bfloat16",
                num_pages=4096,
                enable_prefix_caching=False,
            ),
            progress=False,
            model=model,
        )
        row = _run_workload(quick, "base", lambda i: None, 1)
        print(f"in-memory model, kernels {as_text(quick.kernels)}: {row}", flush=True)
        del quick
        torch.cuda.empty_cache()
    ckpt = _roomy_dir(weight_bytes + (8 << 30)) if checkpoint else None
    if ckpt is None:
        print("serving the in-memory model" + ("" if not checkpoint else " (no room for a checkpoint)"), flush=True)
    else:  # write it, free the GPU copy, load it back through the loader
        t0 = time.perf_counter()
        write_checkpoint(model, shape, demo, ckpt)
        write_s = time.perf_counter() - t0
        del model
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        model = load_model(ckpt, dtype=torch.bfloat16, device="cuda", progress=False)
        torch.cuda.synchronize()
        load_s = time.perf_counter() - t0
        print(
            f"checkpoint: wrote {weight_bytes / 1e9:.1f} GB in {write_s:.1f}s to {ckpt}; load_model took "
            f"{load_s:.1f}s ({weight_bytes / 1e9 / load_s:.1f} GB/s)",
            flush=True,
        )
    t0 = time.perf_counter()
    adapters = random_adapters(workdir, cfg, n_adapters)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine = LLMEngine(
        demo,
        EngineConfig(
            max_model_len=1024,
            max_num_seqs=32,
            max_num_batched_tokens=step_tokens,
            max_loras=n_adapters,
            max_lora_rank=16,
            dtype="bfloat16",
            fault_injection=True,  # fault_check, after the workload
            enable_prefix_caching=False,  # every mode runs the same prompts: none may find them cached
        ),
        adapters,
        progress=False,
        model=model,
    )
    setup_s = time.perf_counter() - t0
    print(f"kernels: {as_text(engine.kernels)}; LoRA apply: masked (CUDA)", flush=True)
    print(
        f"27B-shape model built in {build_s:.1f}s ({weight_bytes / 1e9:.1f} GB), adapters written in "
        f"{write_s:.1f}s, engine set up (adapter load + cache plan) in {setup_s:.1f}s; "
        f"KV pages {engine.kv.num_pages}, state slots {engine.states.num_slots}",
        flush=True,
    )
    rows = []
    for label, adapter_of, warm in [
        ("base (= merged weights)", lambda i: None, 1),
        (f"{n_adapters} adapters mixed", lambda i: f"a{i % n_adapters}", n_adapters),
    ]:
        rows.append(
            _run_workload(engine, label, adapter_of, warm) | {"decode_roofline_ms": 1e3 * weight_bytes / copy_rate()}
        )
        print(rows[-1], flush=True)
    rows.append(fault_check(engine, n_adapters))
    print(rows[-1], flush=True)
    return rows


def _run_workload(engine: LLMEngine, label: str, adapter_of, warm: int) -> dict:
    """DESIGN.md's workload: 32 requests x 512 random prompt tokens + 64 greedy tokens, all at once.
    The same prompts every call: the engine must not cache prefixes (EngineConfig.enable_prefix_caching)."""
    if engine.prefix_cache is not None:
        raise ValueError("the workload reruns its prompts: build the engine with enable_prefix_caching=False")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1000, (512,), generator=g).tolist() for _ in range(32)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for i in range(warm):  # one short request per adapter used
        engine.add_request(f"w{label}{i}", prompts[0][:16], SamplingParams(max_tokens=2), adapter_of(i))
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    timer = StepTimer()
    engine.add_observer(timer)  # what each step until the first tokens ran
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{label}{i}", p, params, adapter_of(i))
    first_token_at, decode_steps, decode_time, finite = None, 0, 0.0, True
    while engine.has_unfinished():  # no device sync between steps: a step may run behind the host's
        s0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - s0
        if first_token_at is None and sum(1 for o in outs if o.num_output_tokens) == 32:
            first_token_at = time.perf_counter() - t0
            engine.remove_observer(timer)
        elif first_token_at is not None:
            decode_steps += 1
            decode_time += dt
        finite &= all(o.error is None for o in outs)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    if first_token_at is None:
        engine.remove_observer(timer)
    return {
        "run": label,
        "wall_s": wall,
        "out_tok_s": 32 * 64 / wall,
        "prefill_s": first_token_at,
        "decode_step_ms": 1e3 * decode_time / max(decode_steps, 1),
        "no_errors": finite,
        "prefill_steps": timer.table(),
    }


class StepTimer(StepObserver):
    """Notes each forward's sequences, tokens, host time to queue it and device time (CUDA events:
    no added sync)."""

    def __init__(self) -> None:
        self.steps: list[tuple] = []

    def before_forward(self, chunks) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._t0 = time.perf_counter()
        self._start.record()

    def after_forward(self, chunks) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        host_ms = 1e3 * (time.perf_counter() - self._t0)
        self.steps.append((len(chunks), sum(c.num_tokens for c in chunks), host_ms, self._start, end))

    def table(self) -> list[dict]:
        """Each step's sequences, tokens, host and device ms, and `gap_ms`: device time from the end of
        the step before's forward to this forward's start (its sampler, and the device idling while the
        host reads that step and plans this one). Call after a device sync."""
        rows, prev_end = [], None
        for n, t, host, a, b in self.steps:
            row = {"sequences": n, "tokens": t, "host_ms": round(host, 2), "device_ms": round(a.elapsed_time(b), 2)}
            if prev_end is not None:
                row["gap_ms"] = round(prev_end.elapsed_time(a), 2)
            rows.append(row)
            prev_end = b
        return rows


def transformers_throughput(shape: dict, n_adapters: int) -> list[dict]:
    """The same workload through transformers (+ PEFT with one adapter per request, mixed in one
    batch via `adapter_names`), random weights of the same shape, in this process."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(**{k: v for k, v in shape.items() if k not in ("model_type", "full_attention_interval")})
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 directly: an fp32 27B model would not fit
    try:
        with torch.device("cuda"):
            model = Qwen3_5ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randint(0, 1000, (512,), generator=g) for _ in range(32)]).cuda()
    rows = []

    def timed(label: str, m, **kw) -> None:
        with torch.no_grad():
            m.generate(ids[:2, :16], max_new_tokens=2, do_sample=False, **{k: v[:2] for k, v in kw.items()})
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = m.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False, **kw)
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        assert out.shape[1] == 512 + 64
        rows.append({"run": label, "wall_s": wall, "out_tok_s": 32 * 64 / wall})
        print(rows[-1], flush=True)

    timed("transformers base", model)
    lora = LoraConfig(r=16, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    peft = get_peft_model(model, lora, adapter_name="a0")
    for i in range(1, n_adapters):
        peft.add_adapter(f"a{i}", lora)
    peft.eval()
    timed(
        f"transformers + PEFT, {n_adapters} adapters mixed",
        peft,
        adapter_names=[f"a{i % n_adapters}" for i in range(32)],
    )
    return rows


def fault_check(engine: LLMEngine, n_adapters: int) -> dict:
    """NaN injected into one request of a mixed batch: only it fails; a later request is bit-identical."""

    def run(requests: list[tuple[str, list[int], str | None]], fault: str | None = None) -> dict:
        for rid, ids, adapter in requests:
            engine.add_request(
                rid, ids, SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True), adapter
            )
        if fault:
            engine.inject_fault(fault)
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        return done

    probe = ("probe", list(range(100, 164)), "a1")
    before = run([probe])["probe"]
    batch = [(f"f{i}", list(range(10 + i, 300 + i)), f"a{i % n_adapters}") for i in range(8)]
    faulted = run(batch, fault="f3")
    after = run([("probe2", probe[1], probe[2])])["probe2"]
    others_ok = all(o.error is None for rid, o in faulted.items() if rid != "f3")
    return {
        "run": "fault isolation",
        "faulted_request_failed": faulted["f3"].finish_reason == "error",
        "others_ok": others_ok,
        "later_request_bit_identical": [x.logprob for x in after.logprobs] == [x.logprob for x in before.logprobs]
        and after.token_ids == before.token_ids,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-27b", action="store_true")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument(
        "--compare-in-memory",
        action="store_true",
        help="also time the base workload on the in-memory model before writing the checkpoint",
    )
    ap.add_argument("--no-checkpoint", action="store_true", help="serve the in-memory model (skip write + load)")
    ap.add_argument(
        "--with-transformers",
        action="store_true",
        help="then run the same workload through transformers and transformers + PEFT",
    )
    ap.add_argument("--shape", choices=["27b", "small"], default="27b")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per engine step")
    ap.add_argument("--out")
    args = ap.parse_args()
    copy_rate()  # measured before anything takes the GPU's memory (cached for the rooflines)
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        rows = [] if args.skip_correctness else correctness(work)
        print(f"correctness part took {time.perf_counter() - t0:.1f}s")
        names = sorted({k.rsplit(" ", 2)[0] for k in rows[0] if k.endswith("rel max")}) if rows else []
        print("tokens | adapter | " + " | ".join(f"{n}: rel max / rel mean / top-1 / finite" for n in names))
        if args.skip_correctness:
            write_demo(work / "demo", media=False)
        for r in rows:
            cells = [
                f"{r[n + ' rel max']:.1e} / {r[n + ' rel mean']:.1e} / {r[n + ' top1']:.3f} / {r[n + ' finite']}"
                for n in names
            ]
            print(f"{r['tokens']} | {r['adapter']} | " + " | ".join(cells), flush=True)
        torch.cuda.empty_cache()
        shape = QWEN36_27B if args.shape == "27b" else SMALL
        speed = []
        if not args.skip_27b:
            speed = throughput(
                work,
                shape,
                compare_in_memory=args.compare_in_memory,
                checkpoint=not args.no_checkpoint,
                step_tokens=args.max_num_batched_tokens,
            )
        if args.with_transformers:
            import gc

            gc.collect()
            torch.cuda.empty_cache()
            speed += transformers_throughput(shape, 8)
    if speed:
        print("run | wall s | output tok/s | prefill s | decode step ms | weight-read floor ms")
        for r in speed:
            if "wall_s" not in r:
                print(r)
                continue
            cells = [f"{r[k]:.2f}" if k in r else "-" for k in ("prefill_s", "decode_step_ms", "decode_roofline_ms")]
            print(f"{r['run']} | {r['wall_s']:.1f} | {r['out_tok_s']:.1f} | " + " | ".join(cells))
    if args.out:
        Path(args.out).write_text(json.dumps({"correctness": rows, "throughput": speed}, indent=2))


if __name__ == "__main__":
    main()

"""vLLM 0.20.2 beside hylora: throughput on one GPU, same checkpoint, same adapters, same workload.

- Checkpoint: random weights of the Qwen3.6-27B text shape cut to 16 layers (12 Gated DeltaNet + 4
  full attention), Hugging Face VL layout, written by hylora's bench helpers (bench/engine_gpu.py),
  with a config.json vLLM reads (Qwen3_5ForConditionalGeneration); `fp8`: its block-FP8 copy
  (`hylora.model.fp8.quantize_checkpoint`: e4m3 weights, 128 x 128 `weight_scale_inv` blocks), with
  the linears it keeps in bf16 named one by one in `modules_to_not_convert` (vLLM matches full names).
- Adapters: 8 random rank-16 adapters on every linear (bench/engine_gpu.py), keys of the VL wrapper
  (vLLM ignores text-model keys on this model; hylora reads both).
- Workload (DESIGN.md, `_run_workload`): 32 requests x 512 random prompt ids + 64 greedy tokens,
  all at once; `base` (no adapter) and `8 mixed` (request i uses adapter a{i mod 8}). Both engines:
  max_num_seqs 32, the same max_num_batched_tokens, prefix caching off, max model length 1024.
- vLLM: offline `LLM` engine with LoRA enabled (base requests run on it too), torch.compile and CUDA
  graphs for batches 1-32, token ids in, no tokenizer. hylora: `LLMEngine` with its defaults
  otherwise (CUDA graphs; an FP8 checkpoint served with FP8 GEMMs on a GPU that has them).

Figures per run: output tok/s (32 x 64 / wall), prefill (the same 32 prompts with max_tokens=1,
wall) and decode step ((wall - prefill) / 63), measured alike on both engines; hylora's own
per-step figures from `_run_workload` are kept in the JSON. The table reports the median run by output
tok/s of `--repeats` (default 5; the first is left out when there are three or more) and the lowest and
highest: in run 23 vLLM's base run at 2048 tokens gave 2069 tok/s in one engine start and 2762 in the
next, on the same warm machine, so one run is no comparison.

Phases (each writes WORK/results/<engine>-<weights>-<mnbt>.json, rewritten after every run):

    ckpt   --weights bf16[,fp8] [--reuse]       the checkpoint(s) and adapters
    vllm   --weights bf16|fp8 --mnbt 2048       one vLLM engine (one batched-token setting); --dry-run:
                                                 vLLM's checks of its arguments and of the checkpoint's
                                                 config only (no GPU needed)
    hylora --weights bf16|fp8 --mnbt 8192,2048  one hylora engine, built at the largest setting,
                                                 lowered for the others (as bench/fp8_gpu.py does)
    table  [--results DIR ...]                  one markdown table from every result found
    run    STEP ...                             steps `phase[:weights[:mnbt,...]]`, each in its own
                                                 process group (GPU memory freed in between), under
                                                 --budget; then the table, all copied to --out

    python bench/peer/throughput_peer.py run ckpt:bf16 hylora:bf16:8192,2048 vllm:bf16:2048 --out $OUT
    python bench/peer/throughput_peer.py run ckpt:bf16,fp8 hylora:bf16,fp8:8192,2048 \
        --tiny --device cpu --repeats 1 --out /tmp/tput          # CPU dry run (hylora only)
    python bench/peer/throughput_peer.py table --results DIR1 DIR2 ... --out DIR   # merge several calls' $OUT

--profile-decode: after an engine's timed runs, the base and the 8-mixed workload once more each, with
20 decode steps under torch.profiler; a per-kernel table (µs and calls a step) into --out/profiles/ and
the record
(bench/peer/decode_profile.py).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.peer import decode_profile  # noqa: E402
from bench.peer.child_env import child_env  # noqa: E402

VERSION = "1"  # bump when the checkpoint or adapters change: a reused work dir with another stamp is rewritten
N_LAYERS = 16  # the 27B shape cut to 16 layers (the tiny CPU shape: 4)
N_ADAPTERS = 8
RANK = 16
N_REQUESTS, PROMPT_LEN, NEW_TOKENS = 32, 512, 64  # DESIGN.md's workload, as bench/engine_gpu.py's _run_workload
MAX_NUM_SEQS = 32
MAX_MODEL_LEN = 1024
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32]  # vLLM's CUDA graphs: this workload's decode batches are <= 32
GPU_MEMORY_UTILIZATION = 0.85  # vLLM (its own process; hylora keeps its default 0.90 in another)
WEIGHTS = ("bf16", "fp8")
PHASES = ("ckpt", "vllm", "hylora", "table", "run")
MIN_LEFT_S = {"ckpt": 60, "vllm": 230, "hylora": 150}  # a GPU step starts only with this much budget left
TABLE_RESERVE_S = 15
WORK_NEED_BYTES = 26e9  # bf16 (14.7 GB) + fp8 (8.6 GB) checkpoints and the adapters, with room to spare
RECORD_NAME = "{engine}-{weights}-{mnbt}.json"


def log(*parts: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, flush=True)


# --------------------------------------------------------------------------------------------
# shared inputs


def model_shape(tiny: bool) -> dict[str, Any]:
    """The Hugging Face text config of the checkpoint (tiny: the bench's small shape, 4 layers)."""
    from bench import engine_gpu as eg

    return dict(eg.SMALL, num_hidden_layers=4) if tiny else dict(eg.QWEN36_27B, num_hidden_layers=N_LAYERS)


def workload_prompts() -> list[list[int]]:
    """Exactly `_run_workload`'s prompts (bench/engine_gpu.py): seed 1, 32 x 512 ids in [0, 1000)."""
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 1000, (PROMPT_LEN,), generator=g).tolist() for _ in range(N_REQUESTS)]


def prompts_digest() -> str:
    return hashlib.sha256(json.dumps(workload_prompts()).encode()).hexdigest()[:16]


def adapter_names() -> list[str]:
    return [f"a{i}" for i in range(N_ADAPTERS)]


def mixed_adapter(i: int) -> str:
    """The adapter of request i in the `8 mixed` run (None in `base`)."""
    return f"a{i % N_ADAPTERS}"


@dataclass(frozen=True)
class Work:
    """The work dir: checkpoints, adapters, completion stamps, results."""

    root: Path

    def ckpt(self, weights: str) -> Path:
        return self.root / f"ckpt-{weights}"

    @property
    def adapters(self) -> Path:
        return self.root / "adapters"

    @property
    def results(self) -> Path:
        return self.root / "results"

    def stamp_file(self, what: str) -> Path:  # beside, not inside, a checkpoint (quantize copies its files)
        return self.root / f"{what}.complete"

    def is_complete(self, what: str, stamp: str) -> bool:
        path = self.stamp_file(what)
        return path.is_file() and path.read_text().strip() == stamp

    def mark(self, what: str, stamp: str | None) -> None:
        if stamp is None:
            self.stamp_file(what).unlink(missing_ok=True)
        else:
            self.stamp_file(what).write_text(stamp + "\n")


def input_stamp(tiny: bool) -> str:
    return f"{VERSION} {'tiny' if tiny else f'27b-{N_LAYERS}'}"


def pick_work() -> Path:
    """/dev/shm when it holds both checkpoints (or already holds a work dir), else /tmp."""
    shm = Path("/dev/shm")
    if (shm / "hylora_tput").is_dir() or (shm.is_dir() and shutil.disk_usage(shm).free > WORK_NEED_BYTES):
        return shm / "hylora_tput"
    return Path("/tmp/hylora_tput")


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def card(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"


def versions(names: tuple[str, ...]) -> dict[str, str]:
    import importlib.metadata as md

    found = {}
    for name in names:
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = "-"
    return found


class Record:
    """One engine's results at one (weights, max_num_batched_tokens), rewritten to disk after every
    change (a phase killed at its deadline keeps what it had)."""

    def __init__(self, work: Work, engine: str, weights: str, mnbt: int, **fields: Any):
        self.path = work.results / RECORD_NAME.format(engine=engine, weights=weights, mnbt=mnbt)
        self.data: dict[str, Any] = {
            "engine": engine, "weights": weights, "mnbt": mnbt, "date": time.strftime("%Y-%m-%d %H:%M"),
            "prompts_sha": prompts_digest(), "runs": {"base": [], "mixed8": []}, "complete": False, **fields,
        }  # fmt: skip
        self.save()

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        self.save()

    def add_run(self, label: str, row: dict[str, Any]) -> None:
        self.data["runs"][label].append(row)
        d = self.data
        log(f"{d['engine']} {d['weights']} mnbt {d['mnbt']} {label}: {row['out_tok_s']:.0f} tok/s, "
            f"prefill {row['prefill_s']:.3f}s, decode step {row['decode_step_ms']:.2f}ms")  # fmt: skip
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.data["updated"] = time.time()
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def workload_row(wall_s: float, out_tokens: int, prefill_s: float) -> dict[str, float]:
    """The figures both engines report alike: tok/s, prefill (max_tokens=1 wall), decode step."""
    return {
        "wall_s": wall_s,
        "out_tokens": out_tokens,
        "out_tok_s": out_tokens / wall_s,
        "prefill_s": prefill_s,
        "decode_step_ms": 1e3 * (wall_s - prefill_s) / (NEW_TOKENS - 1),
    }


# --------------------------------------------------------------------------------------------
# phase ckpt


def phase_ckpt(args: argparse.Namespace) -> None:
    """The bf16 checkpoint (always: the FP8 copy is made from it), the adapters, and the FP8 copy
    when `fp8` is asked for; with --reuse, what an earlier call completed here is kept."""
    work, stamp = Work(args.work), input_stamp(args.tiny)
    shape = model_shape(args.tiny)
    if args.reuse and work.is_complete("bf16", stamp):
        log(f"reusing {work.ckpt('bf16')}")
    else:
        work.mark("bf16", None)
        work.mark("fp8", None)  # made from the bf16 one
        write_bf16(work, shape, args.device)
        work.mark("bf16", stamp)
    if args.reuse and work.is_complete("adapters", stamp):
        log(f"reusing {work.adapters}")
    else:
        work.mark("adapters", None)
        write_adapters(work, shape)
        work.mark("adapters", stamp)
    if "fp8" in args.weights:
        if args.reuse and work.is_complete("fp8", stamp):
            log(f"reusing {work.ckpt('fp8')}")
        else:
            quantize_copy(work.ckpt("bf16"), work.ckpt("fp8"), args.device)
            work.mark("fp8", stamp)


def write_bf16(work: Work, shape: dict[str, Any], device: str) -> None:
    """Random weights built on `device`, written as a sharded VL-layout checkpoint (bench helpers),
    a 1024-token tokenizer (hylora's engine wants one; vLLM runs without), vLLM's config.json."""
    import torch

    from bench import engine_gpu as eg
    from hylora.config import ModelConfig
    from hylora.demo import write_tokenizer

    t0 = time.perf_counter()
    tok, ckpt = work.root / "tok", work.ckpt("bf16")
    shutil.rmtree(ckpt, ignore_errors=True)
    tok.mkdir(parents=True, exist_ok=True)
    write_tokenizer(tok, 1024)
    model = eg.random_model(ModelConfig.from_hf(shape), device, torch.bfloat16)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    eg.write_checkpoint(model, shape, tok, ckpt)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    vllm_style_config(ckpt)
    log(f"bf16 checkpoint, {nbytes / 1e9:.1f} GB, written to {ckpt} in {time.perf_counter() - t0:.1f}s")


def vllm_style_config(
    ckpt: Path, vision: dict[str, Any] | None = None, token_ids: dict[str, int] | None = None
) -> None:
    """config.json as vLLM 0.20.2 wants it: `architectures` and a full Qwen3_5Config. Without `vision`,
    a small vision_config (vLLM runs with language_model_only=True: the tower is never built; hylora is
    given a decoder loaded without it); with it, the tower's config and the tokenizer's vision token ids
    (`image_token_id`, ...: Qwen3_5Config's defaults are the 248k vocabulary's)."""
    from transformers import Qwen3_5Config

    text = dict(json.loads((ckpt / "config.json").read_text())["text_config"])
    vision = vision or dict(depth=2, out_hidden_size=text["hidden_size"])
    config = Qwen3_5Config(
        text_config=text, vision_config=vision, tie_word_embeddings=False, **(token_ids or {})
    ).to_dict()
    config["architectures"] = ["Qwen3_5ForConditionalGeneration"]
    config["dtype"] = config["text_config"]["dtype"] = "bfloat16"
    (ckpt / "config.json").write_text(json.dumps(config, indent=1))


def write_adapters(work: Work, shape: dict[str, Any]) -> None:
    """The bench's random rank-16 adapters (text-model keys), rewritten with the VL wrapper's keys."""
    from bench import engine_gpu as eg
    from hylora.config import ModelConfig

    t0 = time.perf_counter()
    cfg = ModelConfig.from_hf(shape)
    raw = work.root / "raw-adapters"
    shutil.rmtree(work.adapters, ignore_errors=True)
    for i, name in enumerate(adapter_names()):
        eg.write_random_adapter(raw / name, cfg, rank=RANK, seed=i)
        to_vl_keys(raw / name, work.adapters / name)
    shutil.rmtree(raw)
    took = time.perf_counter() - t0
    log(f"{N_ADAPTERS} adapters (rank {RANK}, every linear) written to {work.adapters} in {took:.1f}s")


def to_vl_keys(src: Path, dst: Path) -> None:
    """`base_model.model.model.layers.N…` -> `base_model.model.model.language_model.layers.N…` (what
    vLLM's Qwen3_5ForConditionalGeneration maps onto its modules), and target_modules named one by
    one (PEFT's "all-linear" on a VL model would also name the tower's linears)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "adapter_model.safetensors"))
    out = {k.replace("base_model.model.model.layers.", "base_model.model.model.language_model.layers."): v
           for k, v in tensors.items()}  # fmt: skip
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "adapter_config.json").read_text())
    config["target_modules"] = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in out})
    (dst / "adapter_config.json").write_text(json.dumps(config))


def quantize_copy(src: Path, dst: Path, device: str) -> None:
    """`quantize_checkpoint` of the bf16 checkpoint `src` into `dst` (its blocks computed on `device`:
    the same function, tensors moved there and back); it names every linear it leaves in bf16 in full."""
    from hylora.model import fp8

    t0 = time.perf_counter()
    shutil.rmtree(dst, ignore_errors=True)
    quantize = fp8.quantize_weight

    def on_device(t: Any, block: tuple[int, int]) -> tuple[Any, ...]:
        return tuple(x.cpu() for x in quantize(t.to(device), block))

    on_gpu = device.startswith("cuda")
    with mock.patch.object(fp8, "quantize_weight", on_device) if on_gpu else contextlib.nullcontext():
        fp8.quantize_checkpoint(src, dst, progress=False)
    size = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
    log(f"fp8 checkpoint, {size / 1e9:.1f} GB, written to {dst} in {time.perf_counter() - t0:.1f}s")


def require_inputs(work: Work, weights: str, tiny: bool) -> None:
    stamp = input_stamp(tiny)
    for what in (weights, "adapters"):
        if not work.is_complete(what, stamp):
            raise SystemExit(f"{work.root}: no complete {what} ({stamp}); run the ckpt phase first")


def checkpoint_summary(ckpt: Path) -> dict[str, Any]:
    """What the table says of the checkpoint, read from its files (no model code imported)."""
    text = json.loads((ckpt / "config.json").read_text())["text_config"]
    kinds = text.get("layer_types") or []
    return {
        "hidden_size": text["hidden_size"],
        "layers": text["num_hidden_layers"],
        "gdn_layers": kinds.count("linear_attention"),
        "attention_layers": kinds.count("full_attention"),
        "vocab_size": text["vocab_size"],
        "mamba_ssm_dtype": text.get("mamba_ssm_dtype"),  # vLLM's GDN state dtype (None: the model's)
        "gb_on_disk": round(sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 1e9, 2),
    }


# --------------------------------------------------------------------------------------------
# phase vllm


def phase_vllm(args: argparse.Namespace) -> None:
    """One vLLM engine (LoRA enabled) at one max_num_batched_tokens: base, then 8 mixed adapters."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("vLLM is not importable here (bench/peer/throughput_gpu.sh installs the carried one)")
    (weights,), (mnbt,) = args.weights, args.mnbt
    work = Work(args.work)
    require_inputs(work, weights, args.tiny)
    vers = versions(("vllm", "torch", "triton", "transformers"))
    shape = checkpoint_summary(work.ckpt(weights))
    # the card is read once vLLM is up: CUDA initialised here first would make vLLM start its engine
    # core by spawn instead of fork
    record = Record(work, "vllm", weights, mnbt, card=None, versions=vers, checkpoint=shape)
    backend = args.attention_backend or attention_fallback(work, record, write_stub=not args.dry_run)
    kwargs = vllm_engine_kwargs(work.ckpt(weights), mnbt, backend)
    record.update(settings={k: v for k, v in kwargs.items() if k != "model"})
    profile_dir = args.out / "profiles" / f"vllm-{weights}-{mnbt}" if args.profile_decode else None
    if profile_dir is not None:
        profile_dir.mkdir(parents=True, exist_ok=True)
        kwargs["profiler_config"] = decode_profile.vllm_profiler_config(profile_dir)
    if args.dry_run:
        check_vllm_args(kwargs)
        record.path.unlink()
        return
    try:
        run_vllm(work, kwargs, args.repeats, record, profile_dir)
        record.update(complete=True)
    except BaseException as e:
        record.update(error=f"{type(e).__name__}: {e}"[:2000])
        raise


def vllm_engine_kwargs(ckpt: Path, mnbt: int, attention_backend: str | None) -> dict[str, Any]:
    """`LLM(...)` arguments (the peer harness's, which ran on an H200): no tokenizer (token ids in),
    the decoder only, Triton's GDN prefill (FlashInfer's is not carried), CUDA graphs for 1-32."""
    kwargs: dict[str, Any] = dict(
        model=str(ckpt),
        skip_tokenizer_init=True,
        language_model_only=True,
        dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=mnbt,
        enable_prefix_caching=False,
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        gdn_prefill_backend="triton",
        compilation_config={"cudagraph_capture_sizes": CAPTURE_SIZES},
        enable_lora=True,
        max_loras=N_ADAPTERS,
        max_lora_rank=RANK,
        max_cpu_loras=N_ADAPTERS,
        seed=0,
    )
    if attention_backend:
        kwargs["attention_backend"] = attention_backend
    return kwargs


def check_vllm_args(kwargs: dict[str, Any]) -> None:
    """vLLM's checks of the engine arguments and of the checkpoint's config (architecture, dtype,
    quantization), without a GPU and without building the engine."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.registry import ModelRegistry

    model = EngineArgs(**kwargs).create_model_config()
    cls, arch = ModelRegistry.resolve_model_cls(model.architectures, model)
    log(f"vLLM accepts the arguments: {arch} ({cls.__name__}), text model {model.hf_text_config.model_type}, "
        f"dtype {model.dtype}, quantization {model.quantization}, max_model_len {model.max_model_len}")  # fmt: skip


def attention_fallback(work: Work, record: Record, write_stub: bool = True) -> str | None:
    """None when vLLM's FlashAttention 3 loads (checked once per work dir, in a child process so
    that this one starts vLLM without CUDA initialised); else TRITON_ATTN, with a stub for the FA2
    library the slim bundle drops, so that vllm_flash_attn still imports (the peer harness's fix)."""
    cache = work.root / "fa3.json"
    if not cache.is_file():
        probe = ("import json; from vllm.vllm_flash_attn import flash_attn_interface as f; "
                 "print(json.dumps([bool(f.FA3_AVAILABLE), str(f.FA3_UNAVAILABLE_REASON)]))")  # fmt: skip
        proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        lines = proc.stdout.strip().splitlines()
        errors = proc.stderr.strip().splitlines() or ["no output"]
        found = json.loads(lines[-1]) if proc.returncode == 0 and lines else [False, errors[-1][-300:]]
        cache.write_text(json.dumps(found))
    available, reason = json.loads(cache.read_text())
    record.update(fa3_available=available, fa3_reason=reason)
    if available:
        return None
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None  # phase_vllm checked it
    stub = Path(spec.origin).parent / "vllm_flash_attn" / "_vllm_fa2_C.py"
    if write_stub and not stub.exists():
        stub.write_text("# stub: FlashAttention is not loadable here; attention runs on TRITON_ATTN\n")
    log(f"FA3 not loadable ({reason}): TRITON_ATTN")
    return "TRITON_ATTN"


def run_vllm(work: Work, kwargs: dict[str, Any], repeats: int, record: Record, profile_dir: Path | None) -> None:
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    log("LLM(", kwargs, ")")
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    record.update(startup_s=time.perf_counter() - t0, card=card("cuda"))
    with contextlib.suppress(Exception):  # the GDN state dtype vLLM chose (Qwen's configs: float32)
        record.update(gdn_state_dtype=str(llm.llm_engine.vllm_config.cache_config.mamba_ssm_cache_dtype))
    log(f"vLLM engine up in {record.data['startup_s']:.0f}s, GDN state {record.data.get('gdn_state_dtype', '?')}")
    loras = {name: LoRARequest(name, i + 1, str(work.adapters / name)) for i, name in enumerate(adapter_names())}
    prompts = workload_prompts()
    vllm_warm_up(llm, prompts, list(loras.values()))
    for label, requests in (("base", None), ("mixed8", [loras[mixed_adapter(i)] for i in range(N_REQUESTS)])):
        for _ in range(repeats):
            record.add_run(label, vllm_workload(llm, prompts, requests))
    if profile_dir is not None:
        for label, requests in (("base", None), ("mixed8", [loras[mixed_adapter(i)] for i in range(N_REQUESTS)])):
            rows = decode_profile.vllm_decode_profile(
                llm, lambda requests=requests: vllm_workload(llm, prompts, requests), profile_dir
            )
            save_decode_profile(record, label, rows, profile_dir.parent)
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()


def vllm_warm_up(llm: Any, prompts: list[list[int]], loras: list[Any]) -> None:
    """As `_run_workload` warms hylora: a short request per adapter (all 8 in the GPU slots) and one
    without."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False)
    short = [TokensPrompt(prompt_token_ids=prompts[0][:16]) for _ in range(len(loras) + 1)]
    llm.generate(short, params, lora_request=[*loras, None], use_tqdm=False)


def vllm_workload(llm: Any, prompts: list[list[int]], loras: list[Any] | None) -> dict[str, Any]:
    """The workload (64 greedy tokens), then the same prompts with max_tokens=1 (prefill)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    full = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate(inputs, full, lora_request=loras, use_tqdm=False)
    wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(inputs, first, lora_request=loras, use_tqdm=False)
    prefill = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return workload_row(wall, n, prefill) | {"first_tokens": [list(o.outputs[0].token_ids[:4]) for o in outs[:2]]}


# --------------------------------------------------------------------------------------------
# phase hylora


def phase_hylora(args: argparse.Namespace) -> None:
    """One hylora engine built at the largest max_num_batched_tokens asked for; each setting (largest
    first) then runs base and 8 mixed adapters, the scheduler's budget lowered in between."""
    import torch

    (weights,) = args.weights
    work = Work(args.work)
    require_inputs(work, weights, args.tiny)
    if args.device == "cpu":  # shared cores: one thread
        torch.set_num_threads(1)
    mnbts = sorted(args.mnbt, reverse=True)
    common = dict(
        card=card(args.device),
        versions=versions(("torch", "triton", "transformers", "fla-core")),
        checkpoint=checkpoint_summary(work.ckpt(weights)),
    )
    records = {m: Record(work, "hylora", weights, m, **common) for m in mnbts}
    try:
        engine, setup = hylora_engine(work, weights, mnbts[0], args.device, args.kernels)
        for mnbt in mnbts:
            engine.config.max_num_batched_tokens = mnbt  # the scheduler reads it at every step
            assert engine.scheduler.config is engine.config
            records[mnbt].update(**setup, built_with_mnbt=mnbts[0])
            run_hylora(engine, args.device, args.repeats, records[mnbt], args.ab_plan_ahead)
            if args.profile_decode:
                profiles = args.out / "profiles"
                profiles.mkdir(parents=True, exist_ok=True)
                prompts = workload_prompts()
                for label, adapter_of in (("base", lambda i: None), ("mixed8", mixed_adapter)):
                    trace = profiles / f"hylora-{weights}-{mnbt}-{label}.trace.json.gz"
                    tag = f"{mnbt}-{label}"
                    rows = decode_profile.hylora_decode_profile(engine, prompts, adapter_of, trace, tag)
                    save_decode_profile(records[mnbt], label, rows, profiles)
            if args.profile_prefill:
                profiles = args.out / "profiles"
                profiles.mkdir(parents=True, exist_ok=True)
                for label, adapter_of in (("base", lambda i: None), ("mixed8", mixed_adapter)):
                    trace = profiles / f"hylora-{weights}-{mnbt}-{label}-prefill.trace.json.gz"
                    got = decode_profile.hylora_prefill_profile(
                        engine, workload_prompts(), adapter_of, trace, f"{mnbt}-{label}"
                    )
                    save_prefill_profile(records[mnbt], label, got, profiles)
            records[mnbt].update(complete=True)
    except BaseException as e:
        for record in records.values():
            if not record.data["complete"]:
                record.update(error=f"{type(e).__name__}: {e}"[:2000])
        raise


def hylora_engine(
    work: Work, weights: str, mnbt: int, device: str, kernels: dict[str, int | str] | None = None
) -> tuple[Any, dict[str, Any]]:
    """`LLMEngine` on the checkpoint, given its decoder loaded as the engine would load it (FP8 GEMMs
    where the device has them), without the vision tower (the checkpoint carries only a stub).
    `kernels`: KernelsConfig fields to set (a same-run comparison of a kernel choice)."""
    import torch

    from hylora.config import ModelConfig
    from hylora.engine import EngineConfig, LLMEngine
    from hylora.kernels import as_text
    from hylora.kernels.config import KernelsConfig, serve_fp8
    from hylora.model.loader import load_model

    ckpt = work.ckpt(weights)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32  # the CPU dry run: fp32
    config = EngineConfig(
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=mnbt,
        max_loras=N_ADAPTERS,
        max_lora_rank=RANK,
        dtype=str(dtype).removeprefix("torch."),
        device=device,
        enable_prefix_caching=False,  # vLLM 0.20.2's default on this model; the runs repeat the same prompts
        kernels=KernelsConfig(**(kernels or {})),
    )
    log("hylora", config)
    t0 = time.perf_counter()
    fp8 = serve_fp8(ModelConfig.from_dir(ckpt), config.quantization, device, dtype)
    model = load_model(ckpt, dtype=dtype, device=device, progress=False, vision=False, fp8=fp8)
    adapters = {name: work.adapters / name for name in adapter_names()}
    engine = LLMEngine(ckpt, config, lora_modules=adapters, progress=False, model=model)
    sync(device)
    setup = {
        "startup_s": time.perf_counter() - t0,
        "served_as": engine.quantization or ("bf16" if dtype == torch.bfloat16 else "fp32"),
        "kernels": as_text(engine.kernels),
        "kv_pages": engine.kv.num_pages,
        "kernels_config": dict(kernels or {}),
        "settings": {k: str(v) for k, v in vars(config).items() if k != "kernels"},
    }
    log(f"hylora engine up in {setup['startup_s']:.0f}s, served as {setup['served_as']}, kernels {setup['kernels']}")
    return engine, setup


def run_hylora(engine: Any, device: str, repeats: int, record: Record, ab_plan_ahead: bool = False) -> None:
    """`ab_plan_ahead`: before each timed run, the same workload with the prefill steps planned once the
    step before is read (EngineConfig.plan_prefill_ahead off), logged beside it (not recorded)."""
    from bench import engine_gpu as eg

    label_of = {"base": "base", "mixed8": "8 adapters mixed"}
    for label, adapter_of, warm in (("base", lambda i: None, 1), ("mixed8", mixed_adapter, N_ADAPTERS)):
        for r in range(repeats):
            run = f"{label_of[label]}, {record.data['mnbt']} tokens per step, #{r + 1}"  # its request ids too
            if ab_plan_ahead:
                engine.config.plan_prefill_ahead = False
                with cpu_stand_ins(device):
                    off = eg._run_workload(engine, run + ", planned after the read", adapter_of, warm)
                engine.config.plan_prefill_ahead = True
                rate = N_REQUESTS * NEW_TOKENS / off["wall_s"]
                steps_off = step_line(off["prefill_steps"])
                log(f"{run}, plan ahead off: {rate:.0f} tok/s; until every first token {steps_off}")
            with cpu_stand_ins(device):
                own = eg._run_workload(engine, run, adapter_of, warm)
            steps = own.pop("prefill_steps")
            log(f"{run}: until every first token " + step_line(steps))
            prefill = hylora_prefill(engine, adapter_of, device)
            row = workload_row(own["wall_s"], N_REQUESTS * NEW_TOKENS, prefill)
            record.add_run(label, row | {f"hylora_{k}": v for k, v in own.items()} | {"hylora_steps": steps})


def step_line(steps: list[dict[str, Any]]) -> str:
    """The steps until every request's first token, one `sequences/tokens device_ms (+gap_ms)` each."""
    total = sum(s["device_ms"] + s.get("gap_ms", 0.0) for s in steps)
    parts = [
        f"{s['sequences']}/{s['tokens']} {s['device_ms']:.1f}" + (f" (+{s['gap_ms']:.1f})" if "gap_ms" in s else "")
        for s in steps
    ]
    return f"{len(steps)} steps, {total:.1f} ms: " + ", ".join(parts)


def save_decode_profile(record: Record, label: str, rows: list[dict[str, Any]], folder: Path) -> None:
    """The decode step's kernel table of workload `label` (base, mixed8): in the record and as
    `<engine>-<weights>-<mnbt>-<label>-decode.md`."""
    d = record.data
    name = f"{d['engine']}-{d['weights']}-{d['mnbt']}"
    text = decode_profile.summary_md(f"{name}, {label}, batch {N_REQUESTS}", rows)
    (folder / f"{name}-{label}-decode.md").write_text(text)
    record.update(**{f"decode_profile_{label}": rows})
    log(text)


def save_prefill_profile(record: Record, label: str, got: dict[str, Any], folder: Path) -> None:
    """The kernels of workload `label`'s steps until every first token, and the device's idle time in
    them: in the record and as `<engine>-<weights>-<mnbt>-<label>-prefill.md`."""
    d = record.data
    name = f"{d['engine']}-{d['weights']}-{d['mnbt']}"
    head = (
        f"{name}, {label}: {got['steps']} steps until every first token; device span {got['span_ms']:.1f} ms, "
        f"kernels {got['busy_ms']:.1f} ms, idle {got['idle_ms']:.1f} ms"
    )
    text = head + "\n\n" + decode_profile.summary_md(name + ", " + label, got["kernels"], "phase")
    (folder / f"{name}-{label}-prefill.md").write_text(text)
    record.update(**{f"prefill_profile_{label}": got})
    log(text)


_PREFILL_RUNS = itertools.count()


def hylora_prefill(engine: Any, adapter_of: Callable[[int], str | None], device: str) -> float:
    """The workload's prompts with max_tokens=1, timed as vLLM's are (wall, until all finish)."""
    from hylora.engine import SamplingParams

    run = next(_PREFILL_RUNS)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    sync(device)
    t0 = time.perf_counter()
    for i, prompt in enumerate(workload_prompts()):
        engine.add_request(f"prefill{run}-{i}", prompt, params, adapter_of(i))
    while engine.has_unfinished():
        engine.step()
    sync(device)
    return time.perf_counter() - t0


class _Instant:
    """A wall-clock stand-in for a CUDA event (`elapsed_time` in ms)."""

    def __init__(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _Instant) -> float:
        return 1e3 * (end.t - self.t)


def cpu_stand_ins(device: str) -> contextlib.AbstractContextManager[Any]:
    """On the CPU (the dry run), `_run_workload`'s CUDA calls: synchronize a no-op, its StepTimer's
    CUDA events replaced by the wall clock."""
    if device.startswith("cuda"):
        return contextlib.nullcontext()
    import torch

    from bench import engine_gpu as eg

    class CpuStepTimer(eg.StepTimer):
        def __init__(self) -> None:
            self.steps: list[tuple[Any, ...]] = []

        def before_forward(self, chunks: Any) -> None:
            self._start = _Instant()

        def after_forward(self, chunks: Any) -> None:
            end = _Instant()
            n_tokens = sum(c.num_tokens for c in chunks)
            self.steps.append((len(chunks), n_tokens, 1e3 * (end.t - self._start.t), self._start, end))

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: None))
    stack.enter_context(mock.patch.object(eg, "StepTimer", CpuStepTimer))
    return stack


# --------------------------------------------------------------------------------------------
# phase table


def load_records(dirs: list[Path]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """Every result under `dirs` (the newest of each engine, weights, mnbt)."""
    found: dict[tuple[str, str, int], dict[str, Any]] = {}
    for d in dirs:
        for path in sorted(d.rglob("*.json")):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(data, dict) or path.name != record_name(data):
                continue
            key = (data["engine"], data["weights"], int(data["mnbt"]))
            if key not in found or data.get("updated", 0) > found[key].get("updated", 0):
                found[key] = data | {"source": str(path)}
    return found


def record_name(data: dict[str, Any]) -> str:
    return RECORD_NAME.format(engine=data.get("engine"), weights=data.get("weights"), mnbt=data.get("mnbt"))


def shape_text(records: dict[tuple[str, str, int], dict[str, Any]]) -> str:
    """The checkpoints' shape(s) and size on disk per weights, as the records saw them."""
    shapes, sizes = set(), {}
    for (_, weights, _), r in sorted(records.items()):
        c = r.get("checkpoint")
        if c:
            shapes.add(f"hidden {c['hidden_size']}, {c['layers']} layers ({c['gdn_layers']} Gated DeltaNet + "
                       f"{c['attention_layers']} attention), vocab {c['vocab_size']}")  # fmt: skip
            sizes[weights] = f"{weights} {c['gb_on_disk']:.3g} GB"
    return "; ".join(sorted(shapes) or ["shape unknown"]) + (f" ({', '.join(sizes.values())})" if sizes else "")


def timed_runs(record: dict[str, Any] | None, label: str) -> list[dict[str, Any]]:
    """The runs a figure is taken from, slowest first: all but the first when there are three or more."""
    runs = (record or {}).get("runs", {}).get(label) or []
    return sorted(runs[1:] if len(runs) >= 3 else runs, key=lambda r: r["out_tok_s"])


def median_run(record: dict[str, Any] | None, label: str) -> dict[str, Any] | None:
    runs = timed_runs(record, label)
    return runs[len(runs) // 2] if runs else None


def cell(record: dict[str, Any] | None, label: str, key: str, fmt: str) -> str:
    row = median_run(record, label)
    return format(row[key], fmt) if row else "–"


def median_cell(record: dict[str, Any] | None, label: str, key: str, fmt: str) -> str:
    """The median of one figure over the timed runs, taken on its own: the median run's prefill can be
    an outlier (run 26: vLLM's 0.58 s against 0.28–0.31 s, which left that run 0.79 ms a step)."""
    values = sorted(r[key] for r in timed_runs(record, label))
    return format(values[len(values) // 2], fmt) if values else "–"


def tok_s_cell(record: dict[str, Any] | None, label: str) -> str:
    """The median run's output tok/s, with the lowest and highest when there is more than one."""
    runs = timed_runs(record, label)
    if len(runs) < 2:
        return cell(record, label, "out_tok_s", ".0f")
    return f"{median_run(record, label)['out_tok_s']:.0f} ({runs[0]['out_tok_s']:.0f}–{runs[-1]['out_tok_s']:.0f})"


def ratio(hy: dict[str, Any] | None, vl: dict[str, Any] | None, label: str) -> str:
    a, b = median_run(hy, label), median_run(vl, label)
    return f"{a['out_tok_s'] / b['out_tok_s']:.2f}" if a and b else "–"


def table_md(records: dict[tuple[str, str, int], dict[str, Any]]) -> str:
    mnbts = sorted({m for _, _, m in records} | {2048, 8192})
    cards = sorted({r["card"] for r in records.values() if r.get("card")})
    dates = sorted({r.get("date", "?")[:10] for r in records.values()})
    lines = [
        "# vLLM 0.20.2 beside hylora: throughput on one GPU",
        "",
        f"Card: {', '.join(cards) or '–'}; measured {', '.join(dates) or '–'}. Checkpoint: random weights, "
        f"{shape_text(records)}, Hugging Face VL layout; fp8 = hylora's block-FP8 copy (e4m3, 128 x 128 scales). "
        f"Adapters: 8 random rank-{RANK} on every linear. Workload: {N_REQUESTS} requests x {PROMPT_LEN} random "
        "prompt ids + "
        f"{NEW_TOKENS} greedy tokens, all at once; max_num_seqs {MAX_NUM_SEQS}; prefix caching off; 8 mixed: "
        "request i uses adapter i mod 8. Output tok/s (32 x 64 / wall): the median run (lowest–highest); "
        "ratio = hylora / vLLM of the medians. vLLM runs one engine with LoRA enabled for both columns.",
        "",
        "| weights | max_num_batched_tokens | vLLM base | hylora base | ratio "
        "| vLLM 8 mixed | hylora 8 mixed | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for weights in WEIGHTS:
        for mnbt in mnbts:
            vl, hy = records.get(("vllm", weights, mnbt)), records.get(("hylora", weights, mnbt))
            cells = [
                *(tok_s_cell(r, "base") for r in (vl, hy)),
                ratio(hy, vl, "base"),
                *(tok_s_cell(r, "mixed8") for r in (vl, hy)),
                ratio(hy, vl, "mixed8"),
            ]
            lines.append(f"| {weights} | {mnbt} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Prefill: the same 32 prompts with max_tokens=1 (s, wall); decode step: (wall - prefill) / 63 (ms); "
        "each the median over the timed runs, taken on its own.",
        "",
        "| weights | mnbt | vLLM base prefill / step | hylora base prefill / step "
        "| vLLM 8 mixed prefill / step | hylora 8 mixed prefill / step |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for weights in WEIGHTS:
        for mnbt in mnbts:
            row = [f"{median_cell(records.get((e, weights, mnbt)), label, 'prefill_s', '.2f')} / "
                   f"{median_cell(records.get((e, weights, mnbt)), label, 'decode_step_ms', '.2f')}"
                   for label in ("base", "mixed8") for e in ("vllm", "hylora")]  # fmt: skip
            lines.append(f"| {weights} | {mnbt} | " + " | ".join(row) + " |")
    lines += ["", "| engine | weights | mnbt | start-up | served as / attention | runs | status |", "|" + " --- |" * 7]
    for (engine, weights, mnbt), r in sorted(records.items()):
        start = f"{r['startup_s']:.0f} s" if "startup_s" in r else "–"
        how = engine_note(r)
        runs = sum(len(v) for v in r.get("runs", {}).values())
        status = "complete" if r.get("complete") else (r.get("error") or "incomplete")[:120]
        lines.append(f"| {engine} | {weights} | {mnbt} | {start} | {how} | {runs} | {status} |")
    return "\n".join(lines) + "\n"


def engine_note(r: dict[str, Any]) -> str:
    """hylora: what its weights were served as (its GDN state is always fp32) and the kernel switches
    set by --kernels; vLLM: its attention backend, whether FA3 loaded, and its GDN state dtype."""
    if r["engine"] == "hylora":
        switches = "".join(f", {item}" for item in kernel_switches(r.get("kernels_config") or {}).split(",") if item)
        return f"served as {r.get('served_as', '?')}, GDN state float32{switches}"
    fa3 = {True: "loadable", False: "not loadable"}.get(r.get("fa3_available"), "?")
    state = r.get("gdn_state_dtype") or (r.get("checkpoint") or {}).get("mamba_ssm_dtype")
    state = state or "of the model's dtype (the config has no mamba_ssm_dtype)"
    return f"attention {r.get('settings', {}).get('attention_backend', 'auto')}, FA3 {fa3}, GDN state {state}"


def phase_table(args: argparse.Namespace) -> None:
    dirs = [Work(args.work).results, *args.results]
    records = load_records([d for d in dirs if d.is_dir()])
    text = table_md(records)
    out = args.out
    (out / "results").mkdir(parents=True, exist_ok=True)
    for (engine, weights, mnbt), r in records.items():
        dest = out / "results" / RECORD_NAME.format(engine=engine, weights=weights, mnbt=mnbt)
        if Path(r["source"]).resolve() != dest.resolve():
            shutil.copy(r["source"], dest)
    (out / "throughput_peer.md").write_text(text)
    (out / "throughput_peer.json").write_text(json.dumps(list(records.values()), indent=1, default=str))
    print(text, flush=True)


# --------------------------------------------------------------------------------------------
# phase run: steps in child processes under one budget


def parse_step(text: str) -> tuple[str, list[str], list[str]]:
    """`phase[:weights,...[:mnbt,...]]` -> (phase, weights, mnbts)."""
    phase, *rest = text.split(":")
    if phase not in MIN_LEFT_S:
        raise SystemExit(f"step {text!r}: the phase must be one of {sorted(MIN_LEFT_S)}")
    weights = rest[0].split(",") if rest and rest[0] else ["bf16"]
    mnbts = rest[1].split(",") if len(rest) > 1 and rest[1] else ["2048"]
    if bad := [w for w in weights if w not in WEIGHTS] + [m for m in mnbts if not m.isdigit()]:
        raise SystemExit(f"step {text!r}: unknown {bad}")
    return phase, weights, mnbts


def step_commands(step: str) -> list[tuple[str, list[str]]]:
    """(phase, arguments) per child: ckpt one for all weights; hylora one engine per weights;
    vllm one engine per (weights, mnbt)."""
    phase, weights, mnbts = parse_step(step)
    if phase == "ckpt":
        return [(phase, ["--weights", ",".join(weights)])]
    if phase == "hylora":
        return [(phase, ["--weights", w, "--mnbt", ",".join(mnbts)]) for w in weights]
    return [(phase, ["--weights", w, "--mnbt", m]) for w in weights for m in mnbts]


def run_child(argv: list[str], timeout: float, env: dict[str, str]) -> tuple[int | None, float]:
    """A phase in its own process group (vLLM's engine core with it), interrupted at `timeout` (SIGINT: its
    `finally` blocks stop the servers it started in sessions of their own), killed 20 s later."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, start_new_session=True)
    try:
        code: int | None = proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        code = None
        log(f"interrupted at its deadline after {time.perf_counter() - t0:.0f}s")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
    with contextlib.suppress(ProcessLookupError):  # its children (vLLM's engine core) outlive it
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return code, time.perf_counter() - t0


def wait_gpu_free(limit_s: float = 30) -> None:
    """Until the GPU holds under 2 GB (the killed group's memory given back), at most `limit_s`."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        try:
            query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
            used = int(subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.split()[0])
        except (OSError, ValueError, IndexError, subprocess.SubprocessError):
            return
        if used < 2000:
            return
        time.sleep(1)
    log("GPU memory still in use after the step")


def phase_run(args: argparse.Namespace) -> None:
    deadline = time.monotonic() + args.budget - TABLE_RESERVE_S
    commands = [c for step in args.steps for c in step_commands(step)]
    common = ["--work", str(args.work), "--out", str(args.out), "--device", args.device, "--repeats", str(args.repeats)]
    common += ["--tiny"] * args.tiny + ["--reuse"] * args.reuse + ["--dry-run"] * args.dry_run
    common += ["--attention-backend", args.attention_backend] if args.attention_backend else []
    common += ["--profile-decode"] * args.profile_decode
    common += ["--profile-prefill"] * args.profile_prefill
    common += ["--ab-plan-ahead"] * args.ab_plan_ahead
    common += ["--kernels", kernel_switches(args.kernels)] if args.kernels else []
    log(f"work {args.work}, out {args.out}, budget {args.budget:.0f}s, device {args.device}: "
        + "; ".join(f"{p} {' '.join(a)}" for p, a in commands))  # fmt: skip
    env = child_env()
    for phase, extra in commands:
        left = deadline - time.monotonic()
        if not args.tiny and left < MIN_LEFT_S[phase]:
            log(f"=== {phase} {' '.join(extra)}: skipped, {left:.0f}s left (it needs {MIN_LEFT_S[phase]})")
            continue
        log(f"=== {phase} {' '.join(extra)} (deadline in {left:.0f}s)")
        code, took = run_child([sys.executable, str(Path(__file__).resolve()), phase, *extra, *common], left, env)
        log(f"=== {phase} {' '.join(extra)}: exit {code} after {took:.0f}s")
        if args.device.startswith("cuda"):
            wait_gpu_free()
    phase_table(args)


# --------------------------------------------------------------------------------------------


def add_shared_args(ap: argparse.ArgumentParser) -> None:
    """The flags every peer bench's phases take alike (this one's and speculative_peer.py's)."""
    ap.add_argument("--reuse", action="store_true", help="ckpt: keep what an earlier call completed in --work")
    ap.add_argument("--tiny", action="store_true", help="the bench's small shape, 4 layers (CPU dry run)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--budget", type=float, default=540, help="run: seconds for every step and the table")
    ap.add_argument("--results", type=Path, nargs="*", default=[], help="table: more folders of result JSON")
    ap.add_argument("--attention-backend", default=None, help="vllm: e.g. TRITON_ATTN (default: vLLM's choice)")
    ap.add_argument("--dry-run", action="store_true", help="vllm: check the engine arguments, build nothing")


def kernel_overrides(text: str) -> dict[str, int | str]:
    """`--kernels`: hylora.kernels.config.parse_kernel_overrides, its error as argparse's (hylora imported
    only when the flag is given)."""
    from hylora.kernels.config import kernel_overrides_arg

    return kernel_overrides_arg(text)


def kernel_switches(kernels: dict[str, int | str]) -> str:
    from hylora.kernels.config import kernel_switches as switches

    return switches(kernels)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("phase", choices=PHASES)
    ap.add_argument("steps", nargs="*", help="run: phase[:weights,...[:mnbt,...]] (e.g. vllm:bf16:2048,8192)")
    ap.add_argument("--work", type=Path, default=None, help="checkpoints, adapters, results (default /dev/shm or /tmp)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/tput_out")))
    ap.add_argument("--weights", default="bf16", help="bf16, fp8 (ckpt: both may be given, comma-separated)")
    ap.add_argument("--mnbt", default="2048", help="max_num_batched_tokens (hylora: several, comma-separated)")
    ap.add_argument("--repeats", type=int, default=5, help="runs of each workload; the median is reported")
    ap.add_argument(
        "--profile-decode",
        action="store_true",
        help="after the timed runs, the base and the 8-mixed workload with decode steps under torch.profiler: "
        "a per-kernel table each into --out/profiles (bench/peer/decode_profile.py)",
    )
    ap.add_argument(
        "--profile-prefill",
        action="store_true",
        help="hylora: after the timed runs, the base and the 8-mixed workload's steps until every first token "
        "under torch.profiler: the kernels and the device's idle time into --out/profiles",
    )
    ap.add_argument(
        "--ab-plan-ahead",
        action="store_true",
        help="hylora: each timed run also with plan_prefill_ahead off, logged beside it (engine/plan_ahead.py)",
    )
    ap.add_argument(
        "--kernels",
        type=kernel_overrides,
        default={},
        help="hylora: KernelsConfig switches and sizes, e.g. fp8_fused_norm_quant=1,lora_stacked_below=4096",
    )
    add_shared_args(ap)
    args = ap.parse_args(argv)
    args.weights = [w for w in args.weights.split(",") if w]
    args.mnbt = [int(m) for m in args.mnbt.split(",") if m]
    if bad := [w for w in args.weights if w not in WEIGHTS]:
        ap.error(f"unknown weights {bad}")
    if args.phase in ("vllm", "hylora") and len(args.weights) != 1:
        ap.error(f"{args.phase}: one --weights")
    if args.phase == "vllm" and len(args.mnbt) != 1:
        ap.error("vllm: one --mnbt (one engine per setting)")
    if args.phase == "run" and not args.steps:
        ap.error("run: give steps, e.g. ckpt:bf16 hylora:bf16:2048,8192 vllm:bf16:2048")
    args.work = args.work or pick_work()
    if args.phase != "table":
        args.device = args.device or default_device()
    return args


PHASE_FUNCTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "ckpt": phase_ckpt, "vllm": phase_vllm, "hylora": phase_hylora, "table": phase_table, "run": phase_run,
}  # fmt: skip


def run_phase(phases: dict[str, Callable[[argparse.Namespace], None]], args: argparse.Namespace) -> None:
    """`args.phase` of `phases`; the vllm phase ends with a hard exit (its code reported), since vLLM's
    teardown threads can hold a normal one (`run` kills the group after it anyway)."""
    if args.phase != "vllm":
        phases[args.phase](args)
        return
    code = 0
    try:
        phases["vllm"](args)
    except SystemExit as e:  # a refusal with its reason
        print(e, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 (reported, then the hard exit below)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    run_phase(PHASE_FUNCTIONS, parse_args())


if __name__ == "__main__":
    main()

"""`hylora serve`: build the engine from flags and run the HTTP server."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import secrets
import sys
from pathlib import Path

import jinja2
import uvicorn

from hylora.config import read_json_object
from hylora.engine.async_engine import AsyncEngine
from hylora.engine.chat_input import MediaSettings
from hylora.engine.config import EngineConfig
from hylora.engine.engine import LLMEngine
from hylora.kernels import KernelsConfig
from hylora.kernels.config import (
    FAST_KERNEL_CHOICES,
    FP8_ACTIVATIONS,
    GDN_BACKENDS,
    TOWER_ATTENTION,
    kernel_overrides_arg,
    kernels_with_overrides,
    parse_launch,
)
from hylora.media import FetchPolicy, MediaError, MediaLimits, MediaPools, ProcessedCache
from hylora.media.cache import DEFAULT_CAPACITY_GB
from hylora.media.config import apply_overrides, merge_overrides
from hylora.model.layers import LORA_BACKENDS
from hylora.server.app import ServerState, build_app
from hylora.server.routing import TaskRouter
from hylora.server.vllm_argv import human_readable_int, max_model_len_arg
from hylora.server.vllm_flags import DTYPES, add_vllm_args, normalise_vllm_args, parse_mm_limits

log = logging.getLogger(__name__)
# the flags vLLM reads as sizes (`32k`, `1M`; --max-model-len also `auto`)
SIZE_TYPES = {"max_model_len": max_model_len_arg, "max_num_batched_tokens": human_readable_int}
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", nargs="?", help="Hugging Face model directory (or --model)")
    p.add_argument(
        "--demo",
        action="store_true",
        help="serve the embedded demo model with adapters relic, tomb, mural (written on first use)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names of the base model in the API: the first is reported, all are accepted (default: the model "
        "argument exactly as given)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH|JSON",
        help='adapters to load at start: name=path, or vLLM\'s \'{"name": ..., "path": ..., "base_model_name": ...}\'',
    )
    p.add_argument(
        "--task", nargs="+", action="extend", default=[], metavar="TASK=ADAPTER", help="route task TASK to ADAPTER"
    )
    p.add_argument("--task-map", metavar="FILE", help="JSON file {task: adapter} (instead of or with --task)")
    p.add_argument(
        "--adapter-root", metavar="DIR", help="allow /v1/load_lora_adapter for directories under DIR (off without it)"
    )
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route except /health")
    p.add_argument("--chat-template", metavar="FILE|TEMPLATE", help="a Jinja chat template (file or inline) to use")
    p.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="sampling defaults: auto = the model's generation_config.json, vllm = hylora's own, or a folder's",
    )
    p.add_argument(
        "--override-generation-config", type=json.loads, default=None, metavar="JSON", help="defaults over those"
    )
    p.add_argument("--seed", type=int, default=None, help="seed requests that bring none (reproducible runs)")
    p.add_argument("--disable-log-requests", action="store_true", help="no per-request log line (prompts never logged)")
    add_vllm_args(p)
    p.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    compat = p.add_argument_group("accepted for vLLM launch scripts")
    compat.add_argument("--enable-lora", action="store_true", help="accepted; LoRA is always on in hylora")
    compat.add_argument(
        "--trust-remote-code", action="store_true", help="accepted, no effect: hylora runs no code from the checkpoint"
    )
    compat.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1, help="1 only: hylora runs one engine per GPU"
    )
    p.add_argument("--public-metrics", action="store_true", help="serve /metrics without the API key")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument(
        "--max-body-bytes", type=_positive_int, default=8 << 20, help="largest request body (default: %(default)s)"
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds running requests get to finish before they are ended (new ones get 503)",
    )
    p.add_argument(
        "--stream-stall-timeout",
        type=_positive_seconds,
        default=60.0,
        help="cut a streaming client that has read nothing for this many seconds (default: %(default)s)",
    )
    p.add_argument("--timeout-keep-alive", type=float, default=5.0, help="close idle keep-alive connections after")
    h = p.add_argument_group("HTTP (vLLM's names; one server, not --replicas)")
    h.add_argument("--root-path", default="", help="the path prefix a proxy serves this API under (FastAPI's)")
    h.add_argument("--ssl-keyfile", metavar="FILE", help="serve HTTPS with this key (and --ssl-certfile)")
    h.add_argument("--ssl-certfile", metavar="FILE", help="serve HTTPS with this certificate chain")
    h.add_argument("--ssl-ca-certs", metavar="FILE", help="CA certificates to verify clients with")
    h.add_argument("--ssl-cert-reqs", type=int, default=0, help="0: no client certificate, 1: optional, 2: required")
    h.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log line per HTTP request")
    h.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json")
    r = p.add_argument_group("scale out on Ray Serve (pip install 'hylora[ray]'; docs/DEPLOY.md)")
    r.add_argument("--replicas", type=int, default=None, help="N engine replicas behind one endpoint (Ray Serve)")
    r.add_argument("--ray-address", metavar="ADDRESS", help="join this Ray cluster (default: start a local one)")
    r.add_argument(
        "--replica-gpus", type=float, default=None, help="GPUs per replica (default: 1 where Ray has GPUs, else 0)"
    )
    m = p.add_argument_group("images and videos (vLLM's names)")
    m.add_argument(
        "--limit-mm-per-prompt",
        type=parse_mm_limits,
        default=None,
        metavar="JSON|K=N,...",
        help="e.g. image=4,video=1 or JSON",
    )
    m.add_argument(
        "--mm-processor-kwargs", type=json.loads, default=None, metavar="JSON", help="defaults, e.g. '{\"fps\": 1}'"
    )
    m.add_argument(
        "--media-io-kwargs",
        type=json.loads,
        default=None,
        metavar="JSON",
        help='per kind, e.g. \'{"video": {"num_frames": 32}}\'',
    )
    m.add_argument("--allowed-local-media-path", metavar="DIR", help="allow file:// media URLs under DIR")
    m.add_argument(
        "--allowed-media-domains",
        nargs="+",
        action="extend",
        default=[],
        metavar="HOST",
        help="allow http(s) media URLs from HOST",
    )
    m.add_argument(
        "--media-fetch-timeout",
        type=float,
        default=10.0,
        help="seconds for one http(s) media fetch: connect, headers, body and redirects together",
    )
    m.add_argument("--max-media-bytes", type=int, default=64 << 20, help="largest image or video accepted")
    m.add_argument("--max-video-frames", type=int, default=768, help="most frames sampled from one video")
    m.add_argument("--max-visual-tokens", type=int, default=65536, help="most visual tokens in one request")
    m.add_argument(
        "--max-decode-pixels",
        type=int,
        default=MediaLimits.max_decode_pixels,
        help="most width x height x frames decoded from one video or animated image (default: 10 min, 720p, 30 fps)",
    )
    m.add_argument(
        "--media-decode-threads",
        type=int,
        default=None,
        help="threads decoding images and videos (default: one per core, 2 to 8; one request uses at most half)",
    )
    m.add_argument(
        "--media-frame-threads",
        type=int,
        default=None,
        help="threads for videos' frames (a frame list's JPEG decoding, resizing, patch rows), shared by "
        "every request in the order they came (default: one per core)",
    )
    m.add_argument(
        "--media-frame-processes",
        type=int,
        default=None,
        help="worker processes that decode and resize frame lists' frames (data:video/jpeg) out of the server's "
        "process, so they do not slow the engine's steps; they write the rows into /dev/shm (0: on the frame "
        "threads; default: one per core, at most 32, on 4 or more cores, else 0; with --replicas, the cores are "
        "divided among the replicas)",
    )
    m.add_argument(
        "--mm-processor-cache-gb",
        type=float,
        default=DEFAULT_CAPACITY_GB,
        help="preprocessed images and videos kept by content, so one video sent to several adapters is decoded "
        "once (GiB of pixel rows; 0: off; default: %(default)s)",
    )
    d = EngineConfig.__dataclass_fields__
    m.add_argument("--max-num-encoder-tokens", type=int, default=d["max_num_encoder_tokens"].default)
    m.add_argument("--encoder-cache-gb", type=float, default=d["encoder_cache_gb"].default)
    add_switch(
        m,
        "encode_media_ahead",
        "a prompt chunk that reaches a video encodes the video's later temporal patches too, as far as the "
        "step's encoder budget goes (fewer, larger vision-tower calls)",
    )
    unset = {  # what a default of None means
        "max_num_batched_tokens": "8192 on CUDA, 2048 on CPU",
        "max_cpu_loras": "2 x max_loras",
        "num_pages": "from the memory budget on a GPU, max_num_seqs x max_model_len on CPU",
        "page_size": f"{d['page_size'].default}; --block-size is vLLM's name",
    }
    for name in (
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_loras",
        "max_lora_rank",
        "max_cpu_loras",
        "num_pages",
        "page_size",
    ):
        default = None if name == "page_size" else d[name].default  # None: not given (--block-size may set it)
        help_ = f"(default: {unset.get(name, default)})"
        kind = SIZE_TYPES.get(name, int)
        if kind is max_model_len_arg:
            help_ += "; 32k: 32000, 32K: 32768; auto or -1: the model's context, as far as the memory holds it"
        elif kind is not int:
            help_ += "; 32k: 32000, 32K: 32768"
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default, help=help_)
    p.add_argument("--gpu-memory-utilization", type=float, default=d["gpu_memory_utilization"].default)
    p.add_argument("--dtype", default="auto", choices=list(DTYPES))
    p.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["fp8"],
        help="fp8: serve FP8 weights on any device, quantising an unquantised checkpoint at load (128x128 blocks, "
        "as `hylora quantize` writes). Default: an FP8 checkpoint runs FP8 GEMMs where the GPU has them "
        "(compute capability 8.9+), dequantised elsewhere",
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (decode and short steps run eagerly)")
    p.add_argument(
        "--max-short-step-tokens",
        type=int,
        default=d["max_short_step_tokens"].default,
        help="steps of at most this many tokens (decode rows with a prompt's last tokens, speculative verify "
        "steps) replay CUDA graphs per token bucket; 0: they run eagerly (default: %(default)s)",
    )
    add_switch(
        p,
        "async_scheduling",
        "queue the next step before reading this one's tokens (CUDA): decode steps, and steps with prompt "
        "chunks or new requests where nothing but this step's draw decides them",
    )
    add_switch(
        p,
        "queue_drafts",
        "when speculating, queue the next drafts behind the verify step's acceptance on the device, so the "
        "GPU drafts while the host reads the step (needs the short-step graphs)",
    )
    add_kernel_args(p)
    t = p.add_argument_group("testing aids (never in production)")
    t.add_argument(
        "--padded-decode",
        action="store_true",
        help="on the CPU, run decode and short steps padded as CUDA graphs pad them",
    )
    t.add_argument(
        "--enable-fault-injection",
        action="store_true",
        help="a request's body field hylora_inject_fault (nan, raise, device) makes it fault in its next step",
    )


def add_switch(group: argparse._ActionsContainer, field: str, help_: str) -> None:
    """A `--name` / `--no-name` flag for a boolean EngineConfig field, defaulting as the field does."""
    default = EngineConfig.__dataclass_fields__[field].default
    group.add_argument(
        f"--{field.replace('_', '-')}", action=argparse.BooleanOptionalAction, default=default, help=help_
    )


def add_kernel_args(p: argparse.ArgumentParser) -> None:
    """The kernel floor's knobs (hylora.kernels.KernelsConfig)."""
    k = p.add_argument_group("kernels (each fast kernel serves only after its start-up check passed)")
    k.add_argument(
        "--fast-kernels", default="auto", choices=FAST_KERNEL_CHOICES, help="off: the torch references (not fla's)"
    )
    k.add_argument(
        "--gdn-backend", default="auto", choices=GDN_BACKENDS, help="prefill's gated delta rule (fla: required)"
    )
    k.add_argument(
        "--lora-backend", default="auto", choices=("auto", *LORA_BACKENDS), help="force one LoRA implementation"
    )
    k.add_argument(
        "--gdn-decode-launch",
        type=parse_launch,
        default=None,
        metavar="BLOCK_V,WARPS[,V_BLOCKS]",
        help="the GDN decode kernel's launch (V_BLOCKS 0: the split form, conv then delta rule), e.g. the pick "
        "of bench/kernel_sweep_gpu.py --gdn-best-out",
    )
    k.add_argument(
        "--fp8-activations",
        default="dynamic",
        choices=FP8_ACTIVATIONS,
        help="FP8 weights: dynamic quantises each projection's input (FP8 tensor cores, as the checkpoint says); "
        "split, below 768 tokens, writes it as two FP8 terms (FP8 tensor cores, a bf16 rounding's precision), "
        "and from 768 tokens does as none; none keeps it in the model's dtype (weight-only: the dequantised "
        "model's arithmetic, bf16's fidelity and about bf16's speed on an H200, FP8's memory)",
    )
    k.add_argument(
        "--lora-delta-first-from",
        type=int,
        default=KernelsConfig.lora_delta_first_from,
        metavar="TOKENS",
        help="hylora's Triton LoRA in prefill steps of at least TOKENS tokens: the adapter delta written first, "
        "the base GEMM accumulating onto it (docs/LORA.md); 0: never (default: %(default)s)",
    )
    k.add_argument(
        "--tower-attention",
        default="auto",
        choices=TOWER_ATTENTION,
        help="the vision tower's attention: one of torch's SDPA backends, checked at start-up against fp32 math "
        "(start-up fails if it cannot serve); auto: torch's pick (bench/tower_gpu.py times each)",
    )
    k.add_argument(
        "--kernels",
        type=kernel_overrides_arg,
        default={},
        metavar="NAME=VALUE,...",
        help="any field of hylora.kernels.KernelsConfig (booleans 0 / 1), e.g. decode_attention_block_t=64 or "
        "fp8_fused_norm_quant=0: the switches the benches compare in one run (docs/PEER.md)",
    )


KERNEL_FLAGS = (
    "fast_kernels", "gdn_backend", "lora_backend", "gdn_decode_launch", "fp8_activations", "lora_delta_first_from",
    "tower_attention",
)  # fmt: skip


def kernels_config(args: argparse.Namespace) -> KernelsConfig:
    """The kernel flags, then --kernels; a field set both ways to different values is an error."""
    return kernels_with_overrides({name: getattr(args, name) for name in KERNEL_FLAGS}, args.kernels)


def lora_modules(items: list[str], base_name: str) -> dict[str, str]:
    """--lora-modules in both of vLLM's forms: name=path, or a JSON object with name and path."""
    out = {}
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules: {item!r} is not valid JSON ({e})") from None
            if (
                not isinstance(spec, dict)
                or not isinstance(spec.get("name"), str)
                or not isinstance(spec.get("path"), str)
            ):
                raise ValueError(f'--lora-modules: {item!r} needs {{"name": ..., "path": ...}}')
            parent = spec.get("base_model_name")
            if parent not in (None, base_name):
                log.warning("adapter %s names base model %r; serving it on %r", spec["name"], parent, base_name)
            name, path = spec["name"], spec["path"]
        else:
            ((name, path),) = _pairs([item], "--lora-modules").items()
        if name in out:
            raise ValueError(f"--lora-modules names {name!r} twice ({out[name]}, {path}): one name per adapter")
        out[name] = path
    return out


def generation_defaults(source: str, model_dir: Path, overrides: dict | None) -> dict:
    """Sampling defaults a request gets for what it leaves unset (vLLM's --generation-config)."""
    from hylora.server.protocol import SAMPLING_DEFAULTS, SamplingRequest

    defaults: dict = {}
    if source != "vllm":
        folder = model_dir if source == "auto" else Path(source)
        path = folder / "generation_config.json"
        if source != "auto" and not path.is_file():
            raise ValueError(f"--generation-config {source}: no generation_config.json there")
        if path.is_file():
            config = read_json_object(path)
            defaults = {k: config[k] for k in SAMPLING_DEFAULTS if config.get(k) is not None}
            if config.get("do_sample") is False:
                defaults["temperature"] = 0.0
    if overrides is not None and not isinstance(overrides, dict):
        raise ValueError("--override-generation-config expects a JSON object")
    if ignored := sorted(set(overrides or {}) - set(SAMPLING_DEFAULTS)):
        log.warning("--override-generation-config: ignoring %s (it sets %s)", ignored, sorted(SAMPLING_DEFAULTS))
    defaults |= {k: v for k, v in (overrides or {}).items() if k in SAMPLING_DEFAULTS}
    try:  # a default no request could use would fail every request that leaves it unset, as the client's fault
        SamplingRequest().sampling_params(1, None, None, defaults=defaults)
    except (ValueError, TypeError) as e:
        where = "--generation-config / --override-generation-config"
        raise ValueError(f"sampling defaults {defaults} ({where}): {e}") from None
    return defaults


def chat_template(value: str) -> str:
    """--chat-template: a file's text, or the template itself (as vLLM); a path that names no file, or
    a template that does not parse, is refused at start instead of failing every chat request."""
    path = Path(value)
    looks_like_a_path = "{" not in value and ("/" in value or path.suffix in (".jinja", ".j2", ".txt"))
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # too long for a path, NUL bytes: an inline template
        is_file = False
    if is_file:
        value = path.read_text()
    elif looks_like_a_path:
        raise ValueError(f"--chat-template {value}: no such file")
    try:
        jinja2.Environment().parse(value)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: the template does not parse (line {e.lineno}: {e.message})") from None
    return value


def _port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {port}")
    return port


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return number


def _positive_seconds(value: str) -> float:
    seconds = float(value)
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {value}")
    return seconds


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"{flag} expects NAME=VALUE, got {item!r}")
        out[name] = value
    return out


def build_state(args: argparse.Namespace) -> ServerState:
    from hylora.demo import DEMO_ADAPTERS, ensure_demo

    args = normalise_vllm_args(args)
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty: give the key, or leave the flag out for a server without one")
    if args.demo == bool(args.model_dir):
        raise ValueError("give a MODEL_DIR or --demo (one of them)")
    tasks = _pairs(args.task, "--task")
    if args.task_map:
        tasks = TaskRouter.read_task_map(args.task_map) | tasks
    if args.demo:
        model_dir = ensure_demo()
        names = args.served_model_name or ["hylora-demo"]
        lora = {n: str(model_dir / "adapters" / n) for n in DEMO_ADAPTERS} | lora_modules(args.lora_modules, names[0])
        tasks = {n: n for n in DEMO_ADAPTERS} | tasks
    else:
        model_dir = Path(args.model_dir)
        names = args.served_model_name or [args.model_dir]  # vLLM's rule: the argument as given
        lora = lora_modules(args.lora_modules, names[0])
    for adapter in lora:
        if adapter in names or not ADAPTER_NAME.fullmatch(adapter):
            raise ValueError(
                f"adapter name {adapter!r}: use 1-128 letters, digits, '_', '.', ':' or '-', "
                f"other than the base model's names {names}"
            )
    spec = args.speculative_config or {}
    if spec.get("model") not in (None, args.model_dir, str(model_dir)):
        raise ValueError("--speculative-config: MTP drafts with the served checkpoint's own layer; drop 'model'")
    config = EngineConfig(
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        page_size=EngineConfig.page_size if args.page_size is None else args.page_size,
        num_pages=args.num_pages,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        max_num_encoder_tokens=args.max_num_encoder_tokens,
        encoder_cache_gb=args.encoder_cache_gb,
        encode_media_ahead=args.encode_media_ahead,
        enforce_eager=args.enforce_eager,
        max_short_step_tokens=args.max_short_step_tokens,
        async_scheduling=args.async_scheduling,
        seed=args.seed,
        kernels=kernels_config(args),
        padded_decode=args.padded_decode,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_cache_states=args.prefix_cache_states,
        num_speculative_tokens=spec.get("num_speculative_tokens", 0),
        queue_drafts=args.queue_drafts,
        fault_injection=args.enable_fault_injection,
        language_model_only=args.language_model_only,
        hf_overrides=args.hf_overrides,
    )
    defaults = generation_defaults(args.generation_config, model_dir, args.override_generation_config)
    template = chat_template(args.chat_template) if args.chat_template else None
    engine = LLMEngine(model_dir, config, lora_modules=lora)
    if template is not None:
        engine.tokenizer.chat_template = template
    log.info(
        "sampling defaults for what a request leaves unset: %s", defaults or "hylora's (temperature 1, no filters)"
    )
    router = TaskRouter(names[0], engine.adapters, tasks, aliases=names[1:])
    for task in tasks:
        router.resolve(None, task)  # every task must point at a loaded adapter
    return ServerState(
        aengine=AsyncEngine(engine),
        router=router,
        api_key=args.api_key,
        adapter_root=Path(args.adapter_root) if args.adapter_root else None,
        max_body_bytes=args.max_body_bytes,
        shutdown_grace_s=args.shutdown_timeout,
        stream_stall_timeout_s=args.stream_stall_timeout,
        public_metrics=args.public_metrics,
        media=media_settings(args, engine),
        sampling_defaults=defaults,
        log_requests=not args.disable_log_requests,
        template_defaults=dict(args.default_chat_template_kwargs or {}),
        max_logprobs=args.max_logprobs,
        prompt_tokens_details=args.enable_prompt_tokens_details,
        tokens_as_ids=args.return_tokens_as_token_ids,
        force_include_usage=args.enable_force_include_usage,
        request_id_headers=args.enable_request_id_headers,
        cors=cors_settings(args),
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        auto_tool_choice=args.enable_auto_tool_choice,
    )


def cors_settings(args: argparse.Namespace) -> dict | None:
    """starlette CORSMiddleware's arguments from vLLM's --allowed-origins & co, or None (no CORS)."""
    if args.allowed_origins is None:
        return None
    return {
        "allow_origins": args.allowed_origins,
        "allow_methods": args.allowed_methods or ["*"],
        "allow_headers": args.allowed_headers or ["*"],
        "allow_credentials": args.allow_credentials,
    }


def media_settings(args: argparse.Namespace, engine: LLMEngine) -> MediaSettings | None:
    """What the server accepts as images and videos, or None for a model without a vision tower."""
    if engine.model.visual is None:
        return None
    for flag in ("limit_mm_per_prompt", "mm_processor_kwargs", "media_io_kwargs"):
        value = getattr(args, flag)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"--{flag.replace('_', '-')} expects a JSON object")
    kwargs = merge_overrides(args.mm_processor_kwargs, args.media_io_kwargs)
    limits = MediaLimits(
        max_bytes=args.max_media_bytes,
        max_frames=args.max_video_frames,
        max_visual_tokens=args.max_visual_tokens,
        max_decode_pixels=args.max_decode_pixels,
    )
    policy = FetchPolicy(
        allowed_local_root=Path(args.allowed_local_media_path).resolve() if args.allowed_local_media_path else None,
        allowed_domains=frozenset(args.allowed_media_domains),
        timeout_s=args.media_fetch_timeout,
    )
    limit = {"image": 8, "video": 2} | dict(args.limit_mm_per_prompt or {})
    settings = engine.media_settings(
        limits=limits,
        policy=policy,
        limit_per_prompt=limit,
        processor_kwargs=kwargs,
        pools=MediaPools(
            decode_threads=args.media_decode_threads,
            frame_threads=args.media_frame_threads,
            frame_processes="auto" if args.media_frame_processes is None else args.media_frame_processes,
            servers=getattr(args, "replicas", None) or 1,  # Ray replicas may share this machine's cores
        ),
        cache=ProcessedCache.from_gb(args.mm_processor_cache_gb),
    )
    try:  # checked once here: a bad default would otherwise fail every media request
        for kind in (settings.config.image, settings.config.video):
            apply_overrides(kind, kwargs, limits)
    except MediaError as e:
        raise ValueError(f"--mm-processor-kwargs / --media-io-kwargs: {e}") from None
    log.info(
        "media: %s per prompt, preprocessing overrides %s, file:// under %s, pools %s",
        limit,
        kwargs,
        policy.allowed_local_root,
        settings.pools.sizes,
    )
    return settings


class DrainingServer(uvicorn.Server):
    """uvicorn with hylora's shutdown: the first SIGTERM/SIGINT stops admitting requests (503),
    gives running ones the grace period, ends the rest with an error and then stops; a second
    signal stops at once. A device fault stops the server with exit code 1."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        self._draining = False
        state.aengine.on_fatal = self._fatal

    def handle_exit(self, sig: int, frame) -> None:  # type: ignore[override]
        if self._draining or self.should_exit:
            return super().handle_exit(sig, frame)
        self._draining = True
        log.info("signal %d: draining (up to %g s), then stopping", sig, self.state.shutdown_grace_s)
        loop = asyncio.get_running_loop()
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))

    async def _drain(self) -> None:
        try:
            ended = await self.state.aengine.drain(self.state.shutdown_grace_s)
            if ended:
                log.warning("ended %d unfinished request(s) at shutdown", ended)
            await asyncio.sleep(0.2)  # let the last events reach their clients
        finally:
            self.should_exit = True

    def _fatal(self, reason: str) -> None:  # called from the engine thread
        log.critical("stopping the server: %s", reason)
        self.exit_code = 1
        self.should_exit = True


HTTP_FLAGS = ("root_path", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "disable_fastapi_docs")


def http_options(args: argparse.Namespace) -> dict:
    """uvicorn's settings from vLLM's HTTP flags, checked before the model loads."""
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both for HTTPS")
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, flag)
        if path is not None and not Path(path).is_file():
            raise ValueError(f"--{flag.replace('_', '-')} {path}: no such file")
    if args.ssl_cert_reqs not in (0, 1, 2):
        raise ValueError("--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required)")
    if args.ssl_cert_reqs and not args.ssl_ca_certs:
        raise ValueError("--ssl-cert-reqs verifies client certificates: give --ssl-ca-certs to verify them with")
    if args.root_path and not args.root_path.startswith("/"):
        raise ValueError(f"--root-path {args.root_path!r} must start with '/'")
    return dict(
        root_path=args.root_path.rstrip("/"),
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        access_log=not args.disable_uvicorn_access_log,
    )


def serve(args: argparse.Namespace) -> None:
    """One engine behind one HTTP server (`hylora serve` without --replicas)."""
    if args.ray_address or args.replica_gpus is not None:
        raise ValueError("--ray-address and --replica-gpus go with --replicas N")
    http = http_options(args)  # a wrong path stops the start before the weights load
    state = build_state(args)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning(
            "listening on %s without --api-key: anyone who can reach it can use it (e.g. --api-key %s)",
            args.host,
            secrets.token_urlsafe(16),
        )
    log.info(
        "serving %s with adapters %s and tasks %s on http://%s:%d",
        state.router.base_name,
        state.engine.adapters.names(),
        state.router.tasks,
        args.host,
        args.port,
    )
    config = uvicorn.Config(
        build_app(state, docs=not args.disable_fastapi_docs),
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_keep_alive=max(1, round(args.timeout_keep_alive)),
        timeout_graceful_shutdown=5,
        **http,
    )
    server = DrainingServer(config, state)
    server.run()
    sys.exit(server.exit_code)

"""vLLM's launch flags, so that the launch lines of the Qwen3.5 / Qwen3.6 recipes run unchanged.

`add_vllm_args` adds the flags a vLLM launch line uses that hylora does not otherwise have;
`normalise_vllm_args` turns vLLM's spellings into hylora's (a positional model or `--model`,
`--dtype half`, `--block-size`, `--limit-mm-per-prompt image=2,video=1`, several served names) and
says at start-up which accepted flags are not active. docs/SERVING.md lists them all.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path
from typing import Any

from hylora.engine.speculative import check_speculative_config
from hylora.tokenizer import check_template_kwargs

log = logging.getLogger(__name__)

DTYPES = {"auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
          "float32": "float32"}  # fmt: skip
REASONING_PARSERS = ("qwen3", "deepseek_r1")
TOOL_CALL_PARSERS = ("qwen3_coder", "qwen3_xml", "hermes")
# vLLM's second parser of Qwen's <tool_call><function=...><parameter=...> calls: the same format
TOOL_CALL_ALIASES = {"qwen3_xml": "qwen3_coder"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


# Flags of vLLM launch lines that change nothing for one engine on one GPU: accepted, and said at start.
_FLAG = dict(action="store_true")
NO_EFFECT: list[tuple[tuple[str, ...], dict[str, Any], str]] = [
    (("--mm-encoder-tp-mode",), dict(choices=["weights", "data"]), "one GPU: the vision tower runs whole either way"),
    (
        ("--mm-processor-cache-type",),
        dict(choices=["lru", "shm"]),
        "preprocessed media are cached in the server's own process (--mm-processor-cache-gb sizes it)",
    ),
    (("--skip-mm-profiling",), _FLAG, "hylora sizes the tower's activations from --max-num-encoder-tokens"),
    (("--enable-expert-parallel",), _FLAG, "the dense Qwen3.5 / Qwen3.6 models have no experts"),
    (("--disable-custom-all-reduce",), _FLAG, "one GPU: no all-reduce"),
    (("--fully-sharded-loras",), _FLAG, "one GPU: adapters are not sharded"),
    (("--disable-frontend-multiprocessing",), _FLAG, "the API and the engine share one process"),
    (("--api-server-count",), dict(type=int), "one API process (--replicas scales out)"),
    (
        ("--compilation-config",),
        dict(type=json.loads, metavar="JSON"),
        "hylora captures its own CUDA graphs; only its cudagraph_mode NONE is read, as --enforce-eager",
    ),
    (
        ("--optimization-level", "-O"),
        dict(metavar="LEVEL"),
        "hylora captures its own CUDA graphs; only -O0 is read, as --enforce-eager",
    ),
    (
        ("--attention-config",),
        dict(type=json.loads, metavar="JSON"),
        "hylora picks its kernels at start (--kernels; logged)",
    ),
    (("--cuda-graph-sizes",), dict(type=int, nargs="+"), "hylora sizes its own CUDA graphs"),
    (("--max-seq-len-to-capture",), dict(type=int), "hylora sizes its own CUDA graphs"),
    (("--attention-backend",), dict(metavar="NAME"), "hylora picks its kernels at start (--kernels; logged)"),
    (("--mm-encoder-attn-backend",), dict(metavar="NAME"), "hylora picks its kernels at start (--kernels; logged)"),
    (("--guided-decoding-backend",), dict(metavar="NAME"), "hylora compiles every constraint with llguidance"),
    (
        ("--structured-outputs-config",),
        dict(type=json.loads, metavar="JSON"),
        "hylora compiles every constraint with llguidance",
    ),
    (("--swap-space",), dict(type=float, metavar="GB"), "hylora does not swap KV pages to the CPU"),
    (("--max-parallel-loading-workers",), dict(type=int), "the weights load in one pass"),
    (("--download-dir",), dict(metavar="DIR"), "hylora serves local directories and downloads nothing"),
    (("--revision",), dict(metavar="REV"), "the local directory is served as it is"),
]


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    v = p.add_argument_group("vLLM launch flags (docs/SERVING.md says which are active)")
    v.add_argument("--model", dest="model_flag", metavar="MODEL_DIR", help="the model directory (vLLM's spelling)")
    v.add_argument("--reasoning-parser", choices=REASONING_PARSERS, help="split <think>…</think> into reasoning")
    v.add_argument("--enable-auto-tool-choice", action="store_true", help='tool_choice "auto": parse tool calls')
    v.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, help="the model's tool-call format")
    v.add_argument(
        "--default-chat-template-kwargs",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="template variables for every request, e.g. '{\"enable_thinking\": false}' (a request's own win)",
    )
    v.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV pages and GDN states of cached prompt prefixes (default on, as vLLM)",
    )
    v.add_argument(
        "--prefix-cache-states",
        type=int,
        default=None,
        help="GDN state snapshots the prefix cache keeps (default: max(4, max_num_seqs // 2))",
    )
    v.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="MTP speculative decoding with the checkpoint's draft layer: "
        '\'{"method": "mtp", "num_speculative_tokens": 2}\'',
    )
    v.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details.cached_tokens: prompt tokens served from the prefix cache",
    )
    v.add_argument(
        "--return-tokens-as-token-ids", action="store_true", help='logprobs name tokens "token_id:N" (every request)'
    )
    v.add_argument("--enable-force-include-usage", action="store_true", help="every stream ends with a usage chunk")
    v.add_argument(
        "--enable-request-id-headers", action="store_true", help="X-Request-Id on every response (the client's own)"
    )
    v.add_argument("--disable-log-stats", action="store_true", help="accepted; hylora logs no periodic stats")
    v.add_argument("--enable-log-requests", action="store_true", help="a log line per request (the default)")
    v.add_argument("--max-logprobs", type=int, default=20, help="most logprobs / top_logprobs a request may ask for")
    v.add_argument("--block-size", type=int, default=None, help="KV tokens per page (hylora's --page-size)")
    v.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="accepted; hylora always chunks long prompts (--max-num-batched-tokens per step)",
    )
    v.add_argument("--kv-cache-dtype", default="auto", choices=["auto"], help="auto only (the model's dtype)")
    v.add_argument(
        "--mamba-ssm-cache-dtype",
        default="auto",
        choices=["auto", "float32"],
        help="the GDN recurrent state's dtype: always float32 in hylora (what Qwen's configs ask for)",
    )
    v.add_argument(
        "--mamba-cache-dtype",
        default="auto",
        choices=["auto"],
        help="auto only: the GDN conv state in the model's dtype, the recurrent state in float32",
    )
    v.add_argument(
        "--mamba-cache-mode",
        choices=["none", "all", "align"],
        default=None,
        help="accepted; hylora's prefix cache keeps GDN state snapshots its own way (--prefix-cache-states)",
    )
    v.add_argument("--mamba-block-size", type=int, default=None, help="accepted, no effect (see --mamba-cache-mode)")
    v.add_argument(
        "--language-model-only", action="store_true",
        help="text only: the vision tower is not loaded, images and videos are a 400",
    )  # fmt: skip
    v.add_argument(
        "--data-parallel-size", "-dp", type=int, default=1, help="1 only: one engine a process (--replicas scales out)"
    )
    v.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="1 only: one engine a GPU")
    v.add_argument(
        "--load-format", choices=["auto", "safetensors"], default="auto", help="safetensors only (pickles are refused)"
    )
    v.add_argument("--tokenizer-mode", choices=["auto", "hf"], default="auto", help="the model directory's tokenizer")
    v.add_argument("--config-format", choices=["auto", "hf"], default="auto", help="the model directory's config.json")
    v.add_argument("--scheduling-policy", choices=["fcfs"], default="fcfs", help="first come, first served")
    v.add_argument(
        "--hf-overrides", type=json.loads, default=None, metavar="JSON",
        help="merged over config.json, e.g. YaRN rope_parameters for contexts past 262144 tokens",
    )  # fmt: skip
    for flags, kwargs, why in NO_EFFECT:
        v.add_argument(*flags, **kwargs, help=f"accepted, no effect: {why}")
    v.add_argument("--allowed-origins", type=json.loads, default=None, metavar="JSON", help="CORS, e.g. '[\"*\"]'")
    v.add_argument("--allowed-methods", type=json.loads, default=None, metavar="JSON", help="CORS methods")
    v.add_argument("--allowed-headers", type=json.loads, default=None, metavar="JSON", help="CORS headers")
    v.add_argument("--allow-credentials", action="store_true", help="CORS credentials")


def parse_mm_limits(value: Any) -> dict[str, int] | None:
    """--limit-mm-per-prompt as JSON ('{"image": 2}') or vLLM's short form ('image=2,video=1')."""
    if value is None or isinstance(value, dict):
        return value
    text = str(value).strip()
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--limit-mm-per-prompt: {e}") from None
        if not isinstance(parsed, dict):
            raise ValueError("--limit-mm-per-prompt expects a JSON object")
        return parsed
    limits = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, sep, count = item.partition("=")
        if not sep or not count.strip().isdigit():
            raise ValueError(f"--limit-mm-per-prompt: expected image=N,video=N, got {item!r}")
        limits[kind.strip()] = int(count)
    return limits


def normalise_vllm_args(args: argparse.Namespace) -> argparse.Namespace:
    """vLLM's spellings as hylora's, checked; logs which accepted flags change nothing."""
    if args.model_flag is not None:
        if args.model_dir is not None and args.model_dir != args.model_flag:
            raise ValueError(f"two models given: {args.model_dir!r} and --model {args.model_flag!r}")
        args.model_dir = args.model_flag
    if args.model_dir is not None and not Path(args.model_dir).exists():
        raise ValueError(missing_model_message(args.model_dir))
    args.dtype = DTYPES[args.dtype]
    if args.block_size is not None:
        if args.page_size not in (None, args.block_size):
            raise ValueError(
                f"--page-size {args.page_size} and --block-size {args.block_size}: both name the KV tokens per page; "
                "give one"
            )
        args.page_size = args.block_size
    args.speculative_config = check_speculative_config(args.speculative_config)
    try:
        check_template_kwargs(args.default_chat_template_kwargs)
    except ValueError as e:
        raise ValueError(f"--default-chat-template-kwargs: {e}") from None
    if not args.max_logprobs >= 0:
        raise ValueError("--max-logprobs must be >= 0")
    for flag in ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size"):
        if getattr(args, flag, 1) != 1:
            raise ValueError(
                f"--{flag.replace('_', '-')} {getattr(args, flag)}: hylora runs one engine per GPU (no tensor, "
                "data or pipeline parallelism); to use more GPUs, run replicas (--replicas N, docs/DEPLOY.md)"
            )
    if args.hf_overrides is not None and not isinstance(args.hf_overrides, dict):
        raise ValueError("--hf-overrides expects a JSON object (merged over config.json)")
    graphs_off = graphs_off_by(args)
    if graphs_off is not None:
        args.enforce_eager = True
        log.info("%s: no CUDA graphs, as --enforce-eager", graphs_off)
    if args.tool_call_parser in TOOL_CALL_ALIASES:
        same = TOOL_CALL_ALIASES[args.tool_call_parser]
        log.info("--tool-call-parser %s: parsed as %s (the same call format)", args.tool_call_parser, same)
        args.tool_call_parser = same
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (qwen3_coder for Qwen3.5 / Qwen3.6)")
    for flag in ("allowed_origins", "allowed_methods", "allowed_headers"):
        value = getattr(args, flag)
        if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
            raise ValueError(f"--{flag.replace('_', '-')} expects a JSON list of strings")
    for note in inactive_flags(args):
        log.warning("%s", note)
    return args


def graphs_off_by(args: argparse.Namespace) -> str | None:
    """The vLLM flag that turns CUDA graphs off (-O0, or --compilation-config's cudagraph_mode NONE), if any."""
    if str(args.optimization_level).strip().lstrip("=") == "0":
        return "-O0"
    mode = (args.compilation_config or {}).get("cudagraph_mode") if isinstance(args.compilation_config, dict) else None
    if mode == 0 or (isinstance(mode, str) and mode.upper() == "NONE"):
        return "--compilation-config cudagraph_mode NONE"
    return None


def inactive_flags(args: argparse.Namespace) -> list[str]:
    """A line for each accepted flag that changes nothing today (the graph switches of `graphs_off_by` change
    one thing, and say so at start)."""
    notes = [
        f"{flags[0]}: accepted, no effect ({why})"
        for flags, _, why in NO_EFFECT
        if getattr(args, flags[0].lstrip("-").replace("-", "_"), None) not in (None, False)
        and not (flags[0] == "--optimization-level" and graphs_off_by(args) == "-O0")
    ]
    if args.enable_chunked_prefill is False:
        notes.append("--no-enable-chunked-prefill: accepted, but hylora always chunks long prompts")
    if args.disable_log_stats:
        notes.append("--disable-log-stats: accepted, no effect (hylora logs no periodic stats)")
    if args.mamba_cache_mode is not None or args.mamba_block_size is not None:
        notes.append(
            "--mamba-cache-mode / --mamba-block-size: accepted, no effect (hylora's prefix cache snapshots GDN "
            "states its own way: --prefix-cache-states)"
        )
    return notes


def missing_model_message(model: str) -> str:
    if HUB_ID.match(model):
        local = model.split("/")[-1]
        return (
            f"{model!r} is not a local directory. hylora serves local checkpoints and downloads nothing; fetch "
            f"it first, e.g. `huggingface-cli download {model} --local-dir ./{local}`, then `hylora serve ./{local}`"
        )
    return f"no model directory {model!r}"

"""`hylora doctor`: flags → engine, deployment and reference → checks → report and exit code.

Exit code 0 only if every check that applies passed; 1 if any failed (or the server could not be
used); 2 for bad flags, model or adapter directories."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from hylora.kernels.config import kernel_overrides_arg


def add_doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", nargs="?", help="the base model's directory (config.json + safetensors)")
    p.add_argument("--demo", action="store_true", help="the embedded demo model with its adapters relic, tomb, mural")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH", help="the adapters to check")
    g = p.add_argument_group("checking a server (default: hylora in this process)")
    g.add_argument("--endpoint", metavar="URL", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    g.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--served-model-name", help="the base model's name on the server (default: from /v1/models)")
    g.add_argument(
        "--endpoint-dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="the server's precision: the tolerance is its preset (with the reference's) instead of being derived "
        "from the server's measured noise",
    )
    g.add_argument(
        "--endpoint-quantization",
        default=None,
        choices=["fp8", "fp8-weight-only"],
        help="the server serves quantised weights (the fp8 check; the tolerance's ceiling); fp8-weight-only: FP8 "
        "weights with unquantised or split activations (hylora serve --fp8-activations none or split), held to "
        "the unquantised tolerance",
    )
    g.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    g.add_argument("--max-requests", type=int, default=2000, help="requests doctor may send in all")
    g.add_argument("--time-limit", type=float, default=3600.0, help="seconds doctor may spend sending requests")
    g = p.add_argument_group("the model (in-process, and the reference)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument(
        "--hf-overrides",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="as hylora serve --hf-overrides (e.g. YaRN rope_parameters): merged over config.json for the model "
        "checked in-process and for the reference",
    )
    g.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda when available)")
    g.add_argument(
        "--quantization",
        default=None,
        choices=["fp8"],
        help="in-process: serve FP8 weights (as hylora serve -q fp8; an FP8 checkpoint does on FP8 GPUs anyway); "
        "the reference is the checkpoint dequantised",
    )
    g.add_argument(
        "--fp8-activations",
        default="dynamic",
        choices=["dynamic", "split", "none"],
        help="in-process, FP8 weights: as hylora serve --fp8-activations (split and none: judged against the "
        "dequantised reference with the unquantised tolerance instead of the FP8 one)",
    )
    g.add_argument(
        "--max-model-len", type=int, default=4097, help="the sweep runs up to this minus one (the generated token)"
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        metavar="TOKENS",
        help="in-process: tokens a step (default: serve's, 8192 on CUDA and 2048 on the CPU)",
    )
    g.add_argument("--max-num-seqs", type=int, default=32)
    g.add_argument("--max-lora-rank", type=int, default=64)
    g.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="in-process: serve with MTP speculative decoding (as hylora serve), so the speculative check runs, "
        'e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\'',
    )
    g.add_argument(
        "--max-short-step-tokens",
        type=int,
        default=None,
        metavar="TOKENS",
        help="in-process: serve short steps (decode rows with a few prompt tokens, verify steps) as CUDA graphs "
        "(as hylora serve), so every check runs through them (default: serve's; 0: off)",
    )
    g.add_argument(
        "--lora-delta-first-from",
        type=int,
        default=None,
        metavar="TOKENS",
        help="in-process: steps of this many tokens write the LoRA delta first, on the Triton LoRA path (as hylora "
        "serve; default: serve's); 0: never",
    )
    g.add_argument(
        "--kernels",
        type=kernel_overrides_arg,
        default={},
        metavar="NAME=VALUE,...",
        help="in-process: any field of hylora.kernels.KernelsConfig, as hylora serve --kernels (e.g. "
        "fp8_deepgemm=0), so every check runs on the kernels that deployment serves",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="in-process: serve with prefix caching (as hylora serve, on by default), so the prefix-cache check runs",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: 1 with --demo, whose model is too small to gain from more and "
        "slows down badly when the cores are shared; else torch's default)",
    )
    g.add_argument("--restore", default="auto", choices=["auto", "copy", "checkpoint"], help=(
        "how the weights are put back after each adapter's merged reference: copy (touched rows kept in host "
        "memory), checkpoint (re-read from the model directory) or auto (copy when it fits in half the free RAM)"
    ))  # fmt: skip
    g = p.add_argument_group("what to check")
    g.add_argument("--lengths", help="comma-separated prompt lengths (default: boundary sizes up to the model length)")
    g.add_argument("--short-max-len", type=int, default=None, help="sweep lengths sent before the pollution burst")
    g.add_argument("--burst", type=int, default=2, help="long requests in the pollution burst")
    g.add_argument(
        "--video", metavar="FILE", help="a video request joins the pollution burst (default with --demo: its clip)"
    )
    g.add_argument("--load", type=float, default=0.0, metavar="SECONDS", help="also run the load check this long")
    g.add_argument("--load-streams", type=int, default=8)
    g.add_argument("--load-max-tokens", type=int, default=16)
    g.add_argument(
        "--tolerance-mean", type=float, help="mean |Δ logprob| allowed (default: from the measured noise and precision)"
    )
    g.add_argument(
        "--tolerance-max", type=float, help="max |Δ logprob| allowed (default: from the measured noise and precision)"
    )
    g.add_argument("--min-top1", type=float, help="top-1 agreement required (default: by the tolerance's precision)")
    g.add_argument("--no-fast-paths", action="store_true", help="skip the prefix-cache and speculative-decoding checks")
    g.add_argument("--prompt-file", help="text to build the prompts from (default: a built-in text)")
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="FILE", help="write every number to FILE")
    g.add_argument("--report", metavar="FILE.html", help="write a self-contained HTML report with the sweep plot")


def _pairs(items: list[str]) -> dict[str, Path]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"--lora-modules expects NAME=PATH, got {item!r}")
        out[name] = Path(value)
    return out


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse an output path that cannot be written (its directory missing or read-only, or a
    directory itself) before anything runs, not once the run is over."""
    for flag, value in (("--json", args.json), ("--report", args.report)):
        if not value:
            continue
        path = Path(value)
        if path.is_dir():
            raise ValueError(f"{flag} {path}: is a directory")
        if not path.parent.is_dir():
            raise ValueError(f"{flag} {path}: no directory {path.parent}")
        if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise ValueError(f"{flag} {path}: not writable")


@dataclass
class Inputs:
    model_dir: Path
    adapters: dict[str, Path]
    lengths: list[int]
    video: Path | None


def _inputs(args: argparse.Namespace) -> Inputs:
    from hylora.demo import DEMO_ADAPTERS, ensure_demo
    from hylora.doctor.prompts import parse_lengths, sweep_lengths

    if args.demo == bool(args.model_dir):
        raise ValueError("give a MODEL_DIR or --demo (one of them)")
    adapters = _pairs(args.lora_modules)
    video = Path(args.video) if args.video else None
    if args.demo:
        model_dir = ensure_demo()
        adapters = {name: model_dir / "adapters" / name for name in DEMO_ADAPTERS} | adapters
        clip = model_dir / "media" / "excavation.mp4"
        video = video or (clip if clip.is_file() else None)
    else:
        model_dir = Path(args.model_dir)
    if video is not None and not video.is_file():
        raise FileNotFoundError(f"--video {video}: no such file")
    if args.hf_overrides is not None:
        from hylora.model.config_overlay import overridden_model_dir

        if not isinstance(args.hf_overrides, dict):
            raise ValueError("--hf-overrides expects a JSON object (merged over config.json)")
        model_dir = overridden_model_dir(model_dir, args.hf_overrides)
    limit = args.max_model_len - 1
    lengths = parse_lengths(args.lengths) if args.lengths else sweep_lengths(limit)
    if lengths[-1] > limit:
        raise ValueError(f"--lengths goes to {lengths[-1]} tokens; --max-model-len {args.max_model_len} allows {limit}")
    return Inputs(model_dir, adapters, lengths, video)


def run_from_args(args: argparse.Namespace) -> int:
    check_outputs(args)
    import torch

    threads = args.threads if args.threads is not None else (1 if args.demo else None)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(max(1, threads))
    try:
        return _run(args)
    finally:
        torch.set_num_threads(before)


def _tolerance_policy(args: argparse.Namespace, engine_dtype: str, endpoint: bool):
    from hylora.doctor.compare import Tolerance
    from hylora.doctor.noise import TolerancePolicy

    if not endpoint:  # in-process the deployment is the reference's engine: its precision is known
        policy = TolerancePolicy.measured(engine_dtype, engine_dtype)
    elif args.endpoint_dtype:
        policy = TolerancePolicy.of(
            Tolerance.for_dtypes(engine_dtype, args.endpoint_dtype),
            f"the preset for a {args.endpoint_dtype} server and a {engine_dtype} reference (--endpoint-dtype)",
        )
    else:
        policy = TolerancePolicy.measured(engine_dtype, "bfloat16")
    return policy.with_overrides(args.tolerance_mean, args.tolerance_max, args.min_top1)


def _run(args: argparse.Namespace) -> int:
    from hylora.doctor.deployment import EngineDeployment
    from hylora.doctor.doctor import PHASES, DoctorOptions, run_doctor
    from hylora.doctor.endpoint import Budget, Endpoint
    from hylora.doctor.html import write_html
    from hylora.doctor.progress import to_stderr
    from hylora.doctor.prompts import MIXED_LENGTHS, SHORT_MAX, doctor_sequence, read_prompt_text
    from hylora.doctor.reference import Reference
    from hylora.doctor.report import render_text, write_json
    from hylora.doctor.scores import TokenTexts
    from hylora.engine.config import EngineConfig
    from hylora.engine.engine import LLMEngine
    from hylora.engine.speculative import check_speculative_config
    from hylora.kernels.config import kernels_with_overrides
    from hylora.tokenizer import load_tokenizer

    x = _inputs(args)
    tokenizer = load_tokenizer(x.model_dir)
    sequence = doctor_sequence(
        tokenizer, max(x.lengths[-1], sum(MIXED_LENGTHS) + 256), read_prompt_text(args.prompt_file)
    )
    endpoint = None
    if args.endpoint:  # reach the server before spending minutes on loading the model
        endpoint = Endpoint(
            args.endpoint,
            sequence,
            list(x.adapters),
            api_key=args.api_key,
            base_name=args.served_model_name,
            request_timeout=args.request_timeout,
            budget=Budget(args.max_requests, args.time_limit),
            quantization=args.endpoint_quantization,
        )
        try:
            endpoint.connect()
        except ConnectionError as e:
            print(f"hylora doctor: cannot use {args.endpoint}: {e}", file=sys.stderr)
            return 1
    speculative = check_speculative_config(args.speculative_config) or {}
    short_steps = args.max_short_step_tokens
    if short_steps is None:  # serve's default
        short_steps = EngineConfig.max_short_step_tokens
    flags = {"fp8_activations": args.fp8_activations}
    if args.lora_delta_first_from is not None:
        flags["lora_delta_first_from"] = args.lora_delta_first_from
    max_num_seqs = 2 if endpoint else args.max_num_seqs  # the reference alone: one sequence at a time
    pages_a_sequence = -(-args.max_model_len // EngineConfig.page_size)
    config = EngineConfig(
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        # KV for its sequences only, not the GPU's memory as serve sizes it: an FP8 deployment's
        # dequantised reference is a second engine, which needs the rest
        num_pages=max_num_seqs * pages_a_sequence,
        dtype=args.dtype,
        device=args.device,
        quantization=None if endpoint else args.quantization,
        max_num_seqs=max_num_seqs,
        max_loras=1 if endpoint else max(4, len(x.adapters)),  # (an endpoint's reference merges its adapters)
        max_lora_rank=1 if endpoint else args.max_lora_rank,
        fault_injection=endpoint is None,  # in-process, the pollution check faults one request on purpose
        # the fast paths of the deployment checked in-process (a server's are its own)
        num_speculative_tokens=0 if endpoint else speculative.get("num_speculative_tokens", 0),
        enable_prefix_caching=args.enable_prefix_caching and endpoint is None,
        max_short_step_tokens=0 if endpoint else short_steps,
        kernels=kernels_with_overrides(flags, args.kernels),
    )
    # the reference's engine: unquantised weights (an FP8 checkpoint's dequantised), which adapters merge
    # into; in-process it is also the deployment checked, unless that serves FP8 weights
    dequantized = replace(config, quantization="dequantized")
    if endpoint is not None:
        engine = served = LLMEngine(x.model_dir, dequantized)
    else:
        engine = served = LLMEngine(x.model_dir, config, lora_modules=x.adapters)
        if served.quantization is not None:
            reference_config = replace(  # the FP8 values served, dequantised (also when quantised at load)
                config,
                quantization="fp8-dequantized",
                max_num_seqs=2,
                num_pages=2 * pages_a_sequence,
                max_loras=1,
                fault_injection=False,
            )
            engine = LLMEngine(x.model_dir, reference_config)
    reference = Reference(engine, x.adapters, sequence, x.lengths[-1], args.restore)
    engine_dtype = str(engine.model.dtype).removeprefix("torch.")
    if endpoint is not None:
        deployment, kernels = endpoint, None
    else:
        deployment, kernels = EngineDeployment(served, sequence, args.request_timeout), dict(served.kernels)
    options = DoctorOptions(
        lengths=x.lengths,
        tolerance=_tolerance_policy(args, engine_dtype, endpoint is not None),
        short_max=args.short_max_len if args.short_max_len is not None else SHORT_MAX,
        burst_size=args.burst,
        load_seconds=args.load,
        load_streams=args.load_streams,
        load_max_tokens=args.load_max_tokens,
        video=x.video,
        fast_paths=not args.no_fast_paths,
    )
    report = run_doctor(
        deployment, reference, list(x.adapters), options, TokenTexts(engine.tokenizer), kernels, to_stderr(PHASES)
    )
    print(render_text(report))
    if args.json:
        write_json(report, args.json)
    if args.report:
        write_html(report, args.report)
    return report.exit_code

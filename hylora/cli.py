"""`hylora` command line: serve, generate, doctor, merge, quantize, demo-model."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", nargs="?", help="Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--demo", action="store_true", help="use the embedded demo model (written on first use)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")


def _model_dir(args: argparse.Namespace) -> Path:
    from hylora.demo import ensure_demo

    if args.demo == bool(args.model_dir):
        raise SystemExit("give a MODEL_DIR or --demo (one of them)")
    return ensure_demo() if args.demo else Path(args.model_dir)


def cmd_demo_model(args: argparse.Namespace) -> None:
    from hylora.demo import write_demo
    from hylora.model.checkpoint_out import refuse_filled

    out = Path(args.dir)
    refuse_filled(out)  # as merge and quantize: never over a model
    path = write_demo(out)
    print(f"wrote the demo model and adapters relic, tomb, mural to {path}")


def cmd_generate(args: argparse.Namespace) -> None:
    from hylora.engine import LLM, SamplingParams
    from hylora.tokenizer import chat_prompt

    model_dir = _model_dir(args)
    lora = {Path(args.lora).name: args.lora} if args.lora else None
    llm = LLM(
        model_dir,
        lora_modules=lora,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=1,
        max_model_len=args.max_model_len,
        max_lora_rank=256,
    )
    tokenizer = llm.tokenizer
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    adapter = next(iter(lora)) if lora else None
    media = [("image_url", p) for p in args.image] + [("video_url", p) for p in args.video]
    if media:
        if args.raw:
            raise ValueError("--image / --video need the chat template (drop --raw)")
        parts = [{"type": kind, kind: {"url": Path(p).resolve().as_uri()}} for kind, p in media]
        messages = [{"role": "user", "content": [*parts, {"type": "text", "text": args.prompt}]}]
        out = llm.chat(messages, params, adapter, media_root="/")  # local files the user named
    elif args.raw:
        out = llm.generate(tokenizer.encode(args.prompt, add_special_tokens=False), params, lora=adapter)[0]
    else:
        out = llm.generate(chat_prompt(tokenizer, [{"role": "user", "content": args.prompt}]), params, lora=adapter)[0]
    print(out.text)


def cmd_merge(args: argparse.Namespace) -> None:
    from hylora.adapters.merge import merge_adapter

    out = merge_adapter(args.model_dir, args.adapter_dir, args.out_dir)
    print(f"wrote {args.model_dir} + {args.adapter_dir} merged to {out}")


def cmd_quantize(args: argparse.Namespace) -> None:
    from hylora.model.fp8 import quantize_checkpoint

    out = quantize_checkpoint(args.model_dir, args.out_dir)
    print(f"wrote {args.model_dir} block-quantised to FP8 (e4m3, 128x128 scales) in {out}")


def cmd_doctor(args: argparse.Namespace) -> None:
    from hylora.doctor.cli import run_from_args

    raise SystemExit(run_from_args(args))


def cmd_serve(args: argparse.Namespace) -> None:
    if args.replicas is not None:  # Ray Serve: replicas of the same server behind one endpoint
        from hylora.deploy.launch import run

        sys.exit(run(args))
    from hylora.server.serve import serve

    serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hylora", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo-model", help="write the embedded demo checkpoint and its task adapters")
    p.add_argument("dir")
    p.set_defaults(func=cmd_demo_model)

    p = sub.add_parser("generate", help="generate from one prompt (greedy unless --temperature)")
    _add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--lora", metavar="ADAPTER_DIR", help="apply this PEFT LoRA adapter dynamically")
    p.add_argument("--image", action="append", default=[], metavar="FILE", help="an image before the prompt")
    p.add_argument("--video", action="append", default=[], metavar="FILE", help="a video before the prompt")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    from hylora.server.serve import add_serve_args

    add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("doctor", help="check that a deployment (hylora or any OpenAI server) serves each adapter right")
    from hylora.doctor.cli import add_doctor_args

    add_doctor_args(p)
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("merge", help="fold a LoRA adapter into the base weights (a complete model directory)")
    p.add_argument("model_dir")
    p.add_argument("adapter_dir")
    p.add_argument("out_dir")
    p.set_defaults(func=cmd_merge)

    p = sub.add_parser(
        "quantize", help="write an FP8 copy of a model (e4m3 weights, 128x128 block scales, as Qwen's -FP8 releases)"
    )
    p.add_argument("model_dir")
    p.add_argument("out_dir")
    p.set_defaults(func=cmd_quantize)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from hylora.server.vllm_argv import vllm_argv

    argv = sys.argv[1:] if argv is None else argv
    try:
        argv = vllm_argv(argv)
    except ValueError as e:
        print(f"hylora: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        hint = ""
        if getattr(args, "command", None) == "serve":  # most likely a vLLM flag from a recipe
            hint = (
                "; `hylora serve --help` lists the flags hylora takes, and docs/SERVING.md which of vLLM's it "
                "accepts, ignores or refuses"
            )
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, LookupError) as e:  # config / checkpoint / usage errors: a message
        print(f"hylora: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None

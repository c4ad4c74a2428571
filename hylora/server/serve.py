"""`hylora serve`: build the engine from flags and run the HTTP server."""

from __future__ import annotations

import argparse
import logging
import secrets
from pathlib import Path

from hylora.engine.async_engine import AsyncEngine
from hylora.engine.config import EngineConfig
from hylora.engine.engine import LLMEngine
from hylora.server.app import ServerState, build_app
from hylora.server.routing import TaskRouter

log = logging.getLogger(__name__)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", nargs="?", help="Hugging Face model directory")
    p.add_argument(
        "--demo",
        action="store_true",
        help="serve the embedded demo model with adapters relic, tomb, mural (written on first use)",
    )
    p.add_argument("--served-model-name", help="name of the base model in the API (default: the directory name)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH", help="adapters to load at start")
    p.add_argument("--task", nargs="+", default=[], metavar="TASK=ADAPTER", help="route task TASK to ADAPTER")
    p.add_argument("--task-map", metavar="FILE", help="JSON file {task: adapter} (instead of or with --task)")
    p.add_argument(
        "--adapter-root", metavar="DIR", help="allow /v1/load_lora_adapter for directories under DIR (off without it)"
    )
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-body-bytes", type=int, default=8 << 20)
    d = EngineConfig.__dataclass_fields__
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
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=d[name].default)
    p.add_argument("--gpu-memory-utilization", type=float, default=d["gpu_memory_utilization"].default)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")


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

    if args.demo == bool(args.model_dir):
        raise ValueError("give a MODEL_DIR or --demo (one of them)")
    lora = _pairs(args.lora_modules, "--lora-modules")
    tasks = _pairs(args.task, "--task")
    if args.task_map:
        tasks = TaskRouter.read_task_map(args.task_map) | tasks
    if args.demo:
        model_dir = ensure_demo()
        lora = {name: str(model_dir / "adapters" / name) for name in DEMO_ADAPTERS} | lora
        tasks = {name: name for name in DEMO_ADAPTERS} | tasks
        name = args.served_model_name or "hylora-demo"
    else:
        model_dir = Path(args.model_dir)
        name = args.served_model_name or model_dir.resolve().name
    config = EngineConfig(
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        page_size=args.page_size,
        num_pages=args.num_pages,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        dtype=args.dtype,
        device=args.device,
    )
    engine = LLMEngine(model_dir, config, lora_modules=lora)
    router = TaskRouter(name, engine.adapters, tasks)
    for task in tasks:
        router.resolve(None, task)  # every task must point at a loaded adapter
    return ServerState(
        aengine=AsyncEngine(engine),
        router=router,
        api_key=args.api_key,
        adapter_root=Path(args.adapter_root) if args.adapter_root else None,
        max_body_bytes=args.max_body_bytes,
    )


def serve(args: argparse.Namespace) -> None:
    import uvicorn

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
    uvicorn.run(build_app(state), host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=30)

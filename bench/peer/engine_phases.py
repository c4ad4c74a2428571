"""What the one-result-per-engine peer benches (speculative_peer.py, video_peer.py) share: their result
files, the guarded hylora phase, the table phase's collection, the `run` phase and the argument parser.

Each bench writes WORK/results/<prefix>-<engine>.json (engine: vllm or hylora), rewritten as it goes,
so that a phase killed at its deadline keeps what it had.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.peer import throughput_peer as tp
from bench.peer.child_env import child_env

ENGINES = ("vllm", "hylora")


class Notes:
    """What `throughput_peer.attention_fallback` records, kept in a phase's result."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def update(self, **fields: Any) -> None:
        self.data.update(fields)


def result_path(work: Path, prefix: str, engine: str) -> Path:
    return work / "results" / f"{prefix}-{engine}.json"


def save(work: Path, prefix: str, data: dict[str, Any]) -> None:
    path = result_path(work, prefix, data["engine"])
    path.parent.mkdir(parents=True, exist_ok=True)
    data["updated"] = time.time()
    path.write_text(json.dumps(data, indent=1, default=str))


def guarded(
    phase: Callable[[argparse.Namespace], None], prefix: str | Callable[[argparse.Namespace], str], rows: str
) -> Callable[..., None]:
    """`phase` (the hylora one) with its error written into its result before it is raised again;
    `prefix`: the result's, or how to find it from the phase's arguments."""

    def run(args: argparse.Namespace) -> None:
        try:
            phase(args)
        except BaseException as e:
            name = prefix(args) if callable(prefix) else prefix
            path = result_path(args.work, name, "hylora")
            data = json.loads(path.read_text()) if path.is_file() else {"engine": "hylora", rows: []}
            data["error"] = f"{type(e).__name__}: {e}"[:2000]
            save(args.work, name, data)
            raise

    return run


def load(dirs: list[Path], prefix: str) -> dict[str, dict[str, Any]]:
    """The newest result of each engine found under `dirs`, with the file it came from."""
    found: dict[str, dict[str, Any]] = {}
    for d in dirs:
        for path in sorted(d.rglob(f"{prefix}-*.json")):
            with contextlib.suppress(OSError, ValueError):
                data = json.loads(path.read_text())
                engine = data.get("engine")
                if engine in ENGINES and data.get("updated", 0) >= found.get(engine, {}).get("updated", 0):
                    found[engine] = data | {"source": str(path)}
    return found


def status_rows(found: dict[str, dict[str, Any]], extra: dict[str, Callable[[dict[str, Any]], str]]) -> list[str]:
    """The engines' table: start-up, the `extra` columns, and complete or the error."""
    heads = ["engine", "start-up", *extra, "status"]
    lines = ["| " + " | ".join(heads) + " |", "|" + " --- |" * len(heads)]
    for engine, d in sorted(found.items()):
        start = f"{d['startup_s']:.0f} s" if "startup_s" in d else "–"
        status = "complete" if d.get("complete") else (d.get("error") or "incomplete")[:160]
        lines.append("| " + " | ".join([engine, start, *(f(d) for f in extra.values()), status]) + " |")
    return lines


def phase_table(
    args: argparse.Namespace, prefix: str, table_md: Callable[[dict[str, dict[str, Any]]], str], md_name: str
) -> None:
    """The markdown table from every result found, written as `md_name` with copies of those results
    to --out."""
    found = load([d for d in [args.work / "results", *args.results] if d.is_dir()], prefix)
    text = table_md(found)
    args.out.mkdir(parents=True, exist_ok=True)
    for d in found.values():
        dest = args.out / Path(d["source"]).name
        if Path(d["source"]).resolve() != dest.resolve():
            shutil.copy(d["source"], dest)
    (args.out / md_name).write_text(text)
    print(text, flush=True)


def phase_run(args: argparse.Namespace, script: Path, min_left_s: dict[str, int], extra: list[str]) -> None:
    """Each step in its own process group under what is left of --budget (a GPU step starts only with
    its `min_left_s`), then the table."""
    deadline = time.monotonic() + args.budget - tp.TABLE_RESERVE_S
    common = ["--work", str(args.work), "--out", str(args.out), "--device", args.device, *extra]
    common += ["--tiny"] * args.tiny + ["--reuse"] * args.reuse + ["--dry-run"] * args.dry_run
    common += ["--attention-backend", args.attention_backend] if args.attention_backend else []
    env = child_env()
    for phase in args.steps:
        if phase not in min_left_s:
            raise SystemExit(f"step {phase!r}: one of {sorted(min_left_s)}")
        left = deadline - time.monotonic()
        if not args.tiny and left < min_left_s[phase]:
            log(f"=== {phase}: skipped, {left:.0f}s left (it needs {min_left_s[phase]})")
            continue
        log(f"=== {phase} (deadline in {left:.0f}s)")
        code, took = tp.run_child([sys.executable, str(script), phase, *common], left, env)
        log(f"=== {phase}: exit {code} after {took:.0f}s")
        if args.device.startswith("cuda"):
            tp.wait_gpu_free()


def parse_args(
    doc: str,
    phases: list[str],
    default_out: str,
    add: Callable[[argparse.ArgumentParser], None],
    argv: list[str] | None,
) -> argparse.Namespace:
    """The phase, the run steps, --work / --out, the bench's own flags (`add`) and the shared ones."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("phase", choices=phases)
    ap.add_argument("steps", nargs="*", help="run: ckpt vllm hylora (any of them, in order)")
    ap.add_argument("--work", type=Path, default=None, help="checkpoint and results (default /dev/shm or /tmp)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", default_out)))
    add(ap)
    tp.add_shared_args(ap)
    args = ap.parse_args(argv)
    if args.phase == "run" and not args.steps:
        ap.error("run: give steps, e.g. ckpt vllm hylora")
    args.work = args.work or tp.pick_work()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.phase != "table":
        args.device = args.device or tp.default_device()
    return args


def log(*parts: object) -> None:
    tp.log(*parts)

"""The decode step of both engines under torch.profiler, as one per-kernel table each
(`throughput_peer.py --profile-decode`): where hylora's bf16 decode step loses to vLLM's (run 26:
5.96 against 5.51 ms a step at batch 32) is a question of which kernels, and this answers it.

After an engine's timed runs, the base workload runs once more with the profiler on for
PROFILE_STEPS decode steps, after the prefill and DELAY_STEPS more steps. vLLM profiles inside its
engine core (its `profiler_config`: delay and max iterations, a Chrome trace into a folder); hylora
under torch.profiler around its own `step()` calls. Both traces are summed the same way: GPU
kernels by name (CPU ops on a CPU dry run), microseconds and calls per profiled step.
"""

from __future__ import annotations

import contextlib
import gzip
import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

DELAY_STEPS = 4  # engine steps skipped after the profile starts: the prefill (two 8192-token steps) and two more
PROFILE_STEPS = 20  # decode steps profiled (the workload has 63)
TOP = 30  # kernels kept in the record
DECODE_STEP = f"decode step ({PROFILE_STEPS} steps profiled)"


def vllm_profiler_config(trace_dir: Path) -> dict[str, Any]:
    """vLLM's `profiler_config`: torch's profiler in the engine core from DELAY_STEPS steps after
    `start_profile` for PROFILE_STEPS steps, no Python stacks, no front-end trace."""
    return {
        "profiler": "torch",
        "torch_profiler_dir": str(trace_dir),
        "torch_profiler_with_stack": False,
        "ignore_frontend": True,
        "delay_iterations": DELAY_STEPS,
        "max_iterations": PROFILE_STEPS,
    }


def vllm_decode_profile(llm: Any, run_base_workload: Callable[[], Any], trace_dir: Path) -> list[dict[str, Any]]:
    """One base workload with vLLM's profiler on; the kernels of the trace it wrote."""
    before = set(trace_dir.glob("*.json*"))
    llm.start_profile()
    run_base_workload()
    llm.stop_profile()
    traces = sorted(set(trace_dir.glob("*.json*")) - before, key=lambda p: p.stat().st_mtime)
    if not traces:
        raise RuntimeError(f"vLLM wrote no trace into {trace_dir}")
    return kernel_summary(traces[-1], PROFILE_STEPS)


def hylora_decode_profile(
    engine: Any, prompts: list[list[int]], adapter_of: Callable[[int], str | None], trace_path: Path, tag: str
) -> list[dict[str, Any]]:
    """The workload's requests; after the prefill and DELAY_STEPS more steps, PROFILE_STEPS steps under
    torch.profiler (its Chrome trace to `trace_path`); then the rest. The kernels of that trace."""

    from hylora.engine import SamplingParams

    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{tag}-{i}", prompt, params, adapter_of(i))
    started = 0
    while engine.has_unfinished() and started < len(prompts):  # the prefill: until every request has a token
        started = sum(1 for o in engine.step() if o.num_output_tokens)
    for _ in range(DELAY_STEPS - 2):
        engine.step()
    steps = 0
    with profiling(trace_path):
        while engine.has_unfinished() and steps < PROFILE_STEPS:
            engine.step()
            steps += 1
    while engine.has_unfinished():
        engine.step()
    return kernel_summary(trace_path, max(steps, 1))


def hylora_prefill_profile(
    engine: Any, prompts: list[list[int]], adapter_of: Callable[[int], str | None], trace_path: Path, tag: str
) -> dict[str, Any]:
    """The workload's steps until every request has its first token under torch.profiler (its Chrome
    trace to `trace_path`), then the rest unprofiled: the kernels (µs over the whole phase, calls) and
    how busy the device was (`device_busy`)."""

    from hylora.engine import SamplingParams

    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    steps = started = 0
    with profiling(trace_path):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"prefill-profile-{tag}-{i}", prompt, params, adapter_of(i))
        while engine.has_unfinished() and started < len(prompts):
            started = sum(1 for o in engine.step() if o.num_output_tokens)
            steps += 1
    while engine.has_unfinished():
        engine.step()
    return {"steps": steps, "kernels": kernel_summary(trace_path, 1), **device_busy(trace_path)}


@contextlib.contextmanager
def profiling(trace_path: Path) -> Iterator[None]:
    """torch.profiler (the CPU, and CUDA where there is one) around the block; the device synced at
    its end and the Chrome trace written to `trace_path`."""
    import torch

    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * cuda
    with torch.profiler.profile(activities=activities) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace_path))


def _trace_events(trace: Path) -> list[dict[str, Any]]:
    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rt") as f:
        return json.load(f).get("traceEvents", [])


def device_busy(trace: Path) -> dict[str, float]:
    """From a Chrome trace's GPU kernels: the span from the first kernel's start to the last one's
    end, the time inside it that some kernel ran (their union), and the idle rest (ms)."""
    events = _trace_events(trace)
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") == "kernel")
    if not spans:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0}
    busy, end = 0.0, spans[0][0]
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    span = max(e for _, e in spans) - spans[0][0]
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3}


def kernel_summary(trace: Path, steps: int) -> list[dict[str, Any]]:
    """A Chrome trace's GPU kernels (CPU ops when it has none) by name: µs and calls per step, most
    time first, the TOP first and one row for the rest."""
    events = _trace_events(trace)
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        kernels = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
    time_us: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for e in kernels:
        time_us[e["name"]] += float(e["dur"])
        calls[e["name"]] += 1
    rows = [
        {"kernel": name, "us_per_step": t / steps, "calls_per_step": calls[name] / steps}
        for name, t in sorted(time_us.items(), key=lambda kv: -kv[1])
    ]
    rest = rows[TOP:]
    rows = rows[:TOP]
    if rest:
        rows.append({
            "kernel": f"({len(rest)} others)",
            "us_per_step": sum(r["us_per_step"] for r in rest),
            "calls_per_step": sum(r["calls_per_step"] for r in rest),
        })  # fmt: skip
    return rows


def summary_md(engine: str, rows: list[dict[str, Any]], per: str = DECODE_STEP) -> str:
    """The kernel table as markdown, with the total per step (`per`: what one row's µs cover)."""
    total = sum(r["us_per_step"] for r in rows)
    unit = per.split(" (")[0]  # the column heads: "decode step", "phase", "pattern"
    lines = [
        f"{engine}: {total:.0f} µs of kernels per {per}",
        "",
        f"| kernel | µs / {unit} | calls / {unit} |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {r['kernel'][:90]} | {r['us_per_step']:.1f} | {r['calls_per_step']:.1f} |" for r in rows]
    return "\n".join(lines) + "\n"

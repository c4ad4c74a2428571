"""Kernels that compile at their first call, compiled at start-up instead, once the checks chose them:
DeepGEMM's (`KernelsConfig.fp8_deepgemm`, on where it is installed) compiles one kernel per
configuration its heuristic picks for a weight shape and step size, seconds each, which a served step
would otherwise wait for.

DeepGEMM compiles one kernel at a time (nvcc, ~4.4 s each: 14 kernels in 61 s for one 27B shape on an
H100, docs/BASELINE.md run 58 b), and a model has several weight shapes (the 27B: 6). So on a GPU each
shape compiles in a child process of its own, in parallel, into DeepGEMM's on-disk cache
(DG_JIT_CACHE_DIR, shared by the processes); then this process runs the same step sizes itself, which
loads those kernels, and compiles whatever a child did not."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import time

import torch

from hylora.env import child_environment
from hylora.kernels.verdict import KernelVerdict
from hylora.model.decoder import HybridDecoder
from hylora.model.layers import Linear

log = logging.getLogger(__name__)

DEEPGEMM = "deepgemm+cublas+triton"  # the FP8 verdict's implementation that serves DeepGEMM
CHILD_TIMEOUT_S = 900.0  # a child still compiling after this is stopped (this process then compiles the rest)
# a child's work: warm_up_shape(N, K, max_tokens, device) (a fresh interpreter: no fork of a process with CUDA)
CHILD = (
    "import sys; from hylora.ops.fp8_linear.deepgemm import warm_up_shape; "
    "warm_up_shape(*map(int, sys.argv[1:4]), sys.argv[4])"
)


def warm_up_kernels(model: HybridDecoder, verdicts: dict[str, KernelVerdict], max_step_tokens: int) -> None:
    """Compile what the chosen kernels would compile in steps of up to `max_step_tokens` tokens."""
    fp8 = verdicts.get("fp8_linear")
    if fp8 is None or fp8.implementation != DEEPGEMM or max_step_tokens <= 0:
        return
    from hylora.ops.fp8_linear import deepgemm

    start = time.perf_counter()
    weights = [(m.weight, m.weight_scale) for m in model.modules() if isinstance(m, Linear) and m.is_fp8
               and m.quant_block == deepgemm.BLOCK]  # fmt: skip
    shapes = sorted({tuple(w.shape) for w, _ in weights if deepgemm.serves_shape(*w.shape)})
    log.info("DeepGEMM warm-up: compiling its kernels for %d FP8 weight shapes at step sizes up to %d tokens "
             "(a minute or two on a cold DG_JIT_CACHE_DIR, seconds on a warm one; --kernels fp8_deepgemm=0 "
             "serves cuBLAS instead)", len(shapes), max_step_tokens)  # fmt: skip
    if model.device.type == "cuda" and len(shapes) > 1 and deepgemm.available():
        compile_in_processes(shapes, max_step_tokens, str(model.device))
    runs = deepgemm.warm_up(weights, max_step_tokens)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
        torch.cuda.empty_cache()  # the warm-up's inputs and outputs, before the caches are planned
    log.info("DeepGEMM warm-up: %d GEMMs over steps of up to %d tokens in %.1f s", runs, max_step_tokens,
             time.perf_counter() - start)  # fmt: skip


def compile_in_processes(
    shapes: list[tuple[int, int]], max_tokens: int, device: str, workers: int | None = None
) -> list[tuple[int, int]]:
    """Run `deepgemm.warm_up_shape` for each [N, K] in a child process, up to `workers` at a time (default:
    one per shape, at most half the CPUs), each with this process's import path. Returns the shapes whose
    child failed or timed out (logged; the in-process warm-up compiles them instead)."""
    workers = workers or max(1, min(len(shapes), (os.cpu_count() or 2) // 2))
    env = child_environment(PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    pending, running, failed = list(shapes), [], []
    with contextlib.ExitStack() as files:
        while pending or running:
            while pending and len(running) < workers:
                N, K = shape = pending.pop(0)
                err = files.enter_context(tempfile.TemporaryFile())  # not a pipe: no child waits on a reader
                args = [sys.executable, "-c", CHILD, str(N), str(K), str(max_tokens), device]
                proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=err)
                running.append((shape, proc, err, time.monotonic()))
            shape, proc, err, started = running.pop(0)
            try:
                proc.wait(timeout=max(1.0, CHILD_TIMEOUT_S - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.returncode != 0:
                failed.append(shape)
                err.seek(0)
                last = err.read().decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
                log.warning("DeepGEMM warm-up of the [%d, %d] weights in a child process failed (rc %s: %s); "
                            "compiling them here", *shape, proc.returncode, last[0])  # fmt: skip
    return failed

"""CUDA graphs for decode steps and short steps, captured at engine start.

Decode: one graph per (bucket, adapters present). Each replays `PaddedDecode.step` on the persistent
buffers of its bucket: the base-only graph runs no LoRA kernel; the adapter graph runs hylora's LoRA
kernels over every slice for every slot, the grouping built on the device, so it serves any adapter
mix. Short steps (engine/short_step.py: decode rows with a prompt's last few tokens, speculative
verify steps): one graph per (token bucket, adapters present, verify), replaying
`PaddedShortStep.step` the same way; the MTP layer's k drafting passes (engine/draft_step.py): one
graph per token bucket.

Each kind's graphs share one memory pool (captured largest first, so the smaller ones reuse its
blocks). Graphs need the kernels that read their layout from the device and skip padding (the GDN
decode step or conv + token-by-token recurrence, paged decode attention) installed by the start-up
check: the references sync with the host and cannot be captured, so without them those steps stay eager.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Hashable

import torch

from hylora import ops
from hylora.cache import PagedKVCache, StatePool
from hylora.engine.config import EngineConfig
from hylora.engine.draft_step import PaddedDraft
from hylora.engine.padded_decode import PaddedDecode
from hylora.engine.short_step import PaddedShortStep
from hylora.model.decoder import HybridDecoder

log = logging.getLogger(__name__)
GiB = 1 << 30


class GraphCaptureError(RuntimeError):
    pass


def capture_graphs(
    what: str,
    keys: list[Hashable],
    prepare: Callable[[Hashable], None],
    step: Callable[[Hashable], tuple[torch.Tensor, ...]],
    device: torch.device,
    without: str = "--enforce-eager",
) -> dict[Hashable, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]]:
    """One graph of `step(key)` per key, in the order given (largest first: one shared pool), after
    `prepare(key)` (fill the buffers with padding: the warm-up writes nowhere live) and one eager
    warm-up run (Triton compilation, cuBLAS workspaces). Returns key → (graph, its outputs); on a
    failure the error names the flag `without` that serves without these graphs."""
    torch.cuda.synchronize(device)
    free_before = torch.cuda.mem_get_info(device)[0]
    t0 = time.perf_counter()
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    # Python's cyclic collector must not run inside a capture: freeing an unreachable engine's graphs
    # (cudaGraphExecDestroy) is not permitted while a stream captures, and it invalidates the capture
    # (seen on the H200 when a test's previous engine was collected mid-capture)
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.inference_mode():
            for key in keys:
                prepare(key)
                step(key)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    outputs = step(key)
                graphs[key] = (graph, outputs)
    except Exception as e:
        raise GraphCaptureError(
            f"capturing the {what} CUDA graphs failed: {e!r}; start with {without} to serve without them"
        ) from e
    finally:
        if collecting:
            gc.enable()
    torch.cuda.synchronize(device)
    used = free_before - torch.cuda.mem_get_info(device)[0]
    took = time.perf_counter() - t0
    log.info("captured %d %s CUDA graphs %s in %.1f s, %.2f GiB", len(graphs), what, keys, took, used / GiB)
    return graphs


class CudaGraphDecode(PaddedDecode):
    """`PaddedDecode` whose steps replay captured graphs."""

    def __init__(
        self, model: HybridDecoder, kv: PagedKVCache, states: StatePool, max_num_seqs: int, max_model_len: int
    ) -> None:
        super().__init__(model, kv, states, max_num_seqs, max_model_len)
        variants = (False, True) if self.has_lora else (False,)
        keys = [(bucket, lora) for bucket in reversed(self.buckets) for lora in variants]
        self.graphs = capture_graphs(
            "decode", keys, lambda key: self.buffers.fill([], key[0]), lambda key: self.step(*key), model.device
        )

    def _forward(self, bucket: int, lora: bool) -> tuple[torch.Tensor, torch.Tensor]:
        graph, (logits, finite) = self.graphs[(bucket, lora)]
        graph.replay()
        return logits, finite


class CudaGraphShortStep(PaddedShortStep):
    """`PaddedShortStep` whose steps replay captured graphs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        lora_variants = (False, True) if self.has_lora else (False,)
        spec_variants = (False, True) if self.max_drafts else (False,)
        keys = [(b, lora, spec) for b in reversed(self.buckets) for lora in lora_variants for spec in spec_variants]
        fill = lambda key: self.buffers.fill([], key[0])  # noqa: E731
        step = lambda key: self.step(*key)  # noqa: E731
        self.graphs = capture_graphs("short-step", keys, fill, step, self.model.device, "--max-short-step-tokens 0")

    def _forward(self, bucket: int, lora: bool, spec: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        graph, (hidden, logits, finite) = self.graphs[(bucket, lora, spec)]
        graph.replay()
        return hidden, logits, finite


class CudaGraphDraft(PaddedDraft):
    """`PaddedDraft` whose steps replay captured graphs (one per token bucket; the MTP layer has no LoRA)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        fill = lambda bucket: self.fill([], bucket)  # noqa: E731
        buckets, device = list(reversed(self.buckets)), self.model.device
        self.graphs = capture_graphs("MTP drafting", buckets, fill, self.step, device, "--max-short-step-tokens 0")

    def _forward(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        graph, (tokens, finite) = self.graphs[bucket]
        graph.replay()
        return tokens, finite


def decode_kernels_graphable(model: HybridDecoder) -> str | None:
    """None if every decode kernel of the model can be captured, else why not (for the log)."""
    for layer in model.layers:
        if layer.is_linear and layer.linear_attn.decode_step is None:
            return "the Triton GDN decode kernel is not installed (start-up check or --fast-kernels off)"
        if not layer.is_linear and layer.self_attn.decode_attention is None:
            return "the Triton paged decode attention is not installed (start-up check or --fast-kernels off)"
    return None


def short_step_kernels_graphable(model: HybridDecoder) -> str | None:
    """None if every kernel of a short step can be captured, else why not (for the log)."""
    for layer in model.layers:
        gdn = layer.linear_attn if layer.is_linear else None
        if gdn is not None and (gdn.short_prefill is None or gdn.conv is ops.causal_conv1d_by_slot):
            return "the Triton causal conv and token-by-token GDN kernels are not both installed"
        if not layer.is_linear and layer.self_attn.decode_attention is None:
            return "the Triton paged decode attention is not installed (start-up check or --fast-kernels off)"
    return None


def make_graph_draft(
    model: HybridDecoder, kv: PagedKVCache, states: StatePool, config: EngineConfig
) -> PaddedDraft | None:
    """The MTP layer's drafting graphs when speculating with short-step graphs on (or their eager twin
    on the CPU with `config.padded_decode`), else None: drafting runs pass by pass, eagerly."""
    k = config.num_speculative_tokens
    if not k or not config.max_short_step_tokens or model.mtp is None:
        return None
    args = (model, kv, states, config.max_short_step_tokens, k, config.max_model_len)
    if model.device.type != "cuda":
        return PaddedDraft(*args) if config.padded_decode else None
    if config.enforce_eager:
        return None
    if any(layer.self_attn.decode_attention is None for layer in model.mtp.layers):
        log.warning("MTP drafting graphs off: the Triton paged decode attention is not installed")
        return None
    return CudaGraphDraft(*args)


def make_graph_decode(
    model: HybridDecoder, kv: PagedKVCache, states: StatePool, config: EngineConfig
) -> PaddedDecode | None:
    """The engine's decode graphs, or None (with the reason logged) when decode runs eagerly.

    `config.padded_decode` on the CPU runs decode steps through the graphs' eager twin instead, so
    that the CPU tests can drive the paths that only padded steps take (decode ahead)."""
    if model.device.type != "cuda":
        if config.padded_decode:
            return PaddedDecode(model, kv, states, config.max_num_seqs, config.max_model_len)
        return None
    if config.enforce_eager:
        log.info("CUDA graphs off (enforce_eager): decode runs eagerly")
        return None
    why_not = decode_kernels_graphable(model)
    if why_not is not None:
        log.warning("CUDA graphs off: %s; decode runs eagerly", why_not)
        return None
    return CudaGraphDecode(model, kv, states, config.max_num_seqs, config.max_model_len)


def make_graph_short_step(
    model: HybridDecoder, kv: PagedKVCache, states: StatePool, config: EngineConfig
) -> PaddedShortStep | None:
    """The engine's short-step graphs (or their eager twin on the CPU with `config.padded_decode`), or
    None (with the reason logged) when short steps run eagerly."""
    if not config.max_short_step_tokens:
        return None
    args = (model, kv, states, config.max_short_step_tokens, config.num_speculative_tokens, config.max_model_len)
    if model.device.type != "cuda":
        return PaddedShortStep(*args) if config.padded_decode else None
    if config.enforce_eager:
        return None
    why_not = short_step_kernels_graphable(model)
    if why_not is not None:
        log.warning("short-step CUDA graphs off: %s; those steps run eagerly", why_not)
        return None
    return CudaGraphShortStep(*args)

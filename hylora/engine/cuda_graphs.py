"""CUDA graphs for decode steps: one graph per (bucket, adapters present), captured at engine start.

Each graph replays `PaddedDecode.step` on the persistent buffers of its bucket: the base-only graph
runs no LoRA kernel; the adapter graph runs hylora's LoRA kernels over every slice for every slot,
the grouping built on the device, so it serves any adapter mix. The graphs share one memory pool
(captured largest first, so the smaller ones reuse its blocks). Graphs need the padding-aware decode
kernels (`gdn_decode`, `paged_decode_attention`) installed by the start-up check: the references
sync with the host and cannot be captured, so without them decode stays eager.
"""

from __future__ import annotations

import logging
import time

import torch

from hylora.cache import PagedKVCache, StatePool
from hylora.engine.config import EngineConfig
from hylora.engine.padded_decode import PaddedDecode
from hylora.model.decoder import HybridDecoder

log = logging.getLogger(__name__)
GiB = 1 << 30


class GraphCaptureError(RuntimeError):
    pass


class CudaGraphDecode(PaddedDecode):
    """`PaddedDecode` whose steps replay captured graphs."""

    def __init__(
        self, model: HybridDecoder, kv: PagedKVCache, states: StatePool, max_num_seqs: int, max_model_len: int
    ) -> None:
        super().__init__(model, kv, states, max_num_seqs, max_model_len)
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.capture()

    def capture(self) -> None:
        dev = self.model.device
        torch.cuda.synchronize(dev)
        free_before = torch.cuda.mem_get_info(dev)[0]
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        variants = (False, True) if self.has_lora else (False,)
        try:
            with torch.inference_mode():
                for bucket in reversed(self.buckets):
                    for lora in variants:
                        self.buffers.fill([], bucket)  # all padding: the warm-up writes nowhere live
                        self.step(bucket, lora)  # warm-up: Triton compilation, cuBLAS workspaces
                        torch.cuda.synchronize(dev)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=pool):
                            logits, finite = self.step(bucket, lora)
                        self.graphs[(bucket, lora)] = (graph, logits, finite)
        except Exception as e:
            self.graphs.clear()
            raise GraphCaptureError(
                f"capturing the decode CUDA graphs failed: {e!r}; start with --enforce-eager to serve without them"
            ) from e
        torch.cuda.synchronize(dev)
        used = free_before - torch.cuda.mem_get_info(dev)[0]
        log.info(
            "captured %d decode CUDA graphs (buckets %s%s) in %.1f s, %.2f GiB",
            len(self.graphs),
            self.buckets,
            ", with and without adapters" if self.has_lora else "",
            time.perf_counter() - t0,
            used / GiB,
        )

    def _forward(self, bucket: int, lora: bool) -> tuple[torch.Tensor, torch.Tensor]:
        graph, logits, finite = self.graphs[(bucket, lora)]
        graph.replay()
        return logits, finite


def decode_kernels_graphable(model: HybridDecoder) -> str | None:
    """None if every decode kernel of the model can be captured, else why not (for the log)."""
    for layer in model.layers:
        if layer.is_linear and layer.linear_attn.decode_step is None:
            return "the Triton GDN decode kernel is not installed (start-up check or --fast-kernels off)"
        if not layer.is_linear and layer.self_attn.decode_attention is None:
            return "the Triton paged decode attention is not installed (start-up check or --fast-kernels off)"
    return None


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

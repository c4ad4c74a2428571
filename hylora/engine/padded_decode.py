"""The static-shape decode step: a decode batch padded to its bucket, on persistent buffers.

`PaddedDecode.step` is exactly what a CUDA graph captures (engine/cuda_graphs.py): embeddings →
layers → norm → logits of every row, and the per-row finiteness of the hidden states and logits,
so that a NaN still fails its own request alone. Run eagerly here, it is the graphs' plain twin
(the CPU tests run it) and their warm-up. No host sync inside the step, nor after it: the
finiteness flags travel to the host behind the step, and the engine reads them after the sampler's
one wait for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hylora.cache import PagedKVCache, StatePool
from hylora.engine.decode_batch import DecodeBuffers, DecodeRow, bucket_for, decode_buckets
from hylora.engine.host_copy import HostCopy
from hylora.model.decoder import HybridDecoder
from hylora.model.layers import Linear


@dataclass
class DecodeOutput:
    logits: torch.Tensor  # [n, V] fp32 of the real rows (a copy: the step's buffers are reused)
    flags: HostCopy  # of [2, n]: per row, every hidden state finite; every logit finite

    @property
    def finite_hidden(self) -> list[bool]:
        return self.flags.values()[0][0]

    @property
    def finite_logits(self) -> list[bool]:
        return self.flags.values()[0][1]


class PaddedDecode:
    def __init__(
        self, model: HybridDecoder, kv: PagedKVCache, states: StatePool, max_num_seqs: int, max_model_len: int
    ) -> None:
        self.model, self.kv, self.states = model, kv, states
        self.buckets = decode_buckets(max_num_seqs)
        self.max_model_len = max_model_len  # the attention grid's fixed bound
        self.buffers = DecodeBuffers(
            self.buckets[-1], kv.pages_needed(max_model_len), kv.page_size, kv.null_page, model.device
        )
        self.has_lora = any(isinstance(m, Linear) and m.lora is not None for m in model.layers.modules())

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def run(self, rows: list[DecodeRow], input_ids: torch.Tensor | None = None) -> DecodeOutput:
        """`input_ids` [len(rows)] on the device replaces the rows' token ids: the tokens a step
        still in flight is sampling (the engine's decode ahead)."""
        n = len(rows)
        bucket = bucket_for(n, self.buckets)
        lora = any(r.lora_slot >= 0 for r in rows)
        if lora and not self.has_lora:
            raise ValueError("a row asks for an adapter but the model has no LoRA slots")
        self.buffers.fill(rows, bucket, input_ids)
        logits, finite = self._forward(bucket, lora)
        real_logits = logits[:n].clone()
        return DecodeOutput(real_logits, HostCopy(finite[:, :n]))

    def _forward(self, bucket: int, lora: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step on the filled buffers (CUDA graphs replay it instead)."""
        return self.step(bucket, lora)

    def step(self, bucket: int, lora: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [bucket, V] fp32 and finite [2, bucket] bool (hidden states, logits) of the step on
        the buffers; `lora` False: the base model only, no LoRA kernel runs."""
        batch = self.buffers.batch(bucket, lora, self.max_model_len)
        hidden = self.model(batch, self.kv, self.states)
        logits = self.model.logits(hidden)
        finite = torch.stack([torch.isfinite(hidden).all(dim=-1), self.model.finite_logits(logits)])
        return logits, finite

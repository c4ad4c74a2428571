"""A minimal stepper over the decoder and its caches, for tests and experiments.

`CachedRunner` owns a state pool and a paged KV cache, hands each sequence a slot and pages, and
runs one flat varlen step for any mix of prefill chunks and decode tokens, returning logits. The
serving engine (hylora/engine) adds scheduling, sampling and fault handling on the same caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hylora.adapters.registry import AdapterLease, AdapterRegistry
from hylora.cache import PagedKVCache, StatePool
from hylora.model.decoder import HybridDecoder
from hylora.model.forward_batch import ForwardBatch, SequenceChunk
from hylora.model.mrope import MRopePositions
from hylora.model.multimodal import PromptEmbeds


@dataclass
class SequenceHandle:
    slot: int
    pages: list[int] = field(default_factory=list)
    length: int = 0  # tokens already in the caches
    lora: AdapterLease | None = None  # the adapter version this sequence runs with
    positions: MRopePositions | None = None  # M-RoPE of a multimodal prompt; None = text positions
    embeds: PromptEmbeds | None = None  # visual embeddings at the prompt's placeholder tokens

    @property
    def lora_slot(self) -> int:
        return self.lora.slot if self.lora is not None else -1


class CachedRunner:
    def __init__(
        self,
        model: HybridDecoder,
        num_slots: int = 8,
        num_pages: int = 512,
        page_size: int = 16,
        adapters: AdapterRegistry | None = None,
    ):
        self.model = model
        self.adapters = adapters
        self.states = StatePool(model.config, num_slots, model.dtype, model.device)
        self.kv = PagedKVCache(model.config, num_pages, page_size, model.dtype, model.device)

    def add(
        self,
        adapter: str | None = None,
        positions: MRopePositions | None = None,
        embeds: PromptEmbeds | None = None,
    ) -> SequenceHandle:
        """A new sequence, on the base model or on the current version of adapter `adapter`;
        a multimodal prompt brings its M-RoPE positions and visual embeddings."""
        lease = None
        if adapter is not None:
            if self.adapters is None:
                raise ValueError("this runner has no adapter registry")
            lease = self.adapters.acquire(adapter)
        return SequenceHandle(slot=self.states.allocate(), lora=lease, positions=positions, embeds=embeds)

    def release(self, seq: SequenceHandle) -> None:
        self.kv.free(seq.pages)
        self.states.free(seq.slot)
        seq.pages = []
        if seq.lora is not None and self.adapters is not None:
            self.adapters.release(seq.lora)

    @torch.inference_mode()
    def step(self, feeds: list[tuple[SequenceHandle, list[int]]], all_logits: bool = False) -> list[torch.Tensor]:
        """Append tokens to several sequences in one forward pass.

        Returns per sequence the fp32 logits of its last new token [V], or of every new token [n, V].
        """
        chunks = []
        for seq, tokens in feeds:
            need = self.kv.pages_needed(seq.length + len(tokens)) - len(seq.pages)
            if need > 0:
                seq.pages += self.kv.allocate(need)
            start, end = seq.length, seq.length + len(tokens)
            chunks.append(
                SequenceChunk(
                    list(tokens),
                    start,
                    seq.slot,
                    seq.pages,
                    positions=seq.positions.window(start, end) if seq.positions is not None else None,
                    lora_slot=seq.lora_slot,
                    embeds=seq.embeds.window(start, end) if seq.embeds is not None else None,
                )
            )
        batch = ForwardBatch.build(chunks, self.kv.page_size, self.model.device)
        hidden = self.model(batch, self.kv, self.states)
        for seq, tokens in feeds:
            seq.length += len(tokens)
        if all_logits:
            return list(self.model.logits(hidden).split(batch.seq_lens))
        return list(self.model.logits(hidden[batch.last_token_index]))

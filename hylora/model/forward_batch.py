"""The flat varlen batch the model runs on: several sequences' new tokens in one tensor."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hylora.lora import LoRABatch
from hylora.ops.host_to_device import host_to_device


@dataclass
class SequenceChunk:
    """One sequence's part of a step: its new tokens and where its cached state lives."""

    token_ids: list[int]
    context_len: int  # tokens of this sequence already in its caches
    state_slot: int  # GDN state-pool slot
    pages: list[int]  # KV pages in order; must cover context_len + len(token_ids) tokens
    positions: torch.Tensor | None = None  # [3, n] M-RoPE positions; None = text (ctx + arange)
    lora_slot: int = -1  # device slot of this sequence's adapter; -1 = base model
    # (offsets [k] into token_ids, values [k, hidden]): rows whose embedding is given, not looked up
    # (the vision tower's output at image / video placeholder tokens). None = all rows are tokens.
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # a speculative verify chunk: the GDN state-pool slots that receive the state after each of its
    # tokens but the last (which lands in state_slot), so the accepted prefix's state can be kept
    spec_slots: list[int] | None = None


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [3, T] temporal / height / width rotary positions
    seq_lens: list[int]  # new tokens per sequence
    context_lens: list[int]  # cached tokens per sequence before this step
    state_slots: torch.Tensor  # [N]
    block_table: torch.Tensor  # [N, max_pages]
    kv_slot_mapping: torch.Tensor  # [T] flat KV-cache row of each new token
    page_size: int
    lora: LoRABatch | None = None  # per-token adapter slots; None = no adapter in this batch
    embed_rows: torch.Tensor | None = None  # [K] flat rows whose embedding is replaced; None = none
    embed_values: torch.Tensor | None = None  # [K, hidden] their embeddings
    # decode attention: the tokens each query row attends to, its own included (a decode batch: one
    # row per sequence; a padded short step: one row per token, with `block_table` per token too)
    decode_lens: torch.Tensor | None = None  # [N] (or [T]) int
    max_decode_len: int = 0  # host bound on decode_lens (sizes the attention grid)
    # a decode batch padded to a CUDA-graph bucket (engine/decode_batch.py): rows may be padding
    # (state slot -1, decode length 0, KV row in the null page), so only the padding-aware decode
    # kernels may run it (their torch references when no fast kernel is installed)
    padded: bool = False
    # [N, J] pool slot that receives each sequence's GDN state after its token j (j < seq_len - 1;
    # -1: none), for speculative verify steps (SequenceChunk.spec_slots); None: no such sequence
    spec_slots: torch.Tensor | None = None
    # only spec_slots[:, :spec_columns] may hold a slot (a padded step's drafts); None: every column
    spec_columns: int | None = None
    # a padded short step (engine/short_step.py): (sequence of each token [T], first token of each
    # sequence [N + 1]) on the device, which the GDN kernels read; `seq_lens` then only fixes T and N
    # (a CUDA graph replays the step for other lengths)
    seq_layout: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def is_decode(self) -> bool:
        """One new token per sequence (the GDN layers' fused decode step)."""
        return self.decode_lens is not None and self.seq_layout is None

    @property
    def attends_by_row(self) -> bool:
        """Attention runs as decode attention, one query row per `decode_lens` entry."""
        return self.decode_lens is not None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def last_token_index(self) -> torch.Tensor:
        """[N] flat index of each sequence's last new token (where its next-token logits come from)."""
        ends = torch.tensor(self.seq_lens, device=self.input_ids.device).cumsum(0)
        return ends - 1

    @classmethod
    def build(cls, chunks: list[SequenceChunk], page_size: int, device: torch.device | str) -> ForwardBatch:
        if not chunks:
            raise ValueError("empty batch")
        device = torch.device(device)
        ids: list[int] = []
        positions, slot_mapping, embed_rows, embed_values = [], [], [], []
        max_pages = max(1, max(len(c.pages) for c in chunks))
        # numpy, not torch, for the host arithmetic: a torch CPU op costs several times a numpy one,
        # and a prefill step's host time is its step time at 2048 tokens (run 41)
        table = np.zeros((len(chunks), max_pages), dtype=np.int32)
        for i, c in enumerate(chunks):
            n = len(c.token_ids)
            if n == 0:
                raise ValueError("a sequence in the batch has no new tokens")
            end = c.context_len + n
            if len(c.pages) * page_size < end:
                raise ValueError(f"sequence {i} needs {end} KV rows but holds {len(c.pages)} pages")
            if c.positions is not None and tuple(c.positions.shape) != (3, n):
                raise ValueError(f"sequence {i}: positions {list(c.positions.shape)} for {n} new tokens")
            if c.embeds is not None and len(c.embeds[0]):
                offsets, values = c.embeds
                if offsets.ndim != 1 or len(offsets) != len(values) or offsets.min() < 0 or offsets.max() >= n:
                    raise ValueError(f"sequence {i}: embedding overrides do not fit its {n} new tokens")
                embed_rows.append(host_to_device(offsets.to(dtype=torch.long) + len(ids), device))
                embed_values.append(values.to(device))
            ids.extend(c.token_ids)
            pos = np.arange(c.context_len, end)
            positions.append(np.broadcast_to(pos, (3, n)) if c.positions is None else c.positions.cpu().numpy())
            pages = np.asarray(c.pages, dtype=np.int64)
            slot_mapping.append(pages[pos // page_size] * page_size + pos % page_size)
            table[i, : len(c.pages)] = pages
        spec_slots = None
        if any(c.spec_slots for c in chunks):
            width = max(1, max(len(c.token_ids) for c in chunks) - 1)
            spec_slots = torch.full((len(chunks), width), -1, dtype=torch.long)
            for i, c in enumerate(chunks):
                if c.spec_slots:
                    if len(c.spec_slots) < len(c.token_ids) - 1:
                        raise ValueError(f"sequence {i}: {len(c.spec_slots)} spec slots for {len(c.token_ids)} tokens")
                    spec_slots[i, : len(c.token_ids) - 1] = torch.tensor(c.spec_slots[: len(c.token_ids) - 1])
        decode = all(len(c.token_ids) == 1 for c in chunks)
        decode_lens = np.array([c.context_len + 1 for c in chunks], dtype=np.int32) if decode else None
        return cls(
            input_ids=host_to_device(np.asarray(ids, dtype=np.int64), device),
            positions=host_to_device(np.concatenate(positions, axis=1).astype(np.int64, copy=False), device),
            seq_lens=[len(c.token_ids) for c in chunks],
            context_lens=[c.context_len for c in chunks],
            state_slots=host_to_device(np.array([c.state_slot for c in chunks], dtype=np.int64), device),
            block_table=host_to_device(table, device),
            kv_slot_mapping=host_to_device(np.concatenate(slot_mapping), device),
            page_size=page_size,
            lora=_lora_batch(chunks, device),
            embed_rows=torch.cat(embed_rows) if embed_rows else None,
            embed_values=torch.cat(embed_values) if embed_values else None,
            decode_lens=host_to_device(decode_lens, device) if decode_lens is not None else None,
            max_decode_len=int(decode_lens.max()) if decode_lens is not None else 0,
            spec_slots=host_to_device(spec_slots, device) if spec_slots is not None else None,
            # a verify chunk's drafts: the columns that may hold a slot (a prefill chunk beside it is longer)
            spec_columns=max((len(c.token_ids) - 1 for c in chunks if c.spec_slots), default=None),
        )


def _lora_batch(chunks: list[SequenceChunk], device: torch.device | str) -> LoRABatch | None:
    if all(c.lora_slot < 0 for c in chunks):
        return None
    return LoRABatch.build([c.lora_slot for c in chunks], [len(c.token_ids) for c in chunks], device)

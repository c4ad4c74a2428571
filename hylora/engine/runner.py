"""Runs one scheduled step: builds the flat batch, calls the model, checks every request's numbers."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from hylora.cache import PagedKVCache, StatePool
from hylora.engine.config import EngineConfig
from hylora.engine.cuda_graphs import make_graph_decode, make_graph_short_step
from hylora.engine.decode_batch import DecodeRow
from hylora.engine.host_copy import HostCopy
from hylora.engine.padded_decode import DecodeOutput, PaddedDecode
from hylora.engine.sampler import to_device
from hylora.engine.scheduler import ScheduledChunk
from hylora.engine.short_step import PaddedShortStep, VerifyAhead
from hylora.model.decoder import HybridDecoder
from hylora.model.forward_batch import ForwardBatch, SequenceChunk


@dataclass
class ChunkResult:
    # every hidden state and logit of this request in this step is finite; a callable that waits for
    # the step's flags on the device when first read (read it via is_finite)
    finite: bool | Callable[[], bool]
    sample_logits: torch.Tensor | None = None  # [V] fp32, when the chunk samples a next token
    prompt_logits: torch.Tensor | None = None  # [n, V] fp32 rows for prompt logprobs
    prompt_positions: range = range(0)  # the prompt positions those rows belong to
    verify_logits: torch.Tensor | None = None  # [1 + drafts, V] fp32: a verify chunk's rows to accept from
    # [n, hidden] final-norm hidden states of the chunk's positions (drafts included), for the MTP layer;
    # None when the model drafts nothing or the step ran through the padded decode step
    hidden: torch.Tensor | None = None

    def is_finite(self) -> bool:
        return self.finite() if callable(self.finite) else self.finite


class ModelRunner:
    def __init__(self, model: HybridDecoder, kv: PagedKVCache, states: StatePool, config: EngineConfig | None = None):
        """With `config` on CUDA (and not `enforce_eager`), decode steps and short steps (every chunk
        short: decode rows with a prompt's last tokens, verify steps) replay CUDA graphs captured here."""
        self.model, self.kv, self.states = model, kv, states
        # padded static-shape decode steps (CUDA graphs); None: decode steps run eagerly
        self.decode: PaddedDecode | None = None if config is None else make_graph_decode(model, kv, states, config)
        # padded short steps (CUDA graphs per token bucket); None: they run eagerly
        self.short: PaddedShortStep | None = None
        if config is not None:
            self.short = make_graph_short_step(model, kv, states, config)

    @torch.inference_mode()
    def execute(
        self, chunks: list[ScheduledChunk], input_ids: torch.Tensor | None = None, verify: VerifyAhead | None = None
    ) -> list[ChunkResult]:
        """`input_ids` [chunks `ahead`] on the device: the input tokens of the chunks planned ahead (one
        token each, drawn by the step still in flight), in order; `verify`: what the device holds of a
        verify step planned ahead, which only the padded short step can take."""
        ahead = [i for i, c in enumerate(chunks) if c.ahead] if verify is None else []  # (verify: ids in it)
        if _count(input_ids) != len(ahead):
            raise ValueError(f"{len(ahead)} chunks planned ahead, input ids for {_count(input_ids)}")
        if input_ids is not None:
            input_ids = input_ids.long()
        decode_rows = _decode_rows(chunks, self.decode.max_batch) if self.decode is not None else None
        if decode_rows is not None:
            if input_ids is not None and len(ahead) < len(chunks):
                known = to_device([r.token_id for r in decode_rows], self.model.device, torch.long)
                input_ids = known.index_copy(0, to_device(ahead, self.model.device, torch.long), input_ids)
            return self._execute_decode(chunks, decode_rows, input_ids)
        seqs = [_sequence_chunk(c) for c in chunks]
        seq_lens = [len(s.token_ids) for s in seqs]
        keep_hidden = self.model.mtp is not None
        rows, wanted = _logit_rows(chunks, seq_lens)
        # the rows as a device index copied behind the step (indexing with a host list would copy it
        # synchronously, and the host would wait for the whole forward here)
        index = to_device(rows, self.model.device, torch.long)
        starts = [0, *itertools.accumulate(seq_lens)][:-1]
        given = None  # (flat rows, tokens) of the chunks planned ahead
        if input_ids is not None:
            given = (to_device([starts[i] for i in ahead], self.model.device, torch.long), input_ids)
        if verify is not None and (self.short is None or not self.short.fits(seqs)):
            raise ValueError("a verify step planned ahead needs the padded short step")
        if self.short is not None and self.short.fits(seqs):
            out = self.short.run(seqs, verify, given=given)  # views of the step's buffers: copy what must outlive it
            hidden = out.hidden.clone() if keep_hidden else out.hidden
            logits = out.logits[index] if rows else hidden.new_zeros(0, 0)
            finite_rows, finite_logits = out.finite[0], out.finite[1][index]
        else:
            batch = ForwardBatch.build(seqs, self.kv.page_size, self.model.device)
            if given is not None:
                batch.input_ids.index_copy_(0, *given)
            hidden = self.model(batch, self.kv, self.states)  # [T, hidden]
            finite_rows = torch.isfinite(hidden).all(dim=-1)
            logits = self.model.logits(hidden[index]) if rows else hidden.new_zeros(0, 0)
            finite_logits = self.model.finite_logits(logits) if rows else finite_rows.new_ones(0)
        # read when the host checks the step, so the sampler and the acceptance queue behind the forward
        flags = HostCopy(finite_rows, finite_logits)

        results = []
        for c, (sample_row, positions, first_prompt_row), start, n in zip(
            chunks, wanted, starts, seq_lens, strict=True
        ):
            logit_rows = list(range(first_prompt_row, first_prompt_row + len(positions)))
            if sample_row is not None:
                logit_rows.extend(range(sample_row, sample_row + 1 + len(c.drafts)))
            finite = partial(_chunk_finite, flags, range(start, start + n), logit_rows)
            verifies = sample_row is not None and bool(c.drafts)
            results.append(
                ChunkResult(
                    finite=finite,
                    sample_logits=logits[sample_row] if sample_row is not None and not verifies else None,
                    prompt_logits=logits[first_prompt_row : first_prompt_row + len(positions)] if positions else None,
                    prompt_positions=positions,
                    verify_logits=logits[sample_row : sample_row + 1 + len(c.drafts)] if verifies else None,
                    hidden=hidden[start : start + n] if keep_hidden else None,
                )
            )
        return results

    def _execute_decode(
        self, chunks: list[ScheduledChunk], rows: list[DecodeRow], input_ids: torch.Tensor | None = None
    ) -> list[ChunkResult]:
        """A decode step through the padded static step (row i = chunk i): same results as `execute`'s
        eager path: each row's logits serve its prompt logprob and/or its next token."""
        assert self.decode is not None
        out = self.decode.run(rows, input_ids)
        results = []
        for i, c in enumerate(chunks):
            positions = _prompt_positions(c)  # at most this one token's position
            wants_logits = bool(positions) or c.samples
            results.append(
                ChunkResult(
                    finite=partial(_row_finite, out, i, wants_logits),
                    sample_logits=out.logits[i] if c.samples else None,
                    prompt_logits=out.logits[i : i + 1] if positions else None,
                    prompt_positions=positions,
                )
            )
        return results


def _count(input_ids: torch.Tensor | None) -> int:
    return 0 if input_ids is None else int(input_ids.shape[0])


def _sequence_chunk(c: ScheduledChunk) -> SequenceChunk:
    """The model's view of a scheduled chunk: its tokens (drafts included) and where its state lives."""
    r = c.request
    assert r.state_slot is not None
    end = c.start + c.num_tokens
    tokens = [0] * c.num_tokens if c.ahead else r.all_ids[c.start : end]  # planned ahead: given on the device
    return SequenceChunk(
        token_ids=tokens + c.drafts,
        context_len=c.start,
        state_slot=r.state_slot,
        pages=r.pages,
        positions=r.mm.positions.window(c.start, end + len(c.drafts)) if r.mm is not None else None,
        lora_slot=r.lora.slot if r.lora is not None else -1,
        embeds=r.mm.chunk_embeds(c.start, end) if r.mm is not None else None,
        spec_slots=r.spec_slots if c.drafts else None,
    )


def _logit_rows(
    chunks: list[ScheduledChunk], seq_lens: list[int]
) -> tuple[list[int], list[tuple[int | None, range, int]]]:
    """(the flat token rows that need logits, per chunk: (its first sampling row among them or None,
    its prompt-logprob positions, its first prompt-logprob row among them))."""
    rows: list[int] = []
    wanted: list[tuple[int | None, range, int]] = []
    first = 0
    for c, n in zip(chunks, seq_lens, strict=True):
        positions = _prompt_positions(c)
        first_prompt_row = len(rows)
        rows.extend(first + p - c.start for p in positions)
        sample_row = None
        if c.samples:  # a verify chunk: its last token's row and each draft's
            sample_row = len(rows)
            rows.extend(range(first + c.num_tokens - 1, first + c.num_tokens + len(c.drafts)))
        wanted.append((sample_row, positions, first_prompt_row))
        first += n
    return rows, wanted


def _decode_rows(chunks: list[ScheduledChunk], max_batch: int) -> list[DecodeRow] | None:
    """The step as padded-decode rows, or None when it must run eagerly: a prefill chunk of several
    tokens, more sequences than the largest bucket, or a token whose embedding is given (media)."""
    if not chunks or len(chunks) > max_batch or any(c.num_tokens != 1 or c.drafts for c in chunks):
        return None
    rows = []
    for c in chunks:
        r = c.request
        assert r.state_slot is not None
        positions = None
        if r.mm is not None:
            if r.mm.chunk_embeds(c.start, c.start + 1) is not None:
                return None
            t, h, w = r.mm.positions.window(c.start, c.start + 1)[:, 0].tolist()
            positions = (t, h, w)
        lora_slot = r.lora.slot if r.lora is not None else -1
        n_prompt = len(r.prompt_ids)  # (not all_ids: that copies the whole sequence)
        if c.ahead:
            token = 0  # on the device only: the runner's caller passes it as input_ids
        else:
            token = r.prompt_ids[c.start] if c.start < n_prompt else r.output_ids[c.start - n_prompt]
        rows.append(DecodeRow(token, c.start, r.state_slot, r.pages, lora_slot, positions))
    return rows


def _prompt_positions(c: ScheduledChunk) -> range:
    """Prompt positions in this chunk whose logits give a still-missing prompt logprob
    (position p predicts prompt token p + 1)."""
    r = c.request
    if not r.wants_prompt_logprobs:
        return range(0)
    first_needed = max(len(r.prompt_logprobs), 1) - 1
    return range(max(c.start, first_needed), min(c.start + c.num_tokens, len(r.prompt_ids) - 1))


def _chunk_finite(flags: HostCopy, token_rows: range, logit_rows: list[int]) -> bool:
    hidden_ok, logits_ok = flags.values()
    return all(hidden_ok[r] for r in token_rows) and all(logits_ok[r] for r in logit_rows)


def _row_finite(out: DecodeOutput, row: int, wants_logits: bool) -> bool:
    return out.finite_hidden[row] and (out.finite_logits[row] or not wants_logits)

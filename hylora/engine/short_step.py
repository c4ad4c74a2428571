"""The static-shape short step: a step whose chunks are all short, padded to a token bucket, on
persistent buffers (what a CUDA graph reads; engine/cuda_graphs.py captures it).

Short steps are the ones a decode graph cannot take and that launch-bound eager code would run:
decode rows mixed with the last tokens of a prompt (every arrival during decoding makes one; so does
a burst of prompts chunked at 2048 tokens a step, whose last step holds the decode rows and one
prompt's tail: 31 rows + 106 tokens in DESIGN.md's workload, run 41), and speculative verify steps
(k+1 tokens per sequence). The GDN layers run token by token in one launch per layer, a program per
(sequence, value head, dv block) carrying its state over the chunk's tokens, which holds for a chunk
as long as the bucket (the step's token limit bounds it; an eager step sends chunks over
`RECURRENT_MAX_TOKENS` to fla's chunked kernels instead); a verify step's chunks stay within
`RECURRENT_MAX_TOKENS` (the spec-slot columns). No chunk may hold a media embedding, and the step
holds at most the largest bucket's tokens.

Layout of a step of T real tokens in a bucket of B tokens (B rows of every per-token field, B
sequences of every per-sequence one):

- tokens 0..T-1 are the chunks' tokens in order, as the eager step lays them out;
- tokens T..B-1 are padding, each its own one-token sequence: token 0 at position 0, state slot -1
  (reads and writes no GDN state), attention length 0 (reads nothing, outputs zeros), KV row in the
  cache's null page, LoRA slot -1;
- sequences past those have no tokens (start = B) and slot -1.

Attention runs as decode attention with one query row per token: token t of a chunk attends to
its sequence's first `position + 1` cached tokens through its own copy of the sequence's block-table
row (the step writes every new token's K and V before any attention reads them). The GDN layers read
the sequences' starts and each token's sequence from the device (`ForwardBatch.seq_layout`), so one
captured graph serves any mix of lengths that fits its bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hylora.cache import PagedKVCache, StatePool
from hylora.engine.decode_batch import bucket_for
from hylora.lora import DeviceLoRABatch
from hylora.model.decoder import HybridDecoder
from hylora.model.forward_batch import ForwardBatch, SequenceChunk
from hylora.model.layers import Linear
from hylora.ops.varlen import RECURRENT_MAX_TOKENS

FIRST_BUCKET = 16
# per token: input id, position t / h / w, KV row, attention length, LoRA slot, sequence
ID, POS, KV_ROW, ATT_LEN, LORA, SEQ, TOKEN_FIELDS = 0, 1, 4, 5, 6, 7, 8
# per sequence (B of them, then the starts' last entry): state slot, first token
SLOT, START = 0, 1


def short_buckets(max_tokens: int) -> list[int]:
    """16, 24, 32, 48, 64, 96, … (each power of two and 1.5 times it) below `max_tokens`, then
    `max_tokens` itself; [] when it is 0. The 1.5 steps fit k = 2 verify steps of 8 and 32
    sequences (24 and 96 tokens) without padding them to the next power of two."""
    if max_tokens < 0:
        raise ValueError("the short-step token limit must be >= 0")
    buckets, size = [], FIRST_BUCKET
    while size < max_tokens:
        buckets += [b for b in (size, size * 3 // 2) if b < max_tokens]
        size *= 2
    return buckets + [max_tokens] if max_tokens else []


def kv_rows(pages: torch.Tensor, position: torch.Tensor, page_size: int) -> torch.Tensor:
    """[n, m] the KV cache rows of positions [n, m] in the sequences whose block-table rows are
    `pages` [n, W], on the device."""
    return pages.gather(1, position // page_size) * page_size + position % page_size


def fits_short_step(seqs: list[SequenceChunk], max_tokens: int) -> bool:
    """Whether a step of `seqs` can run as a padded short step of at most `max_tokens` tokens. A step
    that verifies drafts keeps every chunk within `RECURRENT_MAX_TOKENS`: its GDN kernels read a
    spec-slot column for each token of every chunk, and the buffers hold that many."""
    verifies = any(s.spec_slots for s in seqs)
    return (
        bool(seqs)
        and sum(len(s.token_ids) for s in seqs) <= max_tokens
        and all(s.embeds is None for s in seqs)
        and (not verifies or all(len(s.token_ids) <= RECURRENT_MAX_TOKENS for s in seqs))
    )


class ShortStepBuffers:
    """Persistent inputs of padded short steps of up to `max_tokens` tokens."""

    def __init__(
        self,
        max_tokens: int,
        max_drafts: int,
        max_pages: int,
        page_size: int,
        null_page: int,
        device: torch.device | str,
    ) -> None:
        self.device = torch.device(device)
        self.max_tokens, self.max_drafts, self.max_pages, self.page_size = max_tokens, max_drafts, max_pages, page_size
        self.null_row = null_page * page_size
        # spec-slot columns: as many as the longest chunk has tokens after its first (the GDN kernels read
        # a column per token of every chunk, -1 for a chunk that verifies nothing), not only max_drafts
        self.spec_width = RECURRENT_MAX_TOKENS - 1 if max_drafts else 0
        pinned = self.device.type == "cuda"
        head = TOKEN_FIELDS * max_tokens + 2 * max_tokens + 1 + max_tokens * self.spec_width
        size = head + max_tokens * max_pages
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=pinned)
        self.staged = torch.zeros(size, dtype=torch.int64, device=self.device)
        self.block_table = torch.zeros(max_tokens, max_pages, dtype=torch.int64, device=self.device)
        self._sent = torch.cuda.Event() if pinned else None  # the last copy out of `host`
        self.seq_lens: dict[int, list[int]] = {}  # per bucket: the host lengths of the last fill

    def _views(self, buf: torch.Tensor, bucket: int) -> tuple:
        """(token fields [TOKEN_FIELDS, B], slots [B], starts [B + 1], spec slots [B, J], where the
        block table starts) in `buf`, laid out for `bucket` (a graph always reads the same addresses)."""
        tok_end = TOKEN_FIELDS * bucket
        slot_end = tok_end + bucket
        start_end = slot_end + bucket + 1
        spec_end = start_end + bucket * self.spec_width
        return (
            buf[:tok_end].view(TOKEN_FIELDS, bucket),
            buf[tok_end:slot_end],
            buf[slot_end:start_end],
            buf[start_end:spec_end].view(bucket, self.spec_width),
            spec_end,
        )

    def fill(self, seqs: list[SequenceChunk], bucket: int) -> None:
        """Write `seqs` then padding up to `bucket` tokens into the buffers (stream-ordered: call before
        the step that reads them)."""
        T = sum(len(s.token_ids) for s in seqs)
        if not T <= bucket <= self.max_tokens:
            raise ValueError(f"{T} tokens do not fit a bucket of {bucket} (buffers hold {self.max_tokens})")
        width = max([len(s.pages) for s in seqs] + [1])
        if width > self.max_pages:
            raise ValueError(f"a sequence holds {width} pages, more than max_model_len allows ({self.max_pages})")
        ps = self.page_size
        tokens = np.zeros((TOKEN_FIELDS, bucket), dtype=np.int64)
        tokens[KV_ROW], tokens[LORA] = self.null_row, -1
        slots = np.full(bucket, -1, dtype=np.int64)
        starts = np.full(bucket + 1, bucket, dtype=np.int64)
        spec = np.full((bucket, self.spec_width), -1, dtype=np.int64)
        table = np.zeros((bucket, width), dtype=np.int64)
        lens: list[int] = []
        t = 0
        for i, s in enumerate(seqs):
            n = len(s.token_ids)
            pos = np.arange(s.context_len, s.context_len + n)
            if (s.context_len + n - 1) // ps >= len(s.pages):
                raise ValueError(f"sequence {i}: position {s.context_len + n - 1} is past its {len(s.pages)} pages")
            if s.state_slot < 0:
                raise ValueError(f"sequence {i}: a live sequence needs a state slot")
            pages = np.asarray(s.pages, dtype=np.int64)
            tokens[ID, t : t + n] = s.token_ids
            tokens[POS : POS + 3, t : t + n] = pos if s.positions is None else s.positions.cpu().numpy()
            tokens[KV_ROW, t : t + n] = pages[pos // ps] * ps + pos % ps
            tokens[ATT_LEN, t : t + n] = pos + 1
            tokens[LORA, t : t + n] = s.lora_slot
            tokens[SEQ, t : t + n] = i
            table[t : t + n, : len(pages)] = pages
            slots[i], starts[i] = s.state_slot, t
            if s.spec_slots:
                if n - 1 > self.max_drafts or len(s.spec_slots) < n - 1:
                    raise ValueError(f"sequence {i}: {n - 1} drafts, room for {self.max_drafts}, or too few spec slots")
                spec[i, : n - 1] = s.spec_slots[: n - 1]
            lens.append(n)
            t += n
        padding = range(len(seqs), len(seqs) + bucket - T)  # each padding token its own sequence
        tokens[SEQ, T:] = padding
        starts[padding.start : padding.stop] = np.arange(T, bucket)
        self.seq_lens[bucket] = lens + [1] * len(padding) + [0] * (T - len(seqs))

        if self._sent is not None:
            self._sent.synchronize()  # the previous step's copy has left the pinned buffer
        tok, sl, st, sp, head = self._views(self.host, bucket)
        tok.numpy()[:], sl.numpy()[:], st.numpy()[:], sp.numpy()[:] = tokens, slots, starts, spec
        end = head + bucket * width
        self.host.numpy()[head:end] = table.ravel()
        self.staged[:end].copy_(self.host[:end], non_blocking=True)  # the step's one host→device copy
        if self._sent is not None:
            self._sent.record()
        self.block_table[:bucket, :width].copy_(self.staged[head:end].view(bucket, width))

    def move_on(
        self,
        bucket: int,
        shift: torch.Tensor,
        ids: torch.Tensor | None = None,
        drafted: torch.Tensor | None = None,
    ) -> None:
        """On the device, after `fill` (stream-ordered), for a step planned before the host knows where
        its first `len(shift)` sequences start: each one's tokens move on by its `shift` [n] (positions,
        KV rows, attention lengths); `ids` [T] become the first T tokens' inputs. With `drafted` [n] (a
        verify step planned ahead of the acceptance `shift` of the one before, which verified that many
        drafts), each sequence's state slot is the one `speculative.commit_state` will keep: after
        `shift` of `drafted` accepted drafts, the state slot and spec slot `shift` trade places."""
        n = shift.shape[0]
        T = sum(self.seq_lens[bucket][:n])
        tokens, slots, _, spec, _ = self._views(self.staged, bucket)
        moved = shift[tokens[SEQ, :T]]  # [T] each token's sequence's shift
        position = tokens[ATT_LEN, :T] - 1 + moved  # [T] place in its sequence
        tokens[POS : POS + 3, :T] += moved
        tokens[KV_ROW, :T] = kv_rows(self.block_table[:T], position[:, None], self.page_size)[:, 0]
        tokens[ATT_LEN, :T] = position + 1
        if ids is not None:
            tokens[ID, : ids.shape[0]].copy_(ids)
        if drafted is not None:
            swap = shift < drafted  # [n]
            column = shift.clamp(max=self.spec_width - 1)
            held, spare = slots[:n].clone(), spec[:n].clone()  # [n], [n, J]
            kept = torch.where(swap, spare.gather(1, column[:, None])[:, 0], held)
            traded = (torch.arange(self.spec_width, device=shift.device) == column[:, None]) & swap[:, None]
            spec[:n] = torch.where(traded, held[:, None], spare)
            slots[:n] = kept

    def token_ids(self, bucket: int) -> torch.Tensor:
        """[bucket] the input-token row of the device buffers laid out for `bucket`."""
        return self._views(self.staged, bucket)[0][ID]

    def batch(self, bucket: int, lora: bool, spec: bool, max_seq_len: int) -> ForwardBatch:
        """The ForwardBatch over the buffers of `bucket` tokens (the same tensors every step: what a
        CUDA graph captures). `lora`: apply the adapters of the LoRA-slot row; `spec`: a verify step
        (the GDN layers keep the state after each draft)."""
        tokens, slots, starts, spec_slots, _ = self._views(self.staged, bucket)
        lens = self.seq_lens.get(bucket, [1] * bucket)  # the layout of the last fill (all padding before one)
        return ForwardBatch(
            input_ids=tokens[ID],
            positions=tokens[POS : POS + 3],
            seq_lens=lens,
            context_lens=[],  # on the device only (attention lengths - 1)
            state_slots=slots,
            block_table=self.block_table[:bucket],
            kv_slot_mapping=tokens[KV_ROW],
            page_size=self.page_size,
            lora=DeviceLoRABatch(token_slots=tokens[LORA]) if lora else None,
            decode_lens=tokens[ATT_LEN],
            max_decode_len=max_seq_len,
            padded=True,
            spec_slots=spec_slots if spec else None,
            spec_columns=self.max_drafts if spec else None,
            seq_layout=(tokens[SEQ], starts),
        )


@dataclass
class VerifyAhead:
    """What only the device knows of a verify step planned before the host read the step before it
    (engine.py's decode ahead while speculating): per sequence, how far it moved on (that step's
    accepted drafts) and how many drafts that step verified; per token, its input."""

    shift: torch.Tensor  # [n] int64
    drafted: torch.Tensor  # [n] int64
    ids: torch.Tensor  # [T] int64: each sequence's new token, then its drafts


@dataclass
class ShortStepOutput:
    hidden: torch.Tensor  # [T, hidden] final-norm hidden states of the real tokens (views of the step's buffers)
    logits: torch.Tensor  # [T, V] fp32 (views: copy what must outlive the next step)
    finite: torch.Tensor  # [2, T] bool: per token, hidden state finite; logits finite


class PaddedShortStep:
    """Runs short steps padded to their bucket; eagerly here (the CPU tests, the graphs' warm-up),
    by replaying captured graphs in `CudaGraphShortStep`."""

    def __init__(
        self,
        model: HybridDecoder,
        kv: PagedKVCache,
        states: StatePool,
        max_tokens: int,
        max_drafts: int,
        max_model_len: int,
    ) -> None:
        self.model, self.kv, self.states = model, kv, states
        self.buckets = short_buckets(max_tokens)
        if not self.buckets:
            raise ValueError("a padded short step needs a token limit >= 1")
        self.max_drafts = max_drafts
        self.max_model_len = max_model_len
        self.buffers = ShortStepBuffers(
            self.buckets[-1], max_drafts, kv.pages_needed(max_model_len), kv.page_size, kv.null_page, model.device
        )
        self.has_lora = any(isinstance(m, Linear) and m.lora is not None for m in model.layers.modules())

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def fits(self, seqs: list[SequenceChunk]) -> bool:
        """Whether this step takes `seqs` (a verify chunk's drafts must fit the spec-slot columns)."""
        drafts_fit = all(not s.spec_slots or len(s.token_ids) - 1 <= self.max_drafts for s in seqs)
        return drafts_fit and fits_short_step(seqs, self.max_tokens)

    def run(
        self,
        seqs: list[SequenceChunk],
        ahead: VerifyAhead | None = None,
        given: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> ShortStepOutput:
        """`ahead`: a verify step planned before the step before it was read (`ShortStepBuffers.move_on`);
        `given`: (token rows [n], their input ids [n]) on the device, the inputs of chunks planned
        ahead (drawn by the step still in flight)."""
        T = sum(len(s.token_ids) for s in seqs)
        bucket = bucket_for(T, self.buckets)
        lora = any(s.lora_slot >= 0 for s in seqs)
        spec = any(s.spec_slots for s in seqs)
        if lora and not self.has_lora:
            raise ValueError("a sequence asks for an adapter but the model has no LoRA slots")
        if spec and not self.max_drafts:
            raise ValueError("a verify chunk in a short step built without drafts")
        self.buffers.fill(seqs, bucket)
        if ahead is not None:
            self.buffers.move_on(bucket, ahead.shift, ahead.ids, ahead.drafted)
        if given is not None:
            self.buffers.token_ids(bucket).index_copy_(0, *given)
        hidden, logits, finite = self._forward(bucket, lora, spec)
        return ShortStepOutput(hidden[:T], logits[:T], finite[:, :T])

    def _forward(self, bucket: int, lora: bool, spec: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the step on the filled buffers (CUDA graphs replay it instead)."""
        return self.step(bucket, lora, spec)

    def step(self, bucket: int, lora: bool, spec: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [bucket, H], logits [bucket, V] fp32 and finite [2, bucket] of the step on the buffers."""
        batch = self.buffers.batch(bucket, lora, spec, self.max_model_len)
        hidden = self.model(batch, self.kv, self.states)
        logits = self.model.logits(hidden)
        finite = torch.stack([torch.isfinite(hidden).all(dim=-1), self.model.finite_logits(logits)])
        return hidden, logits, finite

"""The MTP layer's drafting as one static-shape step (what a CUDA graph captures, per token bucket).

`Drafter.propose` (engine/speculative.py) runs the MTP layer over the positions each request computed
this step, then k-1 more passes of one row per request, each on its own output and the draft before.
Run eagerly that is k small forwards, each launch-bound. Here all of it is one step on persistent
buffers:

1. pass 1 over the step's positions, laid out as a padded short step (engine/short_step.py: one
   query row per token, padding on the null page), the decoder's hidden rows copied into a fixed
   input buffer;
2. row i of the later passes is request i: its hidden state is pass 1's output at the request's last
   position (an index on the device), its input token the draft before (on the device), its position,
   KV row and attention length filled on the host for every pass at once. A request with fewer drafts
   than a pass, and every padding row, is a padding row there (null KV row, attention length 0);
3. every pass's argmax and logits' finiteness stay on the device, [k, rows] each.

The MTP layer runs on the base weights (no LoRA) and holds no GDN state, so the only cache a pass
writes is its own KV rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hylora.cache import PagedKVCache, StatePool
from hylora.engine.decode_batch import bucket_for
from hylora.engine.short_step import ShortStepBuffers, fits_short_step, kv_rows, short_buckets
from hylora.model.decoder import HybridDecoder
from hylora.model.forward_batch import ForwardBatch, SequenceChunk

# per later pass and row: position t / h / w, KV row, attention length
POS, KV_ROW, ATT_LEN, PASS_FIELDS = 0, 3, 4, 5


@dataclass
class DraftJob:
    """One request's part of a drafting step."""

    first: SequenceChunk  # pass 1: the tokens after each position computed this step
    hidden: torch.Tensor  # [len(first.token_ids), H] the decoder's final-norm hidden states there
    later: list[SequenceChunk]  # passes 2..k: one position each (their token is the draft before); [] for k <= 1
    drafts: int  # drafts wanted (0: pass 1 only keeps the MTP layer's KV up to date)


class PaddedDraft:
    """Runs drafting steps padded to their bucket; eagerly here (the CPU tests, the graphs' warm-up),
    by replaying captured graphs in `CudaGraphDraft`."""

    def __init__(
        self, model: HybridDecoder, kv: PagedKVCache, states: StatePool, max_tokens: int, k: int, max_model_len: int
    ) -> None:
        if model.mtp is None:
            raise ValueError("drafting needs the model's MTP layer")
        self.model, self.kv, self.states, self.k = model, kv, states, k
        self.buckets = short_buckets(max_tokens)
        if not self.buckets or k < 1:
            raise ValueError("a padded drafting step needs a token limit >= 1 and k >= 1")
        self.max_model_len = max_model_len
        top, device = self.buckets[-1], model.device
        self.first = ShortStepBuffers(top, 0, kv.pages_needed(max_model_len), kv.page_size, kv.null_page, device)
        self.hidden_in = torch.zeros(top, model.config.hidden_size, dtype=model.dtype, device=device)
        size = (k - 1) * PASS_FIELDS * top + top
        pinned = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=pinned)
        self.staged = torch.zeros(size, dtype=torch.int64, device=device)
        self._sent = torch.cuda.Event() if pinned else None
        self.no_slots = torch.full((top,), -1, dtype=torch.int64, device=device)

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def fits(self, jobs: list[DraftJob]) -> bool:
        return fits_short_step([j.first for j in jobs], self.max_tokens)

    def _views(self, buf: torch.Tensor, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(later passes' fields [k-1, PASS_FIELDS, B], last position's row of each request [B])."""
        n = (self.k - 1) * PASS_FIELDS * bucket
        return buf[:n].view(self.k - 1, PASS_FIELDS, bucket), buf[n : n + bucket]

    def fill(self, jobs: list[DraftJob], bucket: int, from_first: bool = False) -> None:
        """Write `jobs` then padding up to `bucket` into the buffers (stream-ordered). The later passes
        read pass 1's output at each request's last row, or its first with `from_first`."""
        self.first.fill([j.first for j in jobs], bucket)
        ps, null_row = self.kv.page_size, self.kv.null_page * self.kv.page_size
        fields = np.zeros((self.k - 1, PASS_FIELDS, bucket), dtype=np.int64)
        fields[:, KV_ROW] = null_row
        last = np.zeros(bucket, dtype=np.int64)
        t = 0
        for i, job in enumerate(jobs):
            n = len(job.first.token_ids)
            last[i] = t if from_first else t + n - 1
            t += n
            if len(job.later) > self.k - 1 or len(job.later) > max(job.drafts - 1, 0):
                raise ValueError(f"request {i}: {len(job.later)} later passes for {job.drafts} drafts (k = {self.k})")
            for s, c in enumerate(job.later):
                pos = c.context_len
                if pos // ps >= len(c.pages):
                    raise ValueError(f"request {i}: draft position {pos} is past its {len(c.pages)} pages")
                fields[s, POS : POS + 3, i] = pos if c.positions is None else c.positions[:, 0].tolist()
                fields[s, KV_ROW, i] = c.pages[pos // ps] * ps + pos % ps
                fields[s, ATT_LEN, i] = pos + 1
        hidden = torch.cat([j.hidden for j in jobs]) if jobs else self.hidden_in[:0]
        self.hidden_in[: hidden.shape[0]].copy_(hidden)
        if self._sent is not None:
            self._sent.synchronize()  # the previous step's copy has left the pinned buffer
        f, lst = self._views(self.host, bucket)
        f.numpy()[:], lst.numpy()[:] = fields, last
        end = (self.k - 1) * PASS_FIELDS * bucket + bucket
        self.staged[:end].copy_(self.host[:end], non_blocking=True)
        if self._sent is not None:
            self._sent.record()

    def run(
        self,
        jobs: list[DraftJob],
        first_ids: torch.Tensor | None = None,
        accepted: torch.Tensor | None = None,
        shift: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [k, len(jobs)] int64, finite [k, len(jobs)] bool) on the device: row i's first
        `jobs[i].drafts` entries are its drafts and whether their logits were finite.

        Drafting queued behind a verify step (`Drafter.launch`) passes what only the device knows yet:
        `first_ids` [T], pass 1's input tokens, and `accepted` [len(jobs)], how far into its first
        chunk each request's last accepted position lies; every job then drafts k, and its later
        passes' positions are those of `jobs` moved on by its `accepted`. `shift` [len(jobs)]: the verify
        step was itself planned ahead (`short_step.VerifyAhead`), so every position moves on by that too."""
        bucket = bucket_for(sum(len(j.first.token_ids) for j in jobs), self.buckets)
        self.fill(jobs, bucket, from_first=accepted is not None)
        if accepted is not None:
            assert first_ids is not None
            if shift is not None:
                self.first.move_on(bucket, shift)
            self._move_on(bucket, first_ids, accepted, accepted if shift is None else accepted + shift)
        tokens, finite = self._forward(bucket)
        return tokens[:, : len(jobs)], finite[:, : len(jobs)]

    def _move_on(self, bucket: int, first_ids: torch.Tensor, accepted: torch.Tensor, moved: torch.Tensor) -> None:
        """On the device, after `fill` (stream-ordered): pass 1's tokens become `first_ids`; each
        request's row for the later passes moves on from its first by its `accepted`, and its later
        passes' positions, KV rows and attention lengths by its `moved`."""
        n = accepted.shape[0]
        self.first.token_ids(bucket)[: first_ids.shape[0]].copy_(first_ids)
        fields, last = self._views(self.staged, bucket)
        last[:n] += accepted
        if self.k == 1:
            return
        live = fields[:, :, :n]  # [k-1, PASS_FIELDS, n]
        position = live[:, ATT_LEN] - 1 + moved  # [k-1, n] each pass's place in its sequence
        pages = self.first.block_table[last[:n]]  # [n, width] each request's block-table row
        live[:, POS : POS + 3] += moved
        live[:, KV_ROW] = kv_rows(pages, position.T, self.kv.page_size).T
        live[:, ATT_LEN] = position + 1

    def _forward(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.step(bucket)

    def step(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k passes on the filled buffers: (tokens [k, bucket], finite [k, bucket])."""
        model, kv, states = self.model, self.kv, self.states
        first = self.first.batch(bucket, lora=False, spec=False, max_seq_len=self.max_model_len)
        fields, last = self._views(self.staged, bucket)
        h = model.draft(first, self.hidden_in[:bucket], kv, states)[last]  # [B, H] at each request's last row
        table = first.block_table[last]  # each request's block-table row
        tokens, finite = [], []
        for s in range(self.k):
            if s > 0:
                f = fields[s - 1]
                batch = ForwardBatch(
                    input_ids=tokens[-1],
                    positions=f[POS : POS + 3],
                    seq_lens=[1] * bucket,
                    context_lens=[],
                    state_slots=self.no_slots[:bucket],
                    block_table=table,
                    kv_slot_mapping=f[KV_ROW],
                    page_size=kv.page_size,
                    decode_lens=f[ATT_LEN],
                    max_decode_len=self.max_model_len,
                    padded=True,
                )
                h = model.draft(batch, h, kv, states, s)
            logits = model.logits(h)
            tokens.append(logits.argmax(-1))
            finite.append(torch.isfinite(logits).all(-1))
        return torch.stack(tokens), torch.stack(finite)

"""Decode batches padded to a bucket size, on persistent buffers (what a CUDA graph reads).

A decode step (one new token per sequence) of n sequences runs as a batch of `bucket_for(n)` rows:
rows n.. are padding: token 0 at position 0, GDN state slot -1 (reads nothing, writes nothing),
decode length 0 (attention reads nothing and outputs zeros), KV row in the cache's null page (the
write sink no sequence owns), LoRA slot -1 (base). So a padding row never touches a live slot or
page, and the real rows compute exactly what they would unpadded.

The per-row inputs live in one int64 buffer whose layout depends on the bucket only (field f of
row i at f * bucket + i, so a bucket's graph always reads the same addresses), filled on the host
and sent with one host→device copy per step together with the block-table columns in use; those
are then placed into the persistent [max_batch, max_pages] table by one device copy. Table entries
past a sequence's pages may be stale: no kernel reads past a sequence's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hylora.lora import DeviceLoRABatch
from hylora.model.forward_batch import ForwardBatch

FIRST_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
# per row: input id, position t / h / w, state slot, KV row, decode length, LoRA slot
ID, POS, SLOT, KV_ROW, LEN, LORA, FIELDS = 0, 1, 4, 5, 6, 7, 8


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, … (×1.5 / ×4/3 steps) up to max_num_seqs, which is
    always the last bucket."""
    if max_num_seqs < 1:
        raise ValueError("max_num_seqs must be >= 1")
    buckets = [b for b in FIRST_BUCKETS if b < max_num_seqs]
    size = FIRST_BUCKETS[-1]
    while size < max_num_seqs:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3  # 64 → 96 → 128 → 192 …
        if size < max_num_seqs:
            buckets.append(size)
    return buckets + [max_num_seqs]


def bucket_for(n: int, buckets: list[int]) -> int:
    """The smallest bucket that holds n rows."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} sequences exceed the largest decode bucket ({buckets[-1]})")


@dataclass
class DecodeRow:
    """One sequence's token in a decode step."""

    token_id: int
    context_len: int  # tokens already in its caches; the new one goes to position context_len
    state_slot: int
    pages: list[int]
    lora_slot: int = -1
    positions: tuple[int, int, int] | None = None  # M-RoPE (t, h, w); None = text: context_len on all three


class DecodeBuffers:
    """Persistent inputs of padded decode steps for up to `max_batch` rows."""

    def __init__(
        self, max_batch: int, max_pages: int, page_size: int, null_page: int, device: torch.device | str
    ) -> None:
        self.device = torch.device(device)
        self.max_batch, self.max_pages, self.page_size = max_batch, max_pages, page_size
        self.null_row = null_page * page_size
        pinned = self.device.type == "cuda"
        size = max_batch * (FIELDS + max_pages)
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=pinned)
        self.staged = torch.zeros(size, dtype=torch.int64, device=self.device)
        self.block_table = torch.zeros(max_batch, max_pages, dtype=torch.int64, device=self.device)
        self._sent = torch.cuda.Event() if pinned else None  # the last copy out of `host`
        self._padding = np.zeros(FIELDS, dtype=np.int64)
        self._padding[[SLOT, KV_ROW, LORA]] = (-1, self.null_row, -1)

    def fill(self, rows: list[DecodeRow], bucket: int, input_ids: torch.Tensor | None = None) -> None:
        """Write `rows` then padding up to `bucket` rows into the buffers (stream-ordered: call before
        the step that reads them). `input_ids` [len(rows)] on the device, if given, replaces the
        rows' token ids by a device copy (no host wait)."""
        n = len(rows)
        if n > bucket or bucket > self.max_batch:
            raise ValueError(f"{n} rows do not fit a bucket of {bucket} (buffers hold {self.max_batch})")
        if input_ids is not None and tuple(input_ids.shape) != (n,):
            raise ValueError(f"input_ids has shape {list(input_ids.shape)}, expected [{n}]")
        width = max([len(r.pages) for r in rows] + [1])
        if width > self.max_pages:
            raise ValueError(f"a sequence holds {width} pages, more than max_model_len allows ({self.max_pages})")
        fields = np.repeat(self._padding[:, None], bucket, axis=1)  # [FIELDS, bucket]
        table = np.zeros((bucket, width), dtype=np.int64)
        ps = self.page_size
        for i, r in enumerate(rows):
            pos = r.context_len
            if pos // ps >= len(r.pages):
                raise ValueError(f"row {i}: position {pos} is past its {len(r.pages)} pages")
            if r.state_slot < 0:
                raise ValueError(f"row {i}: a live row needs a state slot")
            fields[ID, i] = r.token_id
            fields[POS : POS + 3, i] = r.positions if r.positions is not None else pos
            fields[SLOT, i] = r.state_slot
            fields[KV_ROW, i] = r.pages[pos // ps] * ps + pos % ps
            fields[LEN, i] = pos + 1
            fields[LORA, i] = r.lora_slot
            table[i, : len(r.pages)] = r.pages
        head, end = FIELDS * bucket, FIELDS * bucket + bucket * width
        if self._sent is not None:
            self._sent.synchronize()  # the previous step's copy has left the pinned buffer
        host = self.host.numpy()
        host[:head] = fields.ravel()
        host[head:end] = table.ravel()
        self.staged[:end].copy_(self.host[:end], non_blocking=True)  # the step's one host→device copy
        if self._sent is not None:
            self._sent.record()
        if input_ids is not None:
            self.staged[ID * bucket : ID * bucket + n].copy_(input_ids)
        self.block_table[:bucket, :width].copy_(self.staged[head:end].view(bucket, width))

    def batch(self, bucket: int, lora: bool, max_seq_len: int) -> ForwardBatch:
        """The ForwardBatch over the buffers of `bucket` rows (the same tensors every step: what a
        CUDA graph captures). `lora`: apply the adapters of the LoRA-slot column."""
        f = self.staged[: FIELDS * bucket].view(FIELDS, bucket)
        return ForwardBatch(
            input_ids=f[ID],
            positions=f[POS : POS + 3],
            seq_lens=[1] * bucket,
            context_lens=[],  # on the device only (decode_lens - 1)
            state_slots=f[SLOT],
            block_table=self.block_table[:bucket],
            kv_slot_mapping=f[KV_ROW],
            page_size=self.page_size,
            lora=DeviceLoRABatch(token_slots=f[LORA]) if lora else None,
            decode_lens=f[LEN],
            max_decode_len=max_seq_len,
            padded=True,
        )

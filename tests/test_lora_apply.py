"""The layer's LoRA backends: the masked all-adapters path equals the grouped reference, and leaves
base rows and absent slices bit-identical."""

from __future__ import annotations

import pytest
import torch

from hylora.lora import LoRABatch
from hylora.model.layers import add_lora
from tests.lora_helpers import random_stack


@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 127, 128, 129, 257], ids=lambda t: f"T{t}")
def test_masked_equals_grouped(T):
    g = torch.Generator().manual_seed(T)
    rows = [48, 16, 33]
    present = [[True, False, True], [True, True, True], [False, False, False], [False, True, True]]
    stack = random_stack(g, 40, rows, 4, 8, ranks=[8, 3, 0, 5], present=present)
    # sequences: base, slot 0, slot 3, base, slot 1, slot 0 again (non-contiguous group)
    seq_slots = [-1, 0, 3, -1, 1, 0]
    cuts = sorted(torch.randint(0, T + 1, (5,), generator=g).tolist())
    seq_lens = [b - a for a, b in zip([0, *cuts], [*cuts, T], strict=True)]
    if sum(seq_lens[i] for i, s in enumerate(seq_slots) if s >= 0) == 0:
        seq_lens[1] += 1
    x = torch.randn(sum(seq_lens), 40, generator=g)
    base = torch.randn(sum(seq_lens), sum(rows), generator=g)
    batch = LoRABatch.build(seq_slots, seq_lens, "cpu")
    ref = add_lora(x, base.clone(), stack, batch, "grouped")
    got = add_lora(x, base.clone(), stack, batch, "masked")
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    base_rows = batch.token_slots == -1
    assert torch.equal(got[base_rows], base[base_rows])
    slot3_rows = batch.token_slots == 3  # slot 3 has no LoRA on slice 0
    assert torch.equal(got[slot3_rows, :48], base[slot3_rows, :48])


def test_masked_skips_slices_no_adapter_in_the_batch_targets():
    g = torch.Generator().manual_seed(0)
    stack = random_stack(g, 8, [4, 4], 2, 2, ranks=[2, 2], present=[[True, False], [False, True]])
    x, base = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    out = add_lora(x, base.clone(), stack, LoRABatch.build([0], [3], "cpu"), "masked")
    assert torch.equal(out[:, 4:], base[:, 4:]) and not torch.equal(out[:, :4], base[:, :4])

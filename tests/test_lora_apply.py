"""The masked all-adapters LoRA path equals the grouped reference, and leaves base rows and absent
slices bit-identical."""

from __future__ import annotations

import pytest
import torch

from hylora.lora.apply import LoRABatch, LoRAStack, lora_apply_grouped, lora_apply_masked


def random_stack(g, in_f, rows, num_slots, max_rank, ranks, present):
    """ranks[slot] (0 = empty slot), present[slot][slice]; A/B zero outside each slot's rank and
    for absent slices, as the registry lays them out."""
    a = [torch.zeros(num_slots, max_rank, in_f) for _ in rows]
    b = [torch.zeros(num_slots, max_rank, r) for r in rows]
    for slot, rank in enumerate(ranks):
        for i in range(len(rows)):
            if present[slot][i]:
                a[i][slot, :rank] = torch.randn(rank, in_f, generator=g)
                b[i][slot, :rank] = torch.randn(rank, rows[i], generator=g)
    offsets, start = [], 0
    for r in rows:
        offsets.append((start, r))
        start += r
    return LoRAStack(a=a, b=b, offsets=offsets, present=[list(p) for p in present])


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
    ref = lora_apply_grouped(x, base.clone(), stack, batch)
    got = lora_apply_masked(x, base.clone(), stack, batch)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    base_rows = batch.token_slots == -1
    assert torch.equal(got[base_rows], base[base_rows])
    slot3_rows = batch.token_slots == 3  # slot 3 has no LoRA on slice 0
    assert torch.equal(got[slot3_rows, :48], base[slot3_rows, :48])


def test_masked_skips_slices_no_adapter_in_the_batch_targets():
    g = torch.Generator().manual_seed(0)
    stack = random_stack(g, 8, [4, 4], 2, 2, ranks=[2, 2], present=[[True, False], [False, True]])
    x, base = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    out = lora_apply_masked(x, base.clone(), stack, LoRABatch.build([0], [3], "cpu"))
    assert torch.equal(out[:, 4:], base[:, 4:]) and not torch.equal(out[:, :4], base[:, :4])

"""Carrying GDN state and KV across steps gives the same logits as one full pass."""

from __future__ import annotations

import pytest
import torch

from hylora.generate import CachedRunner
from hylora.model.loader import load_model
from tests.helpers import hylora_logits, random_ids

ATOL = 1e-4


@pytest.fixture(scope="module")
def model(causal_ckpt):
    return load_model(causal_ckpt[0], progress=False)


def test_prefill_then_32_decode_steps(model):
    ids = random_ids(100 + 32, model.config.vocab_size, seed=11)
    full = hylora_logits(model, ids)
    runner = CachedRunner(model, num_slots=1, num_pages=16, page_size=16)
    seq = runner.add()
    steps = [runner.step([(seq, ids[:100])])[0]]
    for t in ids[100:]:
        steps.append(runner.step([(seq, [t])])[0])
    got = torch.stack(steps)  # logits after token 99, 100, ..., 131
    assert (got - full[99:]).abs().max().item() <= ATOL


@pytest.mark.parametrize("cuts", [[1], [7, 8, 9], [63, 64, 65], [100, 300], [1, 2, 3, 200, 450]], ids=str)
def test_chunked_prefill_at_arbitrary_points(model, cuts):
    ids = random_ids(513, model.config.vocab_size, seed=12)
    full = hylora_logits(model, ids)
    runner = CachedRunner(model, num_slots=1, num_pages=64, page_size=16)
    seq = runner.add()
    bounds = [0, *cuts, len(ids)]
    pieces = [runner.step([(seq, ids[a:b])], all_logits=True)[0] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert (torch.cat(pieces) - full).abs().max().item() <= ATOL


def test_page_size_does_not_change_logits(model):
    ids = random_ids(200, model.config.vocab_size, seed=13)
    a, b = hylora_logits(model, ids, page_size=16), hylora_logits(model, ids, page_size=7)
    assert (a - b).abs().max().item() <= 1e-5


def test_released_slot_and_pages_do_not_leak_into_next_sequence(model):
    runner = CachedRunner(model, num_slots=1, num_pages=8, page_size=16)
    first = runner.add()
    runner.step([(first, random_ids(100, model.config.vocab_size, seed=14))])
    runner.release(first)
    ids = random_ids(40, model.config.vocab_size, seed=15)
    second = runner.add()
    assert second.slot == first.slot
    reused = runner.step([(second, ids)], all_logits=True)[0]
    assert torch.equal(reused, hylora_logits(model, ids))

"""Shared test helpers: run hylora and the transformers reference on the same tokens."""

from __future__ import annotations

import torch

from hylora.generate import CachedRunner


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hylora_logits(model, ids: list[int], page_size: int = 16) -> torch.Tensor:
    runner = CachedRunner(model, num_slots=1, num_pages=len(ids) // page_size + 2, page_size=page_size)
    return runner.step([(runner.add(), ids)], all_logits=True)[0]


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

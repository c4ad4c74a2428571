"""PEFT-written random adapters (non-zero B) on the tiny test checkpoints."""

from __future__ import annotations

import copy
import dataclasses
from contextlib import contextmanager
from pathlib import Path

import torch

from hylora.lora import LoRABatch, LoRAStack
from hylora.ops.lora.reference import lora_apply_grouped

# name → LoraConfig kwargs; different ranks, target sets, patterns and one rsLoRA
ADAPTER_SPECS = {
    "gdn_attn": dict(
        r=8,
        lora_alpha=16,
        target_modules=["in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "v_proj"],
        layers_to_transform=[0, 2, 3],
    ),
    "rs_mlp": dict(
        r=4,
        lora_alpha=4,
        use_rslora=True,
        target_modules=["in_proj_b", "in_proj_a", "gate_proj", "down_proj", "k_proj", "o_proj"],
        rank_pattern={"down_proj": 2},
        alpha_pattern={"o_proj": 3},
    ),
    "all_linear": dict(r=6, lora_alpha=6, target_modules="all-linear"),
    "regex": dict(r=3, lora_alpha=5, target_modules=r".*layers\.[13]\..*(in_proj_qkv|in_proj_ba?|up_proj|o_proj)"),
}

# LoRA on the vision tower of the VL test checkpoint (tests/vl_helpers.py), with PEFT's own matching:
# "proj" also wraps the Conv3d patch embedding; all-linear takes the tower's nn.Linear modules only.
TOWER_ADAPTER_SPECS = {
    "explicit": dict(
        r=4, lora_alpha=8, target_modules=["qkv", "proj", "linear_fc1", "linear_fc2", "in_proj_qkv", "o_proj"]
    ),
    "all_linear": dict(r=6, lora_alpha=6, use_rslora=True, target_modules="all-linear"),
    "tower_only": dict(
        r=4,
        lora_alpha=4,
        target_modules=["patch_embed.proj", "merger.linear_fc1", "merger.linear_fc2"],
        rank_pattern={"linear_fc2": 2},
        alpha_pattern={"patch_embed.proj": 3},
    ),
}


def peft_adapter(base_model, out_dir: Path, seed: int, **lora_kwargs):
    """Wrap a copy of `base_model` with a random LoRA (B != 0), save it, return the PEFT model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora_kwargs)
    peft_model = get_peft_model(copy.deepcopy(base_model), cfg).eval()
    peft_model.save_pretrained(out_dir)
    return peft_model


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


def grouped_reference(x: torch.Tensor, y: torch.Tensor, stack: LoRAStack, batch: LoRABatch) -> torch.Tensor:
    """The grouped fp32 LoRA reference on a stack and a batch."""
    return lora_apply_grouped(x, y, stack.a, stack.b, stack.offsets, stack.present, batch.groups)


@contextmanager
def lora_backend(model, backend: str):
    """Run `model`'s linears (decoder and tower) with one LoRA backend, then restore its kernels."""
    before = model.kernels
    model.use_kernels(dataclasses.replace(before, lora_backend=backend, tower_lora_backend=backend))
    try:
        yield
    finally:
        model.use_kernels(before)

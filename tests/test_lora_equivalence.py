"""Dynamic LoRA == PEFT (unmerged) == merged checkpoint, at every length and in mixed batches."""

from __future__ import annotations

import pytest
import torch

from hylora.adapters.merge import merge_adapter
from hylora.adapters.registry import AdapterRegistry
from hylora.generate import CachedRunner
from hylora.model.loader import load_model
from tests.helpers import hf_logits, random_ids
from tests.lora_helpers import ADAPTER_SPECS, lora_backend, peft_adapter

ATOL = 1e-4
LENGTHS = [1, 64, 65, 128, 129, 400, 513, 1024, 2048]


@pytest.fixture(scope="module")
def setup(causal_ckpt, tmp_path_factory):
    """Base model, a registry holding every test adapter, PEFT models and merged checkpoints."""
    from transformers import Qwen3_5ForCausalLM

    base_dir, ref = causal_ckpt
    root = tmp_path_factory.mktemp("adapters")
    model = load_model(base_dir, progress=False)
    registry = AdapterRegistry(model, max_loras=len(ADAPTER_SPECS), max_lora_rank=16)
    peft, merged = {}, {}
    for i, (name, spec) in enumerate(ADAPTER_SPECS.items()):
        peft[name] = peft_adapter(ref, root / name, seed=10 + i, **spec)
        registry.load(name, root / name)
        merge_adapter(base_dir, root / name, root / f"{name}-merged", progress=False)
        merged[name] = Qwen3_5ForCausalLM.from_pretrained(root / f"{name}-merged").eval()
    return model, registry, peft, merged, ref


def run_alone(model, registry, adapter, ids):
    runner = CachedRunner(model, num_slots=1, num_pages=len(ids) // 16 + 2, adapters=registry)
    seq = runner.add(adapter)
    try:
        return runner.step([(seq, ids)], all_logits=True)[0]
    finally:
        runner.release(seq)


@pytest.mark.parametrize("n", LENGTHS, ids=lambda n: f"len{n}")
@pytest.mark.parametrize("name", list(ADAPTER_SPECS))
def test_dynamic_equals_peft_equals_merged(setup, name, n):
    model, registry, peft, merged, ref = setup
    ids = random_ids(n, model.config.vocab_size, seed=n + 1)
    with lora_backend(model, "masked" if n in (129, 2048) else "grouped"):  # also the masked path the GPU uses
        ours = run_alone(model, registry, name, ids)
    with_peft, with_merged = hf_logits(peft[name], ids), hf_logits(merged[name], ids)
    assert torch.isfinite(ours).all()
    # the two transformers oracles must agree among themselves, or this case cannot resolve ATOL
    assert (with_peft - with_merged).abs().max().item() <= ATOL / 2
    assert (ours - with_peft).abs().max().item() <= ATOL
    assert (ours - with_merged).abs().max().item() <= ATOL
    # and the adapter really does something
    assert (ours - hf_logits(ref, ids)).abs().max().item() > 1e-2


def test_merged_directory_is_complete(setup, causal_ckpt, tmp_path):
    base_dir = causal_ckpt[0]
    model, registry, *_ = setup
    out = merge_adapter(base_dir, registry.get("gdn_attn").path, tmp_path / "m", progress=False)
    assert {p.name for p in base_dir.iterdir()} == {p.name for p in out.iterdir()}
    ids = random_ids(50, model.config.vocab_size, seed=3)
    merged = run_alone(load_model(out, progress=False), None, None, ids)
    assert (merged - run_alone(model, registry, "gdn_attn", ids)).abs().max().item() <= ATOL


@pytest.mark.parametrize("backend", ["grouped", "masked"])
def test_mixed_batch_equals_each_request_alone(setup, backend):
    """Three adapters (different ranks / targets, one rsLoRA) and base requests in one batch,
    prefill (with chunks) and decode together."""
    model, registry, *_ = setup
    with lora_backend(model, backend):
        check_mixed_batch(model, registry)


def check_mixed_batch(model, registry) -> None:
    plan = [
        ("gdn_attn", 130),
        (None, 64),
        ("rs_mlp", 1),
        ("all_linear", 257),
        (None, 5),
        ("gdn_attn", 33),
        ("regex", 70),
        ("rs_mlp", 200),
    ]
    prompts = [random_ids(n, model.config.vocab_size, seed=100 + i) for i, (_, n) in enumerate(plan)]
    decode = [random_ids(6, model.config.vocab_size, seed=200 + i) for i in range(len(plan))]

    runner = CachedRunner(model, num_slots=len(plan), num_pages=256, adapters=registry)
    seqs = [runner.add(adapter) for adapter, _ in plan]
    # step 1: half of each prompt; step 2: the rest; then 6 decode steps, all sequences together
    got = [[] for _ in plan]
    halves = [(p[: len(p) // 2], p[len(p) // 2 :]) for p in prompts]
    firsts = [(s, h[0]) for s, h in zip(seqs, halves, strict=True) if h[0]]
    for (s, _), lg in zip(firsts, runner.step(firsts, all_logits=True), strict=True):
        got[seqs.index(s)].append(lg)
    for i, lg in enumerate(runner.step([(s, h[1]) for s, h in zip(seqs, halves, strict=True)], all_logits=True)):
        got[i].append(lg)
    for t in range(6):
        for i, lg in enumerate(runner.step([(s, [decode[i][t]]) for i, s in enumerate(seqs)])):
            got[i].append(lg[None])
    for i, (adapter, _) in enumerate(plan):
        alone = run_alone(model, registry, adapter, prompts[i] + decode[i])
        batched = torch.cat(got[i])
        assert (batched - alone[: batched.shape[0]]).abs().max().item() <= ATOL, plan[i]

"""Adapter files: both key prefixes, fused-slice placement, and a clear refusal for everything else."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hylora.adapters.files import AdapterError, read_adapter
from hylora.adapters.registry import AdapterRegistry
from hylora.generate import CachedRunner
from hylora.lora import LoRABatch
from hylora.model.loader import load_model
from tests.helpers import hf_logits, random_ids
from tests.lora_helpers import peft_adapter

TARGETS = ["in_proj_qkv", "in_proj_a", "q_proj", "down_proj"]


@pytest.fixture(scope="module")
def twin_checkpoints(causal_ckpt, tmp_path_factory):
    """The same text weights as a CausalLM and as a VL wrapper, and one adapter saved by PEFT from
    each (same LoRA values, the two key prefixes)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from tests.conftest import VISION_CONFIG

    causal_dir, causal = causal_ckpt
    root = tmp_path_factory.mktemp("twins")
    vl = Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(text_config=causal.config.to_dict(), vision_config=VISION_CONFIG)
    ).eval()
    vl.model.language_model.load_state_dict(causal.model.state_dict())
    vl.lm_head.load_state_dict(causal.lm_head.state_dict())
    vl.save_pretrained(root / "vl")

    causal_peft = peft_adapter(causal, root / "from_causal", seed=5, r=4, lora_alpha=8, target_modules=TARGETS)
    from peft import LoraConfig, get_peft_model

    vl_peft = get_peft_model(vl, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    src = dict(causal_peft.named_parameters())
    with torch.no_grad():
        for name, p in vl_peft.named_parameters():
            if "lora_" in name:
                p.copy_(src[name.replace("model.language_model.", "model.")])
    vl_peft.save_pretrained(root / "from_vl")
    keys = load_file(root / "from_vl" / "adapter_model.safetensors")
    assert all(".language_model.layers." in k for k in keys)
    return (
        {"causal": causal_dir, "vl": root / "vl"},
        {"causal": root / "from_causal", "vl": root / "from_vl"},
        causal_peft,
    )


def test_same_adapter_from_causal_lm_and_vl_wrapper(twin_checkpoints):
    bases, adapters, causal_peft = twin_checkpoints
    ids = random_ids(90, 320, seed=1)
    expected = hf_logits(causal_peft, ids)
    for base_layout, base_dir in bases.items():
        model = load_model(base_dir, progress=False)
        registry = AdapterRegistry(model, max_loras=2, max_lora_rank=8)
        runner = CachedRunner(model, num_slots=3, num_pages=32, adapters=registry)
        plain = runner.step([(runner.add(), ids)], all_logits=True)[0]
        for adapter_layout, adapter_dir in adapters.items():
            registry.load(adapter_layout, adapter_dir)
            got = runner.step([(runner.add(adapter_layout), ids)], all_logits=True)[0]
            where = f"{adapter_layout} adapter on {base_layout} base"
            assert (got - plain).abs().max().item() > 1e-2, f"{where}: adapter had no effect"
            assert (got - expected).abs().max().item() <= 1e-4, where


def test_absent_slice_contributes_exactly_zero(causal_ckpt, tmp_path):
    """An adapter on in_proj_qkv only leaves the in_proj_z rows of the fused GEMM bit-identical."""
    base_dir, ref = causal_ckpt
    peft_adapter(ref, tmp_path / "a", seed=2, r=4, target_modules=["in_proj_qkv", "gate_proj"])
    model = load_model(base_dir, progress=False)
    registry = AdapterRegistry(model, max_loras=2, max_lora_rank=4)
    lease = registry.acquire(registry.load("a", tmp_path / "a").name)
    x = torch.randn(9, model.config.hidden_size)
    lora = LoRABatch.build([lease.slot, -1], [5, 4], "cpu")
    for linear, untouched in [
        (model.layers[0].linear_attn.in_proj, "in_proj_z"),
        (model.layers[0].mlp.gate_up_proj, "up_proj"),
    ]:
        with_lora, base = linear(x, lora), linear(x)
        start, rows = linear.slice_offsets[list(linear.slices).index(untouched)]
        assert torch.equal(with_lora[:, start : start + rows], base[:, start : start + rows])
        assert torch.equal(with_lora[5:], base[5:])  # base rows of the batch untouched
        assert not torch.equal(with_lora[:5], base[:5])


# --- refusals --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_adapter(causal_ckpt, tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "a"
    peft_adapter(causal_ckpt[1], path, seed=3, r=4, target_modules=["in_proj_qkv", "o_proj"])
    return path


def edited(good, tmp_path, config=None, tensors=None):
    path = tmp_path / "edited"
    shutil.copytree(good, path)
    if config:
        cfg = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps(config(cfg)))
    if tensors:
        t = load_file(path / "adapter_model.safetensors")
        save_file(tensors(t), path / "adapter_model.safetensors")
    return path


def read(path, causal_ckpt):
    return read_adapter(path, load_model(causal_ckpt[0], progress=False).config)


def _rename(old, new):
    return lambda t: {k.replace(old, new): v for k, v in t.items()}


REFUSALS = {
    "pickle": (None, None, "only pickle weights .*adapter_model.bin.* safetensors only"),
    "dora": (lambda c: c | {"use_dora": True}, None, "DoRA"),
    "modules_to_save": (lambda c: c | {"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    "bias": (lambda c: c | {"bias": "lora_only"}, None, "LoRA bias 'lora_only' is not supported"),
    "conv1d": (None, _rename("in_proj_qkv", "conv1d"), "conv1d is not supported"),
    "vision": (
        None,
        _rename("model.layers.0.linear_attn.in_proj_qkv", "model.visual.blocks.0.attn.qkv"),
        "vision tower",
    ),
    "unmatched": (None, _rename("layers.0.linear_attn", "layers.0.mixer"), "match no projection"),
    "wrong_layer_kind": (
        None,
        _rename("layers.0.linear_attn.in_proj_qkv", "layers.0.self_attn.q_proj"),
        "targets self_attn, but layer 0 is linear_attention",
    ),
    "shape": (
        None,
        lambda t: {k: (v[:, :-1].contiguous() if "lora_A" in k else v) for k, v in t.items()},
        r"lora_A \[4, 63\].*needs lora_A \[r, 64\]",
    ),
    "rank": (lambda c: c | {"r": 8}, None, "has rank 4, adapter_config.json says 8"),
    "zero": (
        None,
        lambda t: {k: (torch.zeros_like(v) if "lora_B" in k else v) for k, v in t.items()},
        "would change nothing",
    ),
    "nan": (None, lambda t: {k: (v * float("nan") if "lora_B" in k else v) for k, v in t.items()}, "NaN"),
    "nothing": (None, lambda t: {"other": torch.ones(1)}, "match no projection"),
    "target_without_tensors": (
        lambda c: c | {"target_modules": ["in_proj_qkv", "o_proj", "up_proj"]},
        None,
        "targets .* modules with no tensors.*up_proj",
    ),
    "tensors_not_targeted": (
        lambda c: c | {"target_modules": ["in_proj_qkv"]},
        None,
        "does not target: .*o_proj",
    ),
    "not_lora": (lambda c: c | {"peft_type": "IA3"}, None, "peft_type 'IA3'"),
    # an update too small to change anything would serve the base model under the adapter's name
    "alpha_zero": (lambda c: c | {"lora_alpha": 0}, None, "its update scale·B·A is at most 0 .*would change nothing"),
    "alpha_pattern_zero": (
        lambda c: c | {"alpha_pattern": {"in_proj_qkv": 0, "o_proj": 0}},
        None,
        "would change nothing and serve the base model",
    ),
    "tiny_b": (None, lambda t: {k: (v * 1e-30 if "lora_B" in k else v) for k, v in t.items()}, "would change nothing"),
    # one that overflows (or swamps the base weights) would serve garbage or fail every request
    "alpha_huge": (lambda c: c | {"lora_alpha": 1e308}, None, r"update scale·B·A can reach .*check lora_alpha"),
    "b_huge": (
        None,
        lambda t: {k: (torch.full_like(v, 3e38) if "lora_B" in k else v) for k, v in t.items()},
        r"update scale·B·A can reach [0-9.]+e\+38",
    ),
    # PEFT never writes both spellings; one would silently replace the other
    "two_spellings": (
        None,
        lambda t: t | {k.removeprefix("base_model.model."): v * 2 for k, v in t.items()},
        "are the same weight; keep one of them",
    ),
    "activated_lora": (lambda c: c | {"alora_invocation_tokens": [5, 6]}, None, "alora_invocation_tokens .*"),
    "trainable_tokens": (lambda c: c | {"trainable_token_indices": [1]}, None, "trainable_token_indices"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_problem(case, good_adapter, causal_ckpt, tmp_path):
    config, tensors, message = REFUSALS[case]
    path = edited(good_adapter, tmp_path, config, tensors)
    if case == "pickle":
        (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    with pytest.raises(AdapterError, match=message):
        read(path, causal_ckpt)


def test_missing_directory_and_config(causal_ckpt, tmp_path):
    with pytest.raises(AdapterError, match="not a directory"):
        read(tmp_path / "nope", causal_ckpt)
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read(tmp_path / "empty", causal_ckpt)


def test_adapter_for_another_model_size_is_refused(causal_ckpt, tmp_path):
    from tests.conftest import write_causal

    other = write_causal(tmp_path / "big", hidden_size=96)
    peft_adapter(other, tmp_path / "a", seed=1, r=4, target_modules=["in_proj_qkv"])
    with pytest.raises(AdapterError, match="in_proj_qkv has lora_A \\[4, 96\\]"):
        read(tmp_path / "a", causal_ckpt)


def test_rank_above_max_lora_rank_is_refused(good_adapter, causal_ckpt):
    registry = AdapterRegistry(load_model(causal_ckpt[0], progress=False), max_loras=1, max_lora_rank=2)
    with pytest.raises(AdapterError, match="rank 4, above max_lora_rank 2"):
        registry.load("a", good_adapter)


def test_merge_vl_checkpoint_keeps_layout_and_vision(twin_checkpoints, tmp_path):
    """`hylora merge` on a VL checkpoint: same files and keys, vision tower untouched, and
    transformers' VL class loads it with the adapter's effect."""
    import subprocess
    import sys

    from transformers import Qwen3_5ForConditionalGeneration

    bases, adapters, causal_peft = twin_checkpoints
    out = tmp_path / "merged"
    run = subprocess.run(
        [sys.executable, "-m", "hylora", "merge", str(bases["vl"]), str(adapters["causal"]), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    before, after = load_file(bases["vl"] / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".language_model." in k for k in changed)
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("model.visual."))
    merged = Qwen3_5ForConditionalGeneration.from_pretrained(out).eval()
    ids = random_ids(70, 320, seed=8)
    assert (hf_logits(merged, ids) - hf_logits(causal_peft, ids)).abs().max().item() <= 1e-4


def test_merge_refuses_to_overwrite(twin_checkpoints):
    from hylora.adapters.merge import merge_adapter

    bases, adapters, _ = twin_checkpoints
    with pytest.raises(ValueError, match="must differ"):
        merge_adapter(bases["vl"], adapters["vl"], bases["vl"])

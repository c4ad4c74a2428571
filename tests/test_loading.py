"""Checkpoint loading: both key layouts, shards, dtypes, and clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hylora.config import ConfigError
from hylora.model.loader import CheckpointError, load_model
from tests.helpers import hylora_logits, random_ids


def rewrite(src, dst, edit_tensors=None, edit_config=None):
    """Copy a checkpoint directory, editing its tensors and config."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    if edit_tensors:
        tensors = edit_tensors(tensors)
    save_file(tensors, dst / "model.safetensors")
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(edit_config(cfg)))
    return dst


def to_vl_layout(tensors):
    return {
        ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v for k, v in tensors.items()
    } | {"model.visual.patch_embed.proj.weight": torch.zeros(4, 3)}


def to_vl_config(cfg):
    return {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": cfg,
        "vision_config": {"depth": 1},
    }


def test_both_key_layouts_give_identical_logits(causal_ckpt, tmp_path):
    src, _ = causal_ckpt
    vl = rewrite(src, tmp_path / "vl", to_vl_layout, to_vl_config)
    ids = random_ids(150, 320, seed=21)
    a = hylora_logits(load_model(src, progress=False), ids)
    b = hylora_logits(load_model(vl, progress=False), ids)
    assert torch.equal(a, b)


def test_sharded_checkpoint(causal_ckpt, tmp_path):
    src, ref = causal_ckpt
    ref.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ids = random_ids(70, 320, seed=22)
    assert torch.equal(
        hylora_logits(load_model(tmp_path, progress=False), ids),
        hylora_logits(load_model(src, progress=False), ids),
    )


def test_missing_tensor_is_named(causal_ckpt, tmp_path):
    key = "model.layers.2.linear_attn.in_proj_b.weight"
    bad = rewrite(causal_ckpt[0], tmp_path / "m", lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(CheckpointError, match="missing tensors 'layers.2.linear_attn.in_proj_b.weight'"):
        load_model(bad, progress=False)


def test_misshaped_tensor_is_named(causal_ckpt, tmp_path):
    key = "model.layers.3.self_attn.q_proj.weight"
    bad = rewrite(causal_ckpt[0], tmp_path / "m", lambda t: t | {key: t[key][:-1]})
    with pytest.raises(CheckpointError, match=r"'model.layers.3.self_attn.q_proj.weight' has shape \[255, 64\]"):
        load_model(bad, progress=False)


def test_unexpected_tensor_is_named(causal_ckpt, tmp_path):
    bad = rewrite(causal_ckpt[0], tmp_path / "m", lambda t: t | {"model.layers.0.extra.weight": torch.ones(2)})
    with pytest.raises(CheckpointError, match="unexpected tensors 'model.layers.0.extra.weight'"):
        load_model(bad, progress=False)


def test_pickle_weights_are_refused_with_a_hint(causal_ckpt, tmp_path):
    shutil.copytree(causal_ckpt[0], tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").rename(tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin: pickle weights are not loaded"):
        load_model(tmp_path / "m", progress=False)


def test_unsupported_model_type(causal_ckpt, tmp_path):
    bad = rewrite(causal_ckpt[0], tmp_path / "m", edit_config=lambda c: c | {"model_type": "qwen3_5_moe"})
    with pytest.raises(ConfigError, match="MoE variant is not supported"):
        load_model(bad, progress=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_load_stays_close(causal_ckpt, dtype):
    ids = random_ids(100, 320, seed=23)
    full = hylora_logits(load_model(causal_ckpt[0], progress=False), ids)
    half_model = load_model(causal_ckpt[0], dtype=dtype, progress=False)
    assert half_model.layers[0].mlp.gate_up_proj.weight.dtype == dtype
    half = hylora_logits(half_model, ids)
    assert torch.isfinite(half).all()
    rel = (half - full).norm() / full.norm()
    assert rel < 3e-2


@pytest.mark.parametrize(
    "name",
    [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "video_preprocessor_config.json",
    ],
)
def test_a_damaged_json_file_of_the_model_is_named(demo_dir, tmp_path, name):
    """A truncated copy of any of the model directory's JSON files stops the start with its path, not a
    bare `Expecting value` (which file?) or a traceback."""
    import argparse

    from hylora.server.serve import add_serve_args, build_state

    model = tmp_path / "model"
    shutil.copytree(demo_dir, model)
    (model / name).write_text('{"eos_token_id": ')
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    with pytest.raises(ValueError, match=rf"{model / name} could not be read as JSON .*is the copy complete"):
        build_state(parser.parse_args([str(model), "--device", "cpu", "--dtype", "float32"]))
    (model / name).write_text("[]")
    with pytest.raises(ValueError, match=rf"{model / name}: expected a JSON object, found list"):
        build_state(parser.parse_args([str(model), "--device", "cpu", "--dtype", "float32"]))

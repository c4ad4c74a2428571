"""LoRA on the vision tower and merger (PEFT `model.visual.*` keys, the Conv3d patch embedding included):
applied dynamically per item == transformers + PEFT merged, several adapters and base in one tower call,
folded by `hylora merge`, refused clearly where it cannot apply."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hylora.adapters.files import AdapterError, read_adapter
from hylora.adapters.merge import merge_adapter
from hylora.adapters.registry import AdapterRegistry
from hylora.config import ModelConfig
from hylora.generate import CachedRunner
from hylora.model.loader import load_model
from hylora.model.mrope import mrope_positions
from hylora.model.multimodal import placeholder_embeds
from hylora.model.vision import VisionTower
from tests.lora_helpers import TOWER_ADAPTER_SPECS, lora_backend, peft_adapter
from tests.vl_helpers import build_prompt, hf_vl_logits, pixels

TOWER_ATOL = 1e-5  # fp32 tower output
LOGITS_ATOL = 1e-4
GRIDS = [(1, 4, 4), (2, 6, 8), (1, 8, 12), (3, 4, 6)]


@pytest.fixture(scope="module")
def setup(vl_media_ckpt, tmp_path_factory):
    """Our VL model with a registry holding every tower adapter (all on the device), and per adapter
    transformers + PEFT merged (`merge_and_unload`) as the oracle."""
    base_dir, ref = vl_media_ckpt
    root = tmp_path_factory.mktemp("tower_adapters")
    model = load_model(base_dir, progress=False, vision=True)
    registry = AdapterRegistry(model, max_loras=len(TOWER_ADAPTER_SPECS), max_lora_rank=8)
    merged, slots = {}, {}
    for i, (name, spec) in enumerate(TOWER_ADAPTER_SPECS.items()):
        peft = peft_adapter(ref, root / name, seed=70 + i, **spec)
        merged[name] = peft.merge_and_unload().eval()
        registry.load(name, root / name)
        slots[name] = registry.acquire(name).slot
    return model, registry, merged, slots, ref, root


@torch.no_grad()
def ours(tower: VisionTower, grids, px, slots=None) -> torch.Tensor:
    return tower(px, torch.tensor(grids), slots)


@torch.no_grad()
def theirs(hf_model, grids, px) -> torch.Tensor:
    return hf_model.model.visual(px, grid_thw=torch.tensor(grids)).pooler_output


def test_adapter_files_hold_tower_keys(setup):
    *_, root = setup
    keys = {name: load_file(root / name / "adapter_model.safetensors") for name in TOWER_ADAPTER_SPECS}
    conv = keys["explicit"]["base_model.model.model.visual.patch_embed.proj.lora_A.weight"]
    assert conv.shape == (4, 3, 2, 16, 16)  # PEFT's Conv3d LoRA: A is a conv kernel, B a 1x1x1 conv
    assert keys["explicit"]["base_model.model.model.visual.patch_embed.proj.lora_B.weight"].shape == (32, 4, 1, 1, 1)
    assert not any("patch_embed" in k for k in keys["all_linear"])  # all-linear: nn.Linear only
    assert any("merger.linear_fc2" in k for k in keys["all_linear"])
    assert not any(".language_model." in k for k in keys["tower_only"])


@pytest.mark.parametrize("backend", ["grouped", "masked"])
@pytest.mark.parametrize("name", list(TOWER_ADAPTER_SPECS))
def test_tower_equals_peft_merged(setup, name, backend):
    model, registry, merged, slots, ref, _ = setup
    assert registry.get(name).has_tower_lora
    px = pixels(GRIDS, seed=1)
    with lora_backend(model, backend):
        got = ours(model.visual, GRIDS, px, [slots[name]] * len(GRIDS))
    err = (got - theirs(merged[name], GRIDS, px)).abs().max().item()
    assert err <= TOWER_ATOL, err
    assert (got - theirs(ref, GRIDS, px)).abs().max().item() > 1e-2  # the tower LoRA really does something


@pytest.mark.parametrize("backend", ["grouped", "masked"])
def test_mixed_items_in_one_call_equal_each_alone(setup, backend):
    """Items for adapters A, B, C and the base tower in one call: each == its own oracle and == itself
    encoded alone; the base items are bit-identical to a call without any adapter."""
    model, _, merged, slots, ref, _ = setup
    with lora_backend(model, backend):
        plan = [("explicit", (1, 8, 12)), (None, (2, 6, 8)), ("all_linear", (1, 4, 4)), ("tower_only", (3, 4, 6))]
        plan += [(None, (1, 4, 4)), ("explicit", (2, 4, 4)), ("all_linear", (1, 16, 6))]
        grids = [g for _, g in plan]
        item_px = [pixels([g], seed=10 + i) for i, g in enumerate(grids)]
        item_slots = [slots[a] if a else -1 for a, _ in plan]
        together = ours(model.visual, grids, torch.cat(item_px), item_slots)
        base_call = ours(model.visual, grids, torch.cat(item_px))
        sizes = [t * h * w // 4 for t, h, w in grids]
        for (adapter, grid), px, slot, got, base in zip(
            plan, item_px, item_slots, together.split(sizes), base_call.split(sizes), strict=True
        ):
            alone = ours(model.visual, [grid], px, [slot])
            assert (got - alone).abs().max().item() <= 1e-6, (adapter, grid)
            oracle = theirs(merged[adapter] if adapter else ref, [grid], px)
            assert (got - oracle).abs().max().item() <= TOWER_ATOL, (adapter, grid)
            if adapter is None:
                assert torch.equal(got, base)


def test_base_only_call_runs_no_lora(setup, monkeypatch):
    model, *_ = setup
    px = pixels(GRIDS, seed=3)
    expected = ours(model.visual, GRIDS, px)

    def fail(*args, **kwargs):
        raise AssertionError("LoRA code ran in a call without adapters")

    monkeypatch.setattr("hylora.model.vision.add_lora", fail)
    assert torch.equal(ours(model.visual, GRIDS, px, [-1] * len(GRIDS)), expected)


def test_bad_item_slots_are_refused(setup, vl_media_ckpt):
    model, *_ = setup
    px = pixels(GRIDS[:2], seed=4)
    with pytest.raises(ValueError, match="has 1 entries for 2 items"):
        ours(model.visual, GRIDS[:2], px, [0])
    with pytest.raises(ValueError, match="this tower's 3 LoRA slots"):
        ours(model.visual, GRIDS[:2], px, [0, 3])
    bare = load_model(vl_media_ckpt[0], progress=False, vision=True).visual  # no registry: no slots
    with pytest.raises(ValueError, match="this tower's 0 LoRA slots"):
        ours(bare, GRIDS[:2], px, [0, -1])


def test_image_prompt_logits_equal_peft_merged(setup):
    """Tower and decoder LoRA together: an image prompt under each adapter (and the base) gives the
    PEFT-merged VL model's logits."""
    model, registry, merged, _, ref, _ = setup
    p = build_prompt([("text", 5), ("image", (1, 8, 12)), ("text", 9), ("image", (1, 4, 4)), ("text", 4)], seed=7)
    vision = model.config.vision
    positions = mrope_positions(p.ids, vision, p.image_grids, p.video_grids)
    runner = CachedRunner(model, num_slots=len(merged) + 1, num_pages=32, adapters=registry)
    for name in [None, *merged]:
        seq = runner.add(name, positions)
        slot = seq.lora.tower_slot if seq.lora is not None else -1
        image_rows = ours(model.visual, p.image_grids, p.pixel_values, [slot] * len(p.image_grids))
        seq.embeds = placeholder_embeds(p.ids, vision, image_rows)
        got = runner.step([(seq, p.ids)], all_logits=True)[0]
        runner.release(seq)
        want = hf_vl_logits(merged[name] if name else ref, p)
        assert (got - want).abs().max().item() <= LOGITS_ATOL, name


def test_text_only_adapter_on_vl_model_leaves_the_tower_alone(setup, vl_media_ckpt, tmp_path):
    """A VL adapter without tower keys: has_tower_lora False, tower_slot -1, and its slot's tower
    stacks stay empty — even in a slot that held a tower adapter before, the tower gives the base."""
    *_, ref, root = setup
    peft_adapter(ref, tmp_path / "text", seed=5, r=4, target_modules=["in_proj_qkv", "q_proj"])
    model = load_model(vl_media_ckpt[0], progress=False, vision=True)
    registry = AdapterRegistry(model, max_loras=1, max_lora_rank=8)
    tower = registry.acquire(registry.load("tower", root / "explicit").name)
    assert tower.tower_slot == tower.slot == 0
    assert all(model.visual.blocks[1].mlp.linear_fc2.lora.present[0])
    registry.release(tower)
    lease = registry.acquire(registry.load("text", tmp_path / "text").name)  # evicts "tower" from slot 0
    assert not lease.version.has_tower_lora and lease.tower_slot == -1 and lease.slot == 0
    stack = model.visual.patch_embed.proj.lora
    assert not any(stack.present[0]) and not stack.a[0].any() and not stack.b[0].any()
    px = pixels(GRIDS, seed=6)
    assert torch.equal(ours(model.visual, GRIDS, px, [0] * len(GRIDS)), ours(model.visual, GRIDS, px))


def test_merge_folds_tower_lora(setup, vl_media_ckpt, tmp_path):
    """`hylora merge` with tower LoRA: same files and keys, the tower weights (patch embedding
    included) changed, transformers loads it and equals PEFT merged; hylora loads it and equals the
    dynamic adapter."""
    from transformers import Qwen3_5ForConditionalGeneration

    base_dir = vl_media_ckpt[0]
    model, _, merged, slots, _, root = setup
    out = merge_adapter(base_dir, root / "explicit", tmp_path / "m", progress=False)
    before, after = load_file(base_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert "model.visual.patch_embed.proj.weight" in changed and "model.visual.merger.linear_fc2.weight" in changed
    assert "model.visual.patch_embed.proj.bias" not in changed
    loaded = Qwen3_5ForConditionalGeneration.from_pretrained(out).eval()
    px = pixels(GRIDS, seed=8)
    assert (theirs(loaded, GRIDS, px) - theirs(merged["explicit"], GRIDS, px)).abs().max().item() <= TOWER_ATOL
    ours_merged = load_model(out, progress=False, vision=True).visual
    dynamic = ours(model.visual, GRIDS, px, [slots["explicit"]] * len(GRIDS))
    assert (ours(ours_merged, GRIDS, px) - dynamic).abs().max().item() <= TOWER_ATOL


# --- refusals --------------------------------------------------------------------------------

CONV_A = "base_model.model.model.visual.patch_embed.proj.lora_A.weight"
CONV_B = "base_model.model.model.visual.patch_embed.proj.lora_B.weight"


def _edit(t, key, fn):
    return t | {key: fn(t[key]).contiguous()}


REFUSALS = {
    "conv_a_flattened": (
        None,
        lambda t: _edit(t, CONV_A, lambda a: a.flatten(1)),
        r"patch_embed.proj has lora_A \[4, 1536\].*Conv3d.*lora_A \[r, 3, 2, 16, 16\] and lora_B \[32, r, 1, 1, 1\]",
    ),
    "conv_b_2d": (None, lambda t: _edit(t, CONV_B, lambda b: b.flatten(1)), r"lora_B \[32, 4\]; .*Conv3d"),
    "conv_kernel": (None, lambda t: _edit(t, CONV_A, lambda a: a[:, :, :, :8, :8]), r"lora_A \[4, 3, 2, 8, 8\]"),
    "tower_shape": (
        None,
        lambda t: _edit(t, "base_model.model.model.visual.blocks.0.attn.qkv.lora_B.weight", lambda b: b[:-1]),
        r"blocks.0.attn.qkv has lora_A \[4, 32\] and lora_B \[95, 4\]",
    ),
    "beyond_depth": (
        None,
        lambda t: {k.replace("visual.blocks.1.", "visual.blocks.7."): v for k, v in t.items()},
        r"model.visual.blocks.7.attn.proj.* match no LoRA-capable module .*vision tower \(depth 2",
    ),
    "tower_nan": (
        None,
        lambda t: _edit(t, "base_model.model.model.visual.merger.linear_fc1.lora_B.weight", lambda b: b * torch.nan),
        "merger.linear_fc1 contains NaN",
    ),
    "tower_not_targeted": (
        lambda c: c | {"target_modules": ["qkv", "attn.proj", "linear_fc1", "linear_fc2", "in_proj_qkv", "o_proj"]},
        None,
        "does not target: model.visual.patch_embed.proj",
    ),
    "tower_target_without_tensors": (
        None,
        lambda t: {k: v for k, v in t.items() if "merger.linear_fc1" not in k},
        "targets 1 modules with no tensors .*model.visual.merger.linear_fc1",
    ),
    "all_linear_string_wants_tower": (
        lambda c: c | {"target_modules": "all-linear"},
        lambda t: {k: v for k, v in t.items() if ".visual." not in k},
        "targets 10 modules with no tensors .*model.visual.blocks.0.attn.qkv",
    ),
    "mixed_prefixes": (
        None,
        lambda t: {k.replace("model.language_model.", "model."): v for k, v in t.items()},
        r"mixes key prefixes \['model.', 'model.language_model.'\]",
    ),
}


def _edited(src, dst, config=None, tensors=None):
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps(config(cfg)))
    if tensors:
        save_file(tensors(load_file(dst / "adapter_model.safetensors")), dst / "adapter_model.safetensors")
    return dst


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_problem(case, setup, tmp_path):
    model, *_, root = setup
    config, tensors, message = REFUSALS[case]
    source = root / ("all_linear" if case == "all_linear_string_wants_tower" else "explicit")
    with pytest.raises(AdapterError, match=message):
        read_adapter(_edited(source, tmp_path / "a", config, tensors), model.config)


def test_all_linear_string_config_is_read_like_peft(setup, tmp_path):
    """adapter_config.json with target_modules "all-linear" (as older PEFT saved it): the tower's
    nn.Linear modules are targets, the Conv3d patch embedding is not."""
    model, *_, root = setup
    path = _edited(root / "all_linear", tmp_path / "a", lambda c: c | {"target_modules": "all-linear"})
    adapter = read_adapter(path, model.config)
    assert len(adapter.tower) == 10 and "patch_embed.proj" not in adapter.tower


def test_tower_keys_on_a_text_only_model_are_refused(setup, causal_ckpt):
    *_, root = setup
    with pytest.raises(AdapterError, match="has LoRA on the vision tower .* this base model is text-only"):
        read_adapter(root / "tower_only", ModelConfig.from_dir(causal_ckpt[0]))
    with pytest.raises(AdapterError, match="model.visual.blocks.0.attn.proj.* text-only"):
        read_adapter(root / "explicit", ModelConfig.from_dir(causal_ckpt[0]))


def test_text_part_still_serves_on_a_tower_less_model(setup, vl_media_ckpt):
    """The VL checkpoint loaded text-only (no tower): the adapter loads, keeps has_tower_lora, and its
    decoder part equals PEFT's."""
    _, _, merged, _, _, root = setup
    model = load_model(vl_media_ckpt[0], progress=False)
    registry = AdapterRegistry(model, max_loras=1, max_lora_rank=8)
    assert registry.load("a", root / "all_linear").has_tower_lora
    p = build_prompt([("text", 40)], seed=9)
    runner = CachedRunner(model, num_slots=1, num_pages=8, adapters=registry)
    got = runner.step([(runner.add("a"), p.ids)], all_logits=True)[0]
    assert (got - hf_vl_logits(merged["all_linear"], p)).abs().max().item() <= LOGITS_ATOL

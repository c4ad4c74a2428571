"""hylora's vision tower gives transformers' `model.visual` output; loading it from the same checkpoint."""

from __future__ import annotations

import copy
import logging
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from hylora.config import ConfigError, ModelConfig
from hylora.model.loader import CheckpointError, load_model
from hylora.model.vision import VisionAttention, VisionLinear, VisionTower, _segment_runs
from tests.vl_helpers import IMAGE, VIDEO, VISION_END, VISION_START, pixels

ATOL = 1e-5
GRIDS = {
    "img2x2": (1, 2, 2),
    "img4x4": (1, 4, 4),
    "img8x12_wide": (1, 8, 12),
    "img16x6_tall": (1, 16, 6),
    "img10x10_table": (1, 10, 10),
    "img20x14_above_table": (1, 20, 14),
    "vid1x4x6": (1, 4, 6),
    "vid2x6x8_even": (2, 6, 8),
    "vid3x4x10_odd": (3, 4, 10),
}


@pytest.fixture(scope="module")
def towers(vl_media_ckpt):
    path, ref = vl_media_ckpt
    return load_model(path, progress=False, vision=True).visual, ref.model.visual


@torch.no_grad()
def run(tower, grids: list[tuple[int, int, int]], px: torch.Tensor) -> torch.Tensor:
    if isinstance(tower, VisionTower):
        return tower(px, torch.tensor(grids))
    return tower(px, grid_thw=torch.tensor(grids)).pooler_output


@pytest.mark.parametrize("grid", GRIDS.values(), ids=GRIDS.keys())
def test_tower_matches_transformers(towers, grid):
    ours, ref = towers
    px = pixels([grid], seed=sum(grid))
    got, want = run(ours, [grid], px), run(ref, [grid], px)
    assert got.shape == (grid[0] * grid[1] * grid[2] // 4, 64)
    assert (got - want).abs().max().item() <= ATOL


def test_items_in_one_call_equal_each_alone(towers):
    ours, ref = towers
    grids = list(GRIDS.values())
    px = [pixels([g], seed=i) for i, g in enumerate(grids)]
    alone = torch.cat([run(ours, [g], x) for g, x in zip(grids, px, strict=True)])
    together = run(ours, grids, torch.cat(px))
    assert (together - alone).abs().max().item() <= 1e-6
    assert (together - run(ref, grids, torch.cat(px))).abs().max().item() <= ATOL


def gathered_attention(grids):
    """VisionAttention.forward as it was before runs: the segments grouped by length and gathered
    by row index (whatever runs it is given)."""
    starts, offset = {}, 0
    for t, h, w in grids:
        for _ in range(t):
            starts.setdefault(h * w, []).append(offset)
            offset += h * w
    segments = [torch.tensor(s)[:, None] + torch.arange(length) for length, s in sorted(starts.items())]

    def forward(self, x, cos, sin, runs, lora=None):
        n = x.shape[0]
        q, k, v = self.qkv(x, lora).reshape(n, 3, self.heads, self.head_dim).unbind(1)
        q, k = self.rotary(q, cos, sin), self.rotary(k, cos, sin)
        out = torch.empty_like(q)
        for rows in segments:
            qs, ks, vs = (t[rows].transpose(1, 2) for t in (q, k, v))
            out[rows] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
        return self.proj(out.reshape(n, -1), lora)

    return forward


def test_runs_of_segments_equal_the_gathered_segments(towers, monkeypatch):
    """Items of different sizes in one call: runs of equal-length segments break and rejoin; the
    result equals each item alone and the old per-length gather."""
    ours, _ = towers
    grids = [(1, 4, 4), (2, 6, 8), (1, 4, 4), (1, 4, 4), (3, 4, 6), (1, 6, 4)]
    assert _segment_runs(grids) == [(0, 1, 16), (16, 2, 48), (112, 2, 16), (144, 4, 24)]
    px = [pixels([g], seed=20 + i) for i, g in enumerate(grids)]
    together = run(ours, grids, torch.cat(px))
    alone = torch.cat([run(ours, [g], x) for g, x in zip(grids, px, strict=True)])
    assert (together - alone).abs().max().item() <= 1e-6
    monkeypatch.setattr(VisionAttention, "forward", gathered_attention(grids))
    assert (together - run(ours, grids, torch.cat(px))).abs().max().item() <= 1e-6


def test_bf16_tower_follows_transformers_bf16(towers, vl_media_ckpt):
    ours_fp32, ref = towers
    ours = load_model(vl_media_ckpt[0], dtype=torch.bfloat16, progress=False, vision=True).visual
    assert ours.blocks[0].attn.qkv.weight.dtype == torch.bfloat16
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)
    grids = [(1, 8, 12), (3, 4, 10)]
    px = pixels(grids, seed=5)
    got, want, full = run(ours, grids, px), run(ref16, grids, px).float(), run(ours_fp32, grids, px)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2
    assert ((got.float() - full).norm() / full.norm()).item() < 3e-2


def test_tower_parameters_mirror_checkpoint_keys(vl_media_ckpt):
    path, _ = vl_media_ckpt
    model = load_model(path, progress=False, vision=True)
    keys = {k for k in load_file(path / "model.safetensors") if k.startswith("model.visual.")}
    assert {"model." + n for n, _ in model.named_parameters() if n.startswith("visual.")} == keys
    linears = {n for n, m in model.visual.named_modules() if isinstance(m, VisionLinear)}
    assert linears == {
        "patch_embed.proj",
        "blocks.0.attn.qkv",
        "blocks.0.attn.proj",
        "blocks.0.mlp.linear_fc1",
        "blocks.0.mlp.linear_fc2",
        "blocks.1.attn.qkv",
        "blocks.1.attn.proj",
        "blocks.1.mlp.linear_fc1",
        "blocks.1.mlp.linear_fc2",
        "merger.linear_fc1",
        "merger.linear_fc2",
    }


def test_vision_config_read_from_config_json(vl_media_ckpt):
    vision = ModelConfig.from_dir(vl_media_ckpt[0]).vision
    assert (vision.image_token_id, vision.video_token_id) == (IMAGE, VIDEO)
    assert (vision.vision_start_token_id, vision.vision_end_token_id) == (VISION_START, VISION_END)
    assert (vision.depth, vision.hidden_size, vision.out_hidden_size, vision.position_grid_side) == (2, 32, 64, 10)
    assert (vision.patch_dim, vision.merge_unit, vision.gelu_approximate) == (3 * 2 * 16 * 16, 4, "tanh")


def test_vl_checkpoint_loads_text_only_by_default(vl_media_ckpt):
    assert load_model(vl_media_ckpt[0], progress=False).visual is None


def test_text_only_checkpoint_has_no_tower(causal_ckpt):
    assert ModelConfig.from_dir(causal_ckpt[0]).vision is None
    with pytest.raises(ConfigError, match="text-only checkpoint has no vision tower"):
        load_model(causal_ckpt[0], progress=False, vision=True)


def test_sharded_checkpoint_loads_the_same_tower(towers, vl_media_ckpt, tmp_path):
    vl_media_ckpt[1].save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    sharded = load_model(tmp_path, progress=False, vision=True).visual
    grids = [(1, 8, 12)]
    px = pixels(grids, seed=7)
    assert torch.equal(run(sharded, grids, px), run(towers[0], grids, px))


def _edited(src, dst, edit):
    shutil.copytree(src, dst)
    save_file(edit(load_file(dst / "model.safetensors")), dst / "model.safetensors")
    return dst


def test_missing_tower_tensor_is_named(vl_media_ckpt, tmp_path):
    key = "model.visual.blocks.1.attn.qkv.bias"
    bad = _edited(vl_media_ckpt[0], tmp_path / "m", lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(CheckpointError, match="missing tensors 'visual.blocks.1.attn.qkv.bias'"):
        load_model(bad, progress=False, vision=True)
    assert load_model(bad, progress=False).visual is None  # text-only use does not need the tower


def test_misshaped_and_unexpected_tower_tensors_are_named(vl_media_ckpt, tmp_path):
    key = "model.visual.merger.linear_fc1.weight"
    bad = _edited(vl_media_ckpt[0], tmp_path / "m", lambda t: t | {key: t[key][:, :-1].contiguous()})
    with pytest.raises(CheckpointError, match=r"'model.visual.merger.linear_fc1.weight' has shape \[128, 127\]"):
        load_model(bad, progress=False, vision=True)
    extra = _edited(vl_media_ckpt[0], tmp_path / "e", lambda t: t | {"model.visual.blocks.0.extra": torch.ones(2)})
    with pytest.raises(CheckpointError, match="unexpected tensors 'model.visual.blocks.0.extra'"):
        load_model(extra, progress=False, vision=True)


def test_bad_grids_are_refused(towers):
    ours, _ = towers
    with pytest.raises(ValueError, match="multiples of 2"):
        ours(pixels([(1, 3, 4)], seed=0), torch.tensor([[1, 3, 4]]))
    with pytest.raises(ValueError, match=r"expected \[16, 1536\]"):
        ours(pixels([(1, 4, 2)], seed=0), torch.tensor([[1, 4, 4]]))


def test_tower_attention_backend_serves_after_its_check(vl_media_ckpt):
    """`tower_attention` names torch's SDPA backend for every tower attention once its start-up check on
    the tower's strided views passed; the tower's output stays transformers' (math and CPU flash here)."""
    from hylora.kernels import KernelsConfig
    from hylora.kernels.select import select_kernels

    path, ref = vl_media_ckpt
    grids = [GRIDS["vid3x4x10_odd"], GRIDS["img8x12_wide"], GRIDS["vid2x6x8_even"]]  # several runs
    px = pixels(grids, seed=5)
    want = run(ref.model.visual, grids, px)
    for backend in ("math", "flash"):
        model = load_model(path, progress=False, vision=True)
        verdicts = select_kernels(model, 16, KernelsConfig(tower_attention=backend))
        assert verdicts["tower_attention"].implementation == backend
        assert all(m.sdpa_backend == backend for m in model.visual.modules() if isinstance(m, VisionAttention))
        torch.testing.assert_close(run(model.visual, grids, px), want, atol=ATOL, rtol=0)
    model = load_model(path, progress=False, vision=True)
    assert "tower_attention" not in select_kernels(model, 16, KernelsConfig())  # auto: torch's pick, no check
    assert all(m.sdpa_backend is None for m in model.visual.modules() if isinstance(m, VisionAttention))


def test_tower_attention_backend_that_cannot_serve_stops_startup(vl_media_ckpt, causal_ckpt, caplog):
    from hylora.kernels import KernelsConfig
    from hylora.kernels.select import select_kernels

    model = load_model(vl_media_ckpt[0], progress=False, vision=True)
    with pytest.raises(RuntimeError, match="tower_attention cudnn: torch's SDPA cannot run the vision tower's"):
        select_kernels(model, 16, KernelsConfig(tower_attention="cudnn"))
    with pytest.raises(ValueError, match="tower_attention must be one of auto, flash, cudnn, efficient, math"):
        KernelsConfig(tower_attention="fa3")
    text_only = load_model(causal_ckpt[0], progress=False)
    with caplog.at_level(logging.WARNING, logger="hylora.kernels.select"):
        assert "tower_attention" not in select_kernels(text_only, 16, KernelsConfig(tower_attention="cudnn"))
    assert "tower_attention 'cudnn': no effect, no vision tower is loaded" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused SDPA backends need a CUDA device")
@pytest.mark.parametrize("backend", ["flash", "cudnn", "efficient"])
def test_tower_attention_backends_on_the_gpu_follow_fp32(towers, vl_media_ckpt, backend):
    """Each fused backend that passes its check keeps the bf16 tower within bf16's distance of the fp32
    tower; one that cannot run the tower's views stops start-up (skipped here)."""
    from hylora.kernels import KernelsConfig
    from hylora.kernels.select import select_kernels

    ours_fp32, _ = towers
    model = load_model(vl_media_ckpt[0], dtype=torch.bfloat16, device="cuda", progress=False, vision=True)
    try:
        select_kernels(model, 16, KernelsConfig(tower_attention=backend))
    except RuntimeError as e:
        pytest.skip(str(e))
    grids = [(1, 8, 12), (3, 4, 10), (2, 6, 8)]
    px = pixels(grids, seed=5)
    got, full = run(model.visual, grids, px.cuda()).float().cpu(), run(ours_fp32, grids, px)
    assert torch.isfinite(got).all()
    assert ((got - full).norm() / full.norm()).item() < 3e-2

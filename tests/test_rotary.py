"""Interleaved M-RoPE with distinct temporal/height/width positions equals transformers'."""

from __future__ import annotations

import torch

from hylora.config import ModelConfig
from hylora.model.rotary import MRotaryEmbedding
from tests.conftest import text_config


def test_mrope_matches_transformers_on_vision_positions():
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    rope = {
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    }
    hf_cfg = Qwen3_5TextConfig(**text_config(head_dim=256, rope_parameters=rope))
    ours = MRotaryEmbedding(ModelConfig.from_hf(hf_cfg.to_dict()), "cpu")
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 5000, (3, 37), generator=g)  # T, H, W all different
    cos, sin = ours.cos_sin(positions, torch.float32)
    ref_cos, ref_sin = Qwen3_5TextRotaryEmbedding(hf_cfg)(torch.zeros(1), positions[:, None, :])
    torch.testing.assert_close(cos, ref_cos[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(sin, ref_sin[0], atol=1e-5, rtol=0)
    # each axis really drives some frequencies
    for axis in range(3):
        moved = positions.clone()
        moved[axis] += 1
        assert not torch.allclose(ours.cos_sin(moved, torch.float32)[0], cos)

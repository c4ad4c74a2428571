"""Checkpoints with an MTP layer (`mtp.*`) for the speculative-decoding tests.

`write_mtp_checkpoint` copies a test checkpoint and adds the MTP tensors under their released names:

- "random": a random draft layer — drafts are nearly always rejected; the output must not care.
- "arranged": the draft layer predicts the model's own next greedy token. The decoder's layers are
  scaled down by `layer_scale` (their output projections), so its next token is nearly a function
  of the current token's embedding, f(x) = argmax lm_head(norm(embed(x))); the MTP layer computes
  exactly f(token t+1): fc = [I | 0] passes the normed embedding, the layer adds nothing (zero
  o_proj and down_proj), and every norm has weight 0 (scale 1). layer_scale 0 gives acceptance 1;
  a small scale keeps the GDN and attention states in the logits (a wrong state shows) and makes
  some drafts fail.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

OUTPUT_PROJECTIONS = ("linear_attn.out_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight")


def mtp_tensors(
    hidden: int, cfg: dict, g: torch.Generator, arranged: bool, attention_scale: float = 0.0
) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors (a full-attention decoder layer with a gated q_proj and a dense MLP).
    An arranged layer's attention adds `attention_scale` times a random o_proj (0: nothing)."""
    heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    inter = cfg["intermediate_size"]
    shapes = {
        "self_attn.q_proj.weight": (2 * heads * head_dim, hidden),
        "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.o_proj.weight": (hidden, heads * head_dim),
        "self_attn.q_norm.weight": (head_dim,),
        "self_attn.k_norm.weight": (head_dim,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    out = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=g) * (0.1 if "norm" in name else 0.2)
        if arranged and name == "self_attn.o_proj.weight":
            t = t * attention_scale
        if arranged and name == "mlp.down_proj.weight":
            t = torch.zeros(shape)
        out[f"mtp.layers.0.{name}"] = t
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{norm}.weight"] = torch.zeros(hidden) if arranged else torch.randn(hidden, generator=g) * 0.1
    if arranged:
        out["mtp.fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    else:
        out["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) / (2 * hidden) ** 0.5
    return out


def write_mtp_checkpoint(
    src: Path, dst: Path, mode: str = "random", layer_scale: float = 0.0, seed: int = 0, attention_scale: float = 0.0
) -> Path:
    """`src` (a text test checkpoint, one safetensors file) with an MTP layer, into `dst`. An arranged
    head with `attention_scale` > 0 also draws on its attention over earlier positions (its drafts
    then depend on what its KV rows hold and on their positions)."""
    if mode not in ("random", "arranged"):
        raise ValueError(mode)
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    (weights_file,) = dst.glob("*.safetensors")
    weights = load_file(weights_file)
    g = torch.Generator().manual_seed(seed)
    if mode == "arranged":
        for key in weights:
            if key.endswith(OUTPUT_PROJECTIONS):
                weights[key] = weights[key] * layer_scale
        weights["model.norm.weight"] = torch.zeros_like(weights["model.norm.weight"])
    weights.update(
        mtp_tensors(config["hidden_size"], config, g, arranged=mode == "arranged", attention_scale=attention_scale)
    )
    save_file({k: v.contiguous() for k, v in weights.items()}, weights_file, metadata={"format": "pt"})
    return dst

"""Which checkpoint projections hylora fuses into one GEMM, and where their rows go.

One table, two users: the checkpoint loader copies each base weight into its rows of the fused
weight, and the LoRA loader puts each adapter's B slice on exactly the same rows.
"""

from __future__ import annotations

from hylora.config import LINEAR, ModelConfig

# (sub-layer, fused module) → the checkpoint modules whose output rows it stacks, in order
PACKED_MODULES: dict[tuple[str, str], tuple[str, ...]] = {
    ("linear_attn", "in_proj"): ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    ("self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"),
    ("mlp", "gate_up_proj"): ("gate_proj", "up_proj"),
}
# checkpoint module → (fused module, slice index)
PACKED_INTO: dict[tuple[str, str], tuple[str, int]] = {
    (sub, part): (fused, i) for (sub, fused), parts in PACKED_MODULES.items() for i, part in enumerate(parts)
}
# every projection of the text decoder that LoRA may target, by sub-layer
LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "linear_attn": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def locate(sublayer: str, module: str) -> tuple[str, int]:
    """Checkpoint module name → (hylora module name, output slice index)."""
    return PACKED_INTO.get((sublayer, module), (module, 0))


def projection_shapes(config: ModelConfig) -> dict[tuple[str, str], tuple[int, int]]:
    """(sub-layer, checkpoint module) → (out_features, in_features)."""
    c, h = config, config.hidden_size
    return {
        ("linear_attn", "in_proj_qkv"): (c.linear_conv_dim, h),
        ("linear_attn", "in_proj_z"): (c.linear_value_dim, h),
        ("linear_attn", "in_proj_b"): (c.linear_num_value_heads, h),
        ("linear_attn", "in_proj_a"): (c.linear_num_value_heads, h),
        ("linear_attn", "out_proj"): (h, c.linear_value_dim),
        ("self_attn", "q_proj"): (2 * c.num_attention_heads * c.head_dim, h),
        ("self_attn", "k_proj"): (c.num_key_value_heads * c.head_dim, h),
        ("self_attn", "v_proj"): (c.num_key_value_heads * c.head_dim, h),
        ("self_attn", "o_proj"): (h, c.num_attention_heads * c.head_dim),
        ("mlp", "gate_proj"): (c.intermediate_size, h),
        ("mlp", "up_proj"): (c.intermediate_size, h),
        ("mlp", "down_proj"): (h, c.intermediate_size),
    }


def layer_sublayers(config: ModelConfig, layer: int) -> tuple[str, str]:
    """The token mixer and MLP sub-layer names of decoder layer `layer`."""
    return ("linear_attn" if config.layer_types[layer] == LINEAR else "self_attn", "mlp")

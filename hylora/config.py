"""Model configuration: one normaliser from a Hugging Face config.json to what hylora needs."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hylora.json_merge import merge_json

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
LINEAR, FULL = "linear_attention", "full_attention"


class ConfigError(ValueError):
    """The model directory's config.json describes something hylora cannot serve."""


def read_json_object(path: Path) -> dict[str, Any]:
    """One of the model directory's JSON files (config.json, generation_config.json, the processors');
    ConfigError naming the file where it cannot be read or is not a JSON object (a truncated copy)."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise ConfigError(f"{path} could not be read as JSON ({e}); is the copy complete?") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


# transformers' Qwen3_5VisionConfig / Qwen3_5Config defaults: a key that config.json omits means
# what it means to transformers.
_VISION_DEFAULTS: dict[str, Any] = dict(
    depth=27,
    hidden_size=1152,
    hidden_act="gelu_pytorch_tanh",
    intermediate_size=4304,
    num_heads=16,
    in_channels=3,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=3584,
    num_position_embeddings=2304,
)
_MEDIA_TOKEN_DEFAULTS = dict(
    image_token_id=248056, video_token_id=248057, vision_start_token_id=248053, vision_end_token_id=248054
)
_VISION_ACTS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # → F.gelu(approximate=...)


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower (`model.visual.*`) and the prompt tokens that stand for its output."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    rope_theta: float
    gelu_approximate: str  # "tanh" or "none"
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:  # columns of one pixel row: C * T * p * p
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:  # patches per LLM token
        return self.spatial_merge_size**2

    @property
    def position_grid_side(self) -> int:  # the learned position table is side x side
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> VisionConfig:
        """From the VL wrapper's config dict (its `vision_config` plus the top-level token ids)."""
        v = _VISION_DEFAULTS | dict(hf.get("vision_config") or {})
        ints = {}
        for key in ("patch_size", "temporal_patch_size"):
            value = v[key]
            if isinstance(value, list | tuple):
                if len(set(value)) != 1:
                    raise ConfigError(f"vision_config.{key} {value} is not supported (only a single size)")
                value = value[0]
            ints[key] = int(value)
        act = v["hidden_act"]
        if act not in _VISION_ACTS:
            raise ConfigError(f"vision_config.hidden_act {act!r} is not supported ({', '.join(_VISION_ACTS)})")
        rope = dict(v.get("rope_parameters") or {})
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"vision rope_type {rope['rope_type']!r} is not supported (only 'axial')")
        hidden, heads, table = int(v["hidden_size"]), int(v["num_heads"]), int(v["num_position_embeddings"])
        if hidden % heads or (hidden // heads) % 4:
            raise ConfigError(f"vision hidden_size {hidden} / num_heads {heads} must be a multiple of 4")
        if math.isqrt(table) ** 2 != table:
            raise ConfigError(f"vision num_position_embeddings {table} is not a square table")
        tokens = {key: int(hf.get(key, default)) for key, default in _MEDIA_TOKEN_DEFAULTS.items()}
        return cls(
            depth=int(v["depth"]),
            hidden_size=hidden,
            intermediate_size=int(v["intermediate_size"]),
            num_heads=heads,
            in_channels=int(v["in_channels"]),
            spatial_merge_size=int(v["spatial_merge_size"]),
            out_hidden_size=int(v["out_hidden_size"]),
            num_position_embeddings=table,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            gelu_approximate=_VISION_ACTS[act],
            **ints,
            **tokens,
        )


@dataclass(frozen=True)
class QuantizationConfig:
    """A block-quantised FP8 checkpoint as Qwen and DeepSeek publish them (`quant_method: fp8`):
    e4m3 weights with one `weight_scale_inv` per (block_n x block_k) block; activations are
    quantised at run time per token and per block_k columns (`activation_scheme: dynamic`).
    Which tensors are FP8 is read from the checkpoint (a weight with a `weight_scale_inv` beside it);
    `modules_to_not_convert` is kept for the record."""

    method: str  # "fp8"
    weight_block_size: tuple[int, int]  # (block_n, block_k): rows x columns per scale
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_hf(cls, q: dict[str, Any]) -> QuantizationConfig:
        method = q.get("quant_method")
        if method != "fp8":
            raise ConfigError(
                f"quantization_config.quant_method {method!r} is not supported: hylora serves unquantised "
                "checkpoints and block-quantised FP8 ones (quant_method 'fp8', the format of Qwen's -FP8 releases)"
            )
        if q.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"quantization_config.fmt {q['fmt']!r} is not supported (only e4m3)")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise ConfigError(
                f"quantization_config.activation_scheme {q['activation_scheme']!r} is not supported "
                "(only 'dynamic': activation scales computed per token at run time)"
            )
        block = q.get("weight_block_size")
        if not (isinstance(block, list | tuple) and len(block) == 2 and all(int(b) > 0 for b in block)):
            raise ConfigError(
                f"quantization_config.weight_block_size {block!r} is not supported: FP8 needs block scales, "
                "e.g. [128, 128] (per-tensor and per-channel FP8 checkpoints are not supported)"
            )
        return cls(
            method="fp8",
            weight_block_size=(int(block[0]), int(block[1])),
            modules_to_not_convert=tuple(q.get("modules_to_not_convert") or ()),
        )

    def to_hf(self) -> dict[str, Any]:
        return {
            "quant_method": self.method,
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.weight_block_size),
            "modules_to_not_convert": list(self.modules_to_not_convert),
        }


@dataclass(frozen=True)
class YarnScaling:
    """YaRN context extension (`rope_parameters.rope_type: yarn`, as Qwen3.5 / Qwen3.6 model cards give it
    for contexts past 262144 tokens): interpolated low frequencies, and cos / sin scaled by `attention_factor`."""

    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    @classmethod
    def from_rope(cls, rope: dict[str, Any], max_position_embeddings: int) -> YarnScaling:
        original = int(rope.get("original_max_position_embeddings") or max_position_embeddings)
        factor = rope.get("factor")
        factor = float(max_position_embeddings / original if factor is None else factor)
        if not factor >= 1:
            raise ConfigError(f"rope_parameters.factor must be at least 1 for YaRN, got {factor}")
        attention_factor = rope.get("attention_factor")
        if attention_factor is None:  # the paper's 0.1 ln(s) + 1, or DeepSeek's ratio of two such
            mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = _yarn_mscale(factor)
        return cls(
            factor=factor,
            original_max_position_embeddings=original,
            attention_factor=float(attention_factor),
            beta_fast=float(rope.get("beta_fast") or 32),
            beta_slow=float(rope.get("beta_slow") or 1),
            truncate=bool(rope.get("truncate", True)),
        )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """The text decoder of a Qwen3.5 / Qwen3.6 hybrid model (Gated DeltaNet + gated attention)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, int, int]
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    yarn: YarnScaling | None = None  # YaRN-scaled rotary (rope_type "yarn"); None: plain M-RoPE
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: torch.dtype = torch.float32
    # True for the vision-language wrapper (`model_type: qwen3_5`), whose text weights live
    # under `model.language_model.`.
    is_multimodal: bool = False
    vision: VisionConfig | None = None  # None for a text-only checkpoint
    mtp_num_hidden_layers: int = 0  # multi-token-prediction layers (`mtp.*`) the checkpoint ships
    quantization: QuantizationConfig | None = None  # None: unquantised weights

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def max_context(self) -> int:
        """The longest context the rotary was trained or scaled for: max_position_embeddings, or with YaRN
        original_max_position_embeddings x factor (vLLM's rule)."""
        if self.yarn is None:
            return self.max_position_embeddings
        return int(self.yarn.original_max_position_embeddings * self.yarn.factor)

    @property
    def linear_key_dim(self) -> int:  # Hk * dk
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:  # Hv * dv
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:  # channels of the depthwise conv: [q | k | v]
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @classmethod
    def from_dir(cls, model_dir: str | Path, overrides: dict[str, Any] | None = None) -> ModelConfig:
        """The model directory's config.json, with `overrides` (vLLM's --hf-overrides) merged over it key by
        key (nested objects merged, other values replaced)."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir}: no config.json (is this a Hugging Face model directory?)")
        hf = read_json_object(path)
        text = hf.get("text_config")
        if isinstance(text, dict):  # a VL checkpoint's decoder reads text_config: top-level keys would do nothing
            misplaced = sorted(k for k in overrides or {} if k not in hf and k in text)
            if misplaced:
                raise ConfigError(
                    f"--hf-overrides: {misplaced} belong to this checkpoint's text_config; give them as "
                    f'{{"text_config": {{"{misplaced[0]}": ...}}}}'
                )
        return cls.from_hf(merge_json(hf, overrides or {}))

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Normalise a Hugging Face config dict (VL wrapper or text-only)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported; "
                f"hylora serves {', '.join(SUPPORTED_MODEL_TYPES)}"
                + (" (the MoE variant is not supported yet)" if model_type and "moe" in model_type else "")
            )
        is_multimodal = model_type == "qwen3_5"
        text = dict(hf.get("text_config") or {}) if is_multimodal else dict(hf)
        if is_multimodal and not text:
            raise ConfigError("config.json of model_type 'qwen3_5' has no text_config")

        def need(key: str) -> Any:
            if key not in text:
                raise ConfigError(f"config.json: text config lacks {key!r}")
            return text[key]

        num_layers = int(need("num_hidden_layers"))
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
        if len(layer_types) != num_layers or set(layer_types) - {LINEAR, FULL}:
            raise ConfigError(f"config.json: layer_types {layer_types} do not fit {num_layers} layers")

        if text.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {text['hidden_act']!r} is not supported (only 'silu')")
        if text.get("attention_bias", False):
            raise ConfigError("attention_bias=True is not supported")

        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise ConfigError(f"rope_type {rope_type!r} is not supported (only 'default' and 'yarn' M-RoPE)")
        max_positions = int(text.get("max_position_embeddings", 32768))
        yarn = YarnScaling.from_rope(rope, max_positions) if rope_type == "yarn" else None
        rope_theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        head_dim = int(text.get("head_dim") or need("hidden_size") // need("num_attention_heads"))
        rotary_dim = int(head_dim * partial)
        mrope = tuple(int(s) for s in rope.get("mrope_section", [11, 11, 10]))
        if len(mrope) != 3 or sum(mrope) != rotary_dim // 2:
            raise ConfigError(
                f"mrope_section {list(mrope)} must have 3 entries summing to rotary_dim/2 = {rotary_dim // 2}"
            )
        if rope.get("mrope_interleaved", True) is False:
            raise ConfigError("only the interleaved M-RoPE layout (mrope_interleaved=true) is supported")

        hk, hv = int(need("linear_num_key_heads")), int(need("linear_num_value_heads"))
        if hv % hk:
            raise ConfigError(f"linear_num_value_heads {hv} must be a multiple of linear_num_key_heads {hk}")
        nh, nkv = int(need("num_attention_heads")), int(need("num_key_value_heads"))
        if nh % nkv:
            raise ConfigError(f"num_attention_heads {nh} must be a multiple of num_key_value_heads {nkv}")

        eos = hf.get("eos_token_id", text.get("eos_token_id"))
        eos_ids = tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else ()
        dtype_name = hf.get("dtype") or hf.get("torch_dtype") or text.get("dtype") or "float32"
        tie = bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            layer_types=tuple(layer_types),
            num_attention_heads=nh,
            num_key_value_heads=nkv,
            head_dim=head_dim,
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            mrope_section=mrope,  # type: ignore[arg-type]
            linear_num_key_heads=hk,
            linear_num_value_heads=hv,
            linear_key_head_dim=int(need("linear_key_head_dim")),
            linear_value_head_dim=int(need("linear_value_head_dim")),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=tie,
            max_position_embeddings=max_positions,
            yarn=yarn,
            eos_token_ids=tuple(int(e) for e in eos_ids),
            checkpoint_dtype=parse_dtype(str(dtype_name)),
            is_multimodal=is_multimodal,
            vision=VisionConfig.from_hf(hf) if is_multimodal else None,
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", hf.get("mtp_num_hidden_layers", 0)) or 0),
            quantization=_quantization(hf, text),
        )


def _quantization(hf: dict[str, Any], text: dict[str, Any]) -> QuantizationConfig | None:
    q = hf.get("quantization_config") or text.get("quantization_config")
    return QuantizationConfig.from_hf(q) if q else None


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' / 'torch.bfloat16' / 'bf16' → torch.bfloat16."""
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; use one of float32, bfloat16, float16")
    return _DTYPES[key]

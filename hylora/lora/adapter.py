"""Read a PEFT LoRA adapter directory and map every tensor onto this base model, or refuse it.

No silent misses: each `lora_A` / `lora_B` tensor maps to exactly one (layer, projection) of the
base model, or loading fails naming the keys; shapes are checked against the base; the modules
adapter_config.json targets must be exactly the modules the weights file holds; an adapter that
would change nothing is refused.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from hylora.config import ModelConfig
from hylora.model.packing import LORA_TARGETS, layer_sublayers, projection_shapes

WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT module path of a text-decoder projection, from Qwen3_5ForCausalLM or the VL wrapper
MODULE_RE = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.(linear_attn|self_attn|mlp)\.(\w+)$")
KEY_RE = re.compile(r"^(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)\.weight$")


class AdapterError(ValueError):
    """The adapter cannot be served on this base model; the message says why and what to fix."""


@dataclass
class LoRAWeight:
    a: torch.Tensor  # [r, in] fp32
    b: torch.Tensor  # [out, r] fp32
    scale: float  # alpha / r, or alpha / sqrt(r) with rsLoRA


@dataclass
class LoRAAdapter:
    name: str
    path: Path
    weights: dict[tuple[int, str, str], LoRAWeight]  # (layer, sub-layer, checkpoint module)

    @property
    def max_rank(self) -> int:
        return max(w.a.shape[0] for w in self.weights.values())

    @property
    def num_parameters(self) -> int:
        return sum(w.a.numel() + w.b.numel() for w in self.weights.values())


def read_adapter(path: str | Path, config: ModelConfig, name: str | None = None) -> LoRAAdapter:
    path = Path(path)
    name = name or path.name
    cfg = _read_config(path)
    tensors = _read_tensors(path)

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    unmatched = []
    for key, tensor in tensors.items():
        m = KEY_RE.match(key)
        if m is None:
            _refuse_known_unsupported(key)
            unmatched.append(key)
            continue
        module_path, which = m.groups()
        _refuse_known_unsupported(module_path)
        if MODULE_RE.match(module_path) is None:
            unmatched.append(key)
            continue
        pairs.setdefault(module_path, {})[which] = tensor
    if unmatched:
        raise AdapterError(
            f"adapter {name!r}: {len(unmatched)} tensors match no projection of this base model: "
            f"{_names(unmatched)} (expected keys like "
            "'base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_A.weight')"
        )
    if not pairs:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA tensors; it would change nothing")

    shapes = projection_shapes(config)
    prefixes = {p.split("layers.")[0] for p in pairs}
    if len(prefixes) > 1:
        raise AdapterError(f"adapter {name!r} mixes key prefixes {sorted(prefixes)}")

    weights: dict[tuple[int, str, str], LoRAWeight] = {}
    for module_path, ab in sorted(pairs.items()):
        layer_s, sub, module = MODULE_RE.match(module_path).groups()  # type: ignore[union-attr]
        layer = int(layer_s)
        if layer >= config.num_layers:
            raise AdapterError(
                f"adapter {name!r}: {module_path} is layer {layer}, the base model has {config.num_layers} layers"
            )
        if sub not in layer_sublayers(config, layer):
            kind = config.layer_types[layer]
            raise AdapterError(f"adapter {name!r}: {module_path} targets {sub}, but layer {layer} is {kind}")
        if module not in LORA_TARGETS[sub]:
            raise AdapterError(f"adapter {name!r}: {module_path}: no projection {module!r} in {sub}")
        if set(ab) != {"lora_A", "lora_B"}:
            raise AdapterError(f"adapter {name!r}: {module_path} has {sorted(ab)} but needs lora_A and lora_B")
        a, b = ab["lora_A"].float(), ab["lora_B"].float()
        out_f, in_f = shapes[(sub, module)]
        r = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != in_f or b.shape != (out_f, r):
            raise AdapterError(
                f"adapter {name!r}: {module_path} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; "
                f"this base model needs lora_A [r, {in_f}] and lora_B [{out_f}, r] (was it trained on "
                "another model size?)"
            )
        rank, alpha = _rank_alpha(cfg, module_path)
        if r != rank:
            raise AdapterError(f"adapter {name!r}: {module_path} has rank {r}, adapter_config.json says {rank}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"adapter {name!r}: {module_path} contains NaN or Inf values")
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        weights[(layer, sub, module)] = LoRAWeight(a=a, b=b, scale=scale)
    _check_targets(name, cfg, set(pairs), config, prefix=prefixes.pop())

    if all(not w.b.any() or not w.a.any() for w in weights.values()):
        raise AdapterError(
            f"adapter {name!r}: every lora_A or lora_B is all zeros, so it would change nothing "
            "(an untrained PEFT initialisation?)"
        )
    return LoRAAdapter(name=name, path=path, weights=weights)


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise AdapterError(f"{path}: not a directory (an adapter is a PEFT directory)")
    cfg_path = path / "adapter_config.json"
    if not cfg_path.is_file():
        raise AdapterError(f"{path}: no adapter_config.json (is this a PEFT LoRA adapter directory?)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{cfg_path}: not valid JSON ({e})") from None
    refusals = [
        (
            cfg.get("peft_type", "LORA") != "LORA",
            f"peft_type {cfg.get('peft_type')!r} (only LORA is supported)",
        ),
        (bool(cfg.get("use_dora")), "DoRA (use_dora=true) is not supported; merge it or train plain LoRA"),
        (cfg.get("bias", "none") != "none", f"LoRA bias {cfg.get('bias')!r} is not supported (only 'none')"),
        (bool(cfg.get("lora_bias")), "lora_bias=true is not supported"),
        (
            bool(cfg.get("modules_to_save")),
            f"modules_to_save {cfg.get('modules_to_save')} (full trained copies of modules) is not supported",
        ),
        (bool(cfg.get("target_parameters")), "target_parameters is not supported"),
        (bool(cfg.get("layer_replication")), "layer_replication is not supported"),
        ("r" not in cfg, "adapter_config.json has no 'r'"),
    ]
    for refused, why in refusals:
        if refused:
            raise AdapterError(f"{path}: {why}")
    return cfg


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        if pickles:
            raise AdapterError(
                f"{path}: only pickle weights ({', '.join(pickles)}); hylora loads safetensors only "
                "(re-save with PEFT's save_pretrained(safe_serialization=True))"
            )
        raise AdapterError(f"{path}: no {WEIGHTS_FILE}")
    try:
        with safe_open(str(weights), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except Exception as e:  # corrupt header, truncated file
        raise AdapterError(f"{weights}: cannot read safetensors ({e})") from None


def _refuse_known_unsupported(key: str) -> None:
    checks = [
        ("lora_magnitude_vector", "DoRA magnitude vectors are not supported"),
        ("lora_embedding_", "LoRA on embeddings is not supported"),
        ("modules_to_save", "modules_to_save is not supported"),
        (".visual.", "LoRA on the vision tower is not supported until vision is"),
        ("linear_attn.conv1d", "LoRA on the GDN conv1d is not supported (only linear projections)"),
        ("lm_head", "LoRA on lm_head is not supported"),
        ("embed_tokens", "LoRA on embed_tokens is not supported"),
    ]
    for needle, why in checks:
        if needle in key:
            raise AdapterError(f"{why}: {key}")
    if key.endswith("lora_B.bias"):
        raise AdapterError(f"LoRA bias is not supported: {key}")


def _rank_alpha(cfg: dict[str, Any], module_path: str) -> tuple[int, float]:
    """Per-module rank and alpha as PEFT resolves them (rank_pattern / alpha_pattern)."""
    rank = _pattern_value(cfg.get("rank_pattern") or {}, module_path, int(cfg["r"]))
    alpha = _pattern_value(cfg.get("alpha_pattern") or {}, module_path, float(cfg.get("lora_alpha", cfg["r"])))
    return int(rank), float(alpha)


def _pattern_value(patterns: dict[str, Any], module_path: str, default: Any) -> Any:
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module_path):
            return value
    return default


def _check_targets(name: str, cfg: dict[str, Any], in_file: set[str], config: ModelConfig, prefix: str) -> None:
    """The modules adapter_config.json targets must be exactly the ones the weights file holds."""
    candidates = [
        f"{prefix}layers.{i}.{sub}.{module}"
        for i in range(config.num_layers)
        for sub in layer_sublayers(config, i)
        for module in LORA_TARGETS[sub]
    ]
    targeted = {c for c in candidates if _targets(cfg, c)}
    missing = sorted(targeted - in_file, key=_natural)
    if missing:
        raise AdapterError(
            f"adapter {name!r}: adapter_config.json targets {len(missing)} modules with no tensors in "
            f"{WEIGHTS_FILE}: {_names(missing)}"
        )
    extra = sorted(in_file - targeted, key=_natural)
    if extra:
        raise AdapterError(
            f"adapter {name!r}: {WEIGHTS_FILE} holds modules that adapter_config.json does not target: {_names(extra)}"
        )


def _targets(cfg: dict[str, Any], key: str) -> bool:
    """PEFT's target matching: regex fullmatch, list entries (exact or dotted suffix), all-linear,
    exclude_modules, layers_to_transform (list targets only, as in PEFT)."""
    exclude = cfg.get("exclude_modules")
    if exclude and (
        re.fullmatch(exclude, key)
        if isinstance(exclude, str)
        else key in exclude or any(key.endswith(f".{e}") for e in exclude)
    ):
        return False
    targets = cfg.get("target_modules")
    if targets is None:
        return False
    if isinstance(targets, str):
        return targets == "all-linear" or re.fullmatch(targets, key) is not None
    found = key in targets or any(key.endswith(f".{t}") for t in targets)
    layers = cfg.get("layers_to_transform")
    if found and layers is not None and layers != []:
        layers = [layers] if isinstance(layers, int) else layers
        pattern = cfg.get("layers_pattern")
        patterns = [pattern] if isinstance(pattern, str) else (pattern or [])
        match = None
        if not patterns:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        for p in patterns:
            match = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key)
            if match:
                break
        found = match is not None and int(match.group("idx")) in layers
    return found


def _natural(key: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def _names(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")

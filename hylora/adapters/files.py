"""Read a PEFT LoRA adapter directory and map every tensor onto this base model, or refuse it.

No silent misses: each `lora_A` / `lora_B` tensor maps to exactly one (layer, projection) of the
text decoder or one linear of the vision tower (`model.visual.*`, the Conv3d patch embedding
included), or loading fails naming the keys; shapes are checked against the base; the modules
adapter_config.json targets must be exactly the modules the weights file holds; an adapter that
would change nothing is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import regex
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors.torch import load as load_safetensors

from hylora.config import ModelConfig, VisionConfig
from hylora.model.packing import LORA_TARGETS, layer_sublayers, projection_shapes
from hylora.model.vision import VisionLinear, VisionTower

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
MAX_CONFIG_BYTES = 1 << 20
# |scale · B·A| bounds: below NEGLIGIBLE in every module an adapter changes nothing (it would serve the
# base model under its name); above MAX in any module it overflows or swamps the base weights (~1e-2)
NEGLIGIBLE_UPDATE = 1e-10
MAX_UPDATE = 1e4
# adapter_config.json keys of PEFT variants whose forward is not plain LoRA: served as plain LoRA
# they would give another model's outputs, so an adapter that sets one is refused
UNSERVED_CONFIG_KEYS = {
    "alora_invocation_tokens": "activated LoRA applies only after its invocation tokens",
    "trainable_token_indices": "trained embedding rows",
    "use_qalora": "QALoRA's pooled inputs",
}
MAX_PATTERN_CHARS = 4096
# Every user-supplied pattern (target_modules, exclude_modules, rank/alpha_pattern, layers_pattern)
# is matched with the `regex` engine under this total time budget per adapter, so a pathological
# pattern costs at most this long instead of freezing a thread for minutes.
PATTERN_BUDGET_S = 1.0
# PEFT module path of a text-decoder projection, from Qwen3_5ForCausalLM or the VL wrapper
MODULE_RE = regex.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.(linear_attn|self_attn|mlp)\.(\w+)$")
# PEFT module paths of the vision tower (VL wrapper only) start with this; the rest names a VisionLinear
TOWER_PREFIX = "model.visual."
VL_TEXT_PREFIX = "model.language_model."  # text module paths of an adapter made on the VL wrapper
KEY_RE = regex.compile(r"^(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)\.weight$")


class AdapterError(ValueError):
    """The adapter cannot be served on this base model; the message says why and what to fix."""


@dataclass
class LoRAWeight:
    a: torch.Tensor  # [r, in] fp32
    b: torch.Tensor  # [out, r] fp32
    scale: float  # alpha / r, or alpha / sqrt(r) with rsLoRA

    def delta(self, device: torch.device | str | None = None) -> torch.Tensor:
        """scale · B·A [out, in] in fp32: what merging the adapter adds to the base weight."""
        return self.scale * (self.b.to(device, torch.float32) @ self.a.to(device, torch.float32))

    @property
    def update_bound(self) -> float:
        """An upper bound on every entry of |scale · B·A| (r · max|B| · max|A| · |scale|), in float64:
        cheap where the product itself would be a full [out, in] matrix."""
        if self.a.numel() == 0 or self.b.numel() == 0:
            return 0.0
        big = float(self.b.abs().max()) * float(self.a.abs().max())
        return abs(self.scale) * self.a.shape[0] * big


@dataclass
class LoRAAdapter:
    name: str
    path: Path
    weights: dict[tuple[int, str, str], LoRAWeight]  # (layer, sub-layer, checkpoint module)
    # tower module (`blocks.0.attn.qkv`, `patch_embed.proj`, ...: its path under `model.visual.`) →
    # LoRA as a linear over its flattened input (the Conv3d patch embedding's A flattened to [r, C*T*p*p])
    tower: dict[str, LoRAWeight] = field(default_factory=dict)

    @property
    def has_tower(self) -> bool:
        return bool(self.tower)

    @property
    def max_rank(self) -> int:
        return max(w.a.shape[0] for w in self._all())

    @property
    def num_parameters(self) -> int:
        return sum(w.a.numel() + w.b.numel() for w in self._all())

    def _all(self) -> list[LoRAWeight]:
        return [*self.weights.values(), *self.tower.values()]


@dataclass(frozen=True)
class TowerTarget:
    """A LoRA-capable linear of the vision tower, as PEFT sees it."""

    out_features: int
    in_features: int
    conv_shape: tuple[int, ...] | None  # (C, T, p, p) of the Conv3d patch embedding; None for nn.Linear


@cache
def tower_targets(vision: VisionConfig) -> dict[str, TowerTarget]:
    """Every module of the tower LoRA may target (its path under `model.visual.`), read off the
    tower hylora builds, so this table cannot drift from the model."""
    with torch.device("meta"):
        tower = VisionTower(vision)
    return {
        name: TowerTarget(m.out_features, m.in_features, tuple(m.weight.shape[1:]) if m.weight.ndim > 2 else None)
        for name, m in tower.named_modules()
        if isinstance(m, VisionLinear)
    }


class AdapterConfig(BaseModel):
    """The fields of adapter_config.json that hylora reads, with strict JSON types."""

    model_config = ConfigDict(extra="allow", strict=True)

    peft_type: str = "LORA"
    r: int = Field(gt=0, le=65536)
    lora_alpha: float | None = None
    use_rslora: bool = False
    use_dora: bool = False
    bias: str = "none"
    lora_bias: bool = False
    modules_to_save: list[str] | None = None
    target_parameters: list[str] | None = None
    layer_replication: list[Any] | None = None
    target_modules: str | list[str] | None = None
    exclude_modules: str | list[str] | None = None
    rank_pattern: dict[str, int] = Field(default_factory=dict)
    alpha_pattern: dict[str, float] = Field(default_factory=dict)
    layers_to_transform: int | list[int] | None = None
    layers_pattern: str | list[str] | None = None

    @property
    def alpha(self) -> float:
        return float(self.r if self.lora_alpha is None else self.lora_alpha)


@dataclass
class AdapterFiles:
    """What an adapter directory holds, read once: the digest is of exactly the bytes parsed."""

    path: Path
    config: AdapterConfig
    tensors: dict[str, torch.Tensor]
    digest: str  # sha256 of adapter_config.json's bytes, then the weights file's


def read_adapter(path: str | Path, config: ModelConfig, name: str | None = None) -> LoRAAdapter:
    return parse_adapter(read_adapter_files(Path(path)), config, name)


def read_adapter_files(path: Path, max_weight_bytes: int | None = None) -> AdapterFiles:
    """Read an adapter directory (file I/O only: call it off the engine thread and the event loop).
    Every way a directory can be unreadable becomes an AdapterError."""
    try:
        if not path.is_dir():
            raise AdapterError(f"{path}: not a directory (an adapter is a PEFT directory)")
        cfg, cfg_bytes = _read_config(path)
        weights = path / WEIGHTS_FILE
        if not weights.is_file():
            pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
            if pickles:
                raise AdapterError(
                    f"{path}: only pickle weights ({', '.join(pickles)}); hylora loads safetensors only "
                    "(re-save with PEFT's save_pretrained(safe_serialization=True))"
                )
            raise AdapterError(f"{path}: no {WEIGHTS_FILE}")
        size = weights.stat().st_size
        if max_weight_bytes is not None and size > max_weight_bytes:
            raise AdapterError(
                f"{weights}: {size} bytes, more than any adapter of rank <= --max-lora-rank on this model "
                f"can hold ({max_weight_bytes} bytes)"
            )
        data = weights.read_bytes()
    except AdapterError:
        raise
    except (OSError, ValueError, RuntimeError) as e:  # symlink loops, NUL bytes, too-long names, permissions
        raise AdapterError(f"cannot read adapter directory {str(path)[:300]!r}: {e}") from None
    try:
        tensors = load_safetensors(data)
    except Exception as e:  # corrupt header, truncated file
        raise AdapterError(f"{weights}: cannot read safetensors ({e})") from None
    digest = hashlib.sha256(hashlib.sha256(cfg_bytes).digest() + data).hexdigest()  # a config edit counts too
    return AdapterFiles(path=path, config=cfg, tensors=tensors, digest=digest)


def parse_adapter(files: AdapterFiles, config: ModelConfig, name: str | None = None) -> LoRAAdapter:
    """Map every tensor onto this base model, or refuse the adapter (no I/O)."""
    path, cfg, tensors = files.path, files.config, files.tensors
    name = name or path.name
    patterns = _Patterns(name)

    pairs: dict[str, dict[str, torch.Tensor]] = {}  # text decoder module path → lora_A / lora_B
    tower_pairs: dict[str, dict[str, torch.Tensor]] = {}  # tower module (under model.visual.) → ...
    unmatched = []
    first_key: dict[tuple[str, str], str] = {}  # (module, lora_A / lora_B) → the key that gave it
    for key, tensor in tensors.items():
        m = KEY_RE.match(key)
        if m is None:
            _refuse_known_unsupported(key)
            unmatched.append(key)
            continue
        module_path, which = m.groups()
        _refuse_known_unsupported(module_path)
        if (earlier := first_key.setdefault((module_path, which), key)) != key:  # two spellings of one key
            raise AdapterError(f"adapter {name!r}: {key!r} and {earlier!r} are the same weight; keep one of them")
        if module_path.startswith(TOWER_PREFIX):
            tower_pairs.setdefault(module_path.removeprefix(TOWER_PREFIX), {})[which] = tensor
        elif MODULE_RE.match(module_path) is not None:
            pairs.setdefault(module_path, {})[which] = tensor
        else:
            unmatched.append(key)
    if unmatched:
        raise AdapterError(
            f"adapter {name!r}: {len(unmatched)} tensors match no projection of this base model: "
            f"{_names(unmatched)} (expected keys like "
            "'base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_A.weight')"
        )
    if not pairs and not tower_pairs:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA tensors; it would change nothing")
    if tower_pairs and config.vision is None:
        paths = [TOWER_PREFIX + m for m in sorted(tower_pairs, key=_natural)]
        raise AdapterError(
            f"adapter {name!r} has LoRA on the vision tower ({_names(paths)}), but this base model is text-only "
            "and has no vision tower; serve it on the vision-language checkpoint it was trained on"
        )

    prefixes = {p.split("layers.")[0] for p in pairs}
    if tower_pairs:
        prefixes.add(VL_TEXT_PREFIX)  # tower keys only exist on the VL wrapper
    if len(prefixes) > 1:
        raise AdapterError(
            f"adapter {name!r} mixes key prefixes {sorted(prefixes)}"
            + (" (its model.visual.* keys come from the VL wrapper)" if tower_pairs else "")
        )
    prefix = prefixes.pop()

    shapes = projection_shapes(config)
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
        out_f, in_f = shapes[(sub, module)]
        weights[(layer, sub, module)] = _lora_weight(name, cfg, patterns, module_path, ab, out_f, in_f)
    tower = _tower_weights(name, cfg, patterns, tower_pairs, config)
    in_file = set(pairs) | {TOWER_PREFIX + m for m in tower_pairs}
    _check_targets(name, cfg, in_file, config, prefix, patterns)

    every = [*weights.values(), *tower.values()]
    if all(not w.b.any() or not w.a.any() for w in every):
        raise AdapterError(
            f"adapter {name!r}: every lora_A or lora_B is all zeros, so it would change nothing "
            "(an untrained PEFT initialisation?)"
        )
    largest = max(w.update_bound for w in every)
    if largest < NEGLIGIBLE_UPDATE:
        raise AdapterError(
            f"adapter {name!r}: its update scale·B·A is at most {largest:.2g} in every module, so it would change "
            f"nothing and serve the base model under its name (lora_alpha {cfg.alpha}; tiny or zeroed weights?)"
        )
    return LoRAAdapter(name=name, path=path, weights=weights, tower=tower)


def _tower_weights(
    name: str,
    cfg: AdapterConfig,
    patterns: _Patterns,
    pairs: dict[str, dict[str, torch.Tensor]],
    config: ModelConfig,
) -> dict[str, LoRAWeight]:
    if not pairs or config.vision is None:  # tower keys on a text-only model were refused already
        return {}
    targets = tower_targets(config.vision)
    unknown = [TOWER_PREFIX + m for m in sorted(pairs, key=_natural) if m not in targets]
    if unknown:
        raise AdapterError(
            f"adapter {name!r}: {_names(unknown)} match no LoRA-capable module of this base model's vision tower "
            f"(depth {config.vision.depth}; targets are patch_embed.proj, blocks.N.attn.qkv, blocks.N.attn.proj, "
            "blocks.N.mlp.linear_fc1/2, merger.linear_fc1/2)"
        )
    tower = {}
    for module, ab in sorted(pairs.items(), key=lambda kv: _natural(kv[0])):
        t = targets[module]
        tower[module] = _lora_weight(
            name, cfg, patterns, TOWER_PREFIX + module, ab, t.out_features, t.in_features, t.conv_shape
        )
    return tower


def _lora_weight(
    name: str,
    cfg: AdapterConfig,
    patterns: _Patterns,
    module_path: str,
    ab: dict[str, torch.Tensor],
    out_f: int,
    in_f: int,
    conv_shape: tuple[int, ...] | None = None,
) -> LoRAWeight:
    """Check one module's lora_A / lora_B against the base and return them as an fp32 linear LoRA.

    A Conv3d whose kernel equals its stride (the patch embedding) is a linear over its flattened
    patch: PEFT stores its lora_A as a conv weight [r, *conv_shape] and lora_B as [out, r, 1, 1, 1]."""
    if set(ab) != {"lora_A", "lora_B"}:
        raise AdapterError(f"adapter {name!r}: {module_path} has {sorted(ab)} but needs lora_A and lora_B")
    a, b = ab["lora_A"], ab["lora_B"]
    r = a.shape[0] if a.ndim >= 1 else -1
    if conv_shape is None:
        fits = a.ndim == 2 and a.shape[1] == in_f and tuple(b.shape) == (out_f, r)
        needs = f"lora_A [r, {in_f}] and lora_B [{out_f}, r]"
    else:
        ones = (1,) * (len(conv_shape) - 1)  # a 1x1x1 kernel
        fits = tuple(a.shape[1:]) == conv_shape and tuple(b.shape) == (out_f, r, *ones)
        a_dims, b_dims = ", ".join(map(str, conv_shape)), ", ".join(map(str, ones))
        needs = f"(a Conv3d, as PEFT saves it) lora_A [r, {a_dims}] and lora_B [{out_f}, r, {b_dims}]"
    if not fits:
        raise AdapterError(
            f"adapter {name!r}: {module_path} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; "
            f"this base model needs {needs} (was it trained on another model size?)"
        )
    if not (a.is_floating_point() and b.is_floating_point()):
        raise AdapterError(f"adapter {name!r}: {module_path} has {a.dtype} / {b.dtype} weights; expected floats")
    a, b = a.float().reshape(r, in_f), b.float().reshape(out_f, r)
    rank = int(patterns.value(cfg.rank_pattern, module_path, cfg.r))
    alpha = float(patterns.value(cfg.alpha_pattern, module_path, cfg.alpha))
    if r != rank:
        raise AdapterError(f"adapter {name!r}: {module_path} has rank {r}, adapter_config.json says {rank}")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise AdapterError(f"adapter {name!r}: {module_path} contains NaN or Inf values")
    scale = alpha / math.sqrt(r) if cfg.use_rslora else alpha / r
    if not math.isfinite(scale):
        raise AdapterError(f"adapter {name!r}: {module_path} has a non-finite scale (lora_alpha {alpha})")
    weight = LoRAWeight(a=a, b=b, scale=scale)
    if not weight.update_bound <= MAX_UPDATE:  # NaN-safe: an overflowing bound fails too
        raise AdapterError(
            f"adapter {name!r}: {module_path}'s update scale·B·A can reach {weight.update_bound:.3g} (lora_alpha "
            f"{alpha}, max |B| {float(b.abs().max()):.3g}); trained adapters stay far below 1, and this would "
            f"overflow or swamp the model: check lora_alpha and the weights"
        )
    return weight


def max_adapter_bytes(config: ModelConfig, max_rank: int) -> int:
    """An upper bound on the weights file of any servable adapter (every projection of every layer and
    every tower linear at `max_rank`, fp32, plus room for the header): anything larger is refused
    before it is read."""
    shapes = projection_shapes(config)
    per_rank = sum(
        sum(out + inp for out, inp in (shapes[(sub, m)] for m in LORA_TARGETS[sub]))
        for layer in range(config.num_layers)
        for sub in layer_sublayers(config, layer)
    )
    if config.vision is not None:
        per_rank += sum(t.out_features + t.in_features for t in tower_targets(config.vision).values())
    return per_rank * max_rank * 4 + (16 << 20)


def _read_config(path: Path) -> tuple[AdapterConfig, bytes]:
    """The validated config and the bytes it was parsed from."""
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise AdapterError(f"{path}: no {CONFIG_FILE} (is this a PEFT LoRA adapter directory?)")
    if cfg_path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{cfg_path}: larger than {MAX_CONFIG_BYTES} bytes; not an adapter config")
    data = cfg_path.read_bytes()
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise AdapterError(f"{cfg_path}: not UTF-8 text ({e})") from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise AdapterError(f"{cfg_path}: not valid JSON ({str(e)[:200]})") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{cfg_path}: expected a JSON object, got {type(raw).__name__}")
    if "r" not in raw:
        raise AdapterError(f"{path}: {CONFIG_FILE} has no 'r'")
    try:
        cfg = AdapterConfig.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors(include_url=False)[:8]
        )
        raise AdapterError(f"{cfg_path}: {problems}") from None
    refusals = [
        (cfg.peft_type != "LORA", f"peft_type {cfg.peft_type!r} (only LORA is supported)"),
        (cfg.use_dora, "DoRA (use_dora=true) is not supported; merge it or train plain LoRA"),
        (cfg.bias != "none", f"LoRA bias {cfg.bias!r} is not supported (only 'none')"),
        (cfg.lora_bias, "lora_bias=true is not supported"),
        (
            bool(cfg.modules_to_save),
            f"modules_to_save {cfg.modules_to_save} (full trained copies of modules) is not supported",
        ),
        (bool(cfg.target_parameters), "target_parameters is not supported"),
        (bool(cfg.layer_replication), "layer_replication is not supported"),
        *((bool(raw.get(key)), f"{key} ({why}) is not supported") for key, why in UNSERVED_CONFIG_KEYS.items()),
    ]
    for refused, why in refusals:
        if refused:
            raise AdapterError(f"{path}: {why}")
    return cfg, data


@dataclass
class _Patterns:
    """Matches adapter-supplied regexes with bounded cost: compile errors and pathological patterns
    become AdapterErrors naming the pattern."""

    adapter: str
    deadline: float = field(default_factory=lambda: time.monotonic() + PATTERN_BUDGET_S)
    _compiled: dict[str, Any] = field(default_factory=dict)

    def fullmatch(self, pattern: str, text: str) -> bool:
        return self._run(pattern, text, full=True) is not None

    def match(self, pattern: str, text: str) -> Any:
        return self._run(pattern, text, full=False)

    def value(self, patterns: dict[str, Any], module_path: str, default: Any) -> Any:
        """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the module path."""
        for pattern, value in patterns.items():
            if self.match(rf"(.*\.)?({pattern})$", module_path) is not None:
                return value
        return default

    def _run(self, pattern: str, text: str, full: bool) -> Any:
        if pattern not in self._compiled:
            if len(pattern) > MAX_PATTERN_CHARS:
                raise AdapterError(f"adapter {self.adapter!r}: a pattern is longer than {MAX_PATTERN_CHARS} characters")
            try:
                self._compiled[pattern] = regex.compile(pattern)
            except (regex.error, RecursionError, OverflowError, ValueError) as e:
                raise AdapterError(f"adapter {self.adapter!r}: invalid pattern {pattern[:200]!r} ({e})") from None
        left = self.deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            compiled = self._compiled[pattern]
            found = compiled.fullmatch(text, timeout=left) if full else compiled.match(text, timeout=left)
        except TimeoutError:
            raise AdapterError(
                f"adapter {self.adapter!r}: matching pattern {pattern[:200]!r} against this model's module names "
                f"took longer than {PATTERN_BUDGET_S:g} s (catastrophic backtracking?); simplify the pattern"
            ) from None
        return found


def _refuse_known_unsupported(key: str) -> None:
    checks = [
        ("lora_magnitude_vector", "DoRA magnitude vectors are not supported"),
        ("lora_embedding_", "LoRA on embeddings is not supported"),
        ("modules_to_save", "modules_to_save is not supported"),
        ("linear_attn.conv1d", "LoRA on the GDN conv1d is not supported (only linear projections)"),
        ("lm_head", "LoRA on lm_head is not supported"),
        ("embed_tokens", "LoRA on embed_tokens is not supported"),
    ]
    for needle, why in checks:
        if needle in key:
            raise AdapterError(f"{why}: {key}")
    if key.endswith("lora_B.bias"):
        raise AdapterError(f"LoRA bias is not supported: {key}")


def _check_targets(
    name: str, cfg: AdapterConfig, in_file: set[str], config: ModelConfig, prefix: str, patterns: _Patterns
) -> None:
    """The modules adapter_config.json targets must be exactly the ones the weights file holds.

    Candidates are the modules PEFT could have wrapped: the decoder's projections, plus the tower's
    linears when the adapter was made on the VL wrapper of a model with a tower (`all-linear` there
    takes every nn.Linear of the tower too, but not the Conv3d patch embedding)."""
    candidates = {
        f"{prefix}layers.{i}.{sub}.{module}": True
        for i in range(config.num_layers)
        for sub in layer_sublayers(config, i)
        for module in LORA_TARGETS[sub]
    }
    if config.vision is not None and prefix == VL_TEXT_PREFIX:
        for module, t in tower_targets(config.vision).items():
            candidates[TOWER_PREFIX + module] = t.conv_shape is None
    targeted = {c for c, linear in candidates.items() if _targets(cfg, c, patterns, linear)}
    missing = sorted(targeted - in_file, key=_natural)
    if missing:
        raise AdapterError(
            f"adapter {name!r}: {CONFIG_FILE} targets {len(missing)} modules with no tensors in "
            f"{WEIGHTS_FILE}: {_names(missing)}"
        )
    extra = sorted(in_file - targeted, key=_natural)
    if extra:
        raise AdapterError(
            f"adapter {name!r}: {WEIGHTS_FILE} holds modules that {CONFIG_FILE} does not target: {_names(extra)}"
        )


def _targets(cfg: AdapterConfig, key: str, patterns: _Patterns, linear: bool = True) -> bool:
    """PEFT's target matching: regex fullmatch, list entries (exact or dotted suffix), all-linear
    (nn.Linear modules only), exclude_modules, layers_to_transform (list targets only, as in PEFT)."""
    exclude = cfg.exclude_modules
    if exclude and (
        patterns.fullmatch(exclude, key)
        if isinstance(exclude, str)
        else key in exclude or any(key.endswith(f".{e}") for e in exclude)
    ):
        return False
    targets = cfg.target_modules
    if targets is None:
        return False
    if isinstance(targets, str):
        if targets.lower() == "all-linear":
            return linear
        return patterns.fullmatch(targets, key)
    found = key in targets or any(key.endswith(f".{t}") for t in targets)
    layers = cfg.layers_to_transform
    if found and layers is not None and layers != []:
        layers = [layers] if isinstance(layers, int) else layers
        pattern = cfg.layers_pattern
        names = [pattern] if isinstance(pattern, str) else (pattern or [])
        match = patterns.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key) if not names else None
        for p in names:
            match = patterns.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key)
            if match is not None:
                break
        found = match is not None and int(match.group("idx")) in layers
    return found


def _natural(key: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in regex.split(r"(\d+)", key)]


def _names(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")

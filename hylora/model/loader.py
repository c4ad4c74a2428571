"""Load a Hugging Face model directory (safetensors, single or sharded) into a HybridDecoder
(and, on request, its vision tower as `model.visual`).

Tensors are read one at a time from the memory-mapped files and copied (cast, moved) straight into
their rows of the destination parameter, so peak host memory is the model plus one tensor, never a
second full copy. Projections that hylora fuses into one GEMM (model/packing.py) are assembled here.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from hylora.config import ConfigError, ModelConfig
from hylora.model.decoder import HybridDecoder
from hylora.model.layers import Linear
from hylora.ops.fp8_linear.reference import dequantize_weight

log = logging.getLogger(__name__)

# Checkpoint key prefixes of the text decoder, most specific first.
TEXT_PREFIXES = ("model.language_model.", "model.")
VISION_PREFIX = "model.visual."  # → `visual.` on the decoder
# Weights hylora does not load: skipped with a note, never silently.
SKIPPED_PREFIXES = {
    VISION_PREFIX: "vision tower (not loaded: load_model(..., vision=True) loads it)",
    "mtp.": "multi-token prediction head (loaded with --speculative-config)",
}
MTP_PREFIX = "mtp."
SCALE_SUFFIX = "_scale_inv"  # FP8 checkpoints: `X.weight_scale_inv` holds the block scales of `X.weight`


class CheckpointError(ValueError):
    """The checkpoint does not match the model its config.json describes."""


def open_shard(path: Path) -> safe_open:
    """`safe_open(path)`; a file that cannot be read, or not as safetensors, is a CheckpointError naming it."""
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as e:
        raise CheckpointError(f"{path} could not be read as safetensors ({e}): is it truncated or corrupt?") from None
    except OSError as e:
        raise CheckpointError(f"{path} could not be read ({e.strerror or e})") from None


def weight_files(model_dir: Path) -> dict[str, Path]:
    """checkpoint key → the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: model_dir / name for key, name in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
        hint = (
            f" (found {', '.join(pickles)}: pickle weights are not loaded; convert them to safetensors)"
            if pickles
            else ""
        )
        raise CheckpointError(f"{model_dir}: no *.safetensors weights{hint}")
    out: dict[str, Path] = {}
    for f in files:
        with open_shard(f) as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                out[key] = f
    return out


def parameter_name(key: str, vision: bool = False, mtp: bool = False) -> str | None:
    """Map a checkpoint key to a HybridDecoder parameter name; None if it is a known skip."""
    if key == "lm_head.weight":
        return key
    if vision and key.startswith(VISION_PREFIX):
        return "visual." + key[len(VISION_PREFIX) :]
    if mtp and key.startswith(MTP_PREFIX):
        return key  # the decoder's `mtp` module has the checkpoint's names
    for prefix in SKIPPED_PREFIXES:
        if key.startswith(prefix):
            return None
    for prefix in TEXT_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key  # reported as unexpected below


def checkpoint_layout(model: HybridDecoder) -> dict[str, tuple[str, int, int]]:
    """Checkpoint parameter name (text prefix removed) → (hylora parameter, first row, rows).

    Fused projections (model/packing.py) receive several checkpoint tensors, one row block each."""
    layout: dict[str, tuple[str, int, int]] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, Linear):
            parent = module_name.rpartition(".")[0]
            for part, (start, rows) in zip(module.slices, module.slice_offsets, strict=True):
                layout[f"{parent}.{part}.weight"] = (f"{module_name}.weight", start, rows)
    covered = {dest for dest, _, _ in layout.values()}
    for name, p in model.named_parameters():
        if name not in covered:
            layout[name] = (name, 0, p.shape[0])
    return layout


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    progress: bool = True,
    vision: bool = False,
    mtp: bool = False,
    fp8: bool = False,
    config: ModelConfig | None = None,
) -> HybridDecoder:
    """Build the decoder from `model_dir`. dtype None = the checkpoint's dtype; `config`: the model directory's
    config as read already (with --hf-overrides), else config.json.

    vision=True also loads the vision tower of a VL checkpoint as `model.visual` (same dtype and
    device); otherwise its tensors are skipped with a note. mtp=True also loads the
    multi-token-prediction layer (`model.mtp`, speculative decoding's draft model).

    A block-quantised FP8 checkpoint (config.quantization) is dequantised to `dtype` (the values its
    e4m3 weights and scales stand for), unless fp8=True: then the decoder's projections keep their
    FP8 rows and scales (`Linear.set_fp8`) and compute with the FP8 kernel; everything else (embeddings,
    head, vision tower, the rows a checkpoint keeps unquantised) is dequantised or loaded as is."""
    model_dir = Path(model_dir)
    config = config or ModelConfig.from_dir(model_dir)
    if vision and config.vision is None:
        raise ConfigError(f"{model_dir}: a text-only checkpoint has no vision tower to load")
    if mtp and config.mtp_num_hidden_layers < 1:
        raise ConfigError(
            f"{model_dir}: the checkpoint has no MTP layer (config.json: mtp_num_hidden_layers is "
            f"{config.mtp_num_hidden_layers}), so MTP speculative decoding cannot run; drop --speculative-config"
        )
    dtype = dtype or config.checkpoint_dtype
    with torch.device("meta"):
        model = HybridDecoder(config, vision=vision, mtp=mtp)
    layout = checkpoint_layout(model)
    if config.tie_word_embeddings:
        del layout["lm_head.weight"]

    files = weight_files(model_dir)
    scales = {key[: -len(SCALE_SUFFIX)]: files.pop(key) for key in list(files) if key.endswith(SCALE_SUFFIX)}
    orphans = sorted(set(scales) - set(files))
    if orphans:
        raise CheckpointError(f"{model_dir}: block scales without their weights: {_names(orphans)}")
    if scales and config.quantization is None:
        raise CheckpointError(
            f"{model_dir}: tensors {_names(sorted(scales))} have block scales "
            "but config.json has no quantization_config"
        )
    by_file: dict[Path, list[tuple[str, str]]] = defaultdict(list)
    unexpected, skipped = [], defaultdict(int)
    for key, path in files.items():
        name = parameter_name(key, vision, mtp)
        if name is None:
            skipped[next(p for p in SKIPPED_PREFIXES if key.startswith(p))] += 1
        elif name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the embedding is the head
        elif name in layout:
            by_file[path].append((key, name))
        else:
            unexpected.append(key)
    if unexpected:
        raise CheckpointError(f"{model_dir}: unexpected tensors {_names(unexpected)}")
    seen: dict[str, str] = {}
    for entries in by_file.values():
        for key, name in entries:
            if name in seen:
                raise CheckpointError(f"{model_dir}: tensors {seen[name]!r} and {key!r} both fill {name!r}")
            seen[name] = key
    missing = sorted(set(layout) - set(seen))
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensors {_names(missing)}")

    params = dict(model.named_parameters())
    linears = {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, Linear)}
    block = config.quantization.weight_block_size if config.quantization else (128, 128)
    # FP8-kept projection → its leading FP8 rows (the unquantised rest, if any, is its tail)
    fp8_lead = _fp8_leading_rows(linears, layout, seen, scales) if fp8 else {}
    filled: dict[str, torch.Tensor] = {}
    fp8_rows: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = defaultdict(dict)  # param → start → (w, s)
    scale_files = ScaleFiles(model_dir, scales)
    bar = tqdm(total=len(seen), desc="loading weights", unit="tensor", disable=not progress)
    for path, entries in by_file.items():
        with open_shard(path) as handle:
            for key, name in entries:
                dest_name, start, rows = layout[name]
                dest_shape = params[dest_name].shape
                expected = (rows, *dest_shape[1:])
                tensor = handle.get_tensor(key)
                if tuple(tensor.shape) != tuple(expected):
                    raise CheckpointError(
                        f"{model_dir}: tensor {key!r} has shape {list(tensor.shape)}, "
                        f"the config expects {list(expected)}"
                    )
                if key in scales:
                    if tensor.dtype != torch.float8_e4m3fn:
                        raise CheckpointError(f"{model_dir}: {key!r} has block scales but is {tensor.dtype}, not e4m3")
                    scale = scale_files.get(key, tensor.shape, block)
                    if dest_name in fp8_lead:
                        fp8_rows[dest_name][start] = (tensor.to(device), scale.to(device))
                        bar.update()
                        continue
                    tensor = dequantize_weight(tensor, scale, block)
                lead = fp8_lead.get(dest_name, 0)  # rows of an FP8 projection's tail start after its FP8 rows
                if dest_name not in filled:
                    shape = (dest_shape[0] - lead, *dest_shape[1:])
                    filled[dest_name] = torch.empty(shape, dtype=_param_dtype(dest_name, dtype), device=device)
                filled[dest_name][start - lead : start - lead + rows].copy_(tensor)
                bar.update()
    bar.close()
    scale_files.close()
    for dest_name, tensor in filled.items():
        if dest_name not in fp8_lead:
            _assign(model, dest_name, tensor)
    for dest_name in fp8_lead:
        assign_fp8(linears[dest_name], fp8_rows[dest_name], filled.get(dest_name), block, dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    for prefix, count in skipped.items():
        log.info("skipped %d tensors of the %s", count, SKIPPED_PREFIXES[prefix])
    return model.eval()


class ScaleFiles:
    """The `weight_scale_inv` tensors of an FP8 checkpoint, read on demand (they may sit in other shards
    than their weights), checked against their weight's shape and returned as fp32."""

    def __init__(self, model_dir: Path, scales: dict[str, Path]):
        self.model_dir, self.scales = model_dir, scales
        self._handles: dict[Path, object] = {}

    def get(self, key: str, weight_shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
        path = self.scales[key]
        if path not in self._handles:
            self._handles[path] = open_shard(path)
        scale = self._handles[path].get_tensor(key + SCALE_SUFFIX)  # type: ignore[attr-defined]
        expected = (-(-weight_shape[0] // block[0]), -(-weight_shape[1] // block[1]))
        if tuple(scale.shape) != expected:
            raise CheckpointError(
                f"{self.model_dir}: {key + SCALE_SUFFIX!r} has shape {list(scale.shape)}; weight_block_size "
                f"{list(block)} and the weight's {list(weight_shape)} need {list(expected)}"
            )
        scale = scale.float()
        if not bool(torch.isfinite(scale).all() and (scale > 0).all()):
            raise CheckpointError(
                f"{self.model_dir}: {key + SCALE_SUFFIX!r} holds non-finite or non-positive scales: every "
                "output of this projection would be NaN or zero"
            )
        return scale

    def close(self) -> None:
        self._handles.clear()


def _fp8_leading_rows(
    linears: dict[str, Linear],
    layout: dict[str, tuple[str, int, int]],
    seen: dict[str, str],
    scales: dict[str, Path],
) -> dict[str, int]:
    """Projections that keep FP8 rows → how many leading rows are FP8. A fused projection keeps FP8
    only where its FP8 slices come first in the fused order (Qwen quantises the GDN in_proj's qkv and
    z rows, not b and a); any other mix is dequantised."""
    starts: dict[str, set[int]] = defaultdict(set)
    for name, key in seen.items():
        dest, start, _ = layout[name]
        if key in scales and dest in linears:
            starts[dest].add(start)
    lead = {}
    for dest, quantised in starts.items():
        leading = linears[dest].slice_offsets[: len(quantised)]
        if quantised == {start for start, _ in leading}:
            lead[dest] = sum(rows for _, rows in leading)
        else:
            log.info("FP8 slices of %s are not its leading rows: dequantised", dest)
    return lead


def assign_fp8(
    linear: Linear,
    parts: dict[int, tuple[torch.Tensor, torch.Tensor]],  # first row → (e4m3 rows, their block scales)
    tail: torch.Tensor | None,  # the unquantised rows after them
    block: tuple[int, int],
    dtype: torch.dtype,
) -> None:
    """Give a (possibly fused) projection its FP8 rows, which lead, and its unquantised tail. Slices
    whose row counts are not multiples of block_n get one scale row per weight row, so that one FP8
    GEMM covers them all."""
    starts = sorted(parts)
    if starts != [start for start, _ in linear.slice_offsets[: len(starts)]]:
        raise ValueError(f"the FP8 slices of {list(linear.slices)} must lead the fused rows")
    weight = torch.cat([parts[s][0] for s in starts])
    if all(parts[s][0].shape[0] % block[0] == 0 for s in starts[:-1]):
        scale, kernel_block = torch.cat([parts[s][1] for s in starts]), block
    else:  # a slice ends inside a scale block: one scale row per weight row
        scale = torch.cat([parts[s][1].repeat_interleave(block[0], dim=0)[: parts[s][0].shape[0]] for s in starts])
        kernel_block = (1, block[1])
    linear.set_fp8(weight, scale.contiguous(), kernel_block, tail, dtype)


def _param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    # The GDN decay parameters stay fp32: exp(A_log) in half precision loses the small decays.
    return torch.float32 if name.endswith(("A_log", "dt_bias")) else dtype


def _assign(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attr, torch.nn.Parameter(tensor, requires_grad=False))


def _names(keys: list[str], limit: int = 12) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")

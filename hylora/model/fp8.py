"""FP8 weights: write a block-quantised copy of a model directory (`hylora quantize`) in the layout of
Qwen's -FP8 releases, or quantise a loaded model's projections in memory (`--quantization fp8` on an
unquantised checkpoint, and the benchmarks' random models) the same way.

Layout: each quantised projection's `*.weight` becomes float8_e4m3fn, with `*.weight_scale_inv`
(fp32, one per 128 x 128 block: dequantised weight = e4m3 value x scale) beside it, and config.json
gains `quantization_config` {quant_method fp8, fmt e4m3, activation_scheme dynamic, weight_block_size}.
As in Qwen's releases the embeddings, the LM head, norms, the GDN conv and decay parameters, the GDN
in_proj_a / in_proj_b rows (small and sensitive), the vision tower and the MTP layer stay unquantised.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from hylora.config import ModelConfig, QuantizationConfig
from hylora.model.checkpoint_out import checkpoint_copy
from hylora.model.layers import Linear
from hylora.model.loader import SCALE_SUFFIX, assign_fp8, open_shard, weight_files
from hylora.ops.fp8_linear.reference import quantize_weight

# decoder projections that become FP8 (checkpoint module names)
QUANTISED_MODULES = (
    "in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)  # fmt: skip
QUANTISED = re.compile(  # their checkpoint keys, text prefix included
    r"^model\.(?:language_model\.)?layers\.\d+\.(?:linear_attn|self_attn|mlp)\.(?:"
    + "|".join(QUANTISED_MODULES)
    + r")\.weight$"
)
NOT_CONVERTED = ("lm_head", "embed_tokens", "visual", "mtp")
# linears that stay unquantised: the GDN in_proj_a / in_proj_b rows and the vision tower's linears
# (patch embedding, attention, MLP, merger). modules_to_not_convert names each in full, as Qwen's
# releases do: vLLM matches full module names, so a short name would leave its fused in_proj_ba, and
# every tower linear (built with the model's quantisation config), FP8 with bf16 weights cast into it.
KEPT = re.compile(
    r"^(model\.(?:language_model\.)?layers\.\d+\.linear_attn\.in_proj_[ab]"
    r"|(?:model\.)?visual\.(?:.+\.)?(?:qkv|proj|linear_fc\d))\.weight$"
)


def quantize_checkpoint(
    model_dir: str | Path, out_dir: str | Path, block: tuple[int, int] = (128, 128), progress: bool = True
) -> Path:
    """Write `model_dir` block-quantised to FP8 into `out_dir` (same files and shards; tokenizer and
    other files copied), all or nothing (model/checkpoint_out.py)."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = ModelConfig.from_dir(model_dir)
    if config.quantization is not None:
        raise ValueError(f"{model_dir} is already quantised ({config.quantization.method})")
    files = weight_files(model_dir)
    kept = sorted(m.group(1) for m in map(KEPT.match, files) if m)
    quant = QuantizationConfig("fp8", block, (*NOT_CONVERTED, *kept))
    with checkpoint_copy(model_dir, out_dir) as tmp:  # all or nothing: a failed run leaves no out_dir
        for path in tqdm(sorted(set(files.values())), desc="quantising", unit="file", disable=not progress):
            with open_shard(path) as f:
                metadata, tensors = f.metadata(), {}
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    t = f.get_tensor(key)
                    if QUANTISED.match(key):
                        w, scale = quantize_weight(t.float(), block)
                        tensors[key], tensors[key + SCALE_SUFFIX] = w, scale
                    else:
                        tensors[key] = t
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / path.name, metadata=metadata)
        _rewrite_index(tmp, {k: p for k, p in files.items() if QUANTISED.match(k)})
        set_quantization(tmp, quant)
    return out_dir


@torch.no_grad()
def quantize_linears(model: torch.nn.Module, block: tuple[int, int] = (128, 128)) -> int:
    """Quantise the decoder's projections in place, as `quantize_checkpoint` + loading with fp8=True
    would (each checkpoint projection its own blocks); returns how many projections became FP8."""
    count = 0
    for name, linear in model.named_modules():
        if not isinstance(linear, Linear) or linear.is_fp8 or name.startswith("mtp."):
            continue
        parts = {
            start: quantize_weight(linear.weight[start : start + rows].float(), block)
            for part, (start, rows) in zip(linear.slices, linear.slice_offsets, strict=True)
            if part in QUANTISED_MODULES
        }
        if parts:
            lead = sum(parts[start][0].shape[0] for start in parts)
            tail = linear.weight[lead:].clone() if lead < linear.out_features else None
            assign_fp8(linear, parts, tail, block, linear.weight.dtype)
            count += 1
    return count


def dequantize_linears(model: torch.nn.Module) -> None:
    """Every FP8 projection back to one unquantised weight holding the values FP8 stood for."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.dequantize()


def set_quantization(model_dir: Path, quant: QuantizationConfig | None) -> None:
    """Write (or with None remove) config.json's quantization_config, where transformers reads it."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for where in (config, config.get("text_config") or {}):
        where.pop("quantization_config", None)
    if quant is not None:
        config["quantization_config"] = quant.to_hf()
    path.write_text(json.dumps(config, indent=2))


def _rewrite_index(out_dir: Path, quantised: dict[str, Path]) -> None:
    """A sharded checkpoint's index names each new scale tensor's shard."""
    index = out_dir / "model.safetensors.index.json"
    if not index.is_file():
        return
    data = json.loads(index.read_text())
    for key, path in quantised.items():
        data["weight_map"][key + SCALE_SUFFIX] = path.name
    index.write_text(json.dumps(data, indent=2))

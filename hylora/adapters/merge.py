"""`hylora merge`: fold one adapter into the base weights and write a complete model directory.

The output keeps the input's layout (same files, shards, keys and dtypes; config, tokenizer and
every weight the adapter does not touch copied as they are), so whatever loads the base loads it.
Tower LoRA is folded into `model.visual.*` (the Conv3d patch embedding's delta reshaped to its kernel).

An FP8 checkpoint merges into an unquantised one: every FP8 weight is dequantised to the checkpoint's
dtype (config.json `dtype`, bfloat16 for Qwen's releases), the adapter is added, the block scales and
`quantization_config` are dropped. Adding the delta to FP8 values would need requantising the merged
weight, which rounds the adapter's small delta away block by block (docs/FP8.md measures it); serve
the FP8 base with the adapter dynamically instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file
from tqdm import tqdm

from hylora.adapters.files import LoRAWeight, read_adapter
from hylora.config import ModelConfig
from hylora.model.checkpoint_out import checkpoint_copy
from hylora.model.fp8 import set_quantization
from hylora.model.loader import SCALE_SUFFIX, TEXT_PREFIXES, VISION_PREFIX, open_shard, weight_files
from hylora.ops.fp8_linear.reference import dequantize_weight


def merge_adapter(model_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = ModelConfig.from_dir(model_dir)
    adapter = read_adapter(adapter_dir, config)
    files = weight_files(model_dir)
    scales = {k[: -len(SCALE_SUFFIX)]: p for k, p in files.items() if k.endswith(SCALE_SUFFIX)}
    block = config.quantization.weight_block_size if config.quantization else (128, 128)
    out_dtype = config.checkpoint_dtype

    deltas: dict[str, LoRAWeight] = {}
    for (layer, sub, module), w in adapter.weights.items():
        candidates = [f"{p}layers.{layer}.{sub}.{module}.weight" for p in TEXT_PREFIXES]
        key = next((k for k in candidates if k in files), None)
        if key is None:
            raise ValueError(f"base checkpoint has none of {candidates}")
        deltas[key] = w
    for module, w in adapter.tower.items():
        key = f"{VISION_PREFIX}{module}.weight"
        if key not in files:
            raise ValueError(f"base checkpoint has no {key}")
        deltas[key] = w

    with checkpoint_copy(model_dir, out_dir) as tmp:  # all or nothing: a failed run leaves no out_dir
        for path in tqdm(sorted(set(files.values())), desc="merging", unit="file", disable=not progress):
            with open_shard(path) as f:
                metadata = f.metadata()
                tensors = {}
                for key in f.keys():  # noqa: SIM118
                    if key.endswith(SCALE_SUFFIX):
                        continue
                    t = f.get_tensor(key)
                    if key in scales:
                        with open_shard(scales[key]) as sf:
                            t = dequantize_weight(t, sf.get_tensor(key + SCALE_SUFFIX).float(), block, out_dtype)
                    if key in deltas:
                        w = deltas[key]
                        t = (t.float() + w.delta().reshape(t.shape)).to(t.dtype)
                    tensors[key] = t.contiguous()
            save_file(tensors, tmp / path.name, metadata=metadata)
        if scales:
            _drop_scales_from_index(tmp)
            set_quantization(tmp, None)
    return out_dir


def _drop_scales_from_index(out_dir: Path) -> None:
    index = out_dir / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if not k.endswith(SCALE_SUFFIX)}
        index.write_text(json.dumps(data, indent=2))

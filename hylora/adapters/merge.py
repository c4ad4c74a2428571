"""`hylora merge`: fold one adapter into the base weights and write a complete model directory.

The output keeps the input's layout (same files, shards, keys and dtypes; config, tokenizer and
every weight the adapter does not touch copied as they are), so whatever loads the base loads it.
Tower LoRA is folded into `model.visual.*` (the Conv3d patch embedding's delta reshaped to its kernel).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from hylora.adapters.files import LoRAWeight, read_adapter
from hylora.config import ModelConfig
from hylora.model.loader import TEXT_PREFIXES, VISION_PREFIX, weight_files


def merge_adapter(model_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.resolve() == model_dir.resolve():
        raise ValueError("the output directory must differ from the model directory")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} is not empty")
    config = ModelConfig.from_dir(model_dir)
    adapter = read_adapter(adapter_dir, config)
    files = weight_files(model_dir)

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

    out_dir.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy2(item, out_dir / item.name)
    for path in tqdm(sorted(set(files.values())), desc="merging", unit="file", disable=not progress):
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
            tensors = {}
            for key in f.keys():  # noqa: SIM118
                t = f.get_tensor(key)
                if key in deltas:
                    w = deltas[key]
                    t = (t.float() + w.delta().reshape(t.shape)).to(t.dtype)
                tensors[key] = t.contiguous()
        save_file(tensors, out_dir / path.name, metadata=metadata)
    return out_dir

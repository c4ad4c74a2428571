"""The merged-weights reference without a second copy of the model: fold an adapter into the loaded
weights in place, run, and put the original rows back bit for bit.

`merged(model, adapter)` adds scale · B·A to exactly the rows each adapter projection owns (the
same placement the checkpoint loader and the LoRA registry use: `checkpoint_layout`, built from
model/packing.py), in fp32 and rounded once to the weight's dtype, as `hylora merge` does on disk.
On exit the touched rows are restored by one of two strategies:

- "copy": the touched rows are copied to host memory before folding and copied back (exact; costs
  host RAM equal to the touched rows: all of the text weights for an all-linear adapter);
- "checkpoint": the touched tensors are read again from the checkpoint and copied into their rows
  exactly as the loader did (exact, since the loader's copy is a plain cast; costs a read of those
  tensors from disk; needs the model directory the model was loaded from).

"auto" uses "copy" when the touched rows fit in half of the host memory available now, else
"checkpoint". Nothing else may run on the model while an adapter is folded in.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from hylora.adapters.files import LoRAAdapter, LoRAWeight
from hylora.model.loader import checkpoint_layout, parameter_name, weight_files

log = logging.getLogger(__name__)
Restore = Literal["auto", "copy", "checkpoint"]


@dataclass(frozen=True)
class Rows:
    """The rows of one model parameter that one adapter projection changes."""

    name: str  # checkpoint parameter name without the text prefix, e.g. layers.3.mlp.gate_proj.weight
    param: str  # hylora parameter holding them, e.g. layers.3.mlp.gate_up_proj.weight
    start: int
    count: int


def touched_rows(model: torch.nn.Module, adapter: LoRAAdapter) -> list[tuple[Rows, LoRAWeight]]:
    """Where each of the adapter's projections lands in the model's (possibly fused) parameters."""
    layout = checkpoint_layout(model)  # type: ignore[arg-type]
    wanted = {f"layers.{layer}.{sub}.{module}.weight": w for (layer, sub, module), w in adapter.weights.items()}
    wanted |= {f"visual.{module}.weight": w for module, w in adapter.tower.items()}
    missing = sorted(set(wanted) - set(layout))
    if missing:
        raise ValueError(f"adapter {adapter.name!r} targets parameters this model does not have: {missing[:5]}")
    return [(Rows(name, *layout[name]), w) for name, w in wanted.items()]


def touched_bytes(model: torch.nn.Module, adapter: LoRAAdapter) -> int:
    params = dict(model.named_parameters())
    total = 0
    for rows, _ in touched_rows(model, adapter):
        p = params[rows.param]
        total += rows.count * p[0].numel() * p.element_size()
    return total


@contextlib.contextmanager
def merged(
    model: torch.nn.Module,
    adapter: LoRAAdapter,
    restore: Restore = "auto",
    model_dir: str | Path | None = None,
) -> Iterator[str]:
    """Within the block `model` computes with `adapter` merged into its weights; afterwards every
    touched row holds its original bits again. Yields the restore strategy used."""
    if any(getattr(m, "is_fp8", False) for m in model.modules()):
        raise ValueError(
            "adapters merge into unquantised weights only: load the FP8 checkpoint dequantised "
            "(EngineConfig(quantization='dequantized')) for the reference"
        )
    plan = touched_rows(model, adapter)
    strategy = _choose(restore, touched_bytes(model, adapter), model_dir)
    params = dict(model.named_parameters())
    saved: dict[Rows, torch.Tensor] = {}
    done: list[Rows] = []
    try:
        with torch.no_grad():
            for rows, w in plan:
                block = params[rows.param].data[rows.start : rows.start + rows.count]
                if strategy == "copy":
                    saved[rows] = block.to("cpu", copy=True)
                delta = w.delta(block.device)
                done.append(rows)
                block.copy_((block.float() + delta.reshape(block.shape)).to(block.dtype))
        yield strategy
    finally:
        with torch.no_grad():
            if strategy == "copy":
                for rows in done:
                    params[rows.param].data[rows.start : rows.start + rows.count].copy_(saved.pop(rows))
            else:
                _reread(params, done, Path(model_dir))  # type: ignore[arg-type]


def _choose(restore: Restore, nbytes: int, model_dir: str | Path | None) -> Literal["copy", "checkpoint"]:
    if restore == "checkpoint" and model_dir is None:
        raise ValueError("restoring from the checkpoint needs the model directory")
    if restore != "auto":
        return restore
    if model_dir is None or nbytes <= _available_host_bytes() // 2:
        return "copy"
    log.info("adapter rows (%.1f GiB) do not fit in host memory: restoring from the checkpoint", nbytes / 2**30)
    return "checkpoint"


def _available_host_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown (not Linux): assume it fits


def _reread(params: dict[str, torch.nn.Parameter], rows: list[Rows], model_dir: Path) -> None:
    """Copy the checkpoint tensors behind `rows` into their rows, as the loader did."""
    by_name = {r.name: r for r in rows}
    by_file: dict[Path, list[tuple[str, Rows]]] = defaultdict(list)
    for key, path in weight_files(model_dir).items():
        name = parameter_name(key, vision=True)
        if name in by_name:
            by_file[path].append((key, by_name.pop(name)))
    if by_name:
        raise RuntimeError(f"cannot restore {sorted(by_name)[:5]}: not in the checkpoint at {model_dir}")
    for path, entries in by_file.items():
        with safe_open(str(path), framework="pt") as handle:
            for key, r in entries:
                tensor = handle.get_tensor(key)
                block = params[r.param].data[r.start : r.start + r.count]
                if tuple(tensor.shape) != tuple(block.shape):
                    shapes = f"{list(tensor.shape)}, not {list(block.shape)}"
                    raise RuntimeError(f"checkpoint tensor {key!r} has shape {shapes}")
                block.copy_(tensor)

"""A model directory as `--hf-overrides` makes it, for tools that read the directory themselves.

`hylora serve` merges vLLM's --hf-overrides over config.json in memory (`ModelConfig.from_dir`). `hylora
doctor` also builds transformers' reference from the directory, so it gets a directory instead: symlinks to
every file of the model's, and config.json written with the overrides merged, in a temporary directory
removed when the process exits.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hylora.config import ModelConfig, read_json_object
from hylora.json_merge import merge_json


def overridden_model_dir(model_dir: str | Path, overrides: dict[str, Any]) -> Path:
    """`model_dir` with `overrides` merged over its config.json (checked as `hylora serve` checks them)."""
    model_dir = Path(model_dir).resolve()
    ModelConfig.from_dir(model_dir, overrides)  # the same refusals as serve's (a misplaced key, a bad rope_type)
    merged = merge_json(read_json_object(model_dir / "config.json"), overrides)
    overlay = Path(tempfile.mkdtemp(prefix=f"hylora-{model_dir.name}-overrides-"))
    atexit.register(shutil.rmtree, overlay, ignore_errors=True)
    for item in model_dir.iterdir():
        if item.name != "config.json":
            (overlay / item.name).symlink_to(item)
    (overlay / "config.json").write_text(json.dumps(merged, indent=2))
    return overlay

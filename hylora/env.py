"""The environment variables hylora reads, all of them, here. Every knob is a flag and a config
field; the environment only says where files live and what the tools around hylora set.

- HYLORA_CACHE_DIR: where the demo model is written (default ~/.cache/hylora);
- TRITON_INTERPRET=1: Triton's own switch to its CPU interpreter (the tests run kernels that way);
- HYLORA_ALLOW_LONG_MAX_MODEL_LEN=1 (or vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN=1): a --max-model-len past the
  model's max_position_embeddings is served, not refused (as vLLM's variable);
- HYLORA_*: handed on as they are to Ray Serve replicas, which may start on other nodes;
- the whole environment, to the child processes that compile DeepGEMM's kernels at start-up (its
  DG_JIT_CACHE_DIR says where they are kept: kernels/warmup.py).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("HYLORA_CACHE_DIR") or Path.home() / ".cache" / "hylora")


def triton_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def allow_long_max_model_len() -> bool:
    return "1" in (os.environ.get("HYLORA_ALLOW_LONG_MAX_MODEL_LEN"), os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN"))


def hylora_variables() -> dict[str, str]:
    """Every HYLORA_* variable of this process."""
    return {k: v for k, v in os.environ.items() if k.startswith("HYLORA_")}


def child_environment(**overrides: str) -> dict[str, str]:
    """This process's environment with `overrides`, for a child process (e.g. kernels/warmup.py's
    compilers, which need this process's import path and DeepGEMM's DG_JIT_CACHE_DIR)."""
    return {**os.environ, **overrides}

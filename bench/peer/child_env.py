"""The environment of the peer harnesses' child processes (servers, engine phases, doctor)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def child_env(single_thread: bool = False) -> dict[str, str]:
    """This process's environment with the repo on PYTHONPATH, unbuffered output and no network
    lookups (Hub, usage stats); `single_thread`: one torch thread (shared CPU cores)."""
    env = dict(os.environ)
    paths = [str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(
        PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)),
        PYTHONUNBUFFERED="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    if single_thread:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env

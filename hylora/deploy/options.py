"""What a deployment is made of, from `hylora serve`'s own flags: the same parser reads the command
line and a Ray Serve builder's `args` (so there is one list of options and one set of defaults)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hylora.env import hylora_variables

TRUE = {"1", "true", "yes", "on"}


def serve_parser() -> argparse.ArgumentParser:
    from hylora.server.serve import add_serve_args

    parser = argparse.ArgumentParser(prog="hylora.deploy", add_help=False)
    add_serve_args(parser)
    return parser


def parse_config(config: Mapping[str, Any]) -> argparse.Namespace:
    """`hylora serve` flags given as a mapping (a builder's `args`: `serve run ... demo=true replicas=2`
    or a config file's `args:`). Keys are flag names with '_' or '-'; `model_dir` (or `model`) is
    the positional model directory; lists stand for repeated values, booleans for switches; a JSON flag
    takes a mapping or vLLM's dotted keys (`limit_mm_per_prompt.video: 0`)."""
    from hylora.server.vllm_argv import JSON_FLAGS, expand_dotted_args

    parser = serve_parser()
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    argv: list[str] = []
    for key, value in config.items():
        name, dot, path = key.partition(".")  # the JSON keys after the dot keep their spelling
        dest = name.replace("-", "_")
        flag = "--" + dest.replace("_", "-")
        if dot and flag in JSON_FLAGS:  # vLLM's dotted key: one key of the flag's JSON object
            argv += [f"{flag}.{path}", _text(value)]
            continue
        if dest in ("model_dir", "model"):
            argv.insert(0, str(value))
            continue
        action = actions.get(dest)
        if action is None:
            raise ValueError(f"unknown option {key!r} (use hylora serve's flag names, e.g. max_loras)")
        flag = next(o for o in action.option_strings if o.startswith("--"))
        if action.nargs == 0:  # a switch
            if value is True or str(value).lower() in TRUE:
                argv.append(flag)
        elif action.nargs in ("+", "*"):
            values = value.split() if isinstance(value, str) else list(value)
            if values:
                argv += [flag, *(_text(v) for v in values)]
        elif value is not None:
            argv += [flag, _text(value)]
    try:
        return parser.parse_args(expand_dotted_args(argv))
    except SystemExit:  # argparse has printed why
        raise ValueError(f"invalid hylora serve options: {argv}") from None


def _text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


@dataclass(frozen=True)
class ReplicaPlan:
    """How many engine replicas, and what each one reserves from Ray."""

    replicas: int
    gpus: float  # per replica: 1 pins one GPU (Ray sets CUDA_VISIBLE_DEVICES), 0 runs on CPU
    cpus: float = 1.0
    max_models: int = 4  # adapters a replica keeps for multiplexing = its device LoRA slots (max_loras)
    max_ongoing: int = 32  # requests a replica takes at once = its running sequences (max_num_seqs)

    @classmethod
    def from_args(cls, args: argparse.Namespace, cluster_gpus: float) -> ReplicaPlan:
        replicas = args.replicas if args.replicas is not None else 1
        if replicas < 1:
            raise ValueError("--replicas must be at least 1")
        gpus = args.replica_gpus
        if gpus is None:  # auto: one GPU each where the cluster has GPUs and the engine may use them
            gpus = 1.0 if cluster_gpus > 0 and args.device in (None, "cuda") else 0.0
        if gpus < 0:
            raise ValueError("--replica-gpus must be >= 0")
        if gpus == 0 and args.device == "cuda":
            raise ValueError("--device cuda needs GPU replicas: --replica-gpus 1 (or leave it out on a GPU cluster)")
        return cls(replicas, float(gpus), 1.0, max(1, args.max_loras), max(1, args.max_num_seqs))


def hylora_env() -> dict[str, str]:
    """HYLORA_* settings of this process, handed to every replica (they may start on other nodes)."""
    return hylora_variables()

"""Damaged adapter directories, reloaded over a working adapter: the weights file's bytes mutated, its
safetensors header edited (dtypes, shapes, names, lora_A / lora_B swapped), its tensor values set to NaN, inf,
the largest float or a denormal, and adapter_config.json's fields set to wrong types and values.

Each load either succeeds — and the adapter then gives finite logits — or raises AdapterError (a 400 naming
the fault), never another exception; and a refused reload loses nothing: the adapter it was to replace keeps
serving exactly the logits it gave before. The cases are seeded; an exploratory run of 900 of them found no
other exception.
"""

from __future__ import annotations

import json
import random
import shutil
import struct

import pytest
import torch

from hylora.adapters.files import AdapterError
from hylora.adapters.registry import AdapterRegistry
from hylora.generate import CachedRunner
from hylora.model.loader import load_model
from tests.helpers import random_ids
from tests.lora_helpers import peft_adapter

CASES = 160
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
FLOAT_VALUES = (b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\xff\xff\x7f\x7f", b"\x01\x00\x00\x00")  # NaN inf max tiny
CONFIG_VALUES = (None, 0, -1, 2**70, 1e308, "x", [], {}, [1, "a"], {"a": 1}, True, "all-linear", ".*", {"q_proj": -3})
CONFIG_KEYS = (
    "r",
    "lora_alpha",
    "target_modules",
    "rank_pattern",
    "alpha_pattern",
    "use_rslora",
    "layers_to_transform",
)
DTYPES = ("F16", "BF16", "F64", "I32", "I8", "U8", "BOOL", "F8_E4M3", "I64")


def _split(weights: bytes) -> tuple[dict, bytes]:
    size = struct.unpack("<Q", weights[:8])[0]
    return json.loads(weights[8 : 8 + size]), weights[8 + size :]


def _join(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def _bytes(weights: bytes, rng: random.Random) -> bytes:
    b = bytearray(weights)
    for _ in range(rng.choice((1, 2, 4, 16))):
        i = rng.randrange(len(b))
        if (op := rng.random()) < 0.6:
            b[i] = rng.randrange(256)
        elif op < 0.85:
            del b[i : i + rng.randrange(1, 64)]
        else:
            del b[max(i, 1) :]
    return bytes(b)


def _header(weights: bytes, rng: random.Random) -> bytes:
    header, data = _split(weights)
    names = [k for k in header if k != "__metadata__"]
    name, op = rng.choice(names), rng.random()
    if op < 0.3:
        header[name]["dtype"] = rng.choice(DTYPES)
    elif op < 0.6:
        shape = header[name]["shape"]
        header[name]["shape"] = rng.choice([[], [0], shape[::-1], [*shape, 1], shape[:1], [shape[0], 0], [1, 1]])
    elif op < 0.8:
        header[rng.choice(names) + rng.choice(["", ".x", "_"])] = header.pop(name)
    else:
        other = name.replace("lora_A", "lora_B") if "lora_A" in name else name.replace("lora_B", "lora_A")
        header[name], header[other] = header[other], header[name]
    return _join(header, data)


def _value(weights: bytes, rng: random.Random) -> bytes:
    _, data = _split(weights)
    start = len(weights) - len(data)
    b = bytearray(weights)
    i = start + 4 * rng.randrange(len(data) // 4)  # PEFT saves fp32: one whole float
    b[i : i + 4] = rng.choice(FLOAT_VALUES)
    return bytes(b)


def _config(config: bytes, rng: random.Random) -> bytes:
    fields = json.loads(config)
    fields[rng.choice(CONFIG_KEYS)] = rng.choice(CONFIG_VALUES)
    return json.dumps(fields).encode()


def damaged(good, out, k: int) -> str:
    """Write case `k` to `out`; return which part it damaged."""
    rng = random.Random(k)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(good, out)
    part = rng.choice(["bytes", "header", "value", "config"])
    if part == "config":
        (out / CONFIG).write_bytes(_config((good / CONFIG).read_bytes(), rng))
    else:
        mutate = {"bytes": _bytes, "header": _header, "value": _value}[part]
        (out / WEIGHTS).write_bytes(mutate((good / WEIGHTS).read_bytes(), rng))
    return part


@pytest.fixture(scope="module")
def served(causal_ckpt, tmp_path_factory):
    base_dir, hf = causal_ckpt
    good = tmp_path_factory.mktemp("adapter") / "good"
    peft_adapter(hf, good, seed=4, r=4, lora_alpha=8, target_modules="all-linear")
    model = load_model(base_dir, progress=False)
    registry = AdapterRegistry(model, max_loras=2, max_lora_rank=8)
    runner = CachedRunner(model, num_slots=2, num_pages=16, adapters=registry)
    return good, registry, runner


def _logits(runner: CachedRunner, adapter: str) -> torch.Tensor:
    seq = runner.add(adapter)
    try:
        return runner.step([(seq, random_ids(12, 320, seed=7))], all_logits=True)[0]
    finally:
        runner.release(seq)


def test_a_damaged_reload_is_refused_cleanly_or_serves_finite_logits(served, tmp_path):
    good, registry, runner = served
    registry.load("task", good)
    before = _logits(runner, "task")
    outcomes: dict[tuple[str, str], int] = {}
    for k in range(CASES):
        part = damaged(good, tmp_path / "case", k)
        digest = registry.get("task").digest
        try:
            registry.load("task", tmp_path / "case")
        except AdapterError as e:
            assert str(e).strip(), f"case {k} ({part}): an AdapterError without a message"
            assert registry.get("task").digest == digest, f"case {k} ({part}): a refused reload replaced the adapter"
            outcome = "refused"
        except Exception as e:  # noqa: BLE001 - what this test looks for
            pytest.fail(f"case {k} ({part}): {type(e).__name__} escaped, not an AdapterError: {e}")
        else:
            logits = _logits(runner, "task")
            assert torch.isfinite(logits).all(), f"case {k} ({part}): an accepted adapter gave non-finite logits"
            registry.load("task", good)  # back to the working files for the next case
            outcome = "loaded"
        outcomes[part, outcome] = outcomes.get((part, outcome), 0) + 1
    assert torch.equal(_logits(runner, "task"), before), "the working adapter's logits changed"
    # every kind of damage was tried, and the cases reached both outcomes
    assert {part for part, _ in outcomes} == {"bytes", "header", "value", "config"}, outcomes
    assert {outcome for _, outcome in outcomes} == {"refused", "loaded"}, outcomes

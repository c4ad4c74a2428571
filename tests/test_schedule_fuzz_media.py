"""Random media workloads through the engine's scheduling paths (the users' workload: one video to
several task adapters, beside images and text): whatever the mix, every request gets what it gets
alone.

Each seed draws requests from a few prompts (a video, an image, both, text, and a video the tower
gives NaN for) sent to the base model or a task adapter, with the same video often going to several
adapters (one content key: the encoder cache and shared encodes), arriving over the first steps, one
aborted and one made to fault at a random step; and a step size and encoder budget (from one image or
temporal patch per step up). It runs synchronously, planned ahead (padded short steps; the prefix
cache on), planned ahead with the encoder cache off, and synchronously with each temporal patch
encoded only as the prefill reaches it (no encode ahead). Against each request run alone on a
synchronous engine: the same tokens, logprobs within 1e-4; the aborted one a prefix of its tokens
alone, the faulted one an error, the poisoned video's requests the tower's numerical fault; every KV
page and state slot back.

`HYLORA_SCHEDULE_FUZZ_SEEDS=N` draws N workloads per configuration (default 4).
"""

from __future__ import annotations

import os
import random

import pytest

from hylora.engine import EngineConfig, LLMEngine, RequestOutput
from hylora.engine.multimodal import build_multimodal_prompt
from tests.engine_helpers import assert_all_freed, assert_each_as_alone, run
from tests.lora_helpers import peft_adapter
from tests.test_engine_media import LANGUAGE_TARGETS, media_items
from tests.test_schedule_fuzz import draw_params
from tests.vl_helpers import build_prompt, poison_tower

SEEDS = range(int(os.environ.get("HYLORA_SCHEDULE_FUZZ_SEEDS", "4")))
PROMPTS = {
    "video": [("text", 3), ("video", (3, 4, 4)), ("text", 6)],
    "image": [("text", 5), ("image", (1, 4, 6)), ("text", 7)],
    "both": [("text", 4), ("image", (1, 6, 4)), ("text", 9), ("video", (2, 4, 6)), ("text", 5)],
    "text": [("text", 30)],
    "poisoned": [("text", 4), ("video", (2, 4, 4)), ("text", 5)],  # the tower gives NaN for its 2nd patch
}
BASE = dict(device="cpu", max_model_len=256, max_num_seqs=4, max_lora_rank=8, fault_injection=True)
CONFIGS = {
    "sync": dict(async_scheduling=False, enable_prefix_caching=False),
    "ahead": dict(async_scheduling=True, padded_decode=True),
    "ahead-no-encoder-cache": dict(async_scheduling=True, padded_decode=True, encoder_cache_gb=0),
    "sync-segment-by-segment": dict(async_scheduling=False, encode_media_ahead=False),  # each patch as reached
}


@pytest.fixture(scope="module")
def prompts():
    return {name: build_prompt(parts, seed=30 + i) for i, (name, parts) in enumerate(PROMPTS.items())}


@pytest.fixture(scope="module")
def adapters(vl_media_ckpt, tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("fuzz_vl_adapters")
    for i, name in enumerate(("relic", "tomb")):
        peft_adapter(vl_media_ckpt[1], root / name, seed=80 + i, r=8, lora_alpha=16, target_modules=LANGUAGE_TARGETS)
    return {name: root / name for name in ("relic", "tomb")}


def new_engine(ckpt, adapters, prompts, **config) -> LLMEngine:
    """An engine whose tower gives non-finite rows for the poisoned video's second temporal patch."""
    engine = LLMEngine(ckpt, EngineConfig(**(BASE | config)), lora_modules=adapters, progress=False)
    (item,) = media_items(prompts["poisoned"], "poisoned")
    _, h, w = item.grid_thw
    poison_tower(engine, item.rows(h * w, 2 * h * w))
    return engine


def draw_workload(seed: int) -> tuple[list[tuple], dict, tuple[str, int], tuple[str, int]]:
    """(requests as (arrival step, id, prompt name, params, adapter), step sizes, (aborted, step),
    (faulted, step))."""
    rng = random.Random(seed)
    requests = []
    for i in range(rng.randint(4, 6)):
        name = rng.choice(["video", "video", "image", "both", "text", "poisoned"])
        adapter = rng.choice([None, "relic", "tomb"])
        requests.append((rng.choice([0, 0, 1, 3, 6]), f"r{i}", name, draw_params(rng), adapter))
    sizes = dict(max_num_batched_tokens=rng.choice([9, 24, 64]), max_num_encoder_tokens=rng.choice([6, 12, 16384]))
    ids = [r[1] for r in requests]
    aborted, faulted = rng.sample(ids, 2)
    return requests, sizes, (aborted, rng.randint(1, 12)), (faulted, rng.randint(0, 10))


def add(engine: LLMEngine, prompts, rid: str, name: str, params, adapter) -> None:
    p = prompts[name]
    mm = build_multimodal_prompt(p.ids, media_items(p, name), engine.model.config.vision) if name != "text" else None
    engine.add_request(rid, p.ids, params, adapter, mm=mm)


@pytest.fixture(scope="module")
def references(vl_media_ckpt, adapters, prompts) -> dict[int, dict[str, RequestOutput]]:
    outs = {}
    for seed in SEEDS:
        requests, sizes, *_ = draw_workload(seed)
        reference = new_engine(vl_media_ckpt[0], adapters, prompts, **CONFIGS["sync"], **sizes)
        outs[seed] = {}
        for _, rid, name, params, adapter in requests:
            add(reference, prompts, rid, name, params, adapter)
            outs[seed] |= run(reference, {})
    return outs


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_random_media_mix_gives_each_request_what_it_gets_alone(
    vl_media_ckpt, adapters, prompts, references, config, seed
):
    requests, sizes, (aborted, abort_step), (faulted, fault_step) = draw_workload(seed)
    engine = new_engine(vl_media_ckpt[0], adapters, prompts, **CONFIGS[config], **sizes)
    arrivals: dict[int, list[tuple]] = {}
    for step, *request in requests:
        arrivals.setdefault(step, []).append(request)
    done: dict[str, RequestOutput] = {}
    for step in range(10_000):
        for request in arrivals.get(step, []):
            add(engine, prompts, *request)
        if step == fault_step and faulted in engine.requests:
            engine.inject_fault(faulted, "nan")
        if step == abort_step:
            engine.abort(aborted)
        done |= {o.request_id: o for o in engine.step() if o.finished}
        if len(done) == len(requests) and not engine.has_unfinished():
            break
    poisoned = {rid for _, rid, name, _, _ in requests if name == "poisoned"}
    for rid in poisoned - {aborted, faulted}:  # fails as alone, whatever shares its tower calls and steps
        assert "non-finite values (NaN/Inf) in the vision tower" in done[rid].error, rid
    assert_each_as_alone(done, references[seed], aborted, faulted, poisoned=poisoned)
    assert_all_freed(engine)

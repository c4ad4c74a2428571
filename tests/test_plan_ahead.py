"""Plan ahead (engine/plan_ahead.py): a step with prompt chunks, or one that admits waiting requests,
is planned and queued before the step in flight is read.

On the CPU `padded_decode` drives the paths the GPU takes (padded decode and short steps run eagerly,
and steps are planned ahead). Against the same engine without async scheduling: the same tokens and
logprobs, whether the planned steps run as padded short steps or eagerly; the prefix cache still
keeps its snapshots; a fault, a stop or an abort while a planned step is in flight ends that request
alone and leaks nothing; a plan that would preempt is not queued ahead.
"""

from __future__ import annotations

import pytest
import torch

from hylora.engine import SamplingParams
from tests.engine_helpers import (
    assert_a_fault_ahead_fails_alone,
    assert_all_freed,
    greedy,
    make_engine,
    max_logprob_diff,
    run,
)
from tests.helpers import random_ids

CONFIG = dict(max_model_len=160, max_num_seqs=4, max_num_batched_tokens=24, padded_decode=True)
PATHS = {"short-steps": {}, "eager": {"max_short_step_tokens": 0}}


def engine(causal_ckpt, adapter_root, ahead: bool, **config):
    return make_engine(causal_ckpt[0], adapter_root, **dict(CONFIG, async_scheduling=ahead, **config))


def arrivals() -> dict[int, list[tuple]]:
    seeded = SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=5, logprobs=2, ignore_eos=True)
    return {
        0: [
            ("a", random_ids(50, 320, seed=1), greedy(10), None),
            ("b", random_ids(37, 320, seed=2), seeded, "gdn_attn"),
            ("c", random_ids(9, 320, seed=3), greedy(7, logit_bias={7: 3.0}), "rs_mlp"),
        ],
        4: [("late", random_ids(41, 320, seed=4), greedy(8), "all_linear")],  # its prompt joins decode rows
        5: [("short", random_ids(3, 320, seed=6), greedy(1), None)],  # samples its only token in its first step
    }


@pytest.mark.parametrize("path", list(PATHS))
def test_plan_ahead_gives_the_same_tokens_and_logprobs(causal_ckpt, engine_adapter_root, path):
    outs, engines = {}, {}
    for ahead in (False, True):
        e = engines[ahead] = engine(causal_ckpt, engine_adapter_root, ahead, **PATHS[path])
        outs[ahead] = run(e, arrivals())
        assert_all_freed(e)
    assert engines[False].prefill_steps_ahead == 0
    assert engines[True].prefill_steps_ahead >= 8  # the prompts' chunks, the admissions
    for rid, plain in outs[False].items():
        fast = outs[True][rid]
        assert fast.error is None and fast.token_ids == plain.token_ids, rid
        assert len(fast.token_ids) == {"a": 10, "b": 9, "c": 7, "late": 8, "short": 1}[rid]
        assert max_logprob_diff(fast, plain) <= 1e-5, rid
        assert fast.text == plain.text


def test_the_prefix_cache_keeps_its_snapshots(causal_ckpt, engine_adapter_root):
    prompt = random_ids(150, 320, seed=11)  # cached at 128 (a multiple of 64), chunked at 24 a step
    outs, hits = {}, {}
    for ahead in (False, True):
        e = engine(causal_ckpt, engine_adapter_root, ahead)
        other = ("other", random_ids(30, 320, seed=12), greedy(6), None)
        first = run(e, {0: [("first", prompt, greedy(4), None), other]})
        again = run(e, {0: [("again", prompt + [5, 6], greedy(4), None)]})
        outs[ahead], hits[ahead] = first | again, e.stats().prefix_cache_hits
        assert_all_freed(e)
        if ahead:
            assert e.prefill_steps_ahead > 4
    assert hits[True] == hits[False] >= 128
    for rid, plain in outs[False].items():
        assert outs[True][rid].token_ids == plain.token_ids, rid


@pytest.mark.parametrize("kind", ["nan", "raise"])
def test_a_fault_in_a_step_planned_ahead_fails_that_request_alone(causal_ckpt, engine_adapter_root, kind):
    faulty = ("faulty", random_ids(60, 320, seed=31), greedy(6), "all_linear")
    healthy = ("healthy", random_ids(45, 320, seed=32), greedy(6), None)
    e = assert_a_fault_ahead_fails_alone(
        lambda: engine(causal_ckpt, engine_adapter_root, True),
        kind,
        faulty,
        healthy,
        steps=1,
        in_flight=lambda chunks: any(c.num_tokens > 1 for c in chunks),  # a prefill step planned ahead
    )
    assert_all_freed(e)


def test_a_stop_or_an_abort_while_a_planned_step_is_in_flight(causal_ckpt, engine_adapter_root):
    prompt = random_ids(30, 320, seed=41)
    probe = run(engine(causal_ckpt, engine_adapter_root, False), {0: [("p", prompt, greedy(6), None)]})["p"]
    stops = ("s", prompt, greedy(6, stop_token_ids=[probe.token_ids[0]]), None)  # stops on its first token
    keep = ("keep", random_ids(52, 320, seed=42), greedy(8), "gdn_attn")
    gone = ("gone", random_ids(70, 320, seed=43), greedy(8), None)
    alone = run(engine(causal_ckpt, engine_adapter_root, True), {0: [keep]})["keep"]
    e = engine(causal_ckpt, engine_adapter_root, True)
    for r in (stops, keep, gone):
        e.add_request(*r)
    done = {}
    for _ in range(3):
        done |= {o.request_id: o for o in e.step() if o.finished}
    assert e._inflight is not None and any(c.request.request_id == "gone" for c in e._inflight.chunks)
    assert e.abort("gone")
    done |= run(e, {})
    assert done["s"].finish_reason == "stop" and done["s"].token_ids == probe.token_ids[:1]
    assert done["gone"].finish_reason == "abort"
    assert done["keep"].error is None and done["keep"].token_ids == alone.token_ids
    assert e.prefill_steps_ahead >= 2
    assert_all_freed(e)


def test_a_plan_that_would_preempt_waits_for_the_read(causal_ckpt, engine_adapter_root):
    # 12 pages of 16 tokens cannot hold three 60 + 40 token requests at once
    config = dict(max_model_len=128, num_pages=12, max_num_batched_tokens=32)
    requests = [
        (f"p{i}", random_ids(60, 320, seed=70 + i), greedy(40), a)
        for i, a in enumerate([None, "gdn_attn", "all_linear"])
    ]
    outs = {ahead: run(engine(causal_ckpt, engine_adapter_root, ahead, **config), {0: requests}) for ahead in (0, 1)}
    assert sum(o.num_preemptions for o in outs[1].values()) > 0
    for rid, plain in outs[0].items():
        assert outs[1][rid].error is None and outs[1][rid].token_ids == plain.token_ids, rid


@pytest.mark.parametrize(
    "params",
    [greedy(6, repetition_penalty=1.3), SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0)],
    ids=["repetition-penalty", "min-tokens"],
)
def test_a_draw_that_needs_the_host_is_not_planned_past(causal_ckpt, engine_adapter_root, params):
    prompt, other = random_ids(26, 320, seed=51), ("y", random_ids(40, 320, seed=52), greedy(6), None)
    outs = {}
    for ahead in (False, True):
        e = engine(causal_ckpt, engine_adapter_root, ahead)
        outs[ahead] = run(e, {0: [("x", prompt, params, None), other]})
        assert_all_freed(e)
    assert outs[True]["x"].token_ids == outs[False]["x"].token_ids
    assert outs[True]["y"].token_ids == outs[False]["y"].token_ids


def test_prompt_logprobs_are_the_same(causal_ckpt, engine_adapter_root):
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1)
    reqs = [("x", random_ids(55, 320, seed=61), params, "rs_mlp"), ("y", random_ids(33, 320, seed=62), greedy(5), None)]
    outs = {ahead: run(engine(causal_ckpt, engine_adapter_root, ahead), {0: reqs}) for ahead in (False, True)}
    plain, fast = outs[False]["x"], outs[True]["x"]
    assert fast.token_ids == plain.token_ids and len(fast.prompt_logprobs) == 55
    for a, b in zip(fast.prompt_logprobs[1:], plain.prompt_logprobs[1:], strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= 1e-5


def media_engines(vl_media_ckpt, poison: str | None = None, kind: str = "raise") -> tuple[dict, dict, dict]:
    """Images and videos (their chunks wait for the encoder budget) with a text request, on an engine
    without and one with async scheduling: (outputs, engines, which of each engine's encodes ran while a
    step was planned ahead). `poison`: the tower raises on that request's media (`kind` "raise") or
    gives non-finite rows for them ("nan"). Each engine's `launched` lists the request ids of each step
    it queued."""
    from hylora.engine import EngineConfig, LLMEngine
    from hylora.engine.multimodal import build_multimodal_prompt
    from tests.test_engine_media import PROMPTS, media_items
    from tests.vl_helpers import build_prompt, poison_tower

    prompts = {name: build_prompt(parts, seed=10 + i) for i, (name, parts) in enumerate(PROMPTS.items())}
    text = build_prompt([("text", 30)], seed=99)
    outs, engines, encodes = {}, {}, {}
    for ahead in (False, True):
        config = EngineConfig(
            device="cpu", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=16, max_num_encoder_tokens=12,
            padded_decode=True, async_scheduling=ahead,
        )  # fmt: skip
        e = engines[ahead] = LLMEngine(vl_media_ckpt[0], config, progress=False)
        planning, encodes[ahead] = [], []
        real_plan, real_prepare = e._plan_ahead, e.media.prepare

        def plan(*args, real_plan=real_plan, planning=planning):
            planning.append(True)
            try:
                return real_plan(*args)
            finally:
                planning.pop()

        def prepare(chunks, step, real_prepare=real_prepare, planning=planning, encodes=encodes[ahead]):
            encodes.extend((c.request.request_id, bool(planning)) for c in chunks if c.media)
            return real_prepare(chunks, step)

        e.launched = []

        def launch(chunks, *args, real_launch=e._launch, launched=e.launched, **kw):
            launched.append([c.request.request_id for c in chunks])
            return real_launch(chunks, *args, **kw)

        e._plan_ahead, e.media.prepare, e._launch = plan, prepare, launch
        for name, p in [*prompts.items(), ("text", text)]:
            mm = build_multimodal_prompt(p.ids, media_items(p, name), e.model.config.vision) if name != "text" else None
            if name == poison:
                assert mm is not None
                _, h, w = mm.items[0].grid_thw
                poison_tower(e, mm.items[0].rows(0, h * w), kind)  # its first segment's rows
            e.add_request(name, p.ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0), mm=mm)
        outs[ahead] = run(e, {})
        assert_all_freed(e)
    return outs, engines, encodes


def test_media_requests_beside_text_are_the_same(vl_media_ckpt):
    """Images and videos with text requests: media encoded while their step is planned ahead (the tower
    queued behind the step in flight), and the decode rows of media requests planned ahead keep their
    M-RoPE positions. The same tokens and logprobs as without async scheduling."""
    outs, engines, encodes = media_engines(vl_media_ckpt)
    assert engines[True].prefill_steps_ahead >= 3 and engines[True].steps_ahead >= 2
    assert not any(ahead for _, ahead in encodes[False])
    assert any(ahead for _, ahead in encodes[True])  # some media encoded for a step planned ahead
    for rid, plain in outs[False].items():
        assert outs[True][rid].token_ids == plain.token_ids, rid
        assert max_logprob_diff(outs[True][rid], plain) <= 1e-5, rid


@pytest.mark.parametrize("kind", ["raise", "nan"])
def test_media_that_fail_to_encode_ahead_fail_their_request_alone(vl_media_ckpt, kind):
    """The tower raises on one request's video, or gives non-finite rows for it, while its step is
    planned ahead: that request ends with the error it gets without async scheduling, every other
    request gives the same tokens and logprobs, and nothing stays held."""
    poison = "video_odd_t"
    outs, engines, encodes = media_engines(vl_media_ckpt, poison, kind)
    assert (poison, True) in encodes[True]  # its media were encoded for a step planned ahead
    want = "encoding its media failed" if kind == "raise" else "non-finite values (NaN/Inf) in the vision tower"
    for ahead in (False, True):
        bad = outs[ahead][poison]
        assert bad.finish_reason == "error" and want in bad.error, (ahead, bad.error)
        if kind == "nan":  # checked once its step is queued (the tower overlaps the host's building)
            assert any(poison in ids for ids in engines[ahead].launched), ahead
            # no non-finite rows enter the encoder cache
            assert all(bool(torch.isfinite(v).all()) for v in engines[ahead].encoder_cache._entries.values())
    for rid, plain in outs[False].items():
        if rid != poison:
            assert plain.error is None and outs[True][rid].token_ids == plain.token_ids, rid
            assert max_logprob_diff(outs[True][rid], plain) <= 1e-5, rid


def test_lora_slot_waits_and_a_grammar_are_the_same(causal_ckpt, engine_adapter_root):
    """One LoRA slot for three adapters (requests wait for it; admissions planned ahead take it as
    it frees), and a request under a grammar admitted into a planned step (its first mask is the
    grammar's start; the steps after its draws are planned once they are read)."""
    from hylora.structured import StructuredSpec

    requests = [
        (f"r{i}", random_ids(20 + 9 * i, 320, seed=70 + i), greedy(5 + i), a)
        for i, a in enumerate(["gdn_attn", "rs_mlp", None, "all_linear", "gdn_attn"])
    ]
    outs, engines = {}, {}
    for ahead in (False, True):
        e = engines[ahead] = engine(causal_ckpt, engine_adapter_root, ahead, max_loras=1)
        grammar = e.grammar_compiler().compile_blocking(StructuredSpec("regex", "[a-z ]{1,40}"))
        prompt = random_ids(25, 320, seed=80)

        def arrive(step, e=e, grammar=grammar, prompt=prompt):
            if step == 3:
                e.add_request("g", prompt, greedy(12), None, grammar=grammar)

        outs[ahead] = run(e, {0: requests}, before_step=arrive)
        assert_all_freed(e)
    assert engines[True].prefill_steps_ahead >= 5
    assert set(outs[True]) == {"g", *(r[0] for r in requests)}
    for rid, plain in outs[False].items():
        assert outs[True][rid].error is None and outs[True][rid].token_ids == plain.token_ids, rid
    assert all(c.isalpha() or c == " " for c in outs[True]["g"].text)

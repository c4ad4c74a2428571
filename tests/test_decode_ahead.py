"""Decode ahead (async scheduling): the next decode step is queued before the current one is read.

On the CPU the engine runs its padded decode step eagerly (tests.decode_helpers.padded), the same
code the CUDA graphs replay, so the decisions around it are tested here: the same tokens and
logprobs as without decode ahead, nothing leaked past a stop, a request aborted or failed while a
step is in flight ends alone, every page and slot comes back, and rows that need the host's view
of the tokens (grammar, penalties, min_tokens) are never planned ahead.
"""

from __future__ import annotations

import argparse

import pytest

from hylora.engine import SamplingParams
from tests.decode_helpers import padded
from tests.engine_helpers import (
    assert_a_fault_ahead_fails_alone,
    assert_all_freed,
    greedy,
    make_engine,
    max_logprob_diff,
    run,
)
from tests.helpers import random_ids

CONFIG = dict(max_model_len=160, max_num_seqs=4, max_num_batched_tokens=256)


def engine(causal_ckpt, adapter_root, ahead: bool, **config):
    return padded(make_engine(causal_ckpt[0], adapter_root, **dict(CONFIG, async_scheduling=ahead, **config)))


def test_decode_ahead_gives_the_same_tokens_and_logprobs(causal_ckpt, engine_adapter_root):
    seeded = SamplingParams(max_tokens=11, temperature=0.8, top_p=0.9, seed=5, logprobs=1, ignore_eos=True)
    biased = greedy(9, logit_bias={7: 3.0, 11: -100.0})
    arrivals = {
        0: [
            ("a", random_ids(23, 320, seed=1), greedy(14), None),
            ("b", random_ids(40, 320, seed=2), seeded, "gdn_attn"),
            ("c", random_ids(9, 320, seed=3), biased, "rs_mlp"),
        ],
        6: [("late", random_ids(17, 320, seed=4), greedy(10), "all_linear")],  # joins mid-decode
    }
    outs = {}
    for ahead in (False, True):
        e = engine(causal_ckpt, engine_adapter_root, ahead)
        outs[ahead] = run(e, arrivals)
        assert_all_freed(e)
        if ahead:
            assert e.runner.decode.ahead >= 10  # most decode steps were planned ahead
    for rid in ("a", "b", "c", "late"):
        plain, fast = outs[False][rid], outs[True][rid]
        assert fast.error is None and fast.token_ids == plain.token_ids, rid
        assert len(fast.token_ids) == {"a": 14, "b": 11, "c": 9, "late": 10}[rid]
        assert max_logprob_diff(fast, plain) <= 1e-5, rid
        assert fast.text == plain.text


def test_a_full_server_with_a_queue_still_decodes_ahead(causal_ckpt, engine_adapter_root):
    # two running places, five requests: three wait the whole time the first two decode
    arrivals = {0: [(f"q{i}", random_ids(15 + 7 * i, 320, seed=50 + i), greedy(10 + 3 * i), None) for i in range(5)]}
    outs = {}
    for ahead in (False, True):
        e = engine(causal_ckpt, engine_adapter_root, ahead, max_num_seqs=2)
        outs[ahead] = run(e, arrivals)
        assert_all_freed(e)
        if ahead:
            assert e.runner.decode.ahead >= 35  # also while requests waited (20 once none waits)
    for rid, plain in outs[False].items():
        assert outs[True][rid].error is None and outs[True][rid].token_ids == plain.token_ids, rid
        assert max_logprob_diff(outs[True][rid], plain) <= 1e-4, rid


def test_a_stop_while_the_next_step_is_in_flight_leaks_nothing(causal_ckpt, engine_adapter_root):
    prompt = random_ids(30, 320, seed=11)
    probe = run(engine(causal_ckpt, engine_adapter_root, False), {0: [("p", prompt, greedy(12), None)]})["p"]
    stop_at = probe.token_ids[4]  # the fifth greedy token is this request's stop token
    first = probe.token_ids.index(stop_at)
    params = greedy(12, stop_token_ids=[stop_at])
    other = ("o", random_ids(25, 320, seed=12), greedy(12), "rs_mlp")
    outs = {}
    for ahead in (False, True):
        e = engine(causal_ckpt, engine_adapter_root, ahead)
        outs[ahead] = run(e, {0: [("s", prompt, params, None), other]})
        assert_all_freed(e)
    for out in (outs[False]["s"], outs[True]["s"]):
        assert out.finish_reason == "stop" and out.token_ids == probe.token_ids[: first + 1]
    assert outs[True]["o"].token_ids == outs[False]["o"].token_ids


def test_abort_while_a_step_is_in_flight(causal_ckpt, engine_adapter_root):
    e = engine(causal_ckpt, engine_adapter_root, True)
    e.add_request("keep", random_ids(20, 320, seed=21), greedy(12), "gdn_attn")
    e.add_request("gone", random_ids(28, 320, seed=22), greedy(12), None)
    streamed = {"keep": [], "gone": []}
    for _ in range(4):
        for o in e.step():
            streamed[o.request_id] += o.new_token_ids
    assert e._inflight is not None  # a decode step is queued and not read
    assert e.abort("gone")
    done = {}
    while e.has_unfinished():
        for o in e.step():
            streamed[o.request_id] += o.new_token_ids
            if o.finished:
                done[o.request_id] = o
    assert done["gone"].finish_reason == "abort" and done["gone"].token_ids == streamed["gone"]
    alone = run(
        engine(causal_ckpt, engine_adapter_root, True),
        {0: [("keep", random_ids(20, 320, seed=21), greedy(12), "gdn_attn")]},
    )
    assert done["keep"].token_ids == alone["keep"].token_ids == streamed["keep"]
    assert_all_freed(e)


@pytest.mark.parametrize("kind", ["nan", "raise"])
def test_a_fault_in_a_step_planned_ahead_fails_that_request_alone(causal_ckpt, engine_adapter_root, kind):
    faulty = ("faulty", random_ids(33, 320, seed=31), greedy(12), "all_linear")
    healthy = ("healthy", random_ids(45, 320, seed=32), greedy(12), None)
    e = assert_a_fault_ahead_fails_alone(
        lambda: engine(causal_ckpt, engine_adapter_root, True), kind, faulty, healthy, 3
    )
    assert_all_freed(e)


@pytest.mark.parametrize(
    "params",
    [
        greedy(8, repetition_penalty=1.3),
        greedy(8, frequency_penalty=0.5),
        SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0),
    ],
    ids=["repetition-penalty", "frequency-penalty", "min-tokens"],
)
def test_rows_that_need_the_host_view_of_tokens_are_not_planned_ahead(causal_ckpt, engine_adapter_root, params):
    prompt = random_ids(26, 320, seed=41)
    outs = {}
    for ahead in (False, True):
        e = engine(causal_ckpt, engine_adapter_root, ahead)
        outs[ahead] = run(e, {0: [("x", prompt, params, None), ("y", random_ids(12, 320, seed=42), greedy(8), None)]})
        if ahead:
            assert e.runner.decode.ahead == 0
    assert outs[True]["x"].token_ids == outs[False]["x"].token_ids


def test_flags_and_device_defaults(causal_ckpt):
    from hylora.engine import EngineConfig
    from hylora.server.serve import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args(["m"]).async_scheduling and not p.parse_args(["m", "--no-async-scheduling"]).async_scheduling
    assert p.parse_args(["m"]).max_num_batched_tokens is None  # the engine picks it for the device
    assert make_engine(causal_ckpt[0]).config.max_num_batched_tokens == 2048  # CPU
    assert EngineConfig().for_device("cuda").max_num_batched_tokens == 8192  # vLLM's serving default
    assert EngineConfig(max_num_batched_tokens=512).for_device("cuda").max_num_batched_tokens == 512
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=0)


def test_a_request_under_a_grammar_is_not_planned_ahead(causal_ckpt, engine_adapter_root):
    from hylora.structured import StructuredSpec

    prompt, other = random_ids(20, 320, seed=61), ("y", random_ids(18, 320, seed=62), greedy(12), None)
    outs = {}
    for ahead in (False, True):
        e = engine(causal_ckpt, engine_adapter_root, ahead)
        grammar = e.grammar_compiler().compile_blocking(StructuredSpec("regex", "[a-z ]{1,40}"))
        e.add_request("x", prompt, greedy(12), None, grammar=grammar)  # its mask follows each token
        e.add_request(*other)
        outs[ahead] = run(e, {})
        if ahead:
            assert e.runner.decode.ahead == 0
    assert outs[True]["x"].text == outs[False]["x"].text and outs[True]["x"].error is None
    assert all(c.isalpha() or c == " " for c in outs[True]["x"].text)

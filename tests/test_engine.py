"""The serving engine: continuous batching with chunked prefill, mixed adapters, preemption, abort."""

from __future__ import annotations

import pytest

from hylora.engine import SamplingParams
from tests.engine_helpers import ADAPTERS, free_pages, greedy, make_engine, max_logprob_diff, run, run_alone
from tests.helpers import random_ids

ATOL = 1e-4


@pytest.fixture(scope="module")
def adapter_root(engine_adapter_root):
    return engine_adapter_root


@pytest.fixture(scope="module")
def alone_engine(causal_ckpt, adapter_root):
    """Runs each request by itself, whole prompt in one step."""
    return make_engine(causal_ckpt[0], adapter_root, max_model_len=3100, max_num_batched_tokens=4096, max_num_seqs=2)


def test_24_staggered_requests_with_chunking_equal_each_alone(causal_ckpt, adapter_root, alone_engine):
    lengths = [
        1,
        2,
        5,
        17,
        63,
        64,
        65,
        100,
        127,
        128,
        129,
        200,
        255,
        256,
        257,
        400,
        511,
        512,
        513,
        777,
        1024,
        1500,
        2048,
        3000,
    ]
    adapters = [None, *ADAPTERS]
    requests = [(f"r{i}", random_ids(n, 320, seed=i), greedy(), adapters[i % 4]) for i, n in enumerate(lengths)]
    arrivals: dict[int, list[tuple]] = {}
    for i, req in enumerate(requests):
        arrivals.setdefault(2 * (i // 3), []).append(req)  # three new requests every other step
    engine = make_engine(causal_ckpt[0], adapter_root, max_model_len=3100, max_num_batched_tokens=256, max_num_seqs=8)
    batched = run(engine, arrivals)
    for rid, prompt, params, adapter in requests:
        alone = run_alone(alone_engine, rid, prompt, params, adapter)
        assert batched[rid].token_ids == alone.token_ids, (rid, len(prompt), adapter)
        assert max_logprob_diff(batched[rid], alone) <= ATOL, (rid, len(prompt), adapter)
    assert free_pages(engine) == engine.kv.num_pages and engine.states.num_free == engine.states.num_slots


@pytest.mark.parametrize("chunk", [1, 7, 64, 512])
def test_chunked_prefill_equals_whole_prefill(causal_ckpt, adapter_root, alone_engine, chunk):
    prompt = random_ids(300 if chunk == 1 else 700, 320, seed=chunk)
    params = greedy(max_tokens=4, prompt_logprobs=1)
    whole = run_alone(alone_engine, "whole", prompt, params, "rs_mlp")
    engine = make_engine(causal_ckpt[0], adapter_root, max_model_len=1024, max_num_batched_tokens=chunk, max_num_seqs=2)
    chunked = run_alone(engine, "chunked", prompt, params, "rs_mlp")
    assert chunked.token_ids == whole.token_ids
    assert max_logprob_diff(chunked, whole) <= ATOL
    assert chunked.prompt_logprobs[0] is None and len(chunked.prompt_logprobs) == len(prompt)
    for a, b in zip(chunked.prompt_logprobs[1:], whole.prompt_logprobs[1:], strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= ATOL


def test_preemption_and_resume_give_identical_output(causal_ckpt, adapter_root, alone_engine):
    # 12 pages of 16 tokens cannot hold three 60 + 40 token requests at once
    engine = make_engine(causal_ckpt[0], adapter_root, max_model_len=128, num_pages=12, max_num_batched_tokens=64)
    requests = [
        (f"p{i}", random_ids(60, 320, seed=70 + i), greedy(max_tokens=40), a)
        for i, a in enumerate([None, "gdn_attn", "all_linear"])
    ]
    out = run(engine, {0: requests})
    assert sum(o.num_preemptions for o in out.values()) > 0
    for rid, prompt, params, adapter in requests:
        alone = run_alone(alone_engine, rid, prompt, params, adapter)
        assert out[rid].token_ids == alone.token_ids
        assert max_logprob_diff(out[rid], alone) <= ATOL
    assert free_pages(engine) == 12


def test_exhausted_slots_queue_requests_instead_of_failing(causal_ckpt, adapter_root):
    engine = make_engine(causal_ckpt[0], adapter_root, max_model_len=64, max_num_seqs=2, max_loras=1)
    requests = [(f"q{i}", random_ids(10, 320, seed=i), greedy(4), ADAPTERS[i % 2]) for i in range(6)]
    out = run(engine, {0: requests})
    assert all(o.finish_reason == "length" and len(o.token_ids) == 4 for o in out.values())


def test_abort_mid_prefill_frees_pages_and_slot(causal_ckpt, adapter_root):
    engine = make_engine(causal_ckpt[0], adapter_root, max_model_len=2048, max_num_batched_tokens=64)
    pages, slots = free_pages(engine), engine.states.num_free
    engine.add_request("long", random_ids(1000, 320, seed=1), greedy(), "gdn_attn")
    engine.step()
    engine.step()
    assert free_pages(engine) < pages and engine.states.num_free == slots - 1
    assert engine.abort("long")
    (out,) = engine.step()
    assert out.finished and out.finish_reason == "abort"
    assert free_pages(engine) == pages and engine.states.num_free == slots
    assert engine.adapters.stats()["leases"]["gdn_attn"] == 0
    assert not engine.abort("long")


def test_seeded_sampling_is_reproducible_across_runs_and_batches(causal_ckpt, adapter_root):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    prompt = random_ids(40, 320, seed=5)
    first = run_alone(make_engine(causal_ckpt[0], adapter_root), "a", prompt, params, "rs_mlp")
    engine = make_engine(causal_ckpt[0], adapter_root, max_num_batched_tokens=32)
    others = [
        (f"o{i}", random_ids(30 + i, 320, seed=i), SamplingParams(max_tokens=9, temperature=1.0), None)
        for i in range(4)
    ]
    mixed = run(engine, {0: others[:2], 1: [("a", prompt, params, "rs_mlp")], 2: others[2:]})["a"]
    assert mixed.token_ids == first.token_ids
    other_seed = run_alone(engine, "b", prompt, SamplingParams(**{**params.__dict__, "seed": 99}), "rs_mlp")
    assert other_seed.token_ids != first.token_ids

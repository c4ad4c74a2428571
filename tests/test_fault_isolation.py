"""A numerical fault fails one request, never its neighbours, never the next request."""

from __future__ import annotations

import pytest
import torch

from tests.engine_helpers import free_pages, greedy, make_engine, run, run_alone
from tests.helpers import random_ids


@pytest.fixture(scope="module")
def adapter_root(engine_adapter_root):
    return engine_adapter_root


def engine(causal_ckpt, adapter_root):
    # two sequences at a time, so later requests reuse the faulted request's slot and pages
    return make_engine(causal_ckpt[0], adapter_root, max_model_len=3100, max_num_seqs=2, max_num_batched_tokens=512)


def same(a, b) -> bool:
    """Bit-identical tokens and logprobs."""
    return a.token_ids == b.token_ids and all(
        x.logprob == y.logprob and x.top == y.top for x, y in zip(a.logprobs, b.logprobs, strict=True)
    )


def test_fault_fails_one_request_and_neighbours_continue_unchanged(causal_ckpt, adapter_root):
    faulty = ("faulty", random_ids(50, 320, seed=1), greedy(10), "gdn_attn")
    healthy = ("healthy", random_ids(70, 320, seed=2), greedy(10), "rs_mlp")
    # Reference: no fault, and `faulty` ends normally in the step where it will fail below, so every
    # step has the same batch composition (CPU GEMMs are not bit-stable across batch shapes).
    ends_there = ("faulty", faulty[1], greedy(2), "gdn_attn")
    reference = run(engine(causal_ckpt, adapter_root), {0: [ends_there, healthy]})
    e = engine(causal_ckpt, adapter_root)
    e.add_request(*faulty)
    e.add_request(*healthy)
    e.step()  # both prefilled
    e.inject_fault("faulty")  # its state slot and KV pages are now NaN
    out = run(e, {})
    assert out["faulty"].finish_reason == "error"
    assert "numerical fault" in out["faulty"].error and "'gdn_attn'" in out["faulty"].error
    assert "engine step 2" in out["faulty"].error
    assert same(out["healthy"], reference["healthy"])
    assert free_pages(e) == e.kv.num_pages and e.states.num_free == e.states.num_slots
    assert torch.isfinite(e.kv.k).all() and torch.isfinite(e.states.recurrent).all()  # scrubbed


def test_no_pollution_after_fault_or_long_request(causal_ckpt, adapter_root):
    short = ("short", random_ids(20, 320, seed=3), greedy(12), "all_linear")
    fresh = run_alone(engine(causal_ckpt, adapter_root), *short)

    e = engine(causal_ckpt, adapter_root)
    e.add_request("bad", random_ids(300, 320, seed=4), greedy(5), "all_linear")
    e.inject_fault("bad")
    assert run(e, {})["bad"].finish_reason == "error"
    assert same(run_alone(e, *short), fresh)

    long = run(e, {0: [("long", random_ids(3000, 320, seed=5), greedy(4), None)]})["long"]
    assert long.finish_reason == "length"
    after_long = run_alone(e, "short2", *short[1:])
    assert same(after_long, fresh)


def test_fault_during_prefill_chunk(causal_ckpt, adapter_root):
    e = make_engine(causal_ckpt[0], adapter_root, max_model_len=1024, max_num_batched_tokens=64)
    e.add_request("p", random_ids(500, 320, seed=6), greedy(3), None)
    e.step()
    e.inject_fault("p")
    out = run(e, {})["p"]
    assert out.finish_reason == "error" and "on the base model" in out.error and out.token_ids == []

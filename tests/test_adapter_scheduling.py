"""Adapter-aware admission: a request waiting for a LoRA slot does not hold up requests whose adapter
is already resident (or that use none), it is not starved by them, and every output still equals
the request run alone."""

from __future__ import annotations

import pytest

from hylora.engine import scheduler as scheduler_module
from tests.engine_helpers import greedy, make_engine, max_logprob_diff, run_alone
from tests.helpers import random_ids


def running_ids(engine) -> set[str]:
    return {r.request_id for r in engine.scheduler.running}


def test_resident_adapter_and_base_requests_pass_one_waiting_for_a_slot(causal_ckpt, engine_adapter_root):
    engine = make_engine(causal_ckpt[0], engine_adapter_root, max_model_len=96, max_num_seqs=4, max_loras=1)
    order = [("a1", "gdn_attn", 10), ("b1", "rs_mlp", 4), ("a2", "gdn_attn", 4), ("base", None, 4)]
    prompts = {rid: random_ids(9 + i, 320, seed=60 + i) for i, (rid, *_) in enumerate(order)}
    for rid, adapter, n in order:
        engine.add_request(rid, prompts[rid], greedy(n), adapter)
    engine.step()
    # strict FCFS would run a1 alone: b1 needs the one slot, and a2 and base queue behind it
    assert running_ids(engine) == {"a1", "a2", "base"}
    done, finished_at = {}, {}
    for step in range(1, 200):
        for out in engine.step():
            if out.finished:
                done[out.request_id], finished_at[out.request_id] = out, step
        if not engine.has_unfinished():
            break
    assert finished_at["b1"] >= max(finished_at["a1"], finished_at["a2"])  # it got the slot once they left
    for rid, adapter, n in order:
        alone = run_alone(make_engine(causal_ckpt[0], engine_adapter_root), rid, prompts[rid], greedy(n), adapter)
        assert done[rid].token_ids == alone.token_ids, rid
        assert max_logprob_diff(done[rid], alone) <= 1e-4, rid


def test_a_request_waiting_for_a_slot_is_not_starved(causal_ckpt, engine_adapter_root, monkeypatch):
    """A steady stream of requests for the resident adapter would keep its slot forever; after
    LORA_WAIT_STEPS the waiting request's turn comes anyway."""
    monkeypatch.setattr(scheduler_module, "LORA_WAIT_STEPS", 3)
    engine = make_engine(causal_ckpt[0], engine_adapter_root, max_model_len=96, max_num_seqs=3, max_loras=1)
    engine.add_request("a0", random_ids(8, 320, seed=1), greedy(5), "gdn_attn")
    engine.step()
    engine.add_request("b", random_ids(8, 320, seed=2), greedy(3), "rs_mlp")
    b_done_at, arrivals = None, 0
    for step in range(200):
        if step < 60:  # a new request for the resident adapter every step
            engine.add_request(f"a{step + 1}", random_ids(8, 320, seed=10 + step), greedy(5), "gdn_attn")
            arrivals += 1
        for out in engine.step():
            if out.request_id == "b" and out.finished:
                assert out.error is None and len(out.token_ids) == 3
                b_done_at = step
        if not engine.has_unfinished():
            break
    assert b_done_at is not None and b_done_at < 30, b_done_at  # not after the stream of 60


@pytest.mark.parametrize("lookahead_hit", [True, False])
def test_a_waiting_request_whose_adapter_was_unloaded_still_fails_alone(
    causal_ckpt, engine_adapter_root, lookahead_hit
):
    engine = make_engine(causal_ckpt[0], engine_adapter_root, max_model_len=96, max_num_seqs=4, max_loras=1)
    engine.add_request("a1", random_ids(8, 320, seed=3), greedy(6), "gdn_attn")
    engine.add_request("b1", random_ids(8, 320, seed=4), greedy(3), "rs_mlp")
    if lookahead_hit:
        engine.add_request("a2", random_ids(8, 320, seed=5), greedy(3), "gdn_attn")
    engine.step()
    engine.adapters.unload("rs_mlp")
    outs = {}
    while engine.has_unfinished():
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    assert outs["b1"].finish_reason == "error" and "unloaded" in outs["b1"].error
    assert outs["a1"].error is None and (not lookahead_hit or outs["a2"].error is None)


def test_a_plan_made_ahead_then_again_counts_one_lora_wait(causal_ckpt, engine_adapter_root):
    """Plan ahead (engine/plan_ahead.py) may plan a step, drop the plan and plan it again once the step
    before is read: the wait that bounds how long a request yields its turn counts steps, not plans."""
    engine = make_engine(causal_ckpt[0], engine_adapter_root, max_model_len=96, max_num_seqs=4, max_loras=1)
    engine.add_request("a1", random_ids(8, 320, seed=3), greedy(20), "gdn_attn")
    engine.step()
    engine.add_request("b1", random_ids(8, 320, seed=4), greedy(3), "rs_mlp")
    b1 = engine.requests["b1"]
    for step, plans in ((7, 2), (8, 1), (9, 3)):
        for i in range(plans):
            engine.scheduler.schedule(preempt=i > 0, step=step)
    assert b1.lora_wait_steps == 3 and running_ids(engine) == {"a1"}

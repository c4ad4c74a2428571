"""Admission shared fairly between client requests of many sequences (engine/scheduler.py): a
one-sequence request behind a many-sequence one waits for the next free place, not for all of the
other's sequences; two large requests take turns; ungrouped requests stay FCFS; outputs are the
same as each request run alone."""

from __future__ import annotations

from tests.engine_helpers import greedy, make_engine, max_logprob_diff, run_alone
from tests.helpers import random_ids


def step_all(engine, limit: int = 400) -> tuple[dict, dict, list[str]]:
    """Step to the end: (outputs, the step each finished at, request ids in the order they started)."""
    done, finished_at, started = {}, {}, []
    for step in range(limit):
        for out in engine.step():
            if out.finished:
                done[out.request_id], finished_at[out.request_id] = out, step
        started += [r.request_id for r in engine.scheduler.running if r.request_id not in started]
        if not engine.has_unfinished():
            return done, finished_at, started
    raise AssertionError("the engine did not finish")


def test_a_small_request_is_not_queued_behind_every_sequence_of_a_large_one(causal_ckpt):
    engine = make_engine(causal_ckpt[0], max_model_len=64, max_num_seqs=2)
    big = [f"big-{i}" for i in range(12)]  # one client request of 12 sequences (n = 12)
    for i, rid in enumerate(big):
        engine.add_request(rid, random_ids(6, 320, seed=i), greedy(6), group="big")
    engine.step()  # big-0 and big-1 run, big-2.. wait
    small_prompt = random_ids(7, 320, seed=99)
    engine.add_request("small", small_prompt, greedy(6), group="small")
    done, finished_at, started = step_all(engine)
    # it takes the first place big-0 or big-1 frees; FCFS would start it after all 12
    assert started.index("small") == 2, started
    assert finished_at["small"] < sorted(finished_at[r] for r in big)[4]
    alone = run_alone(make_engine(causal_ckpt[0]), "small", small_prompt, greedy(6))
    assert done["small"].token_ids == alone.token_ids
    assert max_logprob_diff(done["small"], alone) <= 1e-4
    assert all(done[r].error is None and len(done[r].token_ids) == 6 for r in big)
    assert engine.scheduler._group_size == {}  # nothing left behind for finished groups


def test_two_large_requests_take_turns_and_ungrouped_requests_stay_fcfs(causal_ckpt):
    engine = make_engine(causal_ckpt[0], max_model_len=64, max_num_seqs=2)
    for g in ("a", "b"):
        for i in range(4):
            engine.add_request(f"{g}{i}", random_ids(5, 320, seed=10 * i + ord(g)), greedy(3), group=g)
    _, _, started = step_all(engine)
    assert started == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]

    engine = make_engine(causal_ckpt[0], max_model_len=64, max_num_seqs=2)
    order = [f"r{i}" for i in range(6)]
    for i, rid in enumerate(order):
        engine.add_request(rid, random_ids(5, 320, seed=i), greedy(3))
    _, _, started = step_all(engine)
    assert started == order

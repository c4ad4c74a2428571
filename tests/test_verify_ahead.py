"""Decode ahead while speculating (engine.py `_verify_ahead`): the next verify step is queued before
the host reads the step before it. Its tokens, where each request's chunk starts and which state slot
it holds are read on the device from the acceptance and the drafts queued behind it
(`short_step.VerifyAhead`); the host mirrors them once it reads the step. The output must be the output
without speculation, and a request that stops or faults meanwhile must cost no other request anything.
"""

from __future__ import annotations

import pytest

from hylora.engine import SamplingParams
from tests.engine_helpers import ADAPTERS, free_pages, greedy, make_engine, run
from tests.test_speculative import assert_same

AHEAD = dict(padded_decode=True, max_short_step_tokens=64)


@pytest.mark.parametrize(("head", "k"), [("arranged", 2), ("attending", 3), ("random", 2)])
def test_verify_steps_planned_ahead_keep_the_output_of_decoding_without_speculation(
    mtp_ckpts, engine_adapter_root, head, k
):
    """Base and two adapters, greedy with logprobs (within 1e-5), one arriving while the others run (planning
    ahead stops while it waits and starts again after), one with a stop token."""
    config = dict(max_model_len=192, max_loras=3)
    plain = make_engine(mtp_ckpts[head], engine_adapter_root, **config)
    spec = make_engine(mtp_ckpts[head], engine_adapter_root, num_speculative_tokens=k, **config, **AHEAD)
    reference = run(plain, {0: [("probe", list(range(3, 30)), greedy(30), None)]})["probe"]
    arrivals = {
        0: [
            ("base", list(range(3, 30)), greedy(40), None),
            ("a0", list(range(5, 21)), greedy(33), ADAPTERS[0]),
            ("stop", list(range(3, 30)), greedy(40, stop_token_ids=[reference.token_ids[17]]), None),
        ],
        9: [("late", list(range(40, 52)), greedy(25), ADAPTERS[1])],
    }
    assert_same(run(plain, arrivals), run(spec, arrivals))
    assert spec.steps_ahead > 5
    stats = spec.stats()
    if head != "random":
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # accepted and rejected drafts both
    assert free_pages(spec) == spec.kv.num_pages and spec.states.num_free == spec.states.num_slots


def test_a_request_faulting_in_a_step_planned_ahead_fails_alone(mtp_ckpts):
    plain = make_engine(mtp_ckpts["attending"], max_model_len=160, enable_prefix_caching=False)
    spec = make_engine(
        mtp_ckpts["attending"], max_model_len=160, enable_prefix_caching=False, num_speculative_tokens=2, **AHEAD
    )
    requests = {0: [(f"r{i}", list(range(3 + i, 22 + i)), greedy(30), None) for i in range(3)]}
    expected = run(plain, requests)
    faulted_ahead = []

    def fault(step):
        if step == 6:
            faulted_ahead.append(spec._inflight is not None)  # the fault lands in a step queued ahead
            spec.inject_fault("r1", "nan")

    done = run(spec, requests, before_step=fault)
    assert faulted_ahead == [True] and spec.steps_ahead > 3
    assert done["r1"].finish_reason == "error" and "numerical fault" in done["r1"].error
    assert_same({r: expected[r] for r in ("r0", "r2")}, {r: done[r] for r in ("r0", "r2")})
    assert free_pages(spec) == spec.kv.num_pages and spec.states.num_free == spec.states.num_slots


def test_sampled_requests_are_planned_ahead_and_a_seed_repeats_its_tokens(mtp_ckpts):
    """A seeded sampled request gives the same tokens whether its verify steps are planned ahead or
    not (the draws happen in the same order on its own generator)."""
    params = SamplingParams(max_tokens=30, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
    outputs, ahead_steps = [], []
    for async_scheduling in (True, False):
        spec = make_engine(
            mtp_ckpts["arranged"], max_model_len=160, num_speculative_tokens=2, async_scheduling=async_scheduling,
            **AHEAD,
        )  # fmt: skip
        out = run(spec, {0: [("s", list(range(3, 25)), params, None), ("g", list(range(5, 30)), greedy(30), None)]})
        outputs.append({r: o.token_ids for r, o in out.items()})
        ahead_steps.append(spec.steps_ahead)
    assert outputs[0] == outputs[1] and ahead_steps[0] > 3 and ahead_steps[1] == 0


@pytest.mark.parametrize("head", ["attending", "random"])
def test_drafts_queued_behind_a_step_planned_ahead_are_the_drafts_made_without_it(mtp_ckpts, head):
    """The MTP layer's passes behind a verify step planned ahead sit where the device says that step
    starts: each request gets the drafts it gets when nothing is planned ahead (the attending head's
    drafts depend on the positions and KV rows of its passes)."""
    seen = {}
    for async_scheduling in (True, False):
        spec = make_engine(
            mtp_ckpts[head], max_model_len=192, num_speculative_tokens=3, async_scheduling=async_scheduling, **AHEAD
        )
        log = seen[async_scheduling] = []
        real_assign = spec.drafter.assign
        spec.drafter.assign = lambda req, drafts, log=log, real=real_assign: (
            drafts and log.append((req.request_id, len(req.output_ids), tuple(drafts))),
            real(req, drafts),
        )
        run(spec, {0: [(f"r{i}", list(range(3 + i, 24 + 2 * i)), greedy(36), None) for i in range(3)]})
        assert (spec.steps_ahead > 5) == async_scheduling
    assert sorted(seen[True]) == sorted(seen[False]) and len(seen[True]) > 20


def test_a_step_too_large_for_a_short_step_is_not_planned_ahead(mtp_ckpts, caplog):
    """Six requests verifying one draft each fit a 16-token short step (12 tokens); the step after,
    planned ahead, would verify k = 2 drafts each (18 tokens). The engine reads each step first
    instead (nothing requeued, nothing recomputed), and the output is unchanged."""
    requests = {0: [(f"r{i}", list(range(3 + i, 20 + i)), greedy(12), None) for i in range(6)]}
    plain = make_engine(mtp_ckpts["arranged"], max_model_len=128)
    spec = make_engine(
        mtp_ckpts["arranged"], max_model_len=128, num_speculative_tokens=2, padded_decode=True, max_short_step_tokens=16
    )
    real_assign = spec.drafter.assign
    spec.drafter.assign = lambda req, drafts: real_assign(req, drafts[:1])  # the host keeps one draft
    assert_same(run(plain, requests), run(spec, requests))
    stats = spec.stats()
    assert stats.spec_drafts > 10 and stats.spec_draft_tokens == stats.spec_drafts  # one draft a step verified
    assert spec.steps_ahead == 0 and "failed" not in caplog.text

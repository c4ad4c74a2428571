"""The MTP layer's drafting as one padded step (engine/draft_step.py), run eagerly on the CPU: the plain
twin of the drafting CUDA graphs.

Every drafting step of a speculating engine is run both ways from the same caches: the padded step
must give each request the drafts (and finiteness flags) of the pass-by-pass eager drafting, and
write the MTP layer's KV rows the eager drafting writes and no others (the null page aside). With the
padded drafting in the engine, an exact draft head is still always accepted.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from hylora.engine.draft_step import DraftJob, PaddedDraft
from hylora.engine.speculative import Drafter
from hylora.model.forward_batch import SequenceChunk
from tests.engine_helpers import ADAPTERS, greedy, make_engine, run


@pytest.mark.parametrize(
    "head, bucket",
    [("random", None), ("random", 64), ("arranged", None)],
    ids=["random-head-smallest-bucket", "random-head-bucket-64", "arranged-head"],
)
def test_padded_drafting_equals_eager_drafting(mtp_ckpts, engine_adapter_root, monkeypatch, head, bucket):
    """(A random head's drafts depend on its attention; the arranged head's are accepted, so requests
    reach the later passes with the drafts before them.)"""
    engine = make_engine(mtp_ckpts[head], engine_adapter_root, max_model_len=128, num_speculative_tokens=2)
    kv = engine.kv
    padded = PaddedDraft(engine.model, kv, engine.states, max_tokens=64, k=2, max_model_len=128)
    if bucket is not None:
        padded.buckets = [bucket]  # force padding rows
    real_eager, checked = Drafter._eager, []

    def both_ways(drafter, jobs):
        model, passes = engine.model, {"eager": [], "padded": []}  # each pass's MTP output (lm_head input)
        before = kv.k.clone(), kv.v.clone()
        model.logits = lambda h: passes["eager"].append(h.clone()) or type(model).logits(model, h)
        tokens, finite = real_eager(drafter, jobs)
        eager_kv = kv.k.clone(), kv.v.clone()
        kv.k.copy_(before[0])
        kv.v.copy_(before[1])
        model.logits = lambda h: passes["padded"].append(h.clone()) or type(model).logits(model, h)
        got_tokens, got_finite = (t.clone() for t in padded.run(jobs))
        del model.logits
        for step, want in enumerate(passes["eager"]):  # eager: the rows of the jobs wanting this many drafts
            rows = [i for i, job in enumerate(jobs) if job.drafts > step]
            torch.testing.assert_close(passes["padded"][step][rows], want, rtol=1e-5, atol=1e-5)
        for i, job in enumerate(jobs):
            assert got_tokens[: job.drafts, i].tolist() == tokens[: job.drafts, i].tolist()
            assert got_finite[: job.drafts, i].tolist() == finite[: job.drafts, i].tolist()
        ps, null = kv.page_size, kv.null_page
        keep = torch.ones(kv.k.shape[1], dtype=torch.bool)
        keep[null * ps : (null + 1) * ps] = False  # the padding rows' write sink
        for got, want in zip((kv.k, kv.v), eager_kv, strict=True):
            torch.testing.assert_close(got[:, keep], want[:, keep], rtol=1e-5, atol=1e-5, equal_nan=True)
        checked.append(sorted(j.drafts for j in jobs))
        return tokens, finite

    monkeypatch.setattr(Drafter, "_eager", both_ways)
    arrivals = {
        0: [("base", list(range(3, 30)), greedy(9), None), ("a0", list(range(5, 21)), greedy(12), ADAPTERS[0])],
        3: [("late", list(range(40, 52)), greedy(6), ADAPTERS[1])],
    }
    out = run(engine, arrivals)
    assert all(o.error is None for o in out.values())
    assert len(checked) > 5 and any(len(set(c)) > 1 for c in checked)  # requests wanting 0, 1 and 2 drafts


def test_jobs_that_do_not_fit_are_refused_clearly(mtp_ckpts):
    engine = make_engine(mtp_ckpts["arranged"], max_model_len=64, num_speculative_tokens=2)
    padded = PaddedDraft(engine.model, engine.kv, engine.states, max_tokens=16, k=2, max_model_len=64)
    pages = engine.kv.allocate(1)
    hidden = torch.zeros(1, engine.model.config.hidden_size)
    one = SequenceChunk([5], 3, 0, pages)
    assert padded.fits([DraftJob(one, hidden, [], 1)])
    assert not padded.fits([DraftJob(SequenceChunk([5] * 17, 0, 0, pages * 2), hidden, [], 1)])
    with pytest.raises(ValueError, match="later passes"):
        padded.fill([DraftJob(one, hidden, [one, one], 2)], 16)  # more later passes than k - 1
    with pytest.raises(ValueError, match="past its"):
        padded.fill([DraftJob(one, hidden, [SequenceChunk([0], 16, 0, pages)], 2)], 16)


def test_an_exact_draft_head_is_always_accepted_with_padded_drafting(mtp_ckpts):
    config = dict(max_model_len=256, num_speculative_tokens=2, padded_decode=True, max_short_step_tokens=32)
    engine = make_engine(mtp_ckpts["exact"], **config)
    assert engine.drafter.padded is not None
    calls, real_run = [], engine.drafter.padded.run
    engine.drafter.padded.run = lambda jobs, *device: calls.append(len(jobs)) or real_run(jobs, *device)
    plain = run(make_engine(mtp_ckpts["exact"], max_model_len=256), {0: [("r", list(range(3, 20)), greedy(31), None)]})
    out = run(engine, {0: [("r", list(range(3, 20)), greedy(31), None)]})
    assert out["r"].token_ids == plain["r"].token_ids and calls
    stats = engine.stats()
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0
    assert engine.step_count == 1 + math.ceil(30 / 3)  # the prefill, then 3 tokens a step


@pytest.mark.parametrize(("head", "k"), [("random", 2), ("arranged", 3), ("attending", 3)])
def test_drafting_queued_behind_the_verify_step_drafts_what_drafting_after_it_does(
    mtp_ckpts, engine_adapter_root, monkeypatch, head, k
):
    """Queued behind the verify step (`Drafter.launch`), the drafting pass covers every verified
    position and the later passes start where the device's acceptance says: each request must get the
    drafts it gets when drafting waits for the host to read the step. The random head's drafts depend
    on the MTP layer's attention over its own KV rows (a row written at the wrong place shows); the
    arranged head accepts some drafts and rejects others (every shift is used); the attending one
    does both, so a later pass at the wrong position, KV row or length shows too."""
    config = dict(
        max_model_len=128, num_speculative_tokens=k, padded_decode=True, max_short_step_tokens=64, max_loras=2
    )
    queued = make_engine(mtp_ckpts[head], engine_adapter_root, **config)
    after = make_engine(mtp_ckpts[head], engine_adapter_root, queue_drafts=False, **config)
    launched = {id(queued): 0, id(after): 0}
    real_launch = Drafter.launch

    def counting_launch(drafter, ran, verify, ahead=None):
        pending = real_launch(drafter, ran, verify, ahead)
        launched[id(drafter.engine)] += pending is not None
        return pending

    monkeypatch.setattr(Drafter, "launch", counting_launch)
    seen = {}
    for engine in (queued, after):
        engine.drafter.engine = engine
        log = seen[id(engine)] = []
        real_assign = engine.drafter.assign
        engine.drafter.assign = lambda req, drafts, log=log, real=real_assign: (
            drafts and log.append((req.request_id, len(req.output_ids), tuple(drafts))),
            real(req, drafts),
        )
    arrivals = {
        0: [("base", list(range(3, 30)), greedy(25), None), ("a0", list(range(5, 21)), greedy(22), ADAPTERS[0])],
        4: [("late", list(range(40, 52)), greedy(16), ADAPTERS[1])],
    }
    out_queued, out_after = run(queued, arrivals), run(after, arrivals)
    assert {r: o.token_ids for r, o in out_queued.items()} == {r: o.token_ids for r, o in out_after.items()}
    # (the steps differ: the queued engine also plans verify steps ahead, so a late arrival joins later)
    assert sorted(seen[id(queued)]) == sorted(seen[id(after)]) and len(seen[id(queued)]) > 10
    assert launched[id(queued)] > 5 and launched[id(after)] == 0
    if head != "random":
        stats = queued.stats()
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens


def test_queued_drafting_is_a_serve_flag_on_by_default():
    from hylora.engine import EngineConfig
    from hylora.server.serve import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args(["m"]).queue_drafts is EngineConfig().queue_drafts is True
    assert p.parse_args(["m", "--no-queue-drafts"]).queue_drafts is False

"""MTP speculative decoding (issue 26): the output is the output without speculation.

Checkpoints (tests/spec_helpers.py): "arranged" MTP heads that predict the model's own next greedy
token (decoder layers scaled by 0.1: most drafts accepted, some not, the states still in the
logits), an "exact" one (acceptance 1), and a random head (drafts almost always rejected).
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open

from hylora.config import ConfigError, ModelConfig
from hylora.engine import SamplingParams
from hylora.engine.request import Request
from hylora.engine.speculative import launch_verify
from hylora.model.loader import load_model
from tests.engine_helpers import ADAPTERS, free_pages, greedy, make_engine, max_logprob_diff, run

# the speculating engine eagerly, and with its verify and drafting steps padded as their CUDA graphs pad them
STEPS = pytest.mark.parametrize("padded", [False, True], ids=["eager-steps", "padded-steps"])


def engines(ckpt, k: int, adapter_root=None, padded: bool = False, **config):
    """The same checkpoint without and with speculation (`padded`: through the short-step and drafting
    steps' padded twins, engine/short_step.py and engine/draft_step.py)."""
    config.setdefault("max_model_len", 256)
    plain = make_engine(ckpt, adapter_root, **config)
    if padded:
        config |= dict(padded_decode=True, max_short_step_tokens=64)
    spec = make_engine(ckpt, adapter_root, num_speculative_tokens=k, **config)
    assert (spec.runner.short is not None) == (spec.drafter.padded is not None) == padded
    return plain, spec


def assert_same(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid].finish_reason == b[rid].finish_reason, rid
        assert a[rid].token_ids == b[rid].token_ids, rid
        assert a[rid].text == b[rid].text, rid
        if a[rid].logprobs:
            assert max_logprob_diff(a[rid], b[rid]) <= tol, rid


def test_the_mtp_layer_loads_under_the_released_names(mtp_ckpts, causal_ckpt, demo_dir):
    ckpt = mtp_ckpts["random"]
    model = load_model(ckpt, progress=False, mtp=True)
    (weights,) = ckpt.glob("*.safetensors")
    with safe_open(str(weights), "pt") as f:
        assert torch.equal(model.mtp.fc.weight, f.get_tensor("mtp.fc.weight"))
        qkv = torch.cat([f.get_tensor(f"mtp.layers.0.self_attn.{p}_proj.weight") for p in "qkv"])
        assert torch.equal(model.mtp.layers[0].self_attn.qkv_proj.weight, qkv)
        assert torch.equal(model.mtp.norm.weight, f.get_tensor("mtp.norm.weight"))
    assert model.kv_layers == [*model.config.attention_layers, model.config.num_layers]  # its own KV layer
    assert load_model(ckpt, progress=False).mtp is None  # not loaded unless speculating
    with pytest.raises(ConfigError, match="no MTP layer"):
        load_model(causal_ckpt[0], progress=False, mtp=True)
    assert ModelConfig.from_dir(demo_dir).mtp_num_hidden_layers == 1  # the demo ships one


@pytest.mark.parametrize(("head", "k"), [("arranged", 1), ("arranged", 3), ("random", 2)])
@STEPS
def test_greedy_tokens_and_logprobs_equal_decoding_without_speculation(mtp_ckpts, engine_adapter_root, head, k, padded):
    """Base and every adapter in one batch, arriving over several steps (prefill chunks mixed with
    verify chunks, and a prompt longer than a verify step allows alongside)."""
    plain, spec = engines(mtp_ckpts[head], k, engine_adapter_root, padded, max_loras=3)
    arrivals = {
        0: [("base", list(range(3, 40)), greedy(20), None), ("a0", list(range(5, 25)), greedy(17), ADAPTERS[0])],
        2: [("a1", list(range(7, 30)), greedy(19), ADAPTERS[1])],
        4: [("long", [(7 * i) % 300 + 1 for i in range(150)], greedy(12), ADAPTERS[2])],
        5: [("late", list(range(40, 52)), greedy(15, stop_token_ids=[]), None)],
    }
    assert_same(run(plain, arrivals), run(spec, arrivals))
    stats = spec.stats()
    assert stats.spec_drafts > 0 and stats.spec_draft_tokens >= stats.spec_drafts
    if head == "arranged":
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # accepted and rejected drafts both
    assert free_pages(spec) == spec.kv.num_pages and spec.states.num_free == spec.states.num_slots


@STEPS
def test_an_exact_draft_head_is_always_accepted(mtp_ckpts, padded):
    plain, spec = engines(mtp_ckpts["exact"], 2, padded=padded)
    arrivals = {0: [("r", list(range(3, 20)), greedy(31), None)]}
    assert_same(run(plain, arrivals), run(spec, arrivals))
    stats = spec.stats()
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0
    assert stats.spec_accepted_per_position == [stats.spec_drafts] * 2
    # the prefill step gives token 1; each later step gives 3 (two drafts and the token after them)
    assert spec.step_count == 1 + math.ceil(30 / 3) and plain.step_count == 31


def test_drafting_waits_for_the_host_once_and_a_non_finite_draft_ends_its_drafts(mtp_ckpts, monkeypatch):
    """The k MTP passes keep their tokens on the device (one host read for all of them); a draft whose
    logits are not finite ends its request's drafts there, and the output stays the plain run's."""
    import hylora.engine.speculative as speculative

    plain, spec = engines(mtp_ckpts["exact"], 3)
    arrivals = {0: [(f"r{i}", list(range(3 + i, 20 + i)), greedy(13), None) for i in range(2)]}
    expected = run(plain, arrivals)
    reads, calls = [], []
    real_copy, real_logits = speculative.HostCopy, spec.model.logits

    def counting_copy(*tensors):
        reads.append(len(tensors))
        return real_copy(*tensors)

    def nan_second_draft(h):  # the second pass: request row 0's draft is NaN
        calls.append(h.shape[0])
        out = real_logits(h)
        if len(calls) == 2:
            out[0] = float("nan")
        return out

    monkeypatch.setattr(speculative, "HostCopy", counting_copy)
    drafts = []
    real_propose = spec.drafter.propose

    def propose(ran, num_drafts):
        reads.clear()
        calls.clear()
        spec.model.logits = nan_second_draft
        try:
            real_propose(ran, num_drafts)
        finally:
            del spec.model.logits  # the class's method again
        if calls:
            assert len(reads) == 1  # one device→host copy for all passes
            drafts.append(sorted(len(c.request.draft_ids) for c, _ in ran if c.request.draft_ids))

    monkeypatch.setattr(spec.drafter, "propose", propose)
    assert_same(expected, run(spec, arrivals))
    assert drafts and all(d[0] == 1 for d in drafts)  # the NaN row: its first draft only


@STEPS
def test_stops_and_limits_inside_a_verified_run_end_where_they_would_without_it(mtp_ckpts, padded):
    plain, spec = engines(mtp_ckpts["exact"], 3, padded=padded)
    reference = run(plain, {0: [("r", list(range(3, 20)), greedy(30), None)]})["r"]
    stop_token = reference.token_ids[6]
    stop_text = plain.tokenizer.decode(reference.token_ids[9:11])
    requests = {
        0: [
            ("token", list(range(3, 20)), greedy(30, stop_token_ids=[stop_token]), None),
            ("text", list(range(3, 20)), greedy(30, stop=[stop_text]), None),
            ("length", list(range(3, 20)), greedy(6), None),  # max_tokens inside a run of accepted drafts
        ]
    }
    out_plain, out_spec = run(plain, requests), run(spec, requests)
    assert_same(out_plain, out_spec)
    assert out_spec["token"].finish_reason == "stop" and len(out_spec["token"].token_ids) <= 7
    assert len(out_spec["length"].token_ids) == 6


@STEPS
def test_penalised_requests_decode_plainly_beside_speculating_ones(mtp_ckpts, padded):
    plain, spec = engines(mtp_ckpts["arranged"], 2, padded=padded)
    penalised = greedy(12, presence_penalty=0.8, frequency_penalty=0.3)
    requests = {
        0: [
            ("pen", list(range(3, 20)), penalised, None),
            ("min", list(range(4, 20)), greedy(12, min_tokens=5), None),
            ("free", list(range(5, 20)), greedy(12), None),
        ]
    }
    assert_same(run(plain, requests), run(spec, requests))


@STEPS
def test_a_faulted_speculating_request_fails_alone(mtp_ckpts, padded):
    plain, spec = engines(mtp_ckpts["arranged"], 2, padded=padded, enable_prefix_caching=False)
    requests = {0: [(f"r{i}", list(range(3 + i, 22 + i)), greedy(14), None) for i in range(3)]}
    expected = run(plain, requests)
    done = run(spec, requests, before_step=lambda step: step == 3 and spec.inject_fault("r1", "nan"))
    assert done["r1"].finish_reason == "error" and "numerical fault" in done["r1"].error
    assert_same({r: expected[r] for r in ("r0", "r2")}, {r: done[r] for r in ("r0", "r2")})
    assert free_pages(spec) == spec.kv.num_pages and spec.states.num_free == spec.states.num_slots


@STEPS
def test_speculation_with_the_prefix_cache_and_preemption(mtp_ckpts, padded):
    """Requests sharing a cached prefix, on too few KV pages for all of them (preemptions)."""
    shared = list(range(3, 70))
    requests = {i: [(f"r{i}", [*shared, 100 + i, 101 + i], greedy(24), None)] for i in range(4)}
    plain, _ = engines(mtp_ckpts["arranged"], 2, enable_prefix_caching=False)
    _, spec = engines(mtp_ckpts["arranged"], 2, padded=padded, num_pages=14, page_size=8)
    assert_same(run(plain, requests), run(spec, requests), tol=1e-4)  # (the cache's own tolerance)
    stats = spec.stats()
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0 and stats.spec_accepted_tokens > 0


@STEPS
def test_streamed_outputs_carry_every_token_once(mtp_ckpts, padded):
    _, spec = engines(mtp_ckpts["exact"], 3, padded=padded)
    spec.add_request("r", list(range(3, 20)), greedy(20), None)
    streamed, texts, per_step = [], [], []
    while spec.has_unfinished():
        for out in spec.step():
            streamed.extend(out.new_token_ids)
            texts.append(out.new_text)
            per_step.append(len(out.new_token_ids))
            final = out
    assert streamed == final.token_ids and "".join(texts) == final.text
    assert max(per_step) == 4  # a step streams its accepted drafts and the token after them together


def _requests(n: int, **params) -> list[Request]:
    return [Request(f"q{i}", [1], SamplingParams(seed=i, **params)) for i in range(n)]


@pytest.mark.parametrize("top_k", [0, 3])
def test_rejection_sampling_keeps_the_target_distribution(top_k):
    """Many seeded requests with the same logits and drafts: the first token is distributed as the
    target's p0, the second (after an accepted first draft) as p1, and the chance to accept the first
    draft is p0(draft)."""
    n, vocab = 20000, 6
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, vocab, generator=g) * 1.5  # [k + 1, V] for k = 2
    drafts = [int(rows[0].argsort()[-2]), int(rows[1].argmax())]  # both inside the top 3
    reqs = _requests(n, temperature=0.8, top_k=top_k)
    results = launch_verify([rows] * n, reqs, [drafts] * n).results()
    probs = torch.softmax(rows / 0.8, dim=-1)
    if top_k:
        kth = probs.topk(top_k, dim=-1).values[:, -1:]
        probs = torch.where(probs >= kth, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    first = torch.bincount(torch.tensor([r[0][0] for r in results]), minlength=vocab) / n
    assert (first - probs[0]).abs().max() < 0.015
    after_accept = [r for r in results if len(r) > 1]
    assert abs(len(after_accept) / n - probs[0, drafts[0]].item()) < 0.015
    second = torch.bincount(torch.tensor([r[1][0] for r in after_accept]), minlength=vocab) / len(after_accept)
    assert (second - probs[1]).abs().max() < 0.03
    assert all(r[0][0] == drafts[0] for r in after_accept)  # a later token only after an accepted draft


def test_greedy_verification_keeps_drafts_while_they_are_the_argmax():
    rows = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    reqs = _requests(3, temperature=0.0, logprobs=1)
    results = launch_verify([rows, rows, rows], reqs, [[1, 0], [1, 2], [2, 0]]).results()
    assert [[t for t, _ in r] for r in results] == [[1, 0, 2], [1, 0], [1]]
    logprob = torch.log_softmax(rows[1], -1)[0].item()
    assert math.isclose(results[1][1][1].logprob, logprob, rel_tol=1e-6)  # logprobs of the accepted tokens


def test_the_accepted_count_per_request_stops_at_its_first_rejected_row():
    from hylora.engine.speculative import _leading_accepted

    accept = torch.tensor([True, False, True, False, True, True, False, False, True])  # rows of 4 requests: 3, 1, 3, 2
    owner, firsts = torch.tensor([0, 0, 0, 1, 2, 2, 2, 3, 3]), torch.tensor([0, 3, 4, 7])
    assert _leading_accepted(accept, owner, firsts).tolist() == [1, 0, 2, 0]


def test_sampled_output_with_speculation_follows_the_same_distribution(mtp_ckpts):
    """End to end on a small support (top_k 3): the second and third generated tokens — those the
    verify steps give — are distributed alike with and without speculation."""
    plain, spec = engines(mtp_ckpts["arranged"], 2, max_num_seqs=64, max_model_len=64)
    n = 400
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=i, ignore_eos=True) for i in range(n)]
    prompt = list(range(3, 12))

    def draws(engine):
        out = run(engine, {0: [(f"s{i}", prompt, p, None) for i, p in enumerate(params)]})
        return [tuple(out[f"s{i}"].token_ids) for i in range(n)]

    a, b = draws(plain), draws(spec)
    assert spec.stats().spec_accepted_tokens > 0
    for pos in (1, 2):
        tokens = sorted({t[pos] for t in a + b})
        fa = torch.tensor([sum(t[pos] == v for t in a) for v in tokens], dtype=torch.float) / n
        fb = torch.tensor([sum(t[pos] == v for t in b) for v in tokens], dtype=torch.float) / n
        assert (fa - fb).abs().max() < 0.12, (pos, fa, fb)  # ~4 standard errors at n = 400


def test_a_checkpoint_without_an_mtp_layer_is_refused_clearly(causal_ckpt):
    with pytest.raises(ConfigError, match="drop --speculative-config"):
        make_engine(causal_ckpt[0], num_speculative_tokens=2)


@STEPS
def test_structured_outputs_speculate_within_their_grammar(mtp_ckpts, padded):
    """Drafts a grammar cannot take are cut before the verify step; each verified row is masked by
    the grammar's state after the drafts before it; the output is the one without speculation."""
    import re

    from hylora.structured.spec import StructuredSpec

    patterns = {"loose": r"[^<>]{0,40}", "strict": r"(Shang|Zhou|Han)( (Shang|Zhou|Han)){2,5}\."}
    results = []
    for engine in engines(mtp_ckpts["arranged"], 3, padded=padded):
        for name, pattern in patterns.items():
            grammar = engine.grammar_compiler().compile_blocking(StructuredSpec("regex", pattern))
            engine.add_request(name, list(range(3, 20)), greedy(30), grammar=grammar)
        done = {}
        while engine.has_unfinished():
            done |= {out.request_id: out for out in engine.step() if out.finished}
        results.append(done)
    plain, spec = results
    assert_same(plain, spec)
    for name, pattern in patterns.items():
        assert spec[name].finish_reason in ("stop", "length") and spec[name].error is None
        if spec[name].finish_reason == "stop":
            assert re.fullmatch(pattern, spec[name].text), spec[name].text
    stats = engine.stats()
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0

"""Sampling parameters do what their names say; bad values get clear errors."""

from __future__ import annotations

import pytest
import torch

from hylora.engine.request import Request, SamplingParams
from hylora.engine.sampler import (
    SamplingError,
    _filtered_probs,
    apply_penalties,
    filtered_probs,
    prompt_logprobs,
    sample,
)


def req(params: SamplingParams, prompt=(1, 2), output=()) -> Request:
    return Request("r", list(prompt), params, output_ids=list(output))


def test_top_k_top_p_min_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert (_filtered_probs(logits, 2, 1.0, 0.0) > 0).tolist() == [True, True, False, False, False]
    # top_p 0.8: 0.5 + 0.2 = 0.7 < 0.8, so the third token is still needed
    assert (_filtered_probs(logits, 0, 0.8, 0.0) > 0).tolist() == [True, True, True, False, False]
    assert (_filtered_probs(logits, 0, 0.5, 0.0) > 0).tolist() == [True, False, False, False, False]
    # min_p 0.25: keep tokens with p >= 0.125
    assert (_filtered_probs(logits, 0, 1.0, 0.25) > 0).tolist() == [True, True, True, False, False]
    probs = _filtered_probs(logits, 3, 1.0, 0.0)
    assert torch.allclose(probs.sum(), torch.tensor(1.0))
    assert torch.allclose(probs[:3], torch.tensor([0.5, 0.2, 0.15]) / 0.85)


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    out = apply_penalties(logits.clone(), [req(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])])
    assert out.tolist() == [[1.0, -4.0, 1.0, 1.0]]
    out = apply_penalties(
        logits.clone(), [req(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), output=[2, 2, 3])]
    )
    assert out.tolist() == [[2.0, -2.0, 1.0 - 1.0 - 0.25, 1.0 - 0.5 - 0.25]]


def test_greedy_and_temperature_sampling_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    assert sample(logits, [req(SamplingParams(temperature=0.0))])[0][0] == 0
    r = req(SamplingParams(temperature=1.0, seed=0))
    counts = torch.bincount(torch.tensor([sample(logits, [r])[0][0] for _ in range(3000)]), minlength=3)
    assert torch.allclose(counts / 3000, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0]])
    ((token, info),) = sample(
        logits, [req(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=5.0), prompt=[0])]
    )
    expected = torch.log_softmax(logits[0], -1)
    assert info.logprob == pytest.approx(float(expected[token]))
    assert list(info.top) == [0, 1] and info.top[0] == pytest.approx(float(expected[0]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
        (dict(temperature=-1), "temperature must be a number in \\[0, 2\\]"),
        (dict(temperature=float("nan")), "temperature must be a number"),
        (dict(temperature=3.0), "temperature must be a number in \\[0, 2\\]"),
        (dict(top_p=0), "top_p must be a number in \\(0, 1\\]"),
        (dict(top_p=float("nan")), "top_p must be a number"),
        (dict(top_k=-5), "top_k must be"),
        (dict(top_k=2.5), "top_k must be"),
        (dict(min_p=2), "min_p must be a number in"),
        (dict(presence_penalty=3), "presence_penalty must be a number in \\[-2, 2\\]"),
        (dict(frequency_penalty=float("inf")), "frequency_penalty must be a number"),
        (dict(repetition_penalty=0), "repetition_penalty must be a number in \\(0"),
        (dict(seed=2**64), "seed must be an integer in \\[-2\\^63, 2\\^63 - 1\\]"),
        (dict(seed=-(2**63) - 1), "seed must be an integer"),
        (dict(logprobs=50), "logprobs must be between 0 and 20"),
        (dict(stop=[""]), "stop strings must not be empty"),
        (dict(stop=["x"] * 65), "at most 64 stop strings"),
        (dict(stop=["x" * 513]), "at most 512 characters"),
        (dict(stop_token_ids=[1.5]), "stop_token_ids must be a list"),
    ],
)
def test_bad_sampling_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_tiny_temperatures_are_greedy_or_floored_and_edge_seeds_work():
    assert SamplingParams(temperature=1e-30).greedy
    assert SamplingParams(temperature=1e-3).temperature == 0.01  # as vLLM: logits / T must stay finite
    assert SamplingParams(seed=-1).seed is None
    logits = torch.randn(1, 50) * 30
    for seed in (2**63 - 1, -(2**63), 0):
        ((token, _),) = sample(logits, [req(SamplingParams(temperature=0.01, seed=seed))])
        assert 0 <= token < 50


def test_a_row_that_cannot_be_sampled_fails_alone():
    logits = torch.zeros(2, 4)
    logits[0] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    bad = req(SamplingParams(temperature=1.0, seed=1))
    bad.params.temperature = float("nan")  # what validation forbids, as if a bug let it through
    good = req(SamplingParams(temperature=0.0))
    first, second = sample(logits, [good, bad])
    assert first == (3, None)
    assert isinstance(second, SamplingError) and "no token has a finite, positive probability" in str(second)


def test_a_seed_gives_the_same_tokens_whatever_else_is_in_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 300)

    def run(rows: list[int], others: list[SamplingParams]) -> list[int]:
        mine = req(SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1234))
        reqs = [mine] + [req(p) for p in others]
        tokens = []
        for _ in range(20):  # the request's generator advances step by step, as in the engine
            first, *_ = sample(logits[rows], reqs)
            tokens.append(first[0])
        return tokens

    alone = run([0], [])
    crowded = run([0, 1, 2, 3], [SamplingParams(temperature=0), SamplingParams(temperature=1.5, min_p=0.1),
                                 SamplingParams(temperature=0.5, logprobs=3, top_k=2)])  # fmt: skip
    assert alone == crowded and len(set(alone)) > 1


def test_batched_filters_match_each_row_alone():
    torch.manual_seed(1)
    logits = torch.randn(4, 64) * 2
    settings = [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.6, 0.0), (7, 0.8, 0.05)]
    batched = filtered_probs(logits, *[list(col) for col in zip(*settings, strict=True)])
    for row, (k, p, m) in enumerate(settings):
        alone = _filtered_probs(logits[row], k, p, m)
        assert torch.allclose(batched[row], alone)
        if k:
            assert int((alone > 0).sum()) <= k
    assert int((batched[0] > 0).sum()) == 64  # no filter: nothing dropped, not even the float tail


def test_logprobs_of_a_mixed_batch_and_prompt_logprobs():
    torch.manual_seed(2)
    logits = torch.randn(3, 40)
    reqs = [req(SamplingParams(temperature=0, logprobs=0)), req(SamplingParams(temperature=0)),
            req(SamplingParams(temperature=0, logprobs=4))]  # fmt: skip
    (t0, i0), (t1, i1), (t2, i2) = sample(logits, reqs)
    raw = torch.log_softmax(logits, -1)
    assert i1 is None and i0.top == {} and i0.rank == 1 and i0.logprob == pytest.approx(float(raw[0, t0]))
    assert list(i2.top) == raw[2].topk(4).indices.tolist() and i2.token_id == t2 == int(raw[2].argmax())
    infos = prompt_logprobs(logits, [5, 9, 11], 2)
    for j, (t, info) in enumerate(zip([5, 9, 11], infos, strict=True)):
        assert info.token_id == t and info.logprob == pytest.approx(float(raw[j, t]))
        assert info.rank == int((raw[j] > raw[j, t]).sum()) + 1 and len(info.top) == 2


def test_a_nan_row_fails_alone_and_its_neighbours_sample():
    logits = torch.randn(3, 10)
    logits[1, 4] = float("nan")
    out = sample(logits, [req(SamplingParams(temperature=0)), req(SamplingParams(temperature=0)),
                          req(SamplingParams(temperature=1.0, seed=3))])  # fmt: skip
    assert out[0][0] == int(logits[0].argmax()) and 0 <= out[2][0] < 10
    assert isinstance(out[1], SamplingError) and "NaN" in str(out[1])
    forbidden = torch.full((1, 10), float("-inf"))
    (only,) = sample(forbidden, [req(SamplingParams(temperature=0))])
    assert isinstance(only, SamplingError) and "every token is forbidden" in str(only)


def test_allowed_token_ids_and_bad_words_mask_the_draw():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, [req(SamplingParams(temperature=0.0, allowed_token_ids=[3, 4]))])[0][0] == 3
    assert sample(logits, [req(SamplingParams(temperature=0.0, bad_words_ids=[[0], [1]]))])[0][0] == 2
    # a two-token word: its last token is banned only right after its first
    word = SamplingParams(temperature=0.0, bad_words_ids=[[2, 0]])
    assert sample(logits, [req(word, output=[2])])[0][0] == 1
    assert sample(logits, [req(word, output=[3])])[0][0] == 0
    assert sample(logits, [req(word, output=[])])[0][0] == 0
    assert sample(logits, [req(greedy, output=[2])])[0][0] == 0
    # sampled, not greedy: a banned token is never drawn
    r = req(SamplingParams(temperature=1.0, seed=0, bad_words_ids=[[0]], allowed_token_ids=[0, 1, 2]))
    assert {sample(logits, [r])[0][0] for _ in range(200)} == {1, 2}
    # both masks leave nothing: that request fails alone, with the reason
    (failed,) = sample(logits, [req(SamplingParams(temperature=0.0, allowed_token_ids=[0], bad_words_ids=[[0]]))])
    assert isinstance(failed, SamplingError) and "every token is forbidden" in str(failed)


def test_bad_words_token_ids_as_vllm_tokenises_them(tmp_path):
    from hylora.demo import write_tokenizer
    from hylora.tokenizer import bad_words_token_ids, load_tokenizer

    write_tokenizer(tmp_path, 1024)
    tok = load_tokenizer(tmp_path)
    seqs = bad_words_token_ids(tok, ["relic", " tomb"])
    assert tok.encode("relic", add_special_tokens=False) in seqs
    assert tok.encode("tomb", add_special_tokens=False) in seqs  # leading spaces are stripped first
    for word in ("relic", "tomb"):
        spaced = tok.encode(" " + word, add_special_tokens=False)
        bare = tok.encode(word, add_special_tokens=False)
        assert (spaced in seqs) == (spaced[0] != bare[0] and len(spaced) == len(bare))

"""Sampling parameters do what their names say; bad values get clear errors."""

from __future__ import annotations

import pytest
import torch

from hylora.engine.request import Request, SamplingParams
from hylora.engine.sampler import SamplingError, _filtered_probs, apply_penalties, sample


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

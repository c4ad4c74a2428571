"""Sampling parameters do what their names say; bad values get clear errors."""

from __future__ import annotations

import pytest
import torch

from hylora.engine.request import Request, SamplingParams
from hylora.engine.sampler import _filtered_probs, apply_penalties, sample


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
        (dict(temperature=-1), "temperature must be >= 0"),
        (dict(top_p=0), "top_p must be in \\(0, 1\\]"),
        (dict(top_k=-5), "top_k must be"),
        (dict(min_p=2), "min_p must be in"),
        (dict(presence_penalty=3), "presence_penalty must be in \\[-2, 2\\]"),
        (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
        (dict(logprobs=50), "logprobs must be between 0 and 20"),
        (dict(stop=[""]), "stop strings must not be empty"),
    ],
)
def test_bad_sampling_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)

"""The piecewise JSON serialiser sends exactly what FastAPI's JSONResponse sends, at sizes around its
piece size (a hand-written writer of brackets and commas is where a byte goes missing)."""

from __future__ import annotations

import pytest
from fastapi.responses import JSONResponse

from hylora.server.json_body import _PIECE, json_response


def logprobs_body(prompts: int, tokens: int) -> dict:
    """A completions response with prompt logprobs: the first prompt token's entry is None."""
    entry = {
        "7": {"logprob": -0.25, "rank": 1, "decoded_token": "é"},
        "9": {"logprob": -1.5, "rank": 2, "decoded_token": "\n"},
    }
    choices = [
        {"index": i, "text": "ü✓", "prompt_logprobs": [None] + [entry] * (tokens - 1), "logprobs": None}
        for i in range(prompts)
    ]
    return {"id": "cmpl-1", "object": "text_completion", "choices": choices, "usage": {"prompt_tokens": tokens}}


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"a": []},
        logprobs_body(1, 3),
        logprobs_body(1, _PIECE // 9),  # just under one piece
        logprobs_body(2, _PIECE // 9 + 1),  # over: split by choice, then by element
        logprobs_body(3, 3 * _PIECE),  # lists far longer than a piece
        {"ids": list(range(3 * _PIECE + 1)), "nested": [[1, 2]] * (_PIECE + 7), "none": None},
    ],
)
def test_pieces_equal_jsonresponse(body):
    assert json_response(body).body == JSONResponse(body).body


def test_nan_is_refused_as_jsonresponse_refuses_it():
    with pytest.raises(ValueError):
        json_response({"x": [float("nan")] * (_PIECE + 1)})

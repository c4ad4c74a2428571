"""Request intake: a new request's prompt and parameters checked against the model and the caches
before it is queued. Everything wrong with a request is a RequestError here, and nothing changes."""

from __future__ import annotations

import dataclasses
import random

import numpy as np

from hylora.cache import PagedKVCache
from hylora.engine.config import EngineConfig
from hylora.engine.errors import RequestError
from hylora.engine.multimodal import MultimodalPrompt
from hylora.engine.request import SamplingParams


class RequestIntake:
    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, kv: PagedKVCache, has_vision: bool):
        self.config, self.tokenizer, self.vocab_size, self.kv = config, tokenizer, vocab_size, kv
        self.has_vision = has_vision
        self._seeds = random.Random(config.seed) if config.seed is not None else None

    def admit(
        self, prompt: str | list[int], params: SamplingParams, mm: MultimodalPrompt | None
    ) -> tuple[list[int], SamplingParams]:
        """(prompt ids, params) of a request that can be served; a request without a seed gets the
        next of the server's (--seed) unless it is greedy. Raises RequestError."""
        if params.seed is None and self._seeds is not None and not params.greedy:
            params = dataclasses.replace(params, seed=self._seeds.getrandbits(63))
        ids = self.prompt_ids(prompt)
        if mm is not None:
            self._check_media(ids, mm)
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise RequestError(f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
        if params.logit_bias and any(not 0 <= t < vocab for t in params.logit_bias):
            outside = sorted(t for t in params.logit_bias if not 0 <= t < vocab)[:5]
            raise RequestError(f"logit_bias token ids must be in [0, {vocab}); got {outside}", "logit_bias")
        if any(not 0 <= t < vocab for seq in params.bad_words_ids for t in seq):
            raise RequestError(f"bad_words token ids must be in [0, {vocab})", "bad_words")
        if params.allowed_token_ids and any(not 0 <= t < vocab for t in params.allowed_token_ids):
            outside = sorted({t for t in params.allowed_token_ids if not 0 <= t < vocab})[:5]
            raise RequestError(f"allowed_token_ids must be in [0, {vocab}); got {outside}", "allowed_token_ids")
        limit = self.config.max_model_len
        if len(ids) + params.max_tokens > limit:
            raise RequestError(
                f"this model's maximum context length is {limit} tokens; the request has {len(ids)} prompt "
                f"tokens and asks for up to {params.max_tokens} more ({len(ids) + params.max_tokens}); "
                "shorten the prompt or lower max_tokens"
            )
        pages = self.kv.pages_needed(len(ids) + params.max_tokens)
        if pages > self.kv.num_pages:  # could never be scheduled, even alone
            raise RequestError(
                f"the request needs up to {pages} KV pages ({len(ids)} prompt + {params.max_tokens} new tokens) "
                f"but the whole cache has {self.kv.num_pages}; lower max_tokens or start with more --num-pages"
            )
        return ids, params

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            try:
                ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            except Exception as e:
                raise RequestError(f"cannot tokenise the prompt: {e}") from None
        else:
            ids = list(prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        if not _token_ids_in(ids, self.vocab_size):
            raise RequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        return ids

    def _check_media(self, ids: list[int], mm: MultimodalPrompt) -> None:
        if not self.has_vision:
            raise RequestError("this model has no vision tower: send text only")
        if mm.positions.prompt_len != len(ids):
            raise RequestError("the media positions do not match the prompt")
        budget = self.config.max_num_encoder_tokens
        largest = max((s.num_tokens for s in mm.segments), default=0)
        if largest > budget:
            raise RequestError(
                f"one image or video frame of this request is {largest} visual tokens, more than the "
                f"{budget} the server encodes per step (--max-num-encoder-tokens); send it smaller"
            )


def _token_ids_in(ids: list, vocab_size: int) -> bool:
    """Every element a Python int (not a float, string or bool) in [0, vocab_size). In numpy once the
    types are known: a Python loop over a video prompt's ~9k ids cost milliseconds a request."""
    if not set(map(type, ids)) <= {int}:
        return False
    try:
        values = np.asarray(ids, dtype=np.int64)
    except OverflowError:
        return False
    return bool(values.min() >= 0 and values.max() < vocab_size)

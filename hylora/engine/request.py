"""Requests and their sampling parameters: the data the scheduler, runner and sampler share."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

import torch

from hylora.adapters.registry import AdapterLease, PreparedAdapter
from hylora.engine.errors import RequestError
from hylora.engine.multimodal import MultimodalPrompt
from hylora.structured import GrammarMatcher

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
GREEDY_BELOW = 1e-5  # a temperature below this samples greedily (vLLM's rule)
MIN_TEMPERATURE = 1e-2  # smaller positive temperatures are raised to this: logits / T must stay finite


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or < 1e-5) = greedy; (0, 0.01) is raised to 0.01
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # any 64-bit integer; -1 = none (as vLLM)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: no logprobs; k: chosen token + top-k alternatives
    prompt_logprobs: int | None = None  # same, for every prompt token after the first
    skip_special_tokens: bool = True
    min_tokens: int = 0  # EOS and stop_token_ids are suppressed until this many tokens are generated
    logit_bias: dict[int, float] | None = None  # token id → added to its logit, clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be drawn (None or []: any)
    # vLLM's bad_words as token sequences (tokenizer.bad_words_token_ids): a sequence's last token is
    # banned wherever the output so far ends with the rest of it (always, for one-token sequences)
    bad_words_ids: list[list[int]] = field(default_factory=list)

    MAX_LOGPROBS = 20
    MAX_TEMPERATURE = 2.0
    # Stop strings are matched against the text of every new token: bound that cost.
    MAX_STOP_STRINGS = 64
    MAX_STOP_CHARS = 512
    MAX_STOP_TOKEN_IDS = 1024
    MAX_LOGIT_BIAS = 1024
    MAX_BAD_WORDS_IDS = 256  # token sequences (bad words: up to two each)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.seed == -1:
            self.seed = None
        if self.logit_bias:  # as OpenAI and vLLM: biases outside [-100, 100] are clamped
            self.logit_bias = {
                k: min(100.0, max(-100.0, v)) if isinstance(v, (int, float)) and math.isfinite(v) else v
                for k, v in self.logit_bias.items()
            }
        problems = self._problems()
        if problems:
            raise RequestError("; ".join(problems.values()), next(iter(problems)))  # param: the first at fault
        if 0 < self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        elif GREEDY_BELOW <= self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE

    def _problems(self) -> dict[str, str]:
        """What is wrong, by field."""
        problems: dict[str, str] = {}

        def number(name: str, value: object, lo: float, hi: float, lo_open: bool = False) -> None:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            ok = ok and (lo < value if lo_open else lo <= value) and value <= hi  # type: ignore[operator]
            if not ok:
                problems[name] = f"{name} must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value!r}"

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            problems["max_tokens"] = f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"
        number("temperature", self.temperature, 0.0, self.MAX_TEMPERATURE)
        if not _is_int(self.top_k) or self.top_k < -1:
            problems["top_k"] = f"top_k must be -1, 0 (off) or positive, got {self.top_k!r}"
        number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        number("min_p", self.min_p, 0.0, 1.0)
        number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        number("repetition_penalty", self.repetition_penalty, 0.0, 1e6, lo_open=True)
        if self.seed is not None and not (_is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX):
            problems["seed"] = f"seed must be an integer in [-2^63, 2^63 - 1], got {self.seed!r}"
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= self.MAX_LOGPROBS):
                problems[name] = f"{name} must be between 0 and {self.MAX_LOGPROBS}, got {value!r}"
        if not all(isinstance(s, str) for s in self.stop):
            problems["stop"] = "stop must be a string or a list of strings"
        elif any(not s for s in self.stop):
            problems["stop"] = "stop strings must not be empty"
        elif len(self.stop) > self.MAX_STOP_STRINGS or any(len(s) > self.MAX_STOP_CHARS for s in self.stop):
            problems["stop"] = (
                f"at most {self.MAX_STOP_STRINGS} stop strings of at most {self.MAX_STOP_CHARS} characters each"
            )
        if len(self.stop_token_ids) > self.MAX_STOP_TOKEN_IDS or not all(_is_int(t) for t in self.stop_token_ids):
            problems["stop_token_ids"] = f"stop_token_ids must be a list of at most {self.MAX_STOP_TOKEN_IDS} integers"
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= max(self.max_tokens, 0):
            problems["min_tokens"] = f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}"
        bias = self.logit_bias or {}
        if len(bias) > self.MAX_LOGIT_BIAS or not all(
            _is_int(k) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for k, v in bias.items()
        ):
            problems["logit_bias"] = f"logit_bias must map at most {self.MAX_LOGIT_BIAS} token ids to finite numbers"
        bad = self.bad_words_ids
        if len(bad) > self.MAX_BAD_WORDS_IDS or not all(
            isinstance(seq, list) and seq and all(_is_int(t) for t in seq) for seq in bad
        ):
            problems["bad_words"] = f"bad_words must give at most {self.MAX_BAD_WORDS_IDS} non-empty token sequences"
        allowed = self.allowed_token_ids
        if allowed is not None and not (isinstance(allowed, list) and all(_is_int(t) for t in allowed)):
            problems["allowed_token_ids"] = "allowed_token_ids must be a list of token ids"
        return problems

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class FailureKind(enum.Enum):
    """Why a request ended with an error; the server maps each to an HTTP status."""

    INVALID_REQUEST = "invalid_request"  # the client sent something unusable (400)
    ADAPTER_NOT_FOUND = "adapter_not_found"  # the adapter was unloaded before the request started (404)
    ADAPTER_BROKEN = "adapter_broken"  # the adapter's files changed or vanished after loading (409)
    NUMERICAL_FAULT = "numerical_fault"  # NaN/Inf in this request's hidden states or logits (500)
    INTERNAL = "internal_error"  # a bug in hylora (500)
    SHUTTING_DOWN = "shutting_down"  # the server stopped before the request finished (503)
    DEVICE_FAULT = "device_fault"  # the GPU failed; every request in flight ends (503)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # top-k alternatives: token id → logprob
    rank: int = 1  # 1 + the number of tokens more likely than this one


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    mm: MultimodalPrompt | None = None  # images / videos of the prompt; None = text only
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    error: str | None = None
    failure: FailureKind | None = None
    # cache state (owned by the scheduler)
    state_slot: int | None = None
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens of all_ids already in the caches
    lora: AdapterLease | None = None
    prepared: PreparedAdapter | None = None  # the adapter's tensors, read off the engine thread
    grammar: GrammarMatcher | None = None  # structured output: the request's own grammar state
    num_preemptions: int = 0
    # set after a step whose forward raised with this request in it: it runs alone until it passes
    suspect_count: int = 0
    lora_wait_steps: int = 0  # steps spent at the head of the queue waiting for a LoRA slot
    lora_waited_at: int | None = None  # the step last counted in lora_wait_steps
    # the client request it belongs to (a chat with n > 1, a completion's prompt list: one Request per
    # sequence); None: its own. The scheduler shares admission fairly between groups
    group: str | None = None
    cache_salt: str | None = None  # prefix-cache entries are shared only between requests of one salt
    queue_rank: int = 0  # where it waits: after every waiting request of a lower rank (scheduler.add)
    cache_points: list[int] = field(default_factory=list)  # prompt positions whose state the prefix cache keeps
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (its last admission)
    # speculative decoding: spare state slots for the states after each verified token, and the drafts
    # the MTP layer made for the next step (engine/speculative.py)
    spec_slots: list[int] = field(default_factory=list)
    draft_ids: list[int] = field(default_factory=list)
    # sampling state
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # timing (time.monotonic())
    scheduled_time: float | None = None  # first admitted to a step
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to compute (they survive preemption)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

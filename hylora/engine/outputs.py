"""Output processing: each request's detokenizer stream, its stop conditions, and the outputs the
engine hands out (deltas while it runs, everything once it ends)."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

from hylora.engine.detokenizer import TextStream
from hylora.engine.errors import RequestError
from hylora.engine.request import FailureKind, Request, TokenLogprob

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestTiming:
    """When a request went through the engine (time.monotonic()); None: it never got there."""

    arrival: float
    scheduled: float | None
    first_token: float | None
    last_token: float | None


@dataclass
class RequestOutput:
    """What one step changed for one request. While it runs an output carries only what is new
    (streams send deltas, never cumulative copies); the final output (`finished`) also carries
    everything: all tokens, the whole text and the logprobs."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]  # generated since the previous output of this request
    new_text: str
    finished: bool
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    error: str | None = None
    failure: FailureKind | None = None  # why it failed, when finish_reason is "error"
    adapter: str | None = None
    new_logprobs: list[TokenLogprob] | None = None  # for new_token_ids, when asked for
    num_output_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # the first output with tokens (a stream's echo) and the final one: first entry None, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # final output only
    token_ids: list[int] = field(default_factory=list)  # every generated token
    text: str = ""  # generated text (stop strings removed unless asked to keep them)
    logprobs: list[TokenLogprob] | None = None  # per generated token, when asked for
    timing: RequestTiming | None = None

    def merged(self, later: RequestOutput) -> RequestOutput:
        """This output followed by `later` as one (a reader that fell behind gets one delta)."""
        new_logprobs = None
        if self.new_logprobs is not None or later.new_logprobs is not None:
            new_logprobs = (self.new_logprobs or []) + (later.new_logprobs or [])
        return dataclasses.replace(
            later,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            new_text=self.new_text + later.new_text,
            new_logprobs=new_logprobs,
            prompt_logprobs=self.prompt_logprobs if later.prompt_logprobs is None else later.prompt_logprobs,
        )


class OutputProcessor:
    def __init__(self, tokenizer, eos_ids: tuple[int, ...], max_model_len: int):
        self.tokenizer, self.eos_ids, self.max_model_len = tokenizer, eos_ids, max_model_len
        self._streams: dict[str, TextStream] = {}
        self._emitted: dict[str, int] = {}  # generated tokens already handed out per request

    def add(self, req: Request) -> None:
        """Start the request's text stream; RequestError if its prompt cannot be detokenised."""
        p = req.params
        try:
            stream = TextStream(
                self.tokenizer, req.prompt_ids, p.stop, p.skip_special_tokens, p.include_stop_str_in_output
            )
        except Exception as e:
            raise RequestError(f"cannot detokenise this prompt: {e}") from None
        self._streams[req.request_id] = stream
        self._emitted[req.request_id] = 0

    def append_token(self, req: Request, token: int, info: TokenLogprob | None) -> str | None:
        """Add a generated token; the finish reason ("stop", "length") when it ends the request."""
        now = time.monotonic()
        req.first_token_time = req.first_token_time or now
        req.last_token_time = now
        req.output_ids.append(token)
        if info is not None:
            req.logprobs.append(info)
        p = req.params
        # a grammar's EOS ends the document, ignore_eos or not (once the grammar applies)
        constrained = req.grammar is not None and req.grammar.active
        if (token in self.eos_ids and (constrained or not p.ignore_eos)) or token in p.stop_token_ids:
            return "stop"
        hit = self._streams[req.request_id].append(token)
        if hit is not None or (constrained and req.grammar.is_terminated()):  # type: ignore[union-attr]
            return "stop"
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def output(self, req: Request) -> RequestOutput:
        """What is new since the last output of `req` (all of it once it finished, and then the
        request is forgotten here)."""
        rid = req.request_id
        stream = self._streams[rid]
        try:
            new_text = stream.take(req.finished)
        except Exception:  # a broken stream must not keep the request from ending
            log.exception("request %s: taking its text failed", rid)
            new_text = ""
        start = self._emitted[rid]
        self._emitted[rid] = len(req.output_ids)
        wants_logprobs = req.params.logprobs is not None
        out = RequestOutput(
            request_id=rid,
            prompt_token_ids=req.prompt_ids,
            new_token_ids=req.output_ids[start:],
            new_text=new_text,
            finished=req.finished,
            finish_reason=req.finish_reason,
            error=req.error,
            failure=req.failure,
            adapter=req.adapter,
            new_logprobs=req.logprobs[start:] if wants_logprobs else None,
            num_output_tokens=len(req.output_ids),
            num_preemptions=req.num_preemptions,
            num_cached_tokens=req.num_cached_tokens,
        )
        if req.params.prompt_logprobs is not None and (req.finished or (start == 0 and req.output_ids)):
            out.prompt_logprobs = list(req.prompt_logprobs)  # the prompt is done once a token exists
        if req.finished:
            out.token_ids = list(req.output_ids)
            out.text = stream.text
            out.logprobs = list(req.logprobs) if wants_logprobs else None
            out.timing = RequestTiming(req.arrival, req.scheduled_time, req.first_token_time, req.last_token_time)
            self.forget(rid)
        return out

    def forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._emitted.pop(request_id, None)

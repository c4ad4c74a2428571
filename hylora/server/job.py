"""One HTTP generation request: its n engine requests, their outputs, metrics, and the OpenAI
response (JSON or server-sent events)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import Request

from hylora.adapters.files import AdapterError
from hylora.adapters.registry import UnknownAdapter
from hylora.engine.async_engine import EngineDead, Submission
from hylora.engine.engine import RequestError, RequestOutput
from hylora.engine.multimodal import MultimodalPrompt
from hylora.engine.request import TokenLogprob
from hylora.server.chat_output import ChatOutputs
from hylora.server.errors import APIError
from hylora.server.json_body import event_json
from hylora.server.protocol import CompletionRequest, SamplingRequest
from hylora.structured import CompiledGrammar

if TYPE_CHECKING:
    from hylora.server.app import ServerState
    from hylora.server.timing import IntakeClock

log = logging.getLogger(__name__)
FAULT_KINDS = {True: "nan", "nan": "nan", "raise": "raise", "device": "device"}


class Job:
    """One HTTP request: n engine requests for each of its prompts (one prompt for chat; completions
    may send several), their outputs, and the response. Choice k belongs to prompt k // n."""

    def __init__(
        self,
        state: ServerState,
        prefix: str,
        body: SamplingRequest,
        adapter: str | None,
        prompts: list[list[int]],
        max_tokens: list[int],
        logprobs: int | None,
        prompt_logprobs: int | None,
        mm: MultimodalPrompt | None = None,
        grammar: CompiledGrammar | None = None,
        score_only: bool = False,
        chat_outputs: ChatOutputs | None = None,
        grammar_after: Sequence[int] = (),
        bad_words_ids: list[list[int]] | None = None,
        clock: IntakeClock | None = None,
    ):
        """`max_tokens`: per prompt. `score_only`: the prompt's logprobs are the answer (completions with
        max_tokens 0): one token is drawn and dropped, the response has no generated text.
        `chat_outputs`: how chat choices are read (reasoning, tool calls); `grammar_after`: the grammar
        applies after these tokens (a thinking model's `</think>`); `bad_words_ids`: the request's
        `bad_words` tokenised (tokenizer.bad_words_token_ids, off the event loop); `clock`: the request's
        intake so far (its arrival, where its latencies start; the phases up to its admission)."""
        self.state, self.body, self.adapter, self.prompts, self.mm = state, body, adapter, prompts, mm
        self.prompt_ids = prompts[0]
        self.grammar, self.score_only, self.grammar_after = grammar, score_only, tuple(grammar_after)
        self.chat_outputs = chat_outputs or ChatOutputs()
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.model = body.model or adapter or state.router.base_name
        try:
            defaults = state.sampling_defaults
            self.params = [
                body.sampling_params(max_tokens[p], logprobs, prompt_logprobs, i, defaults, bad_words_ids)
                for p in range(len(prompts))
                for i in range(body.n)
            ]
        except ValueError as e:  # RequestError and Unsupported name their field
            raise APIError(400, str(e), param=getattr(e, "param", None)) from None
        self.clock = clock
        self.arrival = time.monotonic() if clock is None else clock.arrival
        self._last_token_at: dict[int, float] = {}
        self._finished: set[int] = set()
        self.tokenizer = state.engine.tokenizer
        self._decoded: dict[int, str] = {}  # token id -> text, for logprobs (a token recurs thousands of times)

    async def start(self, request: Request | None = None) -> list[AsyncIterator[RequestOutput]]:
        """Submit every choice (n × prompts) at once, between two engine steps: one by one, each waited
        for a step of its own (1024 choices: ~1000 steps before the last one started). A `request`
        whose client has disconnected is given up; whatever was submitted, or cancelled on its way, is
        aborted."""
        if self.clock is not None:
            self.clock.mark("prepare")
        submissions = [
            Submission(
                f"{self.id}-{i}",
                self.prompt_of(i),
                params,
                self.adapter,
                self._fault_requested(),
                dataclasses.replace(self.mm, ready={}) if self.mm is not None else None,  # one per choice
                self.grammar,
                self.grammar_after,
                group=self.id,
                cache_salt=self.body.cache_salt,
            )
            for i, params in enumerate(self.params)
        ]
        try:
            if request is not None and await request.is_disconnected():
                raise APIError(499, "client disconnected")
            streams = await self.state.aengine.submit_many(submissions)
        except BaseException as e:
            # Cancelled while the engine thread admits them (a client that left), they would run for
            # nobody: abort each by id (queued after the admission; an unknown id is ignored).
            for submission in submissions:
                self.state.aengine.abort(submission.request_id)
            raise _submit_error(e) from None
        if self.clock is not None:
            self.clock.mark("admit")
        prompt_tokens = sum(len(p) for p in self.prompts)
        self.state.metrics.prompt_tokens.labels(adapter=self.adapter or "").inc(prompt_tokens)
        self.state.vllm_metrics.request_started(prompt_tokens, self.body.n, self.params[0].max_tokens)
        if self.state.log_requests:
            self._log()
        return streams

    def _log(self) -> None:
        """One line per request: its shape and parameters, never the prompt's text or media."""
        p = self.params[0]
        visual = f" ({self.mm.num_visual_tokens} visual)" if self.mm else ""
        grammar = f", structured {self.grammar.spec.label}" if self.grammar else ""
        intake = f"; intake {self.clock.describe()}" if self.clock is not None else ""
        log.info(
            "request %s: model %s, adapter %s, %d prompt tokens%s, n %d, max_tokens %d, temperature %g, top_p %g, "
            "top_k %d, seed %s%s%s",
            self.id, self.model, self.adapter or "-", len(self.prompt_ids), visual, len(self.params), p.max_tokens,
            p.temperature, p.top_p, p.top_k, p.seed, grammar, intake,
        )  # fmt: skip

    def _fault_requested(self) -> str | None:
        """Testing aid: on a server started with --enable-fault-injection, a body field
        `hylora_inject_fault` (true / "nan", "raise" or "device") makes the request fault in its next
        step (engine/faults.py)."""
        if not self.state.engine.config.fault_injection:
            return None
        value = (self.body.model_extra or {}).get("hylora_inject_fault")
        return FAULT_KINDS.get(value) if isinstance(value, (bool, str)) else None

    async def collect(self, streams: list[AsyncIterator[RequestOutput]], request: Request) -> list[RequestOutput]:
        """Run to completion; a client that disconnects meanwhile aborts the requests."""
        final: list[RequestOutput | None] = [None] * len(streams)

        async def drain() -> None:
            async for i, out in self._merged(streams):
                if out.finished:
                    final[i] = out

        task = asyncio.create_task(drain())
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise APIError(499, "client disconnected")
        task.result()
        failed = next((o for o in final if o is not None and o.error), None)
        if failed is not None:
            raise APIError.from_failure(failed.failure, failed.error)
        if any(o is None for o in final):  # cannot happen: every stream ends with a final output
            raise APIError(500, "a request ended without a result", "server_error", "internal_error")
        return final  # type: ignore[return-value]

    async def _merged(self, streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all n streams as they come, with metrics; streams left early count as aborted."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in stream:
                    await queue.put((i, out))
            finally:
                await queue.put((i, done))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, out = await queue.get()
                if out is done:
                    remaining -= 1
                    continue
                self._observe(i, out)
                yield i, out
        finally:
            for t in tasks:
                t.cancel()
            for i in range(len(streams)):
                if i not in self._finished:  # the client went away: the engine aborted it
                    self.state.metrics.requests.labels(status="abort", adapter=self.adapter or "").inc()
                    self.state.vllm_metrics.choice_aborted()
            self.state.vllm_metrics.job_finished(self.params[0].max_tokens)

    def _observe(self, index: int, out: RequestOutput) -> None:
        m, v, label = self.state.metrics, self.state.vllm_metrics, self.adapter or ""
        now = time.monotonic()
        if out.new_token_ids:
            m.generation_tokens.labels(adapter=label).inc(len(out.new_token_ids))
            last = self._last_token_at.get(index)
            if last is None:
                m.ttft.labels(adapter=label).observe(now - self.arrival)
                v.tokens(len(out.new_token_ids), now - self.arrival, None)
            else:
                for _ in out.new_token_ids:
                    m.itl.labels(adapter=label).observe((now - last) / len(out.new_token_ids))
                v.tokens(len(out.new_token_ids), None, now - last)
            self._last_token_at[index] = now
        if out.finished:
            self._finished.add(index)
            m.requests.labels(status=out.finish_reason or "unknown", adapter=label).inc()
            v.choice_finished(out, len(self.prompt_of(index)), now - self.arrival)

    def prompt_of(self, choice: int) -> list[int]:
        return self.prompts[choice // self.body.n]

    # --- chat ------------------------------------------------------------------------------
    def chat_response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outputs):
            message, finish = self.chat_outputs.message(out.text, out.finish_reason)
            choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish, "logprobs": None}
            if out.logprobs is not None:
                choice["logprobs"] = {"content": [self._chat_logprob(lp) for lp in out.logprobs]}
            if self.body.return_token_ids:
                choice["token_ids"] = list(out.token_ids)
            choices.append(choice)
        response = {
            "id": self.id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "usage": self._usage(outputs),
        }
        if outputs[0].prompt_logprobs is not None:  # vLLM's extension: top level for chat
            response["prompt_logprobs"] = self._vllm_prompt_logprobs(outputs[0], self.prompt_ids)
        if outputs[0].prompt_logprobs is not None or self.body.return_token_ids:
            response["prompt_token_ids"] = self.prompt_ids
        return response

    async def chat_events(self, streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
        base = {"id": self.id, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model}
        readers = [self.chat_outputs.stream() for _ in streams]  # reasoning / tool calls, per choice

        def choice(i: int, out: RequestOutput | None, finish: str | None) -> list[dict[str, Any]]:
            if out is None:  # the opening chunk of each choice
                return [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                ]
            deltas = readers[i].feed(out.new_text)
            if finish is not None:
                tail, finish = readers[i].finish(finish)
                deltas += tail
            items = [{"index": i, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
            token_ids = self.body.return_token_ids and bool(out.new_token_ids)
            if out.new_logprobs or token_ids or (finish is not None and not items):
                items.append({"index": i, "delta": {}, "logprobs": None, "finish_reason": None})
            if out.new_logprobs:
                items[-1]["logprobs"] = {"content": [self._chat_logprob(lp) for lp in out.new_logprobs]}
            if token_ids:  # vLLM: each chunk's tokens on its last item
                items[-1]["token_ids"] = list(out.new_token_ids)
            if finish is not None:
                items[-1]["finish_reason"] = finish
            return items

        first = {"prompt_token_ids": self.prompt_ids} if self.body.return_token_ids else {}
        async for event in self._events(streams, base, choice, opening=True, first=first):
            yield event

    def _token(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or "token_id:N" (vLLM's return_tokens_as_token_ids:
        tokens whose text is not a whole character, or that several ids share, stay distinct)."""
        if self.body.return_tokens_as_token_ids or self.state.tokens_as_ids:
            return f"token_id:{token_id}"
        return self._decode(token_id)

    def _decode(self, token_id: int) -> str:
        text = self._decoded.get(token_id)
        if text is None:
            text = self._decoded[token_id] = self.tokenizer.decode([token_id])
        return text

    def _chat_logprob(self, lp: TokenLogprob) -> dict[str, Any]:
        token = self._token(lp.token_id)
        return {
            "token": token,
            "logprob": _finite(lp.logprob),
            "bytes": list(token.encode("utf-8")),
            "top_logprobs": [
                {"token": (t := self._token(tid)), "logprob": _finite(v), "bytes": list(t.encode("utf-8"))}
                for tid, v in lp.top.items()
            ],
        }

    # --- completions -----------------------------------------------------------------------
    def completion_response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        body: CompletionRequest = self.body  # type: ignore[assignment]
        choices = []
        for i, out in enumerate(outputs):
            prompt = self.prompt_of(i)
            echo = self.tokenizer.decode(prompt) if body.echo else ""
            choice = {
                "index": i,
                "text": echo + ("" if self.score_only else out.text),
                "finish_reason": out.finish_reason,
                "logprobs": self._completion_logprobs(out, prompt) if body.logprobs is not None else None,
            }
            if body.prompt_logprobs is not None:  # vLLM's extension: per choice for completions
                choice["prompt_logprobs"] = self._vllm_prompt_logprobs(out, prompt)
            if body.return_token_ids:
                choice["prompt_token_ids"] = prompt
                choice["token_ids"] = [] if self.score_only else list(out.token_ids)
            choices.append(choice)
        return {
            "id": self.id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "usage": self._usage(outputs),
        }

    async def completion_events(self, streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
        body: CompletionRequest = self.body  # type: ignore[assignment]
        base = {"id": self.id, "object": "text_completion", "created": int(time.time()), "model": self.model}

        offsets = [0] * len(streams)  # text_offset of each choice's next token
        told_prompt = [False] * len(streams)  # return_token_ids: the prompt's ids go in a choice's first chunk
        echoed = [not body.echo] * len(streams)

        def choice(i: int, out: RequestOutput, finish: str | None) -> dict[str, Any] | None:
            text, entries = "", []
            if not echoed[i]:  # echo (as vLLM): the prompt and its logprobs lead the choice's first chunk
                echoed[i] = True
                text = self.tokenizer.decode(self.prompt_of(i))
                if body.logprobs is not None:
                    entries = _prompt_entries(self.prompt_of(i), out.prompt_logprobs)
            if not self.score_only:
                text += out.new_text
                if body.logprobs is not None:
                    entries += [(lp.token_id, lp.logprob, lp.top) for lp in out.new_logprobs or []]
            logprobs = None
            if entries:
                logprobs = self._logprobs_block(entries, offsets[i])
                offsets[i] += sum(len(t) for t in logprobs["tokens"])
            new_ids = [] if self.score_only else list(out.new_token_ids or [])
            if not text and logprobs is None and not new_ids and finish is None:
                return None
            item = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
            if body.return_token_ids:
                item["token_ids"] = new_ids
                if not told_prompt[i]:
                    item["prompt_token_ids"], told_prompt[i] = self.prompt_of(i), True
            return item

        async for event in self._events(streams, base, choice, opening=False):
            yield event

    async def _events(
        self,
        streams: list[AsyncIterator[RequestOutput]],
        base: dict[str, Any],
        choice: Any,
        opening: bool,
        first: dict[str, Any] | None = None,
    ) -> AsyncIterator[str]:
        """Server-sent events for n streams. Every choice ends with a finish_reason; a choice that
        fails ends with finish_reason "error" (or "abort" at shutdown) and an error event, and
        whatever goes wrong here still ends the stream that way — never with a bare [DONE]. `first`:
        fields of the opening chunk (vLLM's prompt_token_ids)."""
        finals: list[RequestOutput] = []
        ended: set[int] = set()
        generated = [0] * len(streams)  # tokens of each choice so far
        options = self.body.stream_options or {}  # vLLM: continuous usage only along with include_usage
        continuous = bool(options.get("include_usage") and options.get("continuous_usage_stats"))

        def chunk(item: dict[str, Any], extra: dict[str, Any] | None = None) -> str:
            body = base | (extra or {}) | {"choices": [item]}
            if continuous:  # vLLM's stream_options.continuous_usage_stats: the choice's usage in every chunk
                prompt, done = len(self.prompt_of(item["index"])), generated[item["index"]]
                body["usage"] = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
            return _sse(body)

        try:
            if opening:
                for i in range(len(streams)):
                    items = choice(i, None, None)
                    for item in items if isinstance(items, list) else [items]:
                        yield chunk(item, first)
                        first = None
            async for i, out in self._merged(streams):
                generated[i] += len(out.new_token_ids or [])
                items = choice(i, out, out.finish_reason if out.finished else None)
                for item in items if isinstance(items, list) else [items] if items is not None else []:
                    yield chunk(item)
                if out.finished:
                    ended.add(i)
                    finals.append(out)
                if out.error:
                    yield _sse(APIError.from_failure(out.failure, out.error).body())
        except Exception as e:
            log.exception("stream %s failed", self.id)
            for i in range(len(streams)):
                if i not in ended:
                    items = choice(i, _empty(), "error")
                    for item in items if isinstance(items, list) else [items]:
                        yield chunk(item)
            yield _sse(APIError(500, f"internal server error: {e!r}", "server_error", "internal_error").body())
        if (self.body.stream_options or {}).get("include_usage") or self.state.force_include_usage:
            yield _sse(base | {"choices": [], "usage": self._usage(finals)})
        yield "data: [DONE]\n\n"

    def _completion_logprobs(self, out: RequestOutput, prompt: list[int]) -> dict[str, Any]:
        entries = _prompt_entries(prompt, out.prompt_logprobs)
        for lp in [] if self.score_only else out.logprobs or []:
            entries.append((lp.token_id, lp.logprob, lp.top))
        return self._logprobs_block(entries, 0)

    def _logprobs_block(
        self, entries: list[tuple[int, float | None, dict[int, float] | None]], start: int
    ) -> dict[str, Any]:
        """The completions API's logprobs of these (token id, logprob, top) entries, the first at
        character `start` of the choice's text."""
        tokens, offsets, pos = [], [], start
        for tid, _, _ in entries:
            t = self._token(tid)
            tokens.append(t)
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else _finite(lp) for _, lp, _ in entries],
            "top_logprobs": [
                None if top is None else {self._token(k): _finite(v) for k, v in top.items()} for _, _, top in entries
            ],
            "text_offset": offsets,
        }

    def _vllm_prompt_logprobs(self, out: RequestOutput, prompt: list[int]) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's format: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}
        with the prompt token itself and the top-k alternatives."""
        entries: list[dict[str, dict[str, Any]] | None] = []
        for tid, lp in zip(prompt, out.prompt_logprobs or [], strict=False):
            if lp is None:
                entries.append(None)
                continue
            top = {
                str(t): {"logprob": v, "rank": r, "decoded_token": self._decode(t)}
                for r, (t, v) in enumerate(lp.top.items(), start=1)
            }
            top[str(tid)] = {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self._decode(tid)}
            entries.append(top)
        return entries

    def _usage(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        prompt = sum(len(p) for p in self.prompts)
        completion = 0 if self.score_only else sum(o.num_output_tokens for o in outputs)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if self.state.prompt_tokens_details:  # each prompt once: its first choice's (choice i is prompt i // n)
            cached = sum(o.num_cached_tokens for o in outputs[:: self.body.n])
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage


def _finite(logprob: float) -> float:
    """A token a grammar forbids has logprob -inf, which JSON cannot carry: -9999.0 as vLLM sends."""
    return max(logprob, -9999.0)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {event_json(payload)}\n\n"


def _submit_error(e: BaseException) -> BaseException:
    """The HTTP error for a request the engine refused to admit."""
    if isinstance(e, RequestError):
        code = "context_length_exceeded" if "context length" in str(e) else None
        return APIError(400, str(e), code=code, param=e.param)
    if isinstance(e, UnknownAdapter):
        return APIError(404, str(e), code="model_not_found")
    if isinstance(e, AdapterError):  # broken after loading (files changed or removed)
        return APIError(409, str(e), code="adapter_broken")
    if isinstance(e, EngineDead):
        return APIError(503, str(e), "server_error", "shutting_down")
    return e


def _empty() -> RequestOutput:
    return RequestOutput("", [], [], "", True)


def _prompt_entries(
    prompt: list[int], prompt_logprobs: list[TokenLogprob | None] | None
) -> list[tuple[int, float | None, dict[int, float] | None]]:
    """The prompt's (token id, logprob, top) entries for a completions logprobs block (none without them)."""
    if prompt_logprobs is None:
        return []
    return [
        (t, None, None) if lp is None else (t, lp.logprob, lp.top)
        for t, lp in zip(prompt, prompt_logprobs, strict=True)
    ]

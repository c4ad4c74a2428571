"""One HTTP generation request: its n engine requests, their outputs, metrics, and the OpenAI
response (JSON or server-sent events)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request

from hylora.engine.async_engine import EngineDead
from hylora.engine.engine import RequestError, RequestOutput
from hylora.engine.request import TokenLogprob
from hylora.lora.registry import UnknownAdapter
from hylora.server.errors import APIError
from hylora.server.protocol import CompletionRequest, SamplingRequest

if TYPE_CHECKING:
    from hylora.server.app import ServerState


class Job:
    """One HTTP request: n engine requests that share a prompt, their outputs, and the response."""

    def __init__(
        self,
        state: ServerState,
        prefix: str,
        body: SamplingRequest,
        adapter: str | None,
        prompt_ids: list[int],
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
    ):
        self.state, self.body, self.adapter, self.prompt_ids = state, body, adapter, prompt_ids
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.model = body.model or adapter or state.router.base_name
        try:
            self.params = [
                body.sampling_params(max_tokens, logprobs, prompt_logprobs, seed_offset=i) for i in range(body.n)
            ]
        except ValueError as e:
            raise APIError(400, str(e)) from None
        self.arrival = time.monotonic()
        self._last_token_at: dict[int, float] = {}
        self._finished: set[int] = set()
        self.tokenizer = state.engine.tokenizer

    async def start(self) -> list[AsyncIterator[RequestOutput]]:
        streams = []
        try:
            for i, params in enumerate(self.params):
                streams.append(
                    await self.state.aengine.submit(
                        f"{self.id}-{i}", self.prompt_ids, params, self.adapter, inject_fault=self._fault_requested()
                    )
                )
        except RequestError as e:
            await _close_all(streams)
            raise APIError(
                400, str(e), code="context_length_exceeded" if "context length" in str(e) else None
            ) from None
        except UnknownAdapter as e:
            await _close_all(streams)
            raise APIError(404, str(e), code="model_not_found") from None
        except EngineDead as e:
            await _close_all(streams)
            raise APIError(503, str(e), "server_error") from None
        self.state.metrics.prompt_tokens.labels(adapter=self.adapter or "").inc(len(self.prompt_ids))
        return streams

    def _fault_requested(self) -> bool:
        """Test hook: with HYLORA_ENABLE_FAULT_INJECTION=1 in the server's environment, a body field
        `hylora_inject_fault: true` fills the request's caches with NaN before its next step."""
        extra = self.body.model_extra or {}
        return bool(extra.get("hylora_inject_fault")) and os.environ.get("HYLORA_ENABLE_FAULT_INJECTION") == "1"

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
        failed = next((o for o in final if o is not None and o.finish_reason == "error"), None)
        if failed is not None:
            raise APIError(500, failed.error or "request failed", "server_error", "numerical_fault")
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

    def _observe(self, index: int, out: RequestOutput) -> None:
        m, label = self.state.metrics, self.adapter or ""
        now = time.monotonic()
        if out.new_token_ids:
            m.generation_tokens.labels(adapter=label).inc(len(out.new_token_ids))
            last = self._last_token_at.get(index)
            if last is None:
                m.ttft.labels(adapter=label).observe(now - self.arrival)
            else:
                for _ in out.new_token_ids:
                    m.itl.labels(adapter=label).observe((now - last) / len(out.new_token_ids))
            self._last_token_at[index] = now
        if out.finished:
            self._finished.add(index)
            m.requests.labels(status=out.finish_reason or "unknown", adapter=label).inc()

    # --- chat ------------------------------------------------------------------------------
    def chat_response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outputs):
            choice: dict[str, Any] = {
                "index": i,
                "message": {"role": "assistant", "content": out.text},
                "finish_reason": out.finish_reason,
                "logprobs": None,
            }
            if out.logprobs is not None:
                choice["logprobs"] = {"content": [self._chat_logprob(lp) for lp in out.logprobs]}
            choices.append(choice)
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "usage": self._usage(outputs),
        }

    async def chat_events(self, streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
        base = {"id": self.id, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model}
        finals: list[RequestOutput] = []
        for i in range(len(streams)):
            yield _sse(
                base
                | {
                    "choices": [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                }
            )
        async for i, out in self._merged(streams):
            if out.finish_reason == "error":
                yield _sse({"error": {"message": out.error, "type": "server_error", "code": "numerical_fault"}})
                continue
            choice: dict[str, Any] = {
                "index": i,
                "delta": {"content": out.new_text} if out.new_text else {},
                "logprobs": None,
                "finish_reason": out.finish_reason if out.finished else None,
            }
            if out.logprobs is not None and out.new_token_ids:
                fresh = out.logprobs[len(out.logprobs) - len(out.new_token_ids) :]
                choice["logprobs"] = {"content": [self._chat_logprob(lp) for lp in fresh]}
            if choice["delta"] or choice["finish_reason"] or choice["logprobs"]:
                yield _sse(base | {"choices": [choice]})
            if out.finished:
                finals.append(out)
        if (self.body.stream_options or {}).get("include_usage"):
            yield _sse(base | {"choices": [], "usage": self._usage(finals)})
        yield "data: [DONE]\n\n"

    def _chat_logprob(self, lp: TokenLogprob) -> dict[str, Any]:
        token = self.tokenizer.decode([lp.token_id])
        return {
            "token": token,
            "logprob": lp.logprob,
            "bytes": list(token.encode("utf-8")),
            "top_logprobs": [
                {"token": (t := self.tokenizer.decode([tid])), "logprob": v, "bytes": list(t.encode("utf-8"))}
                for tid, v in lp.top.items()
            ],
        }

    # --- completions -----------------------------------------------------------------------
    def completion_response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        body: CompletionRequest = self.body  # type: ignore[assignment]
        prompt_text = self.tokenizer.decode(self.prompt_ids) if body.echo else ""
        choices = []
        for i, out in enumerate(outputs):
            choices.append(
                {
                    "index": i,
                    "text": prompt_text + out.text,
                    "finish_reason": out.finish_reason,
                    "logprobs": self._completion_logprobs(out) if body.logprobs is not None else None,
                }
            )
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
        finals: list[RequestOutput] = []
        if body.echo:
            text = self.tokenizer.decode(self.prompt_ids)
            for i in range(len(streams)):
                yield _sse(base | {"choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": None}]})
        async for i, out in self._merged(streams):
            if out.finish_reason == "error":
                yield _sse({"error": {"message": out.error, "type": "server_error", "code": "numerical_fault"}})
                continue
            if out.new_text or out.finished:
                yield _sse(
                    base
                    | {
                        "choices": [
                            {
                                "index": i,
                                "text": out.new_text,
                                "logprobs": None,
                                "finish_reason": out.finish_reason if out.finished else None,
                            }
                        ]
                    }
                )
            if out.finished:
                finals.append(out)
        if (body.stream_options or {}).get("include_usage"):
            yield _sse(base | {"choices": [], "usage": self._usage(finals)})
        yield "data: [DONE]\n\n"

    def _completion_logprobs(self, out: RequestOutput) -> dict[str, Any]:
        entries: list[tuple[int, float | None, dict[int, float] | None]] = []
        if out.prompt_logprobs is not None:
            for tid, lp in zip(self.prompt_ids, out.prompt_logprobs, strict=True):
                entries.append((tid, None, None) if lp is None else (tid, lp.logprob, lp.top))
        for lp in out.logprobs or []:
            entries.append((lp.token_id, lp.logprob, lp.top))
        tokens, offsets, pos = [], [], 0
        for tid, _, _ in entries:
            t = self.tokenizer.decode([tid])
            tokens.append(t)
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [
                None if top is None else {self.tokenizer.decode([k]): v for k, v in top.items()}
                for _, _, top in entries
            ],
            "text_offset": offsets,
        }

    def _usage(self, outputs: list[RequestOutput]) -> dict[str, int]:
        completion = sum(len(o.token_ids) for o in outputs)
        return {
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": completion,
            "total_tokens": len(self.prompt_ids) + completion,
        }


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _close_all(streams: list[AsyncIterator[RequestOutput]]) -> None:
    for s in streams:
        await s.aclose()  # type: ignore[attr-defined]

"""The OpenAI-compatible HTTP API."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hylora.engine.async_engine import AsyncEngine, EngineDead
from hylora.engine.engine import RequestError, RequestOutput
from hylora.engine.request import TokenLogprob
from hylora.lora.adapter import AdapterError
from hylora.lora.registry import UnknownAdapter
from hylora.server.metrics import ServerMetrics, engine_snapshot
from hylora.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRARequest,
    UnloadLoRARequest,
    Unsupported,
    _Sampling,
)
from hylora.server.routing import ConflictError, RouteError, TaskRouter
from hylora.server.security import Forbidden, adapter_dir_under, key_matches
from hylora.tokenizer import chat_prompt

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


@dataclass
class ServerState:
    aengine: AsyncEngine
    router: TaskRouter
    api_key: str | None = None
    adapter_root: Path | None = None
    max_body_bytes: int = 8 << 20
    shutdown_grace_s: float = 30.0
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def engine(self):
        return self.aengine.engine


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not state.aengine.alive:
            state.aengine.start()
        yield
        await state.aengine.shutdown(state.shutdown_grace_s)

    app = FastAPI(title="hylora", lifespan=lifespan)
    app.state.hylora = state
    _install_error_handlers(app, state)
    app.add_middleware(_BodyLimit, limit=state.max_body_bytes, metrics=state.metrics)

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        if (
            state.api_key
            and request.url.path.startswith("/v1")
            and not key_matches(request.headers.get("authorization"), state.api_key)
        ):
            state.metrics.rejected.labels(code="401").inc()
            return _error_response(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                "authentication_error",
                "invalid_api_key",
            )
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        if not state.aengine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        snapshot = await state.aengine.call(lambda: engine_snapshot(state.engine))
        return Response(state.metrics.render(snapshot), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        registry = state.engine.adapters
        data = [
            {
                "id": state.router.base_name,
                "object": "model",
                "created": state.created,
                "owned_by": "hylora",
                "root": str(state.engine.model_dir),
                "parent": None,
                "max_model_len": state.engine.config.max_model_len,
            }
        ]
        for name in registry.names():
            version = registry.get(name)
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "hylora",
                    "root": str(version.path),
                    "parent": state.router.base_name,
                    "tasks": sorted(t for t, a in state.router.tasks.items() if a == name),
                }
            )
        return {"object": "list", "data": data}

    @app.post("/v1/load_lora_adapter")
    async def load_lora(body: LoadLoRARequest) -> dict[str, Any]:
        body.warn_unknown("load_lora_adapter")
        try:
            path = adapter_dir_under(state.adapter_root, body.lora_path)
        except Forbidden as e:
            raise APIError(403, str(e), "permission_error") from None
        except FileNotFoundError as e:
            raise APIError(404, str(e), code="adapter_not_found") from None
        try:
            await asyncio.to_thread(state.engine.adapters.load, body.lora_name, path)
        except AdapterError as e:
            raise APIError(400, str(e)) from None
        log.info("loaded adapter %s from %s", body.lora_name, path)
        return {"status": "ok", "lora_name": body.lora_name}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(body: UnloadLoRARequest) -> dict[str, Any]:
        body.warn_unknown("unload_lora_adapter")
        if state.adapter_root is None:
            raise APIError(
                403, "runtime adapter changes are off; start the server with --adapter-root DIR", "permission_error"
            )
        try:
            state.engine.adapters.unload(body.lora_name)
        except UnknownAdapter as e:
            raise APIError(404, str(e), code="model_not_found") from None
        return {"status": "ok", "lora_name": body.lora_name}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        body.warn_unknown("chat/completions")
        adapter = _route(state, body, request)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            prompt_ids = chat_prompt(state.engine.tokenizer, messages)
        except (Unsupported, ValueError) as e:
            raise APIError(400, str(e)) from None
        max_tokens = _max_tokens(state, len(prompt_ids), body.requested_max_tokens)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        job = _Job(state, "chatcmpl", body, adapter, prompt_ids, max_tokens, logprobs, None)
        streams = await job.start()
        if body.stream:
            return StreamingResponse(job.chat_events(streams), media_type="text/event-stream")
        outputs = await job.collect(streams, request)
        return JSONResponse(job.chat_response(outputs))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        body.warn_unknown("completions")
        adapter = _route(state, body, request)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            prompt_ids = state.engine.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            prompt_ids = list(prompt)
        max_tokens = _max_tokens(state, len(prompt_ids), body.max_tokens if body.max_tokens is not None else 16)
        prompt_logprobs = body.logprobs if (body.echo and body.logprobs is not None) else None
        job = _Job(state, "cmpl", body, adapter, prompt_ids, max_tokens, body.logprobs, prompt_logprobs)
        streams = await job.start()
        if body.stream:
            return StreamingResponse(job.completion_events(streams), media_type="text/event-stream")
        outputs = await job.collect(streams, request)
        return JSONResponse(job.completion_response(outputs))

    return app


# --- request handling ------------------------------------------------------------------------


def _route(state: ServerState, body: _Sampling, request: Request) -> str | None:
    try:
        body.check_supported()
        return state.router.resolve(body.model, body.task or request.headers.get("x-task"))
    except Unsupported as e:
        raise APIError(400, str(e)) from None
    except RouteError as e:
        raise APIError(404, str(e), code="model_not_found") from None
    except ConflictError as e:
        raise APIError(400, str(e)) from None


def _max_tokens(state: ServerState, prompt_len: int, requested: int | None) -> int:
    limit = state.engine.config.max_model_len
    if prompt_len >= limit:
        raise APIError(
            400,
            f"this model's maximum context length is {limit} tokens, but the prompt has "
            f"{prompt_len} tokens; shorten the prompt",
            code="context_length_exceeded",
        )
    if requested is None:
        return limit - prompt_len
    if requested < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {requested}")
    if prompt_len + requested > limit:
        raise APIError(
            400,
            f"this model's maximum context length is {limit} tokens; the prompt has {prompt_len} "
            f"tokens and max_tokens asks for {requested} more; shorten the prompt or lower "
            "max_tokens",
            code="context_length_exceeded",
        )
    return requested


class _Job:
    """One HTTP request: n engine requests that share a prompt, their outputs, and the response."""

    def __init__(
        self,
        state: ServerState,
        prefix: str,
        body: _Sampling,
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


# --- plumbing --------------------------------------------------------------------------------


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _close_all(streams: list[AsyncIterator[RequestOutput]]) -> None:
    for s in streams:
        await s.aclose()  # type: ignore[attr-defined]


def _error_response(
    status: int, message: str, kind: str = "invalid_request_error", code: str | None = None
) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status_code=status)


def _install_error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        state.metrics.rejected.labels(code=str(e.status)).inc()
        return _error_response(e.status, e.message, e.kind, e.code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        state.metrics.rejected.labels(code="400").inc()
        problems = []
        for err in e.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return _error_response(400, "invalid request: " + "; ".join(problems))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error_response(e.status_code, str(e.detail))


class _BodyLimit:
    """ASGI middleware: refuse request bodies above `limit` bytes with 413 (Content-Length or streamed)."""

    def __init__(self, app, limit: int, metrics: ServerMetrics):
        self.app, self.limit, self.metrics = app, limit, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope, receive, send):
        self.metrics.rejected.labels(code="413").inc()
        response = _error_response(413, f"request body larger than {self.limit} bytes")
        await response(scope, receive, send)


class _TooLarge(Exception):
    pass

"""The OpenAI-compatible HTTP API: the app, its routes, and request routing / length checks."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypeVar

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from hylora import __version__
from hylora.adapters.files import AdapterError
from hylora.adapters.registry import UnknownAdapter
from hylora.engine.async_engine import AsyncEngine
from hylora.engine.chat_input import MediaSettings, has_media, multimodal_prompt
from hylora.engine.multimodal import MultimodalPrompt
from hylora.media import MediaError
from hylora.media.config import merge_overrides
from hylora.server.chat_output import DEFAULT_TOOL_FORMAT, ChatOutputs
from hylora.server.errors import APIError, BodyLimit, error_response, install_error_handlers
from hylora.server.job import Job
from hylora.server.json_body import json_response
from hylora.server.metrics import ServerMetrics
from hylora.server.parsers import ReasoningParser, ToolRequest, ToolRequestError, parse_tool_request, think_end_ids
from hylora.server.protocol import (
    CONTINUE_NEEDS_NO_GENERATION_PROMPT,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRARequest,
    SamplingRequest,
    TokenizeRequest,
    UnloadLoRARequest,
    Unsupported,
)
from hylora.server.request_id_header import RequestIdHeader
from hylora.server.responses import NOT_STORED, ResponseBuilder, ResponsesRequest, response_events
from hylora.server.routing import ConflictError, RouteError, TaskRouter
from hylora.server.security import Forbidden, RequireKey, adapter_dir_under
from hylora.server.streaming import EventStream
from hylora.server.timing import IntakeClock, StampArrival
from hylora.server.vllm_metrics import VLLMMetrics
from hylora.structured import (
    CompiledGrammar,
    CompilerBusy,
    StructuredOutputError,
    StructuredSpec,
    parse_structured_outputs,
)
from hylora.tokenizer import PromptTooLong, bad_words_token_ids, chat_prompt, check_template_kwargs, max_token_chars

log = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
# A request body, JSON-decoded by FastAPI and validated by `_parse` off the event loop.
Payload = Annotated[Any, Body()]


@dataclass
class ServerState:
    aengine: AsyncEngine
    router: TaskRouter
    api_key: str | None = None
    adapter_root: Path | None = None
    max_body_bytes: int = 8 << 20
    shutdown_grace_s: float = 30.0
    stream_stall_timeout_s: float = 60.0  # a streaming client that reads nothing for this long is cut
    public_metrics: bool = False  # /metrics without the API key (for scrapers)
    media: MediaSettings | None = None  # None: the model has no vision tower
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # from generation_config.json
    log_requests: bool = True  # one line per request, prompts redacted
    template_defaults: dict[str, Any] = field(default_factory=dict)  # --default-chat-template-kwargs
    max_logprobs: int = 20  # --max-logprobs
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details: usage reports cached prompt tokens
    tokens_as_ids: bool = False  # --return-tokens-as-token-ids: every request's default
    force_include_usage: bool = False  # --enable-force-include-usage: every stream ends with its usage
    request_id_headers: bool = False  # --enable-request-id-headers: X-Request-Id on every response
    cors: dict[str, Any] | None = None  # CORSMiddleware's arguments (--allowed-origins & co)
    reasoning_parser: str | None = None  # --reasoning-parser
    tool_call_parser: str | None = None  # --tool-call-parser
    auto_tool_choice: bool = False  # --enable-auto-tool-choice
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def engine(self):
        return self.aengine.engine

    def __post_init__(self) -> None:
        self.max_token_chars = max_token_chars(self.engine.tokenizer)
        # Text requests render and tokenise on their own threads: media fetches and decodes, which
        # have pools of their own, and the loop's default executor can never make them wait.
        self.text_pool = ThreadPoolExecutor(min(8, (os.cpu_count() or 1) + 2), thread_name_prefix="hylora-text")
        c = self.engine.config
        self.vllm_metrics = VLLMMetrics(self.metrics.registry, self.router.base_name, c.max_model_len, c.max_loras)

    @property
    def max_prompt_chars(self) -> int:
        """More characters than this cannot fit in the context even at the longest token's length."""
        return self.engine.config.max_model_len * self.max_token_chars

    async def run_text(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the text pool (rendering, tokenising, detokenising)."""
        return await asyncio.get_running_loop().run_in_executor(self.text_pool, functools.partial(fn, *args, **kwargs))


def build_app(state: ServerState, docs: bool = True) -> FastAPI:
    """The API over `state`; `docs=False` (--disable-fastapi-docs) leaves out /docs, /redoc, /openapi.json."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not state.aengine.alive:
            state.aengine.start()
        yield
        await state.aengine.shutdown(state.shutdown_grace_s)
        state.text_pool.shutdown(wait=False, cancel_futures=True)

    off = dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="hylora", lifespan=lifespan, **({} if docs else off))
    app.state.hylora = state
    _document_bodies(app, {
        "/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
        "/v1/responses": ResponsesRequest,
        "/v1/load_lora_adapter": LoadLoRARequest, "/v1/unload_lora_adapter": UnloadLoRARequest,
        "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
    })  # fmt: skip
    install_error_handlers(app, state.metrics)
    app.add_middleware(BodyLimit, limit=state.max_body_bytes, metrics=state.metrics)

    open_paths = {"/health"} | ({"/metrics"} if state.public_metrics else set())

    def refuse_key() -> Response:
        state.metrics.rejected.labels(code="401").inc()
        message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
        return error_response(401, message, "authentication_error", "invalid_api_key")

    app.add_middleware(RequireKey, api_key=state.api_key, open_paths=open_paths, refuse=refuse_key)

    if state.cors is not None:  # a browser's preflight needs no API key
        app.add_middleware(CORSMiddleware, **state.cors)
    if state.request_id_headers:
        app.add_middleware(RequestIdHeader)
    app.add_middleware(StampArrival)  # outermost: a request's latencies start at its headers

    @app.get("/health")
    async def health() -> Response:
        if not state.aengine.alive:
            return JSONResponse({"status": "engine stopped", "reason": state.aengine.fatal}, status_code=503)
        if not state.aengine.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = await state.aengine.call(state.engine.stats)
        media_cache = state.media.cache if state.media is not None else None

        def render() -> bytes:  # off the event loop: a scrape of many adapters' series takes a while
            state.vllm_metrics.update(stats, media_cache)
            return state.metrics.render(stats, media_cache)

        return Response(await state.run_text(render), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": _model_cards(state)}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        card = next((c for c in _model_cards(state) if c["id"] == model_id), None)
        if card is None:
            names = ", ".join(state.router.model_names())
            raise APIError(404, f"the model {model_id!r} does not exist; models: {names}", code="model_not_found")
        return card

    @app.post("/v1/load_lora_adapter")
    async def load_lora(payload: Payload) -> dict[str, Any]:
        body = await _parse(LoadLoRARequest, payload)
        body.check_unknown_fields("load_lora_adapter")
        if body.lora_name in (state.router.base_name, *state.router.aliases):  # it would route to the base model
            raise APIError(400, f"{body.lora_name!r} is the base model's name; give the adapter another name")
        try:  # file-system work (symlinks, slow mounts) off the event loop
            path = await asyncio.to_thread(adapter_dir_under, state.adapter_root, body.lora_path)
        except Forbidden as e:
            raise APIError(403, str(e), "permission_error") from None
        except FileNotFoundError as e:
            raise APIError(404, str(e), code="adapter_not_found") from None
        except (OSError, ValueError, RuntimeError) as e:  # NUL bytes, symlink loops, names too long
            raise APIError(400, f"bad adapter path: {e}") from None
        try:
            await asyncio.to_thread(state.engine.adapters.load, body.lora_name, path)
        except AdapterError as e:
            raise APIError(400, str(e)) from None
        log.info("loaded adapter %s from %s", body.lora_name, path)
        return {"status": "ok", "lora_name": body.lora_name}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(payload: Payload) -> dict[str, Any]:
        body = await _parse(UnloadLoRARequest, payload)
        body.check_unknown_fields("unload_lora_adapter")
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
    async def chat_completions(payload: Payload, request: Request) -> Response:
        body, clock = await _generation_body(state, ChatCompletionRequest, payload, request, "chat/completions")
        job, streams = await _start_chat(state, body, request, clock)
        if body.stream:
            return EventStream(job.chat_events(streams), state.stream_stall_timeout_s, state.metrics)
        outputs = await job.collect(streams, request)
        return await state.run_text(lambda: json_response(job.chat_response(outputs)))

    @app.post("/v1/responses")
    async def responses(payload: Payload, request: Request) -> Response:
        body, clock = await _generation_body(state, ResponsesRequest, payload, request, "responses")
        body.check_supported()
        chat = body.chat_request()
        if body.stream:  # the chat stream's usage chunk gives the Response its usage
            chat |= {"stream": True, "stream_options": {"include_usage": True}}
        job, streams = await _start_chat(state, await _parse(ChatCompletionRequest, chat), request, clock)
        builder = ResponseBuilder(body, job.model)
        if body.stream:
            events = response_events(builder, job.chat_events(streams))
            return EventStream(events, state.stream_stall_timeout_s, state.metrics)
        outputs = await job.collect(streams, request)
        return await state.run_text(lambda: json_response(builder.from_chat(job.chat_response(outputs))))

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    @app.post("/v1/responses/{response_id}/cancel")
    @app.get("/v1/responses/{response_id}/input_items")
    async def stored_response(response_id: str) -> Response:
        raise APIError(404, f"response {response_id!r}: {NOT_STORED}", code="not_found")

    @app.post("/v1/completions")
    async def completions(payload: Payload, request: Request) -> Response:
        body, clock = await _generation_body(state, CompletionRequest, payload, request, "completions")
        adapter = _route(state, body, request)
        texts = body.prompt_list()
        _check_chars(state, max((len(p) for p in texts if isinstance(p, str)), default=0))  # each fits alone
        prompts = [await state.run_text(_tokenize, state, p) if isinstance(p, str) else list(p) for p in texts]
        requested = body.max_tokens if body.max_tokens is not None else 16
        score_only = requested == 0  # the prompt's logprobs are the answer (scoring clients, lm-eval)
        max_tokens = [_max_tokens(state, len(ids), 1 if score_only else requested) for ids in prompts]
        prompt_logprobs = body.prompt_logprobs
        if prompt_logprobs is None and body.echo and body.logprobs is not None:
            prompt_logprobs = body.logprobs
        grammar = await _grammar(state, body)
        job = Job(
            state, "cmpl", body, adapter, prompts, max_tokens, body.logprobs, prompt_logprobs, grammar=grammar,
            score_only=score_only, bad_words_ids=await _bad_words(state, body), clock=clock,
        )  # fmt: skip
        streams = await job.start(request)
        if body.stream:
            return EventStream(job.completion_events(streams), state.stream_stall_timeout_s, state.metrics)
        outputs = await job.collect(streams, request)
        return await state.run_text(lambda: json_response(job.completion_response(outputs)))

    @app.post("/tokenize")
    async def tokenize(payload: Payload) -> dict[str, Any]:
        body = await _parse(TokenizeRequest, payload)
        body.check_unknown_fields("tokenize")
        _resolve(state, body.model)
        tokenizer = state.engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send either prompt or messages")
        if body.prompt is not None:
            _check_chars(state, len(body.prompt))
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await state.run_text(_tokenize, state, body.prompt, add)
        else:
            parts = [p for m in body.messages for p in _parts(m)]
            media = sorted({str(p.get("type")) for p in parts if p.get("type") != "text"})
            if media:
                raise APIError(
                    400,
                    f"/tokenize takes text content only, not {', '.join(media)} parts: send the text (a request's "
                    "tokens with its images or videos are in /v1/chat/completions' usage.prompt_tokens)",
                    param="messages",
                )
            if body.continue_final_message and body.add_generation_prompt:
                raise APIError(400, CONTINUE_NEEDS_NO_GENERATION_PROMPT, param="continue_final_message")
            template_kwargs = _template_kwargs(state, body)
            try:  # the tools as the chat template renders them (tool_choice does not change the prompt)
                tools = parse_tool_request({"tools": body.tools, "tool_choice": "none"})
            except ToolRequestError as e:
                raise APIError(400, str(e), param=e.param) from None
            ids = await _text_chat_ids(state, body, template_kwargs, tools)
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": state.engine.config.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(payload: Payload) -> dict[str, Any]:
        body = await _parse(DetokenizeRequest, payload)
        _resolve(state, body.model)
        vocab = state.engine.model.config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})")
        return {"prompt": await state.run_text(state.engine.tokenizer.decode, body.tokens)}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    return app


# --- request handling ------------------------------------------------------------------------


async def _generation_body(
    state: ServerState, model: type[M], payload: Any, request: Request, route: str
) -> tuple[M, IntakeClock]:
    """A generation route's body, validated and its unknown fields checked, and the clock of its intake."""
    clock = IntakeClock(request, state.metrics.intake)
    clock.mark("read")
    body = await _parse(model, payload)
    body.check_unknown_fields(route)  # type: ignore[attr-defined]
    return body, clock


async def _start_chat(
    state: ServerState, body: ChatCompletionRequest, request: Request, clock: IntakeClock
) -> tuple[Job, list[Any]]:
    """A chat completion's job, started: routed, templated, its media, tools and grammar prepared."""
    adapter = _route(state, body, request)
    tools = _tool_request(state, body)
    template_kwargs = _template_kwargs(state, body)
    prompt_ids, mm = await _chat_prompt(state, body, template_kwargs, tools)
    max_tokens = _max_tokens(state, len(prompt_ids), body.requested_max_tokens)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    grammar = await _grammar(state, body, _tool_grammar(state, body, tools))
    outputs_as = _chat_outputs(state, prompt_ids, template_kwargs, tools, body.include_reasoning)
    after = think_end_ids(state.engine.tokenizer) if grammar is not None and outputs_as.in_reasoning else ()
    job = Job(
        state, "chatcmpl", body, adapter, [prompt_ids], [max_tokens], logprobs, body.prompt_logprobs, mm, grammar,
        chat_outputs=outputs_as, grammar_after=after, bad_words_ids=await _bad_words(state, body), clock=clock,
    )  # fmt: skip
    return job, await job.start(request)


async def _parse(model: type[M], payload: Any) -> M:
    """The request body as `model`, validated on a worker thread: a body near the size limit can take
    seconds to validate, and the event loop keeps serving everyone else meanwhile. Errors read as
    FastAPI's own validation errors (from_attributes, as FastAPI validates)."""
    try:
        return await asyncio.to_thread(model.model_validate, payload, from_attributes=True)
    except ValidationError as e:
        raise RequestValidationError([err | {"loc": ("body", *err["loc"])} for err in e.errors()]) from None


def _document_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """The routes take their bodies as plain JSON (validated by `_parse`), so FastAPI does not see
    their models: /openapi.json (and /docs) get them back here."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            content = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
            content["schema"] = {"$ref": f"#/components/schemas/{model.__name__}"}
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _model_cards(state: ServerState) -> list[dict[str, Any]]:
    """/v1/models' entries: the base model under each served name, then every adapter. `status` is
    "ready", or "broken" for an adapter whose files changed or vanished after loading (its requests
    answer 409 until it is loaded again), with the reason in `status_message`."""
    registry, max_len = state.engine.adapters, state.engine.config.max_model_len
    common = {"object": "model", "created": state.created, "owned_by": "hylora", "max_model_len": max_len}
    cards = [
        common | {"id": name, "root": str(state.engine.model_dir), "parent": None, "status": "ready"}
        for name in (state.router.base_name, *state.router.aliases)
    ]
    for name in registry.names():
        version = registry.get(name)
        card = common | {
            "id": name,
            "root": str(version.path),
            "parent": state.router.base_name,
            "tasks": sorted(t for t, a in state.router.tasks.items() if a == name),
            "status": "ready",
        }
        if version.broken:
            card |= {"status": "broken", "status_message": version.broken}
        cards.append(card)
    return cards


async def _chat_prompt(
    state: ServerState, body: ChatCompletionRequest, template_kwargs: dict[str, Any], tools: ToolRequest
) -> tuple[list[int], MultimodalPrompt | None]:
    """Prompt ids of the conversation (the request's tools rendered by the chat template); with images
    / videos also their preprocessed media. The characters are bounded before anything else happens
    and again, rendered, before tokenising."""
    if tools.tools:
        template_kwargs = template_kwargs | {"tools": list(tools.tools)}
    _check_chars(state, sum(m.text_chars() for m in body.messages))
    try:
        messages = [m.for_template(m.content) for m in body.messages]
    except Unsupported as e:
        raise APIError(400, str(e), param=e.param or "messages") from None
    if has_media(messages):
        if state.media is None:
            text_only = state.engine.config.language_model_only
            why = "the server runs with --language-model-only" if text_only else "this model has no vision tower"
            raise APIError(400, f"{why}: send text only", param="messages")
        try:
            return await multimodal_prompt(
                state.media,
                state.engine.tokenizer,
                messages,
                merge_overrides(body.mm_processor_kwargs, body.media_io_kwargs),
                max_chars=state.max_prompt_chars,
                template_kwargs=template_kwargs,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
            )
        except MediaError as e:
            raise APIError(400, str(e), code="invalid_media") from None
        except PromptTooLong as e:
            raise _too_long(state, e.chars) from None
    return await _text_chat_ids(state, body, template_kwargs), None


async def _text_chat_ids(
    state: ServerState,
    body: ChatCompletionRequest | TokenizeRequest,
    template_kwargs: dict[str, Any],
    tools: ToolRequest | None = None,
) -> list[int]:
    """Prompt ids of a text-only conversation, as chat requests and /tokenize render it."""
    if tools is not None and tools.tools:
        template_kwargs = template_kwargs | {"tools": list(tools.tools)}
    _check_chars(state, sum(m.text_chars() for m in body.messages))
    try:
        texts = [m.for_template(m.text()) for m in body.messages]
    except Unsupported as e:
        raise APIError(400, str(e), param=e.param or "messages") from None
    return await state.run_text(
        _render_chat, state, texts, body.add_generation_prompt, continue_final_message=body.continue_final_message,
        **template_kwargs,
    )  # fmt: skip


def _parts(message: Any) -> list[dict[str, Any]]:
    """A message's content parts (none for plain-text content)."""
    content = message.content
    return [p for p in content if isinstance(p, dict)] if isinstance(content, list) else []


def _template_kwargs(state: ServerState, body: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
    """The request's chat template variables over the server's defaults (--default-chat-template-kwargs);
    a template of the client's own is refused (as vLLM)."""
    if (body.model_extra or {}).get("chat_template") is not None:
        raise APIError(
            400,
            "chat_template: this server renders every request with its own chat template; a request cannot replace it",
            param="chat_template",
        )
    try:
        return state.template_defaults | check_template_kwargs(body.chat_template_kwargs)
    except ValueError as e:
        raise APIError(400, str(e), param="chat_template_kwargs") from None


def _check_chars(state: ServerState, chars: int) -> None:
    """Refuse, before tokenising, text that cannot fit in the context even at the most characters
    any single token covers."""
    if chars > state.max_prompt_chars:
        raise _too_long(state, chars)


def _too_long(state: ServerState, chars: int) -> APIError:
    return APIError(
        400,
        f"the prompt has {chars} characters, more than fit in this model's maximum context length of "
        f"{state.engine.config.max_model_len} tokens; shorten the prompt",
        code="context_length_exceeded",
    )


def _render_chat(
    state: ServerState, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
) -> list[int]:
    """(`template_kwargs` may hold continue_final_message, which chat_prompt takes by name.)"""
    try:
        return chat_prompt(
            state.engine.tokenizer, messages, add_generation_prompt, max_chars=state.max_prompt_chars, **template_kwargs
        )
    except PromptTooLong as e:
        raise _too_long(state, e.chars) from None
    except Exception as e:  # the template's own checks (e.g. roles must alternate) and jinja errors
        raise APIError(400, f"the chat template cannot render these messages: {e}") from None


def _tokenize(state: ServerState, text: str, add_special_tokens: bool = False) -> list[int]:
    try:
        return state.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except Exception as e:
        raise APIError(400, f"cannot tokenise the prompt: {e}") from None


async def _bad_words(state: ServerState, body: SamplingRequest) -> list[list[int]] | None:
    """vLLM's `bad_words` as token sequences, tokenised on the text pool (None without any)."""
    if not body.bad_words:
        return None
    try:
        return await state.run_text(bad_words_token_ids, state.engine.tokenizer, body.bad_words)
    except ValueError as e:
        raise APIError(400, str(e), param="bad_words") from None


def _tool_request(state: ServerState, body: ChatCompletionRequest) -> ToolRequest:
    """The request's tools and tool_choice, checked (400 naming the field)."""
    try:
        return parse_tool_request(dict(body), auto_tool_choice=state.auto_tool_choice)
    except ToolRequestError as e:
        raise APIError(400, str(e), param=e.param) from None


def _tool_grammar(state: ServerState, body: ChatCompletionRequest, tools: ToolRequest) -> StructuredSpec | None:
    """tool_choice "required" or a named function: a grammar that only admits well-formed calls
    whose arguments fit the function's schema (in the model's own call format)."""
    if not tools.grammar_needed:
        return None
    if parse_structured_outputs(dict(body)) is not None:
        raise APIError(400, "tool_choice forces tool calls: it cannot be combined with response_format or "
                       "another output constraint", param="tool_choice")  # fmt: skip
    added = state.engine.tokenizer.get_added_vocab()  # tags that are one token each are named as tokens
    tags = [tag for tag in ("<tool_call>", "</tool_call>") if tag in added]
    try:
        lark = tools.grammar(state.tool_call_parser or DEFAULT_TOOL_FORMAT, tags)
    except ValueError as e:
        raise APIError(400, str(e), param="tools") from None
    return StructuredSpec("grammar", lark) if lark else None


def _chat_outputs(
    state: ServerState,
    prompt_ids: list[int],
    template_kwargs: dict[str, Any],
    tools: ToolRequest,
    include_reasoning: bool = True,
) -> ChatOutputs:
    """How the request's choices are read: the reasoning split off when the server has a reasoning
    parser and the prompt leaves the model inside `<think>`, tool calls when tools may be called."""
    parser = ReasoningParser(state.reasoning_parser) if state.reasoning_parser else None
    in_reasoning = False
    if parser is not None:  # the generation turn: the prompt's last tokens
        tail = state.engine.tokenizer.decode(prompt_ids[-64:], skip_special_tokens=False)
        in_reasoning = parser.starts_in_reasoning(tail, template_kwargs.get("enable_thinking"))
    return ChatOutputs(parser, in_reasoning, tools, state.tool_call_parser or DEFAULT_TOOL_FORMAT, include_reasoning)


async def _grammar(
    state: ServerState, body: SamplingRequest, forced: StructuredSpec | None = None
) -> CompiledGrammar | None:
    """The request's output constraint (or `forced`, the tool-call grammar), compiled off the event
    loop (cached by spec), or None."""
    try:
        spec = forced or parse_structured_outputs(dict(body))  # (not model_dump: it copies the whole body)
        if spec is None:
            return None
        compiler = await state.run_text(state.engine.grammar_compiler)
        return await compiler.compile(spec)
    except CompilerBusy as e:  # every compile thread stayed busy: overload, not the client's fault
        raise APIError(503, str(e), kind="server_error", code="compiler_busy") from None
    except StructuredOutputError as e:
        raise APIError(400, str(e), code="invalid_structured_output") from None


def _route(state: ServerState, body: SamplingRequest, request: Request) -> str | None:
    try:
        body.check_supported(state.max_logprobs)
    except Unsupported as e:
        raise APIError(400, str(e), param=e.param) from None
    return _resolve(state, body.model, body.task or request.headers.get("x-task"))


def _resolve(state: ServerState, model: str | None, task: str | None = None) -> str | None:
    """The adapter that serves `model` / `task` (None: the base model); 404 for an unknown one."""
    try:
        return state.router.resolve(model, task)
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
        raise APIError(400, f"max_tokens must be at least 1, got {requested}", param="max_tokens")
    if prompt_len + requested > limit:
        raise APIError(
            400,
            f"this model's maximum context length is {limit} tokens; the prompt has {prompt_len} "
            f"tokens and max_tokens asks for {requested} more; shorten the prompt or lower "
            "max_tokens",
            code="context_length_exceeded",
        )
    return requested

"""OpenAI's Responses API (`POST /v1/responses`) on top of the chat path.

A Responses request is translated into the chat completion it stands for (instructions → a system
message, `input` items → messages, function tools → chat tools, `text.format` → `response_format`,
`max_output_tokens` → `max_completion_tokens`), served by the same job as /v1/chat/completions (adapter
routing, templates, media, reasoning split, tool parsing, structured outputs), and the chat answer is
given back as a Response: reasoning, message and function-call output items, or as the Responses
stream's typed events. hylora keeps no responses: `previous_response_id`, `background` and the hosted
tools (web search, file search, ...) are refused with what to send instead.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any, Literal

from pydantic import Field

from hylora.server.json_body import event_json
from hylora.server.protocol import MAX_MESSAGES, Unsupported, _at_most, _Body

log = logging.getLogger(__name__)
NOT_STORED = "hylora keeps no responses (store is off); send the conversation so far in input"
# fields a Responses request shares with a chat completion request (the vLLM extensions included)
SAME_ON_CHAT = (
    "temperature", "top_p", "parallel_tool_calls", "seed", "chat_template_kwargs", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "ignore_eos", "min_tokens",
    "mm_processor_kwargs",
)  # fmt: skip
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


class ResponsesRequest(_Body):
    model: str | None = None
    input: (
        str
        | Annotated[
            list[dict[str, Any]], Field(min_length=1), _at_most(MAX_MESSAGES, "input items", "shorten the conversation")
        ]
    )
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    truncation: Literal["disabled", "auto"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None  # "message.output_text.logprobs" is read; the rest have nothing to add
    top_logprobs: int | None = None
    # vLLM's extensions, passed to the chat request as they are (e.g. chat_template_kwargs {"enable_thinking": false})
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if self.previous_response_id:
            raise Unsupported(f"{NOT_STORED} instead of previous_response_id", "previous_response_id")
        if self.background:
            raise Unsupported("background responses are not supported: send the request without it", "background")
        if self.truncation == "auto":
            raise Unsupported("truncation 'auto' is not supported: hylora never drops input; shorten it", "truncation")
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise Unsupported(
                    f"tools[{i}]: type {tool.get('type')!r} is a hosted tool hylora does not run; give function "
                    "tools and run the tool yourself",
                    "tools",
                )

    def chat_request(self) -> dict[str, Any]:
        """The chat completion request this Response stands for (validated by the caller as one)."""
        chat: dict[str, Any] = {"messages": self._messages()}
        if self.model is not None:
            chat["model"] = self.model
        if self.max_output_tokens is not None:
            chat["max_completion_tokens"] = self.max_output_tokens
        if self.wants_logprobs:
            chat |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        for name in SAME_ON_CHAT:
            value = getattr(self, name)
            if value is not None:
                chat[name] = value
        if self.tools:
            chat["tools"] = [_chat_tool(tool) for tool in self.tools]
        if self.tool_choice is not None:
            chat["tool_choice"] = _chat_tool_choice(self.tool_choice)
        fmt = (self.text or {}).get("format")
        if fmt is not None and not isinstance(fmt, dict):
            raise Unsupported('text.format must be an object, e.g. {"type": "json_schema", "name": ..., "schema": ...}')
        if fmt is not None and fmt.get("type") != "text":
            chat["response_format"] = _chat_response_format(fmt)
        return chat

    @property
    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or []) or bool(self.top_logprobs)

    def _messages(self) -> list[dict[str, Any]]:
        """The chat messages the input stands for. One assistant turn's items (its reasoning, message and
        function calls, in the order a Response gives them) become one assistant message: the reasoning as
        that message's `reasoning`, which the chat template shows in the turn's think block."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        reasoning: list[str] = []  # the reasoning items before the turn's output items

        def assistant_turn(message: dict[str, Any]) -> None:
            if reasoning:
                message["reasoning"] = "\n".join(reasoning)
                reasoning.clear()
            messages.append(message)

        def close_turn() -> None:  # reasoning with no output item after it: a turn of its own
            if reasoning:
                assistant_turn({"role": "assistant", "content": ""})

        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            last = messages[-1] if messages else None
            if kind == "message":
                given = item.get("role")
                role = ROLES.get(given) if isinstance(given, str) else None
                if role is None:
                    roles = "user, system, developer or assistant"
                    raise Unsupported(f"input[{i}]: role {item.get('role')!r}; use {roles}", "input")
                message = {"role": role, "content": _chat_content(item.get("content", ""), i)}
                if role == "assistant":
                    assistant_turn(message)
                    continue
                close_turn()
                messages.append(message)
            elif kind == "function_call":
                call_id, name, arguments = (
                    item.get("call_id") or item.get("id") or f"call_{i}",
                    item.get("name"),
                    item.get("arguments", ""),
                )
                if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, (str, dict)):
                    raise Unsupported(
                        f"input[{i}]: a function_call needs call_id, name and arguments as strings", "input"
                    )
                call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
                if last is not None and last["role"] == "assistant" and not reasoning:
                    last.setdefault("tool_calls", []).append(call)  # the turn's text, or a parallel call
                else:
                    assistant_turn({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                if not isinstance(item.get("call_id", ""), str):
                    raise Unsupported(f"input[{i}]: a function_call_output's call_id is a string", "input")
                output = item.get("output", "")
                text = output if isinstance(output, str) else json.dumps(output)
                close_turn()
                messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""), "content": text})
            elif kind == "reasoning":
                text = _reasoning_text(item, i)
                if text:  # encrypted content alone: hylora writes none and cannot read it
                    reasoning.append(text)
            else:
                raise Unsupported(
                    f"input[{i}]: item type {kind!r} is not supported; send message, function_call, "
                    "function_call_output or reasoning items",
                    "input",
                )
        close_turn()
        return messages


def _reasoning_text(item: dict[str, Any], index: int) -> str:
    """A reasoning item's text: its reasoning_text content (what hylora writes), else its summary."""
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
            raise Unsupported(f"input[{index}]: a reasoning item's {key} is a list of {part_type} parts", "input")
        texts = [p.get("text") for p in parts if p.get("type", part_type) == part_type]
        if not all(isinstance(t, str) for t in texts):
            raise Unsupported(f"input[{index}]: each {part_type} part of a reasoning item needs a string text", "input")
        if texts:
            return "".join(texts)
    return ""


def _chat_content(content: Any, index: int) -> Any:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Unsupported(f"input[{index}]: content must be a string or a list of content parts", "input")
    parts = []
    for part in content:
        if not isinstance(part, dict):
            raise Unsupported(f"input[{index}]: each content part is an object with a type (input_text, ...)", "input")
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise Unsupported(f"input[{index}]: an input_image needs image_url (file_id is not supported)", "input")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise Unsupported(
                f"input[{index}]: content type {kind!r} is not supported; send input_text or input_image", "input"
            )
    return parts


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _chat_response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt.get("type") == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return dict(fmt)  # json_object, or a type the chat path names in its own refusal


class ResponseBuilder:
    """The Response object of one request, from the chat answer (whole, or its stream's deltas)."""

    def __init__(self, body: ResponsesRequest, model: str):
        self.body, self.model = body, model
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                  finish: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "incomplete_details": incomplete,
            "error": error,
            "model": self.model,
            "output": output,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tools": body.tools or [],
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
            "text": body.text or {"format": {"type": "text"}},
            "reasoning": body.reasoning or {"effort": None, "summary": None},
            "truncation": "disabled",
            "store": False,
            "previous_response_id": None,
            "metadata": body.metadata or {},
            "user": body.user,
            "usage": _usage(usage) if usage is not None else None,
        }

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The Response of a whole chat completion (one choice)."""
        choice = chat["choices"][0]
        message = choice["message"]
        output = []
        if message.get("reasoning_content"):
            output.append(reasoning_item(_item_id("rs"), message["reasoning_content"]))
        if message.get("content") or not message.get("tool_calls"):
            text = message.get("content") or ""
            everything = (choice.get("logprobs") or {}).get("content") or []
            logprobs = _answer_logprobs(everything, bool(message.get("reasoning_content")))
            output.append(message_item(_item_id("msg"), text, logprobs=logprobs))
        for call in message.get("tool_calls") or []:
            output.append(function_call_item(_item_id("fc"), call["id"], call["function"]["name"],
                                             call["function"]["arguments"]))  # fmt: skip
        return self.response("completed", output, chat["usage"], choice["finish_reason"])


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}  # fmt: skip


def message_item(item_id: str, text: str | None, status: str = "completed", logprobs: list | None = None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    content = [] if text is None else [part]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip


def _answer_logprobs(logprobs: list[dict[str, Any]], reasoning: bool) -> list[dict[str, Any]]:
    """The logprobs of the answer's tokens: after a reasoning split, the chat's cover the reasoning too, so
    the tokens after the last </think> (all of them where it is not found, e.g. tokens named by id)."""
    if reasoning:
        ends = [i for i, lp in enumerate(logprobs) if lp["token"] == "</think>"]
        if ends:
            return logprobs[ends[-1] + 1 :]
    return logprobs


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


async def response_events(builder: ResponseBuilder, chat_events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The Responses stream of a chat stream (one choice, usage included): response.created, then each
    output item opened, its deltas, closed, then response.completed (or .incomplete, or .failed on an error)."""
    stream = _EventWriter()
    yield stream.event("response.created", response=builder.response("in_progress", []))
    yield stream.event("response.in_progress", response=builder.response("in_progress", []))
    finish, usage, error = None, None, None
    try:
        async with aclosing(chat_events):  # a client gone mid-stream closes this, and so the chat stream's requests
            async for sse in chat_events:
                if not sse.startswith("data: {"):
                    continue  # [DONE]
                chunk = json.loads(sse[len("data: ") :])
                if "error" in chunk:
                    error = chunk["error"]
                    continue
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    logprobs = (choice.get("logprobs") or {}).get("content")
                    for event in stream.delta(choice.get("delta") or {}, logprobs=logprobs):
                        yield event
                    finish = choice.get("finish_reason") or finish
        for event in stream.close_all():
            yield event
        if error is None and not any(item["type"] in ("message", "function_call") for item in stream.output):
            for event in stream.delta({}, empty_message=True) + stream.close_all():  # no answer: an empty message
                yield event
    except Exception as e:  # never a stream cut without its end: the failure as the Response's error
        log.exception("responses stream %s failed", builder.id)
        error = {"code": "internal_error", "message": f"internal server error: {e!r}"}
    if error is not None:
        failure = {"code": error.get("code"), "message": error.get("message")}
        failed = builder.response("failed", stream.output, error=failure)
        yield stream.event("response.failed", response=failed)
        return
    final = builder.response("completed", stream.output, usage, finish)
    yield stream.event(f"response.{final['status']}", response=final)


class _EventWriter:
    """The output items of a stream as they open, grow and close; each event numbered."""

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # closed items
        self.open: dict[str, Any] | None = None  # the item being written: {"kind", "id", "text", ...}
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index → its open function_call
        # the answer's last text delta, held until the next chat item: the chat stream sends a step's logprobs
        # in an item of their own right after its text, and the Responses delta carries both
        self.pending: tuple[str, list] | None = None
        self.unplaced: list = []  # logprobs of tokens with no text yet (a character's first bytes) before any item

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence} | fields
        self.sequence += 1
        return f"event: {kind}\ndata: {event_json(data)}\n\n"

    def delta(self, delta: dict[str, Any], empty_message: bool = False, logprobs: list | None = None) -> list[str]:
        """The events of one chat delta; `logprobs`: its tokens' (kept where the delta is the answer's text)."""
        if logprobs and not delta and self.pending is not None:  # the logprobs of the text just written
            self.open["logprobs"] += logprobs  # type: ignore[index]
            self.pending = (self.pending[0], self.pending[1] + logprobs)
            return self._flush()
        if logprobs and not delta and (self.open is None or self.open["kind"] == "message"):
            self.unplaced += logprobs  # tokens whose text is held back: they go with the answer's next text
            return []
        events = self._flush()
        if delta.get("reasoning_content"):
            events += self._write("reasoning", delta["reasoning_content"])
        if delta.get("content") or empty_message:
            events += self._write("message", delta.get("content") or "", logprobs or [])
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        return events

    def _write(self, kind: str, text: str, logprobs: list | None = None) -> list[str]:
        events = []
        if self.open is None or self.open["kind"] != kind:
            events += self.close_all()
            item_id = _item_id("rs" if kind == "reasoning" else "msg")
            self.open = {"kind": kind, "id": item_id, "text": "", "index": len(self.output), "logprobs": []}
            empty = reasoning_item(item_id, "", "in_progress") if kind == "reasoning" else message_item(
                item_id, None, "in_progress")  # fmt: skip
            events.append(self.event("response.output_item.added", output_index=self.open["index"], item=empty))
            part = {"type": "reasoning_text" if kind == "reasoning" else "output_text", "text": ""}
            if kind == "message":
                part |= {"annotations": [], "logprobs": []}
            events.append(self.event("response.content_part.added", item_id=item_id, output_index=self.open["index"],
                                     content_index=0, part=part))  # fmt: skip
        if self.unplaced:
            logprobs, self.unplaced = (self.unplaced + (logprobs or []) if kind == "message" else logprobs), []
        self.open["text"] += text
        self.open["logprobs"] += logprobs or []
        if kind == "message":
            self.pending = (text, list(logprobs or []))
            return events
        events.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                 output_index=self.open["index"], content_index=0, delta=text))  # fmt: skip
        return events

    def _flush(self) -> list[str]:
        if self.pending is None or self.open is None:
            return []
        (text, logprobs), self.pending = self.pending, None
        return [self.event("response.output_text.delta", item_id=self.open["id"], output_index=self.open["index"],
                           content_index=0, delta=text, logprobs=logprobs)]  # fmt: skip

    def _call(self, call: dict[str, Any]) -> list[str]:
        events = []
        index = call.get("index", 0)
        function = call.get("function") or {}
        item = self.calls.get(index)
        if item is None:
            events += self.close_all()
            item = function_call_item(_item_id("fc"), call.get("id") or f"call_{index}", function.get("name") or "",
                                      "", "in_progress")  # fmt: skip
            item["output_index"] = len(self.output) + len(self.calls)
            self.calls[index] = item
            added = {k: v for k, v in item.items() if k != "output_index"}
            events.append(self.event("response.output_item.added", output_index=item["output_index"], item=added))
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=item["output_index"], delta=function["arguments"]))  # fmt: skip
        return events

    def close_all(self) -> list[str]:
        if self.unplaced and self.open is not None and self.open["kind"] == "message":
            self._write("message", "")  # tokens that never became text (a cut character): an empty delta
        events = self._flush()
        if self.open is not None:
            item_id, index, text, kind = self.open["id"], self.open["index"], self.open["text"], self.open["kind"]
            if kind == "reasoning":
                events.append(self.event("response.reasoning_text.done", item_id=item_id, output_index=index,
                                         content_index=0, text=text))  # fmt: skip
                part, item = {"type": "reasoning_text", "text": text}, reasoning_item(item_id, text)
            else:
                logprobs = self.open["logprobs"]
                events.append(self.event("response.output_text.done", item_id=item_id, output_index=index,
                                         content_index=0, text=text, logprobs=logprobs))  # fmt: skip
                item = message_item(item_id, text, logprobs=logprobs)
                part = item["content"][0]
            events.append(self.event("response.content_part.done", item_id=item_id, output_index=index,
                                     content_index=0, part=part))  # fmt: skip
            events.append(self.event("response.output_item.done", output_index=index, item=item))
            self.output.append(item)
            self.open = None
        for index in sorted(self.calls):
            item = self.calls.pop(index)
            position = item.pop("output_index")
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=position, arguments=item["arguments"]))  # fmt: skip
            item["status"] = "completed"
            events.append(self.event("response.output_item.done", output_index=position, item=item))
            self.output.append(item)
        return events

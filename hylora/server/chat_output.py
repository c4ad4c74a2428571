"""A chat choice's text as OpenAI's message: the reasoning split off (`--reasoning-parser`), tool calls
read out (`tools`, `--tool-call-parser`), whole (`message`) or as streamed deltas (`ChoiceStream`).

Without a reasoning parser and without tools, the text is the content, as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hylora.server.parsers import ReasoningParser, ToolCallParser, ToolRequest, finish_reason

DEFAULT_TOOL_FORMAT = "qwen3_coder"  # Qwen3.5 / Qwen3.6's own, when the server names none


@dataclass(frozen=True)
class ChatOutputs:
    """How one request's choices are read. `in_reasoning`: the output starts inside `<think>`."""

    reasoning: ReasoningParser | None = None
    in_reasoning: bool = False
    tools: ToolRequest | None = None
    tool_format: str = DEFAULT_TOOL_FORMAT
    include_reasoning: bool = True  # false: the reasoning is split off and left out (vLLM's include_reasoning)

    @property
    def reads_calls(self) -> bool:
        return self.tools is not None and self.tools.parses_calls

    def message(self, text: str, engine_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the assistant message, the choice's finish_reason) for a whole completion."""
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text) if self.in_reasoning else (None, text or None)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = reasoning if self.include_reasoning else None
        called = False
        if self.reads_calls:
            parsed = ToolCallParser(self.tool_format).parse(content or "", self._tool_list())
            message["content"] = parsed.content
            if parsed.tool_calls:
                message["tool_calls"] = parsed.tool_calls
                called = True
        if engine_reason in (None, "error", "abort"):
            return message, engine_reason
        return message, finish_reason(engine_reason, self.tools, called)

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)

    def _tool_list(self) -> list[Mapping[str, Any]]:
        return list(self.tools.tools) if self.tools is not None else []


class ChoiceStream:
    """One streamed choice: text deltas in, OpenAI `delta` objects out (a reasoning delta, a content
    delta, and one delta per tool-call piece, as OpenAI sends them)."""

    def __init__(self, outputs: ChatOutputs):
        self.outputs = outputs
        parser = outputs.reasoning
        self._reasoning = parser.stream() if parser is not None else None
        if self._reasoning is not None and not outputs.in_reasoning:
            self._reasoning = _ContentOnly()
        self._calls = ToolCallParser(outputs.tool_format).stream(outputs._tool_list()) if outputs.reads_calls else None

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if self._reasoning is None:
            return self._content(text)
        split = self._reasoning.feed(text)
        return self._split(split.reasoning, split.content)

    def finish(self, engine_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The held-back text's deltas and the finish_reason."""
        deltas: list[dict[str, Any]] = []
        if self._reasoning is not None:
            split = self._reasoning.finish()
            deltas += self._split(split.reasoning, split.content)
        if self._calls is not None:
            tail = self._calls.finish()
            deltas += self._tool_deltas(tail.content, tail.tool_calls)
        if engine_reason in (None, "error", "abort"):
            return deltas, engine_reason
        called = self._calls is not None and self._calls.called
        return deltas, finish_reason(engine_reason, self.outputs.tools, called)

    def _split(self, reasoning: str, content: str) -> list[dict[str, Any]]:
        shown = reasoning and self.outputs.include_reasoning
        deltas = [{"reasoning_content": reasoning, "reasoning": reasoning}] if shown else []
        return deltas + self._content(content)

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if self._calls is None:
            return [{"content": text}]
        out = self._calls.feed(text)
        return self._tool_deltas(out.content, out.tool_calls)

    @staticmethod
    def _tool_deltas(content: str, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = [{"content": content}] if content else []
        return deltas + [{"tool_calls": [call]} for call in calls]


class _ContentOnly:
    """The reasoning stream of an output that never was reasoning (thinking off)."""

    def feed(self, text: str):
        return _Split("", text)

    def finish(self):
        return _Split("", "")


@dataclass(frozen=True)
class _Split:
    reasoning: str
    content: str

"""Tool-call parsers (`--tool-call-parser qwen3_coder | hermes`): a completion's content → the
content around the calls + OpenAI `tool_calls`, whole (`ToolCallParser.parse`) or streamed
(`ToolCallParser.stream`). One file per format; `base.py` holds what they share."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hylora.server.parsers.tool_calls.base import (
    CallScanner,
    ParsedToolCalls,
    ToolCallDelta,
    ToolCallStream,
    new_call_id,
    parse_whole,
)
from hylora.server.parsers.tool_calls.hermes import HermesScanner
from hylora.server.parsers.tool_calls.qwen3_coder import Qwen3CoderScanner
from hylora.server.parsers.tool_calls.schema import tool_schemas

_SCANNERS: dict[str, Callable[[Mapping[str, Mapping[str, Any]]], CallScanner]] = {
    "qwen3_coder": Qwen3CoderScanner,
    "hermes": HermesScanner,
}
TOOL_CALL_PARSERS: tuple[str, ...] = tuple(_SCANNERS)


class ToolCallParser:
    """One server's tool-call format. Stateless: a stream per choice."""

    def __init__(self, name: str = "qwen3_coder", id_factory: Callable[[], str] = new_call_id):
        if name not in _SCANNERS:
            raise ValueError(f"unknown tool call parser {name!r}; use one of {', '.join(TOOL_CALL_PARSERS)}")
        self.name = name
        self._id_factory = id_factory

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedToolCalls:
        """A whole completion's content → (content, tool_calls). `tools`: the request's OpenAI
        `tools` (for the parameter types of qwen3_coder values)."""
        return parse_whole(self.stream(tools, strict=True), text)

    def stream(self, tools: Sequence[Mapping[str, Any]] | None = None, strict: bool = False) -> ToolCallStream:
        """A streaming parser for one choice. `strict`: send a call only once it is complete and
        valid (one delta with the whole arguments) instead of as it is written."""
        return ToolCallStream(_SCANNERS[self.name], tool_schemas(tools), self._id_factory, strict)


__all__ = [
    "TOOL_CALL_PARSERS",
    "ParsedToolCalls",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolCallStream",
    "new_call_id",
]

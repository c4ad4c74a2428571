"""The request's `tools`, `tool_choice` and `parallel_tool_calls`, checked and normalised, and the
`finish_reason` rule for tool calls.

Errors raise ToolRequestError (a ValueError) whose `param` names the field to report ("tools" or
"tool_choice"; the server answers 400). What is accepted follows vLLM's request validation:

- `tools`: a list of `{"type": "function", "function": {"name", "description"?, "parameters"?,
  "strict"?}}` (`type` may be left out); `parameters` a JSON-schema object (a dict, `type` "object"
  when given, `properties` a dict, `required` a list of strings). Names: non-empty, at most 256
  characters, no whitespace, quotes, braces or angle brackets (the tool-call formats cannot carry
  them).
- `tool_choice`: "none", "auto", "required" or `{"type": "function", "function": {"name": ...}}`;
  left out (or null) it is "auto" when there are tools, as vLLM. Any choice but "none" needs
  `tools` ("When using `tool_choice`, `tools` must be set."), except "required" with an empty list,
  which means "none" (vLLM, after OpenAI); a named function must be one of the tools; "auto" needs the
  server's `--enable-auto-tool-choice` and `--tool-call-parser`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hylora.server.parsers.grammar import tool_choice_grammar
from hylora.server.parsers.tool_calls.qwen3_coder import MAX_NAME_CHARS, valid_function_name

Choice = Literal["none", "auto", "required", "function"]
_NAMED_USAGE = 'use {"type": "function", "function": {"name": "my_function"}}'


class ToolRequestError(ValueError):
    """A malformed `tools` / `tool_choice`; `param` is the request field to name in the 400."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked tool settings. `choice` "function" names `function`; `tools` is the
    request's list as given (empty when none)."""

    tools: tuple[Mapping[str, Any], ...]
    choice: Choice
    function: str | None = None
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        """The output is to be read for tool calls (every choice but "none")."""
        return self.choice != "none"

    @property
    def grammar_needed(self) -> bool:
        """The output is forced into tool calls ("required" or a named function)."""
        return self.choice in ("required", "function")

    def grammar(self, fmt: str, token_tags: Collection[str] = ()) -> str | None:
        """The Lark grammar that forces this choice's calls in format `fmt` (None for "none" and
        "auto"; `token_tags`: see tool_choice_grammar); ValueError when the tools cannot be written
        in that format (a 400 on "tools")."""
        if not self.grammar_needed:
            return None
        return tool_choice_grammar(self.tools, fmt, self.function, self.parallel, token_tags)


def parse_tool_request(body: Mapping[str, Any], auto_tool_choice: bool = False) -> ToolRequest:
    """Check a chat request's tool fields. `auto_tool_choice`: the server runs with
    `--enable-auto-tool-choice` and a `--tool-call-parser`."""
    tools = _check_tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolRequestError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    parallel = True if parallel is None else parallel
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
        if choice == "auto" and not auto_tool_choice:
            raise ToolRequestError(_AUTO_NEEDS_FLAGS, "tool_choice")
        return ToolRequest(tuple(tools or ()), choice, parallel=parallel)
    if choice == "none":
        return ToolRequest(tuple(tools or ()), "none", parallel=parallel)
    if isinstance(choice, str):
        if choice not in ("auto", "required"):
            raise ToolRequestError(
                f"Invalid value for `tool_choice`: {choice!r}; use 'none', 'auto', 'required' or a named function "
                f"({_NAMED_USAGE})",
                "tool_choice",
            )
        if tools is None:
            raise ToolRequestError("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if choice == "required" and not tools:
            return ToolRequest((), "none", parallel=parallel)
        if choice == "auto" and not auto_tool_choice:
            raise ToolRequestError(_AUTO_NEEDS_FLAGS, "tool_choice")
        return ToolRequest(tuple(tools), choice, parallel=parallel)
    name = _named_choice(choice)
    if tools is None:
        raise ToolRequestError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if not any(t["function"]["name"] == name for t in tools):
        raise ToolRequestError(
            f"The tool specified in `tool_choice` ({name!r}) does not match any of the specified `tools`",
            "tool_choice",
        )
    return ToolRequest(tuple(tools), "function", name, parallel)


_AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


def finish_reason(engine_reason: str | None, request: ToolRequest | None, called: bool) -> str:
    """The choice's finish_reason: "tool_calls" when calls were produced and generation stopped
    normally (any choice but "none": a named function too, where vLLM keeps "stop" — OpenAI's
    clients look for "tool_calls"); "length" and the rest stay as they are."""
    reason = engine_reason or "stop"
    if called and reason == "stop" and request is not None and request.parses_calls:
        return "tool_calls"
    return reason


def _named_choice(choice: Any) -> str:
    if not isinstance(choice, Mapping):
        raise ToolRequestError(
            f"Invalid value for `tool_choice`: {choice!r}; use 'none', 'auto', 'required' or a named function "
            f"({_NAMED_USAGE})",
            "tool_choice",
        )
    if choice.get("type", "function") != "function":
        raise ToolRequestError(
            f"tool_choice.type must be 'function', not {choice.get('type')!r} ({_NAMED_USAGE})", "tool_choice"
        )
    function = choice.get("function")
    if not isinstance(function, Mapping):
        raise ToolRequestError(f"tool_choice.function must be an object ({_NAMED_USAGE})", "tool_choice")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ToolRequestError(f"tool_choice.function.name must be a non-empty string ({_NAMED_USAGE})", "tool_choice")
    return name


def _check_tools(tools: Any) -> list[Mapping[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ToolRequestError("tools must be an array of tool definitions", "tools")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise ToolRequestError(f"{where} must be an object", "tools")
        if tool.get("type", "function") != "function":
            raise ToolRequestError(
                f"{where}.type: only 'function' tools are supported, not {tool.get('type')!r}", "tools"
            )
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise ToolRequestError(f"{where}.function must be an object with a 'name'", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolRequestError(f"{where}.function.name must be a non-empty string", "tools")
        if not valid_function_name(name):
            raise ToolRequestError(
                f"{where}.function.name {name!r} is not a valid function name: at most {MAX_NAME_CHARS} characters, "
                "without whitespace, quotes, braces or angle brackets",
                "tools",
            )
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolRequestError(f"{where}.function.description must be a string", "tools")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ToolRequestError(f"{where}.function.strict must be a boolean", "tools")
        _check_parameters(function.get("parameters"), f"{where}.function.parameters")
    return list(tools)


def _check_parameters(params: Any, where: str) -> None:
    if params is None:
        return
    if not isinstance(params, Mapping):
        raise ToolRequestError(f"{where} must be a JSON schema object", "tools")
    kind = params.get("type", "object")
    if kind != "object":
        raise ToolRequestError(
            f"{where}.type must be 'object' (the arguments are a JSON object), not {kind!r}", "tools"
        )
    props = params.get("properties")
    if props is not None:
        if not isinstance(props, Mapping):
            raise ToolRequestError(f"{where}.properties must be an object", "tools")
        for key, schema in props.items():
            if not isinstance(schema, Mapping | bool):
                raise ToolRequestError(f"{where}.properties[{key!r}] must be a JSON schema object", "tools")
    required = params.get("required")
    if required is not None and (not isinstance(required, list) or not all(isinstance(r, str) for r in required)):
        raise ToolRequestError(f"{where}.required must be a list of property names", "tools")

"""`--tool-call-parser qwen3_coder`: Qwen3-Coder / Qwen3.5 / Qwen3.6's XML tool calls.

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A call opens with `<tool_call>`, optional whitespace and `<function=NAME>` (NAME without
whitespace, quotes, braces or angle brackets); anything else after `<tool_call>` makes that tag
plain content. A parameter's value is the text between `<parameter=KEY>` and the first
`</parameter>` that is followed (after whitespace) by `<parameter=`, `</function>`, `</tool_call>`
or the end of the output, so a value may itself contain `</parameter>` (code); one leading and one
trailing newline are stripped, and the text is converted to the parameter's JSON type
(`schema.convert_value`, vLLM's rules). A missing `</parameter>` is tolerated when `</function>`
then `</tool_call>` (or the end) follows, a missing `</tool_call>` after `</function>`, and stray
text between parameters is ignored. A call cut short (max_tokens) keeps the parameters it has,
the last one with its value so far (vLLM's non-streaming parse does the same).

Arguments are a JSON object with the parameters in the order written, `json.dumps` style; while
streaming, each parameter is sent whole once its end is known (as vLLM), then the closing `}`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from hylora.server.parsers.text import is_prefix_of_any, skip_whitespace
from hylora.server.parsers.tool_calls.base import TOOL_CALL_END, TOOL_CALL_START, CallScanner, Scan
from hylora.server.parsers.tool_calls.schema import convert_value, property_schema

FUNCTION_OPEN = "<function="
FUNCTION_END = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_END = "</parameter>"
MAX_NAME_CHARS = 256  # a longer name (or one never closed by `>`) opens no call
_NAME_FORBIDDEN = set("{}<>\"' \t\n\r")
_BODY_TAGS = (PARAMETER_OPEN, FUNCTION_END, TOOL_CALL_END)
# a value ends at one of these, when one of its followers comes next (after whitespace)
_VALUE_ENDS = ((PARAMETER_END, _BODY_TAGS), (FUNCTION_END, (TOOL_CALL_END,)))


def valid_function_name(name: str) -> bool:
    """A name the format can carry: `<function=NAME>` and `<parameter=NAME>` end at the first `>`."""
    return 0 < len(name) <= MAX_NAME_CHARS and not (_NAME_FORBIDDEN & set(name))


class Qwen3CoderScanner(CallScanner):
    def __init__(self, schemas: Mapping[str, Mapping[str, Any]]):
        super().__init__(schemas)
        self._name: str | None = None
        self._params: Mapping[str, Any] = {}
        self._pos = 0  # next unread index of the call text (between parameters)
        self._args: list[str] = []  # `{"k": v` / `, "k": v` fragments of the finished parameters
        self._param: str | None = None  # the parameter whose value is being read
        self._value_start = 0
        self._search = 0  # no value end can start before this index

    def step(self, text: str, final: bool) -> Scan:
        if self._name is None:
            head = self._header(text, final)
            if head.kind != "call":
                return head
        while True:
            if self._param is not None:
                end = self._value_end(text, final)
                if end is None:
                    return self._scan()
                self._add_param(text[self._value_start : end[0]])
                self._pos = end[1]
                continue
            at = skip_whitespace(text, self._pos)
            rest = text[at:]
            if rest.startswith(PARAMETER_OPEN):
                close = text.find(">", at + len(PARAMETER_OPEN))
                if close < 0:
                    if final:
                        return self._scan(end=len(text))
                    return self._scan()
                name = text[at + len(PARAMETER_OPEN) : close]
                if "\n" in name or "<" in name:  # not a parameter tag: stray text
                    self._pos = at + 1
                    continue
                self._param, self._value_start = name, close + 1
                self._search = self._value_start
                continue
            if rest.startswith(FUNCTION_END):
                after = skip_whitespace(text, at + len(FUNCTION_END))
                if text.startswith(TOOL_CALL_END, after):
                    return self._scan(end=after + len(TOOL_CALL_END))
                if not final and is_prefix_of_any(text[after:], (TOOL_CALL_END,)):
                    return self._scan()
                return self._scan(end=at + len(FUNCTION_END))  # no `</tool_call>`: the call ends here
            if rest.startswith(TOOL_CALL_END):
                return self._scan(end=at + len(TOOL_CALL_END))
            if not rest or is_prefix_of_any(rest, _BODY_TAGS):
                return self._scan(end=len(text)) if final else self._scan()
            nxt = text.find("<", at + 1)  # stray text between parameters: skipped
            self._pos = nxt if nxt >= 0 else len(text)

    def _header(self, text: str, final: bool) -> Scan:
        at = skip_whitespace(text, len(TOOL_CALL_START))
        rest = text[at:]
        if not rest.startswith(FUNCTION_OPEN):
            maybe = not rest or is_prefix_of_any(rest, (FUNCTION_OPEN,))
            return Scan("pending") if maybe and not final else Scan("not_call")
        start = at + len(FUNCTION_OPEN)
        close = text.find(">", start)
        name = text[start:close] if close >= 0 else text[start:]
        if close < 0:
            open_ok = not final and len(name) < MAX_NAME_CHARS and not (_NAME_FORBIDDEN & set(name))
            return Scan("pending") if open_ok else Scan("not_call")
        if not valid_function_name(name):
            return Scan("not_call")
        self._name, self._pos = name, close + 1
        params = self.schemas.get(name)
        self._params = params if isinstance(params, Mapping) else {}
        return Scan("call", name)

    def _value_end(self, text: str, final: bool) -> tuple[int, int] | None:
        """(end of the value, where reading goes on) once the current value's end is known."""
        pos = self._search
        while True:
            found = [(text.find(tag, pos), tag, followers) for tag, followers in _VALUE_ENDS]
            found = [f for f in found if f[0] >= 0]
            if not found:
                if final:
                    return len(text), len(text)
                self._search = max(pos, len(text) - len(PARAMETER_END) + 1)
                return None
            at, tag, followers = min(found, key=lambda f: f[0])
            after = skip_whitespace(text, at + len(tag))
            rest = text[after:]
            structural = any(rest.startswith(f) for f in followers)
            if not structural and (not rest or is_prefix_of_any(rest, followers)):
                if not final:
                    self._search = at
                    return None
                structural = not rest
            if structural:
                return (at, at + len(tag)) if tag == PARAMETER_END else (at, at)
            pos = at + 1

    def _add_param(self, raw: str) -> None:
        assert self._param is not None
        if raw.startswith("\n"):
            raw = raw[1:]
        if raw.endswith("\n"):
            raw = raw[:-1]
        value = convert_value(raw, property_schema(self._params, self._param), self._params)
        lead = "{" if not self._args else ", "
        self._args.append(
            f"{lead}{json.dumps(self._param, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        )
        self._param = None

    def _scan(self, end: int | None = None) -> Scan:
        args = "".join(self._args)
        if end is not None:
            args = args + "}" if args else "{}"
        return Scan("call", self._name, args, end)

"""`--tool-call-parser hermes`: JSON tool calls inside `<tool_call>` tags (Hermes, Qwen2.5, Qwen3).

    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call>

A call opens with `<tool_call>`, optional whitespace and a JSON object; the call ends after that
object (strings and nesting are followed, so `}` or `</tool_call>` inside a string do not end it)
and an optional `</tool_call>`. When the object starts `{"name": "…", "arguments": {` (the order
every Hermes-style template writes) the call's first delta goes out at that `{` and the arguments
stream as written, character by character; otherwise the whole object is read first and the call is
sent at once, with `arguments` re-serialised (`json.dumps`, as vLLM). `arguments` may also be a
JSON string holding an object, or missing (`{}`). An object without a string `name`, or whose
arguments are not an object, is no call: the text stays content (as vLLM, which then returns the
whole output as content).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from hylora.server.parsers.text import is_prefix_of_any, skip_whitespace
from hylora.server.parsers.tool_calls.base import TOOL_CALL_END, TOOL_CALL_START, CallScanner, Scan

MAX_NAME_CHARS = 256


class _JsonExtent:
    """Follows a JSON text incrementally (strings, escapes, nesting) to find where the value that
    starts with `{` at `start` ends."""

    def __init__(self, start: int):
        self.pos = start  # next index to read
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.end: int | None = None  # index just past the closing `}`

    def advance(self, text: str) -> int | None:
        pos, depth, in_string, escaped = self.pos, self.depth, self.in_string, self.escaped
        n = len(text)
        while pos < n and self.end is None:
            ch = text[pos]
            pos += 1
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth <= 0:
                    self.end = pos
        self.pos, self.depth, self.in_string, self.escaped = pos, depth, in_string, escaped
        return self.end


class _Prefix:
    """Matches `"name": "<json string>", "arguments": {` after the object's `{` (whitespace
    anywhere between), telling full match, possible prefix, or mismatch."""

    def __init__(self, text: str, pos: int):
        self.text, self.pos = text, pos

    def literal(self, word: str) -> bool | None:
        self.pos = skip_whitespace(self.text, self.pos)
        rest = self.text[self.pos : self.pos + len(word)]
        if rest == word:
            self.pos += len(word)
            return True
        return None if word.startswith(rest) else False

    def string(self) -> tuple[bool | None, str]:
        self.pos = skip_whitespace(self.text, self.pos)
        if self.pos >= len(self.text):
            return None, ""
        if self.text[self.pos] != '"':
            return False, ""
        extent = _String(self.pos)
        end = extent.advance(self.text)
        if end is None:
            return (None if extent.pos - self.pos <= MAX_NAME_CHARS + 2 else False), ""
        try:
            name = json.loads(self.text[self.pos : end])
        except ValueError:
            return False, ""
        self.pos = end
        return True, name


class _String:
    def __init__(self, start: int):
        self.pos = start + 1

    def advance(self, text: str) -> int | None:
        escaped = False
        while self.pos < len(text):
            ch = text[self.pos]
            self.pos += 1
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                return self.pos
        return None


def _match_head(text: str, pos: int) -> tuple[bool | None, str, int]:
    """(True, name, index of the arguments' `{`) / (None, …) while it may still match / (False, …)."""
    m = _Prefix(text, pos)
    for step in ('"name"', ":"):
        ok = m.literal(step)
        if ok is not True:
            return ok, "", 0
    ok, name = m.string()
    if ok is not True:
        return ok, "", 0
    for step in (",", '"arguments"', ":", "{"):
        ok = m.literal(step)
        if ok is not True:
            return ok, "", 0
    return True, name, m.pos - 1


class HermesScanner(CallScanner):
    def __init__(self, schemas: Mapping[str, Mapping[str, Any]]):
        super().__init__(schemas)
        self._object: _JsonExtent | None = None  # the whole `{...}` after `<tool_call>`
        self._args: _JsonExtent | None = None  # fast path: the arguments object
        self._args_start = 0
        self._name: str | None = None
        self._fast: bool | None = None  # None: not decided yet

    def step(self, text: str, final: bool) -> Scan:
        if self._object is None:
            at = skip_whitespace(text, len(TOOL_CALL_START))
            if at >= len(text):
                return Scan("not_call") if final else Scan("pending")
            if text[at] != "{":
                return Scan("not_call")
            self._object = _JsonExtent(at)
        if self._fast is None:
            ok, name, args_at = _match_head(text, self._object.pos + 1)
            if ok is None and not final:
                return Scan("pending")
            self._fast = bool(ok) and 0 < len(name) <= MAX_NAME_CHARS
            if self._fast:
                self._name, self._args_start = name, args_at
                self._args = _JsonExtent(args_at)
        if self._fast:
            return self._step_fast(text, final)
        return self._step_whole(text, final)

    def _step_fast(self, text: str, final: bool) -> Scan:
        assert self._args is not None and self._object is not None
        args_end = self._args.advance(text)
        if args_end is None:
            stable = text[self._args_start :]
            if final:
                return Scan("call", self._name, stable, len(text), valid=False)
            return Scan("call", self._name, stable)
        args = text[self._args_start : args_end]
        if self._object.pos < args_end:  # follow the outer object from the end of the arguments
            self._object.pos, self._object.depth = args_end, 1
        end = self._object.advance(text)
        valid = _is_object(args)
        if end is None:
            return Scan("call", self._name, args, len(text) if final else None, valid)
        return Scan("call", self._name, args, self._close(text, end, final), valid)

    def _step_whole(self, text: str, final: bool) -> Scan:
        assert self._object is not None
        end = self._object.advance(text)
        if end is None:
            return Scan("not_call") if final else Scan("pending")
        obj_start = skip_whitespace(text, len(TOOL_CALL_START))
        parsed = _call_of(text[obj_start:end])
        if parsed is None:
            return Scan("not_call")
        close = self._close(text, end, final)
        if close is None:
            return Scan("pending")
        name, args = parsed
        return Scan("call", name, args, close)

    @staticmethod
    def _close(text: str, end: int, final: bool) -> int | None:
        """Where the call ends after its object: past `</tool_call>` if it follows."""
        after = skip_whitespace(text, end)
        if text.startswith(TOOL_CALL_END, after):
            return after + len(TOOL_CALL_END)
        if not final and is_prefix_of_any(text[after:], (TOOL_CALL_END,)):
            return None
        return end


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def _call_of(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a whole call object, or None when it is no call."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):
        if not _is_object(args):
            return None
        return obj["name"], args
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)

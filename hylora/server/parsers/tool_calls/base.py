"""The format-independent half of tool-call parsing: content outside the calls, call ids, and the
OpenAI-shaped deltas, around a per-format `CallScanner` that reads one `<tool_call>` block.

Content rules (both modes, both formats): the text outside calls is content, except whitespace-only
stretches next to a call (the "\\n\\n" before a call, the "\\n" between calls, trailing newlines),
which are dropped; a `<tool_call>` that does not open a well-formed call stays content, as written.

Streaming sends a call's first delta (`index`, `id`, `type`, `function.name`, `function.arguments`
"") as soon as its name is known, then argument fragments; the fragments of a call concatenate to
its arguments. The non-streaming parse runs the same machine on the whole text, but strictly: a
call is kept only when complete and valid (a call cut short whose arguments are not a whole JSON
object becomes content), which a stream cannot do once a call's first delta is out.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from hylora.server.parsers.text import WHITESPACE, held_suffix

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def new_call_id() -> str:
    """`call_` + 24 hex digits, as vLLM's qwen3_coder parser names calls."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Scan:
    """What a scanner knows of its call so far.

    kind: "not_call" (the `<tool_call>` opens no well-formed call: it is content), "pending" (cannot
    tell yet), "call" (a call of function `name`). `arguments`: the part of the arguments text that
    will not change any more (grows step by step). `end`: index in the call text just past the call,
    once complete. `valid`: the complete arguments are a JSON object."""

    kind: Literal["not_call", "pending", "call"]
    name: str | None = None
    arguments: str = ""
    end: int | None = None
    valid: bool = True


class CallScanner(ABC):
    """Reads one call, from its `<tool_call>` on. `step` is called with the call's text so far
    (always a prefix of the next call's text) and must not answer "pending" when `final` (the text
    is all there is). Once it answered "call", it never answers anything else."""

    def __init__(self, schemas: Mapping[str, Mapping[str, Any]]):
        self.schemas = schemas

    @abstractmethod
    def step(self, text: str, final: bool) -> Scan: ...


class ToolCallDelta(NamedTuple):
    """What one streamed delta adds: content text ("" for none) and OpenAI tool-call deltas, in
    order (send one chunk per tool-call delta to look exactly like OpenAI; clients also accept them
    together in one chunk's `delta.tool_calls`)."""

    content: str
    tool_calls: list[dict[str, Any]]


class ParsedToolCalls(NamedTuple):
    """A whole completion: content (None when empty) and the calls, in OpenAI message form."""

    content: str | None
    tool_calls: list[dict[str, Any]]


@dataclass
class _Out:
    content: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def result(self) -> ToolCallDelta:
        return ToolCallDelta("".join(self.content), self.tool_calls)


class ToolCallStream:
    """Parses one choice's streamed content. `feed(delta)` → ToolCallDelta, `finish()` → the rest.
    `tool_calls`: the calls sent so far (OpenAI message form); `called`: at least one."""

    def __init__(
        self,
        scanner: Callable[[Mapping[str, Mapping[str, Any]]], CallScanner],
        schemas: Mapping[str, Mapping[str, Any]],
        id_factory: Callable[[], str] = new_call_id,
        strict: bool = False,
    ):
        self._scanner_cls = scanner
        self._schemas = schemas
        self._new_id = id_factory
        self._strict = strict
        self._outside = ""  # text outside calls not sent yet (may start a `<tool_call>`)
        self._call: str | None = None  # the current call's text, from its `<tool_call>`
        self._scanner: CallScanner | None = None
        self._sent_args = -1  # -1: the current call's first delta is not out
        self._seg_ws = ""  # the current outside stretch, while it is whitespace only
        self._seg_text = False  # the current outside stretch has non-whitespace text
        self._done = False
        self.tool_calls: list[dict[str, Any]] = []

    @property
    def called(self) -> bool:
        return bool(self.tool_calls)

    def feed(self, delta: str) -> ToolCallDelta:
        if self._done:
            raise RuntimeError("feed after finish")
        if self._call is not None:
            self._call += delta
        else:
            self._outside += delta
        out = _Out()
        self._run(out, final=False)
        return out.result()

    def finish(self) -> ToolCallDelta:
        """Flush: held-back text is content, a call cut short ends here."""
        if self._done:
            return ToolCallDelta("", [])
        out = _Out()
        self._run(out, final=True)
        if not self._seg_text and not self.tool_calls:
            out.content.append(self._seg_ws)  # whitespace-only output with no call is content
        self._done = True
        return out.result()

    def _run(self, out: _Out, final: bool) -> None:
        while True:
            if self._call is None:
                at = self._outside.find(TOOL_CALL_START)
                if at < 0:
                    keep = 0 if final else held_suffix(self._outside, (TOOL_CALL_START,))
                    self._text(self._outside[: len(self._outside) - keep], out)
                    self._outside = self._outside[len(self._outside) - keep :]
                    return
                self._text(self._outside[:at], out)
                self._call, self._outside = self._outside[at:], ""
                self._scanner = self._scanner_cls(self._schemas)
            assert self._scanner is not None
            call = self._call
            scan = self._step(call, final)
            if scan.kind == "not_call":
                self._text(TOOL_CALL_START, out)
                self._call, self._outside = None, call[len(TOOL_CALL_START) :]
                continue
            if scan.kind == "pending" or (self._strict and scan.end is None):
                return
            if self._strict and not scan.valid:  # the whole call, as written, is content
                assert scan.end is not None
                self._text(call[: scan.end], out)
                self._call, self._outside = None, call[scan.end :]
                continue
            self._emit(scan, out)
            if scan.end is None:
                return
            self._call, self._outside = None, call[scan.end :]
            self._sent_args, self._seg_ws, self._seg_text = -1, "", False

    def _step(self, call: str, final: bool) -> Scan:
        """The scanner's answer; model output never makes the stream raise (a scanner failure, or a
        "pending" at the end, ends the call where it stands, or makes it text if not yet sent)."""
        assert self._scanner is not None
        try:
            scan = self._scanner.step(call, final)
        except Exception:
            scan = Scan("pending")
        if scan.kind == "pending" and final or scan.kind == "call" and final and scan.end is None:
            if self._sent_args < 0:
                return Scan("not_call")
            return Scan("call", scan.name or self.tool_calls[-1]["function"]["name"], scan.arguments, len(call))
        if scan.kind == "pending" and self._sent_args >= 0:  # a scanner that failed mid-call: wait
            return Scan("call", self.tool_calls[-1]["function"]["name"], self.tool_calls[-1]["function"]["arguments"])
        return scan

    def _emit(self, scan: Scan, out: _Out) -> None:
        assert scan.name is not None
        if self._sent_args < 0:  # the call's first delta; whitespace just before a call is dropped
            self._seg_ws, self._seg_text = "", False
            index = len(self.tool_calls)
            call_id = self._new_id()
            self.tool_calls.append(
                {"id": call_id, "type": "function", "function": {"name": scan.name, "arguments": ""}}
            )
            out.tool_calls.append(
                {"index": index, "id": call_id, "type": "function", "function": {"name": scan.name, "arguments": ""}}
            )
            self._sent_args = 0
        fragment = scan.arguments[self._sent_args :]
        if fragment:
            self._sent_args = len(scan.arguments)
            self.tool_calls[-1]["function"]["arguments"] = scan.arguments
            out.tool_calls.append({"index": len(self.tool_calls) - 1, "function": {"arguments": fragment}})

    def _text(self, text: str, out: _Out) -> None:
        """Outside text: sent, except while its stretch is whitespace only (dropped if a call
        follows or precedes it)."""
        if not text:
            return
        if self._seg_text:
            out.content.append(text)
            return
        pending = self._seg_ws + text
        if pending.strip(WHITESPACE):
            out.content.append(pending)
            self._seg_ws, self._seg_text = "", True
        else:
            self._seg_ws = pending


def parse_whole(stream: ToolCallStream, text: str) -> ParsedToolCalls:
    """Run a (strict) stream over a whole text."""
    first, last = stream.feed(text), stream.finish()
    return ParsedToolCalls(first.content + last.content or None, stream.tool_calls)

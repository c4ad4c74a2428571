"""Reasoning split: the `<think>…</think>` part of a completion goes to `reasoning`, the rest to
`content` (vLLM's `--reasoning-parser qwen3` and `deepseek_r1`).

Where the output starts is decided from the rendered prompt, before any token is generated:

- the generation turn of the prompt (the text after its last `<|im_start|>`) ends inside an open
  `<think>` (Qwen3.5/3.6 with thinking on: the template prefills `<think>\\n`) → the output starts in
  the reasoning, and only `</think>` appears in it;
- that turn already holds a closed `<think>…</think>` (thinking off: the template writes
  `<think>\\n\\n</think>\\n\\n`) → the whole output is content, tags included (vLLM's serving layer:
  `prompt_is_reasoning_end`);
- no tag in that turn (older templates, raw prompts): `qwen3` starts in the reasoning unless the
  request says `enable_thinking: false` (then everything is content); `deepseek_r1` always starts in
  the reasoning.

In the reasoning, one `<think>` the model writes itself is dropped; the first `</think>` ends the
reasoning and what follows is content. With no `</think>` at all the output was cut short and all
of it is reasoning (both parsers). `qwen3` also ends the reasoning at a `<tool_call>` followed by
`<function=` (Qwen3.5 may call a tool without closing its thinking): the content then starts at
`<tool_call>`, where the tool parser finds it.

`ReasoningParser.split` is the non-streaming form, `ReasoningParser.stream` the streaming one (text
deltas that may cut a tag anywhere; partial tags are held back, never leaked, and flushed by
`finish`). Both give the same text. The engine, which works on token ids, uses
`ReasoningEndDetector` to know when the reasoning is over: structured-output grammars apply only to
the tokens after it (vLLM's default).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

from hylora.server.parsers.text import WHITESPACE, held_suffix, skip_whitespace

REASONING_PARSERS: tuple[str, ...] = ("qwen3", "deepseek_r1")
THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
_FUNCTION_OPEN = "<function"
_TURN_START = "<|im_start|>"

PromptState = Literal["open", "closed", "none"]


class Split(NamedTuple):
    """A whole completion, split. None where a part is empty."""

    reasoning: str | None
    content: str | None


class SplitDelta(NamedTuple):
    """What one streamed delta adds to each part ("" for nothing)."""

    reasoning: str
    content: str


def prompt_reasoning_state(prompt: str) -> PromptState:
    """Whether the prompt's generation turn (after its last `<|im_start|>`, or the whole prompt when
    it has none) leaves the model inside `<think>` ("open"), after a closed think block ("closed"),
    or holds no think tag ("none")."""
    turn = prompt.rfind(_TURN_START)
    tail = prompt[turn:] if turn >= 0 else prompt
    start, end = tail.rfind(THINK_START), tail.rfind(THINK_END)
    if start > end:
        return "open"
    return "closed" if end >= 0 else "none"


class ReasoningParser:
    """One server's reasoning parser (`qwen3` or `deepseek_r1`). Stateless: streams are per choice."""

    def __init__(self, name: str = "qwen3"):
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; use one of {', '.join(REASONING_PARSERS)}")
        self.name = name

    def starts_in_reasoning(self, prompt: str | None = None, thinking: bool | None = None) -> bool:
        """Whether the output begins inside the reasoning. `prompt`: the rendered prompt text (None:
        unknown); `thinking`: the request's `enable_thinking` chat-template argument (None: unset)."""
        state = prompt_reasoning_state(prompt) if prompt is not None else "none"
        if state != "none":
            return state == "open"
        return self.name == "deepseek_r1" or thinking is not False

    def stream(self, prompt: str | None = None, thinking: bool | None = None) -> ReasoningStream:
        """A streaming splitter for one choice (see `ReasoningStream`)."""
        return ReasoningStream(self.starts_in_reasoning(prompt, thinking), implicit_tool_end=self.name == "qwen3")

    def split(self, text: str, prompt: str | None = None, thinking: bool | None = None) -> Split:
        """The whole completion `text` → (reasoning, content)."""
        stream = self.stream(prompt, thinking)
        first, last = stream.feed(text), stream.finish()
        return Split(first.reasoning + last.reasoning or None, first.content + last.content or None)


class ReasoningStream:
    """Splits one choice's streamed text. `feed(delta)` → SplitDelta for that delta, `finish()` → what
    was held back (a partial tag at the very end is reasoning text). `reasoning_ended` turns True
    once the content has begun (at once when the output starts in the content)."""

    def __init__(self, in_reasoning: bool, implicit_tool_end: bool = True):
        self._in_reasoning = in_reasoning
        self._implicit_tool_end = implicit_tool_end  # qwen3: `<tool_call><function=` ends the reasoning
        self._start_dropped = False  # the one `<think>` the model may write itself is gone
        self._buf = ""  # reasoning text held back: it may start a tag
        self._done = False

    @property
    def reasoning_ended(self) -> bool:
        return not self._in_reasoning

    def feed(self, delta: str) -> SplitDelta:
        if self._done:
            raise RuntimeError("feed after finish")
        if not self._in_reasoning:
            return SplitDelta("", delta)
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> SplitDelta:
        """Flush the held-back text; the stream is over."""
        if self._done:
            return SplitDelta("", "")
        out = self._advance(final=True) if self._in_reasoning else SplitDelta("", "")
        self._done = True
        return out

    def _tags(self) -> list[str]:
        tags = [THINK_END]
        if not self._start_dropped:
            tags.append(THINK_START)
        if self._implicit_tool_end:
            tags.append(TOOL_CALL_START)
        return tags

    def _advance(self, final: bool) -> SplitDelta:
        buf, reasoning, pos = self._buf, [], 0
        while True:
            tag, at = _first_tag(buf, pos, self._tags())
            if tag is None:
                keep = 0 if final else held_suffix(buf, self._tags())
                reasoning.append(buf[pos : len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                return SplitDelta("".join(reasoning), "")
            reasoning.append(buf[pos:at])
            if tag == THINK_END:
                self._in_reasoning, self._buf = False, ""
                return SplitDelta("".join(reasoning), buf[at + len(THINK_END) :])
            if tag == THINK_START:
                self._start_dropped = True
                pos = at + len(THINK_START)
                continue
            verdict = _tool_call_follows(buf, at + len(TOOL_CALL_START), final)
            if verdict is None:  # `<tool_call>` then only whitespace or part of `<function` so far
                self._buf = buf[at:]
                return SplitDelta("".join(reasoning), "")
            if verdict:
                self._in_reasoning, self._buf = False, ""
                return SplitDelta("".join(reasoning), buf[at:])
            reasoning.append(TOOL_CALL_START)  # a `<tool_call>` mentioned in the thinking
            pos = at + len(TOOL_CALL_START)


def _first_tag(text: str, pos: int, tags: list[str]) -> tuple[str | None, int]:
    best: tuple[str | None, int] = (None, len(text))
    for tag in tags:
        at = text.find(tag, pos)
        if 0 <= at < best[1]:
            best = (tag, at)
    return best


def _tool_call_follows(text: str, pos: int, final: bool) -> bool | None:
    """After a `<tool_call>`: is a `<function=` / `<function ` next (True), surely not (False), or
    not yet known (None)? vLLM's qwen3 parser asks the same (`<function[\\s=]` after whitespace)."""
    rest = text[skip_whitespace(text, pos) :]
    if len(rest) > len(_FUNCTION_OPEN):
        return rest.startswith(_FUNCTION_OPEN) and rest[len(_FUNCTION_OPEN)] in "=" + WHITESPACE
    if final or not _FUNCTION_OPEN.startswith(rest):
        return False
    return None


class ReasoningEndDetector:
    """Token-level: has one request's generated output left the reasoning? Feed the generated ids
    as they come; the grammar of a structured output applies from the token after the end.

    `end_ids`: the token ids of `</think>` (Qwen3.5/3.6: one added token; see `think_end_ids`).
    `in_reasoning`: `ReasoningParser.starts_in_reasoning(prompt, thinking)` for the request (False:
    ended from the start). The detector does not follow qwen3's `<tool_call>` implicit end: a
    grammar that starts after the reasoning sees only `</think>` as its start."""

    def __init__(self, end_ids: Sequence[int], in_reasoning: bool = True):
        if not end_ids:
            raise ValueError("end_ids must hold at least one token id")
        self._end = tuple(end_ids)
        self._tail: tuple[int, ...] = ()
        self.ended = not in_reasoning

    def feed(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids` (the newly generated ones) are still reasoning: all of them while
        the end has not come, the count up to and including the end sequence in the step it
        completes, 0 once ended. The grammar applies to `token_ids[returned:]`."""
        if self.ended:
            return 0
        n, window = len(self._end), self._tail + tuple(token_ids)
        for i in range(len(window) - n + 1):
            if window[i : i + n] == self._end:
                self.ended = True
                return i + n - len(self._tail)
        self._tail = window[len(window) - (n - 1) :] if n > 1 else ()
        return len(token_ids)


def reasoning_ended(token_ids: Sequence[int], end_ids: Sequence[int], in_reasoning: bool = True) -> bool:
    """Stateless form of `ReasoningEndDetector`: whether the generated `token_ids` have left the
    reasoning (the `</think>` id sequence occurs in them, or the output never was reasoning)."""
    detector = ReasoningEndDetector(end_ids, in_reasoning)
    detector.feed(token_ids)
    return detector.ended


def think_end_ids(tokenizer: Any) -> list[int]:
    """The ids the tokenizer writes `</think>` with (one added token for Qwen3.5/3.6)."""
    return list(tokenizer.encode(THINK_END, add_special_tokens=False))

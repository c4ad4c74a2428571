"""hylora/server/parsers: reasoning split, tool-call parsers (qwen3_coder, hermes), tool_choice
grammars and the tools / tool_choice checks — pure text, no model. Streaming is checked against the
whole-text parse at every cut of the text (and character by character)."""

from __future__ import annotations

import json
import random
from itertools import pairwise

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest
from transformers import AutoTokenizer

from hylora.demo import write_tokenizer
from hylora.server.parsers import (
    ReasoningEndDetector,
    ReasoningParser,
    ToolCallParser,
    ToolRequestError,
    finish_reason,
    parse_tool_request,
    prompt_reasoning_state,
    reasoning_ended,
    think_end_ids,
    tool_choice_grammar,
)
from hylora.server.parsers.text import held_suffix
from hylora.server.parsers.tool_calls import ToolCallStream
from hylora.server.parsers.tool_calls.qwen3_coder import Qwen3CoderScanner
from hylora.server.parsers.tool_calls.schema import convert_value
from hylora.structured.rules import check_grammar

OPEN = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"  # Qwen3.5, thinking on
CLOSED = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"  # thinking off
NONE = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # older template, or raw


def cuts(text: str):
    """Every way to cut `text` in two, then character by character."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)


# ---------------------------------------------------------------- reasoning


def test_prompt_state():
    assert prompt_reasoning_state(OPEN) == "open"
    assert prompt_reasoning_state(CLOSED) == "closed"
    assert prompt_reasoning_state(NONE) == "none"
    # an earlier assistant turn's think block does not count: only the generation turn
    history = "<|im_start|>assistant\n<think>\nx\n</think>\n\nok<|im_end|>\n" + NONE
    assert prompt_reasoning_state(history) == "none"
    assert prompt_reasoning_state("raw <think> prompt") == "open"
    assert prompt_reasoning_state("") == "none"


@pytest.mark.parametrize(
    ("name", "prompt", "thinking", "expected"),
    [
        ("qwen3", OPEN, None, True),
        ("qwen3", OPEN, False, True),  # the prompt decides
        ("qwen3", CLOSED, None, False),
        ("qwen3", CLOSED, True, False),
        ("qwen3", NONE, None, True),
        ("qwen3", NONE, True, True),
        ("qwen3", NONE, False, False),  # vLLM qwen3: thinking off → content
        ("qwen3", None, None, True),
        ("deepseek_r1", NONE, False, True),  # vLLM deepseek_r1: always reasoning first
        ("deepseek_r1", CLOSED, None, False),
        ("deepseek_r1", OPEN, None, True),
    ],
)
def test_starts_in_reasoning(name, prompt, thinking, expected):
    assert ReasoningParser(name).starts_in_reasoning(prompt, thinking) is expected


TC = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
REASONING_CASES = [
    # (parser, prompt, thinking, output, reasoning, content)
    ("qwen3", OPEN, None, "Let me think.\n</think>\n\nThe answer is 4.", "Let me think.\n", "\n\nThe answer is 4."),
    ("qwen3", OPEN, None, "</think>\n\nHi", None, "\n\nHi"),  # empty reasoning
    ("qwen3", OPEN, None, "\n</think>\n\n", "\n", "\n\n"),
    ("qwen3", OPEN, None, "still thinking when cut", "still thinking when cut", None),  # no </think>: all reasoning
    ("qwen3", OPEN, None, "", None, None),
    ("qwen3", NONE, None, "<think>\nhmm\n</think>\n\nyes", "\nhmm\n", "\n\nyes"),  # the model writes <think>
    ("qwen3", NONE, None, "pre<think>a</think>b", "prea", "b"),
    ("qwen3", OPEN, None, "a<think>b</think>c<think>d</think>e", "ab", "c<think>d</think>e"),
    ("qwen3", NONE, False, "Plain answer, no tags.", None, "Plain answer, no tags."),  # thinking off
    ("qwen3", CLOSED, None, "Answer </think> as text", None, "Answer </think> as text"),
    ("qwen3", CLOSED, True, "<think>x</think>y", None, "<think>x</think>y"),
    ("qwen3", OPEN, None, "I call a tool.\n\n" + TC, "I call a tool.\n\n", TC),  # implicit end (qwen3)
    ("qwen3", OPEN, None, "use <tool_call> tags.</think>ok", "use <tool_call> tags.", "ok"),  # mention only
    ("qwen3", OPEN, None, "x <tool_call>\n", "x <tool_call>\n", None),  # cut before <function: reasoning
    ("qwen3", OPEN, None, "x <tool_call> <function", "x <tool_call> <function", None),
    ("qwen3", OPEN, None, "x <tool_call><functional>", "x <tool_call><functional>", None),
    ("deepseek_r1", OPEN, None, "I call a tool.\n\n" + TC, "I call a tool.\n\n" + TC, None),  # no implicit end
    ("deepseek_r1", NONE, False, "no end tag at all", "no end tag at all", None),
    ("deepseek_r1", NONE, None, "<think>r</think>c", "r", "c"),
    ("deepseek_r1", CLOSED, None, "content only", None, "content only"),
    ("qwen3", OPEN, None, "思考中…🙂\n</think>\n\n答案：四 🎉", "思考中…🙂\n", "\n\n答案：四 🎉"),
    ("qwen3", OPEN, None, "a</th", "a</th", None),  # a partial tag at the end is text
    ("qwen3", OPEN, None, "a</think", "a</think", None),
    ("qwen3", OPEN, None, "<<//think></think>>", "<<//think>", ">"),
]


@pytest.mark.parametrize(("name", "prompt", "thinking", "text", "reasoning", "content"), REASONING_CASES)
def test_reasoning_split(name, prompt, thinking, text, reasoning, content):
    assert ReasoningParser(name).split(text, prompt, thinking) == (reasoning, content)


@pytest.mark.parametrize(("name", "prompt", "thinking", "text", "reasoning", "content"), REASONING_CASES)
def test_reasoning_stream_every_cut(name, prompt, thinking, text, reasoning, content):
    parser = ReasoningParser(name)
    for pieces in cuts(text):
        stream = parser.stream(prompt, thinking)
        got_r, got_c = [], []
        ended_at = None
        for i, piece in enumerate(pieces):
            d = stream.feed(piece)
            got_r.append(d.reasoning)
            got_c.append(d.content)
            if stream.reasoning_ended and ended_at is None:
                ended_at = i
            if got_c[-1]:
                assert stream.reasoning_ended
        d = stream.finish()
        got_r.append(d.reasoning)
        got_c.append(d.content)
        assert ("".join(got_r) or None, "".join(got_c) or None) == (reasoning, content), pieces


def test_reasoning_stream_holds_only_partial_tags():
    stream = ReasoningParser("qwen3").stream(OPEN)
    assert stream.feed("abc</th") == ("abc", "")
    assert not stream.reasoning_ended
    assert stream.feed("ink>\n\nHi") == ("", "\n\nHi")
    assert stream.reasoning_ended
    assert stream.feed(" there") == ("", " there")
    assert stream.finish() == ("", "")
    stream = ReasoningParser("qwen3").stream(OPEN)
    assert stream.feed("x <") == ("x ", "")
    assert stream.feed("b>") == ("<b>", "")
    assert stream.feed("<tool_call>\n") == ("", "")  # may still open a call: held
    assert stream.feed("<function=f>") == ("", "<tool_call>\n<function=f>")
    assert ReasoningParser("qwen3").stream(CLOSED).feed("</th") == ("", "</th")
    with pytest.raises(RuntimeError):
        s = ReasoningParser("qwen3").stream()
        s.finish()
        s.feed("x")


def test_held_suffix():
    assert held_suffix("abc</th", ["</think>"]) == 4
    assert held_suffix("abc<", ["</think>", "<think>"]) == 1
    assert held_suffix("abc</think>", ["</think>"]) == 0  # whole tags are not held
    assert held_suffix("", ["</think>"]) == 0


def test_reasoning_end_detector():
    det = ReasoningEndDetector([9], in_reasoning=True)
    assert det.feed([1, 2]) == 2 and not det.ended
    assert det.feed([3, 9, 4, 5]) == 2 and det.ended  # tokens after the end: grammar applies to [4, 5]
    assert det.feed([6]) == 0
    det = ReasoningEndDetector([7, 8, 9])
    assert det.feed([1, 7]) == 2
    assert det.feed([8]) == 1 and not det.ended
    assert det.feed([9, 3]) == 1 and det.ended
    det = ReasoningEndDetector([7, 8])
    assert det.feed([7, 7, 8, 1]) == 3 and det.ended
    assert ReasoningEndDetector([9], in_reasoning=False).feed([1, 9]) == 0
    assert reasoning_ended([1, 9, 2], [9]) and not reasoning_ended([1, 2], [9])
    assert reasoning_ended([1, 2], [9], in_reasoning=False)
    with pytest.raises(ValueError):
        ReasoningEndDetector([])


def test_reasoning_end_detector_on_tokenizer(tokenizer):
    end = think_end_ids(tokenizer)
    assert tokenizer.decode(end) == "</think>"
    ids = tokenizer.encode("a thought</think>\n\n{", add_special_tokens=False)
    for cut in range(len(ids) + 1):
        det = ReasoningEndDetector(end)
        kept = det.feed(ids[:cut])
        kept += det.feed(ids[cut:])
        assert det.ended and tokenizer.decode(ids[kept:]) == "\n\n{"


def test_unknown_parsers():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningParser("granite")
    with pytest.raises(ValueError, match="unknown tool call parser"):
        ToolCallParser("llama3_json")


# ---------------------------------------------------------------- tool calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "metric": {"type": "boolean"},
                    "opts": {"type": "object"},
                    "hours": {"type": "array", "items": {"type": "integer"}},
                    "nothing": {"type": "null"},
                    "unit": {"type": ["string", "null"]},
                    "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                    "place": {"$ref": "#/$defs/place"},
                    "mode": {"enum": ["fast", "slow"]},
                },
                "required": ["city"],
                "$defs": {"place": {"type": "object", "properties": {"lat": {"type": "number"}}}},
            },
        },
    },
    {"type": "function", "function": {"name": "ping"}},
]


def qcall(name: str, params: list[tuple[str, str]]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def hcall(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


ALL_TYPES = qcall(
    "get_weather",
    [
        ("city", "São Paulo 🌧"),
        ("days", "3"),
        ("ratio", "0.25"),
        ("metric", "True"),
        ("opts", '{"a": [1, {"b": null}]}'),
        ("hours", "[1, 2]"),
        ("nothing", "null"),
        ("unit", "None"),
        ("limit", "7"),
        ("place", '{"lat": 1.5}'),
        ("mode", "fast"),
    ],
)
ALL_TYPES_ARGS = {
    "city": "São Paulo 🌧",
    "days": 3,
    "ratio": 0.25,
    "metric": True,
    "opts": {"a": [1, {"b": None}]},
    "hours": [1, 2],
    "nothing": None,
    "unit": None,
    "limit": 7,
    "place": {"lat": 1.5},
    "mode": "fast",
}

# (text, content, [(name, arguments as a Python value)])
QWEN_CASES = [
    (ALL_TYPES, None, [("get_weather", ALL_TYPES_ARGS)]),
    ("Let me check.\n\n" + ALL_TYPES + "\n", "Let me check.\n\n", [("get_weather", ALL_TYPES_ARGS)]),
    (
        "\n\n" + qcall("get_weather", [("city", "Paris")]) + "\n" + qcall("ping", []) + "\n",
        None,
        [("get_weather", {"city": "Paris"}), ("ping", {})],
    ),
    (
        "A " + qcall("ping", []) + " between " + qcall("ping", []) + " after",
        "A  between  after",
        [("ping", {}), ("ping", {})],
    ),
    ("No tools here, just <b>text</b>.", "No tools here, just <b>text</b>.", []),
    ("", None, []),
    ("\n\n", "\n\n", []),
    # a value that holds the closing tags as text (code)
    (
        qcall("get_weather", [("city", "a</parameter>b\n</function>c"), ("days", "2")]),
        None,
        [("get_weather", {"city": "a</parameter>b\n</function>c", "days": 2})],
    ),
    # multi-line value: one leading and one trailing newline are stripped, the rest kept
    (qcall("get_weather", [("city", "\nline1\n\nline2\n")]), None, [("get_weather", {"city": "\nline1\n\nline2\n"})]),
    (qcall("get_weather", [("city", "")]), None, [("get_weather", {"city": ""})]),
    # conversions that fail stay strings; an undeclared parameter stays a string
    (
        qcall("get_weather", [("days", "three"), ("ratio", "1e999"), ("extra", "42")]),
        None,
        [("get_weather", {"days": "three", "ratio": "1e999", "extra": "42"})],
    ),
    (
        qcall("get_weather", [("ratio", "2.0"), ("metric", "yes")]),
        None,
        [("get_weather", {"ratio": 2, "metric": False})],
    ),
    (qcall("unknown_fn", [("x", "1")]), None, [("unknown_fn", {"x": "1"})]),  # not among the tools: still a call
    # tolerated malformations
    (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</function>\n</tool_call>",
        None,
        [("get_weather", {"city": "Rome"})],
    ),
    ("<tool_call><function=ping></function> trailing", " trailing", [("ping", {})]),
    ("<tool_call>\n<function=ping>\njunk\n</function>\n</tool_call>", None, [("ping", {})]),
    # not calls: content as written
    ("<tool_call>\nplain</tool_call> text", "<tool_call>\nplain</tool_call> text", []),
    ("x <tool_call>\n<function=bad name>\n</function>", "x <tool_call>\n<function=bad name>\n</function>", []),
    ("<tool_call>{}</tool_call>", "<tool_call>{}</tool_call>", []),
    ("a <tool_call>", "a <tool_call>", []),
    ("a <tool_call>\n<function=get_wea", "a <tool_call>\n<function=get_wea", []),
    ("<tool_", "<tool_", []),
    # cut short: the call keeps what it has (vLLM's non-streaming parse does the same)
    (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        None,
        [("get_weather", {"city": "Par"})],
    ),
    (
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n12\n</parameter>\n",
        None,
        [("get_weather", {"days": 12})],
    ),
    ("<tool_call>\n<function=ping>\n<parame", None, [("ping", {})]),
]

HERMES_CASES = [
    (hcall("get_weather", '{"city": "Paris", "days": 3}'), None, [("get_weather", {"city": "Paris", "days": 3})]),
    (
        "Checking.\n" + hcall("get_weather", '{"city": "}</tool_call>\\"{"}') + "\n" + hcall("ping", "{}") + "\n",
        "Checking.\n",
        [("get_weather", {"city": '}</tool_call>"{'}), ("ping", {})],
    ),
    (
        '<tool_call>\n{"arguments": {"city": "Rome"}, "name": "get_weather"}\n</tool_call>',
        None,
        [("get_weather", {"city": "Rome"})],
    ),  # other key order: sent whole
    (
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>',
        None,
        [("get_weather", {"city": "Oslo"})],
    ),  # arguments as a JSON string
    ('<tool_call>{"name": "ping"}</tool_call>', None, [("ping", {})]),
    (
        hcall("get_weather", '{"city": "東京 🗼", "hours": [1, [2, {"x": "]"}]]}'),
        None,
        [("get_weather", {"city": "東京 🗼", "hours": [1, [2, {"x": "]"}]]})],
    ),
    ('<tool_call>{"name": "ping", "arguments": {}}', None, [("ping", {})]),  # no </tool_call>
    ("No call.", "No call.", []),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    (
        '<tool_call>{"name": "f", "arguments": 5}</tool_call>',
        '<tool_call>{"name": "f", "arguments": 5}</tool_call>',
        [],
    ),
    ('<tool_call>{"name": 5}</tool_call>', '<tool_call>{"name": 5}</tool_call>', []),
]


def check_parse(fmt: str, text: str, content, calls):
    parsed = ToolCallParser(fmt).parse(text, TOOLS)
    assert parsed.content == content
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]
    assert got == calls
    for c in parsed.tool_calls:
        assert c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) == 29
    assert len({c["id"] for c in parsed.tool_calls}) == len(parsed.tool_calls)
    return parsed


@pytest.mark.parametrize(("text", "content", "calls"), QWEN_CASES)
def test_qwen3_coder_parse(text, content, calls):
    check_parse("qwen3_coder", text, content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_parse(text, content, calls):
    check_parse("hermes", text, content, calls)


def test_arguments_text():
    """Arguments are `json.dumps`-style text, keys in the order written, unicode kept."""
    parsed = ToolCallParser("qwen3_coder").parse(ALL_TYPES, TOOLS)
    assert parsed.tool_calls[0]["function"]["arguments"] == json.dumps(ALL_TYPES_ARGS, ensure_ascii=False)
    parsed = ToolCallParser("hermes").parse(hcall("get_weather", '{"city":"Zürich"}'), TOOLS)
    assert parsed.tool_calls[0]["function"]["arguments"] == '{"city":"Zürich"}'  # as written


def stream_all(fmt: str, pieces, strict=False, tools=TOOLS):
    stream = ToolCallParser(fmt, id_factory=iter(f"call_{i}" for i in range(100)).__next__).stream(tools, strict)
    deltas = []
    content = []
    for piece in pieces:
        d = stream.feed(piece)
        content.append(d.content)
        deltas.extend(d.tool_calls)
    d = stream.finish()
    content.append(d.content)
    deltas.extend(d.tool_calls)
    return "".join(content), deltas, stream


def assemble(deltas):
    """OpenAI deltas → calls, checking their shape as OpenAI sends them."""
    calls: list[dict] = []
    for d in deltas:
        if "id" in d:
            assert d["index"] == len(calls)
            assert d["type"] == "function" and d["function"]["arguments"] == "" and d["function"]["name"]
            calls.append({"name": d["function"]["name"], "arguments": ""})
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            assert d["index"] == len(calls) - 1 and d["function"]["arguments"]
            calls[-1]["arguments"] += d["function"]["arguments"]
    return calls


VALID_STREAM_CASES = [("qwen3_coder", *c) for c in QWEN_CASES] + [
    ("hermes", *c) for c in HERMES_CASES if c[0] != '<tool_call>{"name": "ping", "arguments": {}}'
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), VALID_STREAM_CASES)
def test_stream_every_cut(fmt, text, content, calls):
    whole = ToolCallParser(fmt).parse(text, TOOLS)
    for strict in (False, True):
        for pieces in cuts(text):
            got_content, deltas, stream = stream_all(fmt, pieces, strict)
            assert (got_content or None) == content, pieces
            got = assemble(deltas)
            assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls, pieces
            assert [c["arguments"] for c in got] == [c["function"]["arguments"] for c in whole.tool_calls]
            assert stream.called == bool(calls)
            assert [c["function"]["arguments"] for c in stream.tool_calls] == [c["arguments"] for c in got]


def test_stream_sends_header_first_then_fragments():
    text = "Sure.\n\n" + qcall("get_weather", [("city", "Paris"), ("days", "2")])
    stream = ToolCallParser("qwen3_coder", id_factory=lambda: "call_abc").stream(TOOLS)
    assert stream.feed("Sure.\n\n<tool_") == ("Sure.\n\n", [])
    assert stream.feed("call>\n<function=get_wea") == ("", [])
    first = stream.feed("ther>\n<parameter=city>\nPar")
    assert first.tool_calls == [
        {"index": 0, "id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    ]
    assert stream.feed("is\n</parameter>\n<param").tool_calls == []  # is that `</parameter>` the end? not yet known
    assert stream.feed("eter=").tool_calls == [{"index": 0, "function": {"arguments": '{"city": "Paris"'}}]
    rest = stream.feed(text[text.index("<parameter=days>") + len("<parameter=") :])
    assert "".join(d["function"]["arguments"] for d in rest.tool_calls) == ', "days": 2}'
    assert stream.finish() == ("", [])
    # hermes: arguments stream as they are written
    stream = ToolCallParser("hermes", id_factory=lambda: "call_h").stream(TOOLS)
    d = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert d.tool_calls[0]["id"] == "call_h" and d.tool_calls[1]["function"]["arguments"] == '{"ci'
    assert stream.feed('ty": "Rome"}}\n</tool_call>').tool_calls == [
        {"index": 0, "function": {"arguments": 'ty": "Rome"}'}}
    ]


def test_stream_cut_short_and_malformed():
    # hermes call cut short: a stream has sent it (cannot take it back); the whole parse makes it content
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    content, deltas, stream = stream_all("hermes", [text])
    assert content == "" and assemble(deltas) == [{"name": "get_weather", "arguments": '{"city": "Pa'}]
    assert ToolCallParser("hermes").parse(text, TOOLS) == (text, [])
    content, deltas, _ = stream_all("hermes", [text], strict=True)
    assert content == text and deltas == []
    # never raises on junk
    rng = random.Random(0)
    alphabet = ["<tool_call>", "</tool_call>", "<function=f>", "</function>", "<parameter=x>", "</parameter>"]
    alphabet += ['{"name": "f", "arguments": {', "}", '"', "\\", "\n", " ", "a", "<", ">", "="]
    for fmt in ("qwen3_coder", "hermes"):
        for _ in range(300):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
            whole = ToolCallParser(fmt).parse(text, TOOLS)
            for c in whole.tool_calls:
                assert isinstance(json.loads(c["function"]["arguments"]), dict)
            pieces = [
                text[i:j]
                for i, j in pairwise(sorted({0, len(text), *rng.sample(range(len(text) + 1), min(3, len(text) + 1))}))
            ]
            stream_all(fmt, pieces)


def test_reasoning_then_tools_pipeline():
    """The server's chain: reasoning split first, its content into the tool parser; streamed at
    every cut it gives what the whole-text parse gives."""
    call = qcall("get_weather", [("city", "Köln"), ("days", "2")])
    for text, prompt in (
        ("The user wants weather.\n</think>\n\n" + call, OPEN),  # thinking on
        ("Need a tool.\n\n" + call, OPEN),  # Qwen3.5 calls without closing its thinking
        (call + "\n", CLOSED),  # thinking off
    ):
        reasoning, content = ReasoningParser("qwen3").split(text, prompt)
        whole = ToolCallParser("qwen3_coder").parse(content or "", TOOLS)
        assert json.loads(whole.tool_calls[0]["function"]["arguments"]) == {"city": "Köln", "days": 2}
        assert whole.content is None
        for pieces in cuts(text):
            rs = ReasoningParser("qwen3").stream(prompt)
            ts = ToolCallParser("qwen3_coder").stream(TOOLS)
            got_r, got_c, deltas = [], [], []
            for piece in pieces:
                r = rs.feed(piece)
                t = ts.feed(r.content)
                got_r.append(r.reasoning)
                got_c.append(t.content)
                deltas.extend(t.tool_calls)
            r = rs.finish()
            got_r.append(r.reasoning)
            for t in (ts.feed(r.content), ts.finish()):
                got_c.append(t.content)
                deltas.extend(t.tool_calls)
            assert ("".join(got_r) or None) == reasoning
            assert "".join(got_c) == ""
            assert [c["arguments"] for c in assemble(deltas)] == [whole.tool_calls[0]["function"]["arguments"]]
            assert finish_reason("stop", parse_tool_request({"tools": TOOLS}, auto_tool_choice=True), ts.called) == (
                "tool_calls"
            )
    with pytest.raises(RuntimeError):
        ts.feed("x")


def test_stream_survives_a_failing_scanner():
    class Broken(Qwen3CoderScanner):
        def step(self, text, final):
            if "BOOM" in text:
                raise RuntimeError("bug")
            return super().step(text, final)

    stream = ToolCallStream(Broken, {})
    assert stream.feed("a <tool_call>BOOM") == ("a ", [])
    assert stream.finish() == ("<tool_call>BOOM", [])
    stream = ToolCallStream(Broken, {}, id_factory=lambda: "call_1")
    first = stream.feed("<tool_call><function=f><parameter=x>1</parameter></function>")
    assert first.tool_calls[0]["function"]["name"] == "f"
    assert stream.feed("BOOM") == ("", [])
    assert stream.finish() == ("", [])
    assert stream.tool_calls[0]["function"]["arguments"] == '{"x": "1"'  # as sent; the call ends there


@pytest.mark.parametrize(
    ("raw", "schema", "value"),
    [
        ("hello", {"type": "string"}, "hello"),
        ("null", {"type": "string"}, "null"),  # a string keeps "null"
        ("null", {"type": ["string", "null"]}, None),
        ("None", {"anyOf": [{"type": "string"}, {"type": "null"}]}, None),
        ("42", {"type": "integer"}, 42),
        ("-7", {"type": "int"}, -7),
        ("4.5", {"type": "integer"}, "4.5"),
        ("4.0", {"type": "number"}, 4),
        ("1e3", {"type": "number"}, 1000),
        ("0.5", {"type": "float"}, 0.5),
        ("nan", {"type": "number"}, "nan"),
        ("TRUE", {"type": "boolean"}, True),
        ("no", {"type": "boolean"}, False),
        ("null", {"type": "integer"}, None),
        ('{"a": 1}', {"type": "object"}, {"a": 1}),
        ("{'a': (1, 2)}", {"type": "object"}, {"a": [1, 2]}),
        ("\"{'k': 'v'}\"", {"type": "object"}, {"k": "v"}),
        ("[1, 'x']", {"type": "array"}, [1, "x"]),
        ("{1, 2}", {"type": "array"}, "{1, 2}"),  # a Python set is no JSON: stays a string
        ("[[[" * 200, {"type": "array"}, "[[[" * 200),
        ("3j", {"type": "object"}, "3j"),
        ("5", {}, "5"),  # untyped: a string (vLLM)
        ("5", {"enum": [5, 6]}, 5),  # untyped enum: its values' type
        ("x", {"const": "x"}, "x"),
        ("5", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 5),
        ("five", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "five"),
        ("[1]", {"items": {"type": "integer"}}, [1]),
        ('{"a": 1}', {"properties": {"a": {}}}, {"a": 1}),
        ("1", {"type": "null"}, "1"),
    ],
)
def test_convert_value(raw, schema, value):
    assert convert_value(raw, schema, {}) == value


def test_convert_value_refs():
    root = {"$defs": {"n": {"type": "integer"}, "loop": {"$ref": "#/$defs/loop"}}}
    assert convert_value("3", {"$ref": "#/$defs/n"}, root) == 3
    assert convert_value("3", {"$ref": "#/$defs/loop"}, root) == "3"  # a $ref cycle ends
    assert convert_value("3", {"$ref": "#/$defs/missing"}, root) == "3"
    assert convert_value("3", None, root) == "3"  # undeclared
    deep: dict = {"type": "integer"}
    for _ in range(5000):
        deep = {"anyOf": [deep]}
    assert convert_value("3", deep, {}) == "3"  # no recursion on client data


# ---------------------------------------------------------------- grammars


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("parsers-tokenizer")
    write_tokenizer(path, 1024)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=1024, eos_token=[eos])


GRAMMAR_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "maxLength": 6},
                    "limit": {"type": "integer", "minimum": 0, "maximum": 99},
                    "ratio": {"type": "number", "minimum": -100, "maximum": 100},
                    "exact": {"type": "boolean"},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
                    "filter": {
                        "type": "object",
                        "properties": {"field": {"enum": ["a", "b"]}, "min": {"type": ["integer", "null"]}},
                        "required": ["field"],
                    },
                    "nothing": {"type": "null"},
                    "note": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "null"}]},
                    "mode": {"type": "string", "enum": ["fast", "slow"]},
                    "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
                    "ref": {"$ref": "#/$defs/level"},
                    "count": {
                        "anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 2}]
                    },
                },
                "required": ["query", "limit"],
                "$defs": {"level": {"type": "integer", "minimum": 1, "maximum": 3}},
            },
        },
    },
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
    {
        "type": "function",
        "function": {
            "name": "echo",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string", "minLength": 1, "maxLength": 5}},
                "required": ["text"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in GRAMMAR_TOOLS}


def matcher(ll_tokenizer, grammar: str) -> llguidance.LLMatcher:
    check_grammar(grammar)  # hylora/structured's pre-compile bounds accept it
    compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
    assert llguidance.LLMatcher.validate_grammar(compiled, ll_tokenizer) == ""
    m = llguidance.LLMatcher(ll_tokenizer, compiled, log_level=0)
    assert not m.is_error(), m.get_error()
    return m


# the demo tokenizer writes <tool_call> and </tool_call> as one added token each, as Qwen3.5 / 3.6's
TOKEN_TAGS = ("<tool_call>", "</tool_call>")


def tags_grammar(*args, **kwargs) -> str:
    return tool_choice_grammar(*args, **kwargs, token_tags=TOKEN_TAGS)


def test_tags_are_tokens_only_where_the_tokenizer_has_them():
    quoted = tool_choice_grammar(GRAMMAR_TOOLS, "hermes")
    assert '"<tool_call>' in quoted and '</tool_call>"' in quoted
    tokens = tags_grammar(GRAMMAR_TOOLS, "hermes")
    assert " <tool_call> " in tokens and tokens.rstrip().endswith("</tool_call>") and '"<tool_call>' not in tokens


def accepts(ll_tokenizer, grammar: str, text: str) -> bool:
    m = matcher(ll_tokenizer, grammar)
    ok = m.consume_tokens(ll_tokenizer.tokenize_str(text)) and m.consume_token(ll_tokenizer.eos_token)
    return ok and not m.is_error()


QWEN_VALID = qcall(
    "lookup",
    [
        ("query", "bronze"),
        ("limit", "5"),
        ("ratio", "-2.5"),
        ("exact", "true"),
        ("tags", '["a", "b"]'),
        ("filter", '{"field": "a", "min": null}'),
        ("nothing", "null"),
        ("note", "null"),
        ("mode", "slow"),
        ("code", "AB7"),
        ("ref", "2"),
        ("count", "7"),
    ],
)
HERMES_VALID = hcall("lookup", '{"query": "jade", "limit": 0, "tags": [], "filter": {"field": "b"}, "ref": 3}')


@pytest.mark.parametrize(
    ("fmt", "text", "ok"),
    [
        ("qwen3_coder", QWEN_VALID, True),
        ("qwen3_coder", qcall("lookup", [("query", ""), ("limit", "0")]), True),
        ("qwen3_coder", qcall("ping", []), True),
        ("qwen3_coder", QWEN_VALID + "\n" + qcall("ping", []), True),  # parallel calls
        ("qwen3_coder", qcall("lookup", [("query", "x")]), False),  # required "limit" missing
        ("qwen3_coder", qcall("lookup", [("query", "x"), ("limit", "100")]), False),  # maximum
        ("qwen3_coder", qcall("lookup", [("query", "x"), ("limit", "1.5")]), False),  # not an integer
        ("qwen3_coder", qcall("lookup", [("query", "toolong"), ("limit", "1")]), False),  # maxLength
        ("qwen3_coder", qcall("lookup", [("query", "a</parameter>"), ("limit", "1")]), False),
        ("qwen3_coder", qcall("lookup", [("limit", "1"), ("query", "x")]), False),  # order of the schema
        ("qwen3_coder", qcall("lookup", [("query", "x"), ("limit", "1"), ("other", "1")]), False),  # extra
        ("qwen3_coder", qcall("lookup", [("query", "x"), ("limit", "1"), ("mode", "medium")]), False),  # enum
        ("qwen3_coder", qcall("lookup", [("query", "x"), ("limit", "1"), ("code", "ab7")]), False),  # pattern
        ("qwen3_coder", qcall("lookup", [("query", "x"), ("limit", "1"), ("filter", '{"min": 1}')]), False),
        ("qwen3_coder", qcall("lookup", [("query", "x"), ("limit", "1"), ("exact", "yes")]), False),
        # a union is written in its first type's form (the parser converts to that type)
        ("qwen3_coder", qcall("lookup", [("query", "x"), ("limit", "1"), ("count", "xy")]), False),
        ("qwen3_coder", qcall("lookup", [("query", "x"), ("limit", "1"), ("note", "None")]), True),
        ("qwen3_coder", qcall("nope", []), False),  # unknown function
        ("qwen3_coder", "Sure! " + qcall("ping", []), False),  # nothing before the call
        ("qwen3_coder", "", False),  # required: at least one call
        ("hermes", HERMES_VALID, True),
        ("hermes", HERMES_VALID + "\n" + hcall("ping", "{}"), True),
        ("hermes", hcall("lookup", '{"query": "jade"}'), False),  # required "limit" missing
        ("hermes", hcall("lookup", '{"query": "jade", "limit": 1, "zzz": 1}'), False),  # closed object
        ("hermes", hcall("lookup", '{"query":"jade","limit":1}'), False),  # compact json.dumps layout only
        ("hermes", hcall("ping", '{"x": 1}'), False),
    ],
)
def test_required_grammar(ll_tokenizer, fmt, text, ok):
    grammar = tags_grammar(GRAMMAR_TOOLS, fmt)
    assert accepts(ll_tokenizer, grammar, text) is ok
    if ok:  # what the grammar allows, the parser reads back, valid against the schemas
        parsed = ToolCallParser(fmt).parse(text, GRAMMAR_TOOLS)
        assert parsed.content is None and parsed.tool_calls
        for call in parsed.tool_calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_named_and_single_call_grammars(ll_tokenizer):
    for fmt, one, other in (
        ("qwen3_coder", qcall("echo", [("text", "hi")]), qcall("ping", [])),
        ("hermes", hcall("echo", '{"text": "hi"}'), hcall("ping", "{}")),
    ):
        named = tags_grammar(GRAMMAR_TOOLS, fmt, function="echo")
        assert accepts(ll_tokenizer, named, one)
        assert not accepts(ll_tokenizer, named, other)
        assert not accepts(ll_tokenizer, named, one + "\n" + one)  # exactly one call
        single = tags_grammar(GRAMMAR_TOOLS, fmt, parallel=False)
        assert accepts(ll_tokenizer, single, other)
        assert not accepts(ll_tokenizer, single, other + "\n" + one)
    assert not accepts(ll_tokenizer, tags_grammar(GRAMMAR_TOOLS, "qwen3_coder", "echo"), qcall("echo", [("text", "")]))


# a pydantic-style schema whose root is a $ref into its own $defs
REF_ROOT_TOOL = {
    "type": "function",
    "function": {
        "name": "dig",
        "parameters": {
            "$defs": {"Dig": {"type": "object", "required": ["site", "depth"],
                              "properties": {"site": {"type": "string"}, "depth": {"type": "integer"}}}},
            "$ref": "#/$defs/Dig",
        },
    },
}  # fmt: skip


@pytest.mark.parametrize(
    ("fmt", "text", "ok"),
    [
        ("qwen3_coder", qcall("dig", [("site", "tomb"), ("depth", "3")]), True),
        ("qwen3_coder", qcall("dig", []), False),  # the referenced object's required properties
        ("qwen3_coder", qcall("dig", [("site", "tomb"), ("depth", "deep")]), False),
        ("hermes", hcall("dig", '{"site": "tomb", "depth": 3}'), True),
        ("hermes", hcall("dig", "{}"), False),
    ],
)
def test_a_root_ref_schema_constrains_the_arguments_as_its_target(ll_tokenizer, fmt, text, ok):
    assert accepts(ll_tokenizer, tags_grammar([REF_ROOT_TOOL], fmt), text) is ok
    if ok:
        (call,) = ToolCallParser(fmt).parse(text, [REF_ROOT_TOOL]).tool_calls
        assert json.loads(call["function"]["arguments"]) == {"site": "tomb", "depth": 3}


def test_a_tool_schema_with_no_finite_arguments_is_refused():
    endless = {"$defs": {"n": {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}, "required": ["n"]}},
               "$ref": "#/$defs/n"}  # fmt: skip
    tool = {"type": "function", "function": {"name": "nest", "parameters": endless}}
    for fmt in ("qwen3_coder", "hermes"):
        with pytest.raises(ValueError, match="'nest'.*admits no finite document"):
            tool_choice_grammar([tool], fmt)


def random_output(m: llguidance.LLMatcher, ll_tokenizer, rng: np.random.Generator, max_tokens: int = 400):
    tokens = []
    for _ in range(max_tokens):
        if m.is_stopped():
            return ll_tokenizer.decode_str(tokens)
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: ll_tokenizer.vocab_size])
        assert len(allowed), m.get_error()
        eos = ll_tokenizer.eos_token
        token = eos if eos in allowed and rng.random() < 0.5 else int(rng.choice(allowed))
        assert m.consume_token(token), m.get_error()
        if token == eos:
            return ll_tokenizer.decode_str(tokens)
        tokens.append(token)
    return None


@pytest.mark.parametrize("fmt", ["qwen3_coder", "hermes"])
def test_grammar_outputs_read_back(ll_tokenizer, fmt):
    """Random walks through the grammar (any allowed token): every finished output parses into
    calls whose arguments validate against their function's schema."""
    rng = np.random.default_rng(7)
    grammar = tags_grammar(GRAMMAR_TOOLS, fmt)
    template = matcher(ll_tokenizer, grammar)
    done = 0
    for _ in range(120):
        m = template.deep_copy()
        text = random_output(m, ll_tokenizer, rng)
        if text is None:
            continue
        done += 1
        parsed = ToolCallParser(fmt).parse(text, GRAMMAR_TOOLS)
        assert parsed.content is None and parsed.tool_calls, text
        assert len(parsed.tool_calls) == text.count("<tool_call>")
        for call in parsed.tool_calls:
            args = json.loads(call["function"]["arguments"])
            jsonschema.validate(args, SCHEMAS[call["function"]["name"]])
        streamed = stream_all(fmt, list(text), tools=GRAMMAR_TOOLS)
        assert [c["arguments"] for c in assemble(streamed[1])] == [
            c["function"]["arguments"] for c in parsed.tool_calls
        ]
    assert done >= 60


def test_many_tools_grammar(ll_tokenizer):
    """128 functions of 10 parameters: within hylora/structured's bounds, compiles, matches."""
    props = {f"p{j}": {"type": "string"} if j % 2 else {"type": "integer"} for j in range(10)}
    tools = [
        {"type": "function", "function": {"name": f"fn_{i}", "parameters": {"properties": props, "required": ["p0"]}}}
        for i in range(128)
    ]
    for fmt, text in (
        ("qwen3_coder", qcall("fn_77", [("p0", "5"), ("p1", "hello")])),
        ("hermes", hcall("fn_77", '{"p0": 5, "p1": "hello"}')),
    ):
        grammar = tags_grammar(tools, fmt)
        assert len(grammar) < 100_000
        assert accepts(ll_tokenizer, grammar, text)
        assert not accepts(ll_tokenizer, grammar, text.replace("fn_77", "fn_128"))
    # names and keys that need escaping in the grammar's string literals
    tools = [{"function": {"name": "wetter.ß\\x", "parameters": {"properties": {'k"ey': {"type": "string"}}}}}]
    text = '<tool_call>\n{"name": "wetter.ß\\\\x", "arguments": {"k\\"ey": "v"}}\n</tool_call>'
    assert accepts(ll_tokenizer, tags_grammar(tools, "hermes"), text)
    parsed = ToolCallParser("hermes").parse(text, tools)
    assert parsed.tool_calls[0]["function"]["name"] == "wetter.ß\\x"
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {'k"ey': "v"}
    text = '<tool_call>\n<function=wetter.ß\\x>\n<parameter=k"ey>\nv\n</parameter>\n</function>\n</tool_call>'
    assert accepts(ll_tokenizer, tags_grammar(tools, "qwen3_coder"), text)


def test_grammar_errors():
    with pytest.raises(ValueError, match="not among the tools"):
        tags_grammar(GRAMMAR_TOOLS, "hermes", function="nope")
    with pytest.raises(ValueError, match="at least one tool"):
        tags_grammar([], "hermes")
    with pytest.raises(ValueError, match="no tool-call grammar"):
        tags_grammar(GRAMMAR_TOOLS, "pythonic")
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a>b": {}}}}}]
    with pytest.raises(ValueError, match="parameter name"):
        tags_grammar(bad, "qwen3_coder")
    tags_grammar(bad, "hermes")  # JSON keys can be anything
    with pytest.raises(ValueError, match="function name"):
        tags_grammar([{"function": {"name": "a b"}}], "hermes")


# ---------------------------------------------------------------- request checks

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"tools": {"f": 1}}, "tools", "array"),
        ({"tools": ["f"]}, "tools", r"tools\[0\] must be an object"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools", "only 'function'"),
        ({"tools": [{"type": "function"}]}, "tools", r"tools\[0\].function must be an object"),
        ({"tools": [{"function": {"name": ""}}]}, "tools", "non-empty string"),
        ({"tools": [{"function": {"name": 3}}]}, "tools", "non-empty string"),
        ({"tools": [{"function": {"name": "get weather"}}]}, "tools", "not a valid function name"),
        ({"tools": [{"function": {"name": "f", "description": 1}}]}, "tools", "description"),
        ({"tools": [{"function": {"name": "f", "strict": "yes"}}]}, "tools", "strict"),
        ({"tools": [{"function": {"name": "f", "parameters": []}}]}, "tools", "JSON schema object"),
        ({"tools": [{"function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools", "must be 'object'"),
        ({"tools": [{"function": {"name": "f", "parameters": {"properties": []}}}]}, "tools", "properties"),
        ({"tools": [{"function": {"name": "f", "parameters": {"properties": {"a": 1}}}}]}, "tools", "properties"),
        ({"tools": [{"function": {"name": "f", "parameters": {"required": "a"}}}]}, "tools", "required"),
        ({"tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
        ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "`tools` must be set"),
        ({"tools": [TOOL], "tool_choice": "any"}, "tool_choice", "Invalid value for `tool_choice`"),
        ({"tools": [TOOL], "tool_choice": 3}, "tool_choice", "Invalid value for `tool_choice`"),
        ({"tools": [TOOL], "tool_choice": {"type": "custom"}}, "tool_choice", "type must be 'function'"),
        ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice", "function must be an object"),
        ({"tools": [TOOL], "tool_choice": {"function": {"name": ""}}}, "tool_choice", "non-empty string"),
        ({"tools": [TOOL], "tool_choice": {"function": {"name": "g"}}}, "tool_choice", "does not match any"),
        ({"tools": [TOOL], "parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
    ],
)
def test_tool_request_errors(body, param, message):
    with pytest.raises(ToolRequestError, match=message) as err:
        parse_tool_request(body, auto_tool_choice=True)
    assert err.value.param == param and isinstance(err.value, ValueError)


def test_tool_request_choices():
    assert parse_tool_request({}).choice == "none"
    assert parse_tool_request({"tools": []}).choice == "none"
    req = parse_tool_request({"tools": [TOOL]}, auto_tool_choice=True)
    assert (req.choice, req.parses_calls, req.grammar_needed, req.parallel) == ("auto", True, False, True)
    assert parse_tool_request({"tools": [TOOL], "tool_choice": None}, auto_tool_choice=True).choice == "auto"
    assert parse_tool_request({"tools": [TOOL], "tool_choice": "none"}).choice == "none"
    assert parse_tool_request({"tool_choice": "none"}).choice == "none"
    assert parse_tool_request({"tools": [], "tool_choice": "required"}).choice == "none"  # vLLM, after OpenAI
    req = parse_tool_request({"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False})
    assert (req.choice, req.grammar_needed, req.parallel) == ("required", True, False)
    assert req.grammar("hermes") == tool_choice_grammar([TOOL], "hermes", parallel=False)
    req = parse_tool_request({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert (req.choice, req.function) == ("function", "f")
    assert req.grammar("qwen3_coder") == tool_choice_grammar([TOOL], "qwen3_coder", "f")
    assert parse_tool_request({"tools": [TOOL]}, auto_tool_choice=True).grammar("hermes") is None
    assert parse_tool_request({"tools": [TOOL], "tool_choice": {"function": {"name": "f"}}}).function == "f"
    for body in ({"tools": [TOOL]}, {"tools": [TOOL], "tool_choice": "auto"}):  # auto needs the server flags
        with pytest.raises(ToolRequestError, match="enable-auto-tool-choice") as err:
            parse_tool_request(body)
        assert err.value.param == "tool_choice"


def test_finish_reason():
    auto = parse_tool_request({"tools": [TOOL]}, auto_tool_choice=True)
    required = parse_tool_request({"tools": [TOOL], "tool_choice": "required"})
    named = parse_tool_request({"tools": [TOOL], "tool_choice": {"function": {"name": "f"}}})
    assert finish_reason("stop", auto, True) == "tool_calls"
    assert finish_reason("stop", required, True) == "tool_calls"
    assert finish_reason("stop", named, True) == "tool_calls"  # issue 24: a named function too (vLLM: "stop")
    assert finish_reason("length", auto, True) == "length"
    assert finish_reason("stop", auto, False) == "stop"
    assert finish_reason(None, None, False) == "stop"

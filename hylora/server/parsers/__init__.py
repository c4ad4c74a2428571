"""Output parsers of the OpenAI server, as vLLM's `--reasoning-parser` and `--tool-call-parser`,
plus the grammars that enforce `tool_choice` and the checks of the request's tool fields.

- reasoning.py: `<think>…</think>` → reasoning / content (qwen3, deepseek_r1), whole or streamed;
  when the reasoning ends, on text and on token ids.
- tool_calls/: tool calls in the model's format (qwen3_coder XML, hermes JSON) → OpenAI `tool_calls`,
  whole or as streamed deltas.
- grammar.py: Lark grammars for `tool_choice` "required" / a named function.
- tool_request.py: `tools` / `tool_choice` validation (ToolRequestError → 400) and `finish_reason`.

Pure text in, text out: no tokenizer, model or server state here. One choice, streamed:

    tools = parse_tool_request(body, auto_tool_choice=args.enable_auto_tool_choice)  # 400 on ToolRequestError
    grammar = tools.grammar("qwen3_coder")          # Lark for hylora/structured, or None
    rs = ReasoningParser("qwen3").stream(prompt_text, chat_template_kwargs.get("enable_thinking"))
    ts = ToolCallParser("qwen3_coder").stream(tools.tools) if tools.parses_calls else None
    for delta in text_deltas:
        r = rs.feed(delta)                          # r.reasoning → delta.reasoning_content
        t = ts.feed(r.content) if ts else None      # t.content → delta.content, t.tool_calls → delta.tool_calls
    r = rs.finish(); then ts.feed(r.content), ts.finish()
    finish_reason(engine_reason, tools, ts.called)
"""

from hylora.server.parsers.grammar import GRAMMAR_FORMATS, tool_choice_grammar
from hylora.server.parsers.reasoning import (
    REASONING_PARSERS,
    ReasoningEndDetector,
    ReasoningParser,
    ReasoningStream,
    Split,
    SplitDelta,
    prompt_reasoning_state,
    reasoning_ended,
    think_end_ids,
)
from hylora.server.parsers.tool_calls import (
    TOOL_CALL_PARSERS,
    ParsedToolCalls,
    ToolCallDelta,
    ToolCallParser,
    ToolCallStream,
)
from hylora.server.parsers.tool_request import ToolRequest, ToolRequestError, finish_reason, parse_tool_request

__all__ = [
    "GRAMMAR_FORMATS",
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "ParsedToolCalls",
    "ReasoningEndDetector",
    "ReasoningParser",
    "ReasoningStream",
    "Split",
    "SplitDelta",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolCallStream",
    "ToolRequest",
    "ToolRequestError",
    "finish_reason",
    "parse_tool_request",
    "prompt_reasoning_state",
    "reasoning_ended",
    "think_end_ids",
    "tool_choice_grammar",
]

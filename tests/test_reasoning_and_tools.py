"""Issue 24: Qwen3.5 / 3.6 served as its recipes serve it — the thinking split (`--reasoning-parser
qwen3`), tool calls (`--enable-auto-tool-choice --tool-call-parser`), `tool_choice` enforced by the
grammar engine — through the official `openai` client, end to end on models whose greedy output is
known (tests/scripted_model.py) and on the random demo model where the grammar alone decides."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from hylora.tokenizer import chat_prompt, load_tokenizer, render_chat
from tests.scripted_model import write_scripted_model
from tests.server_helpers import running_server

# The generation prompt ends "<think>" "\n" (thinking on) or "</think>" "\n" "\n" (off): "\n" either way.
THINKER = ["\n", "The", " relic", " is", " bronze", "</think>", " jade", ".", "<|im_end|>"]
CALL_TAGS = ("<function=find_relic>", "<parameter=site>", "</parameter>", "</function>")
CALLER = ["\n", "</think>", "<tool_call>", *CALL_TAGS[:2], "t", "omb", *CALL_TAGS[2:], "</tool_call>", "<|im_end|>"]
FIND_RELIC = {
    "type": "function",
    "function": {
        "name": "find_relic",
        "description": "Where a relic was found",
        "parameters": {"type": "object", "properties": {"site": {"type": "string"}}, "required": ["site"]},
    },
}
COUNT = {
    "type": "function",
    "function": {
        "name": "count_chambers",
        "parameters": {
            "type": "object",
            "properties": {
                "site": {"enum": ["tomb", "palace"]},
                "floors": {"type": "integer", "minimum": 1, "maximum": 9},
                "vaulted": {"type": "boolean"},
            },
            "required": ["site", "floors"],
        },
    },
}
ASK = [{"role": "user", "content": "Where was the relic found?"}]


def serve(model_dir, flags, cache, tmp_path_factory):
    args = [str(model_dir), "--device", "cpu", "--dtype", "float32", "--max-model-len", "1024", *flags]
    return running_server(args, cache, tmp_path_factory.mktemp("logs") / "server.log")


@pytest.fixture(scope="module")
def thinker(demo_dir, demo_cache_dir, tmp_path_factory):
    model = write_scripted_model(demo_dir, tmp_path_factory.mktemp("thinker") / "m", THINKER)
    with serve(model, ["--served-model-name", "thinker", "--reasoning-parser", "qwen3"], demo_cache_dir,
               tmp_path_factory) as handle:  # fmt: skip
        yield openai.OpenAI(base_url=f"{handle.url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def caller(demo_dir, demo_cache_dir, tmp_path_factory):
    model = write_scripted_model(demo_dir, tmp_path_factory.mktemp("caller") / "m", CALLER, CALL_TAGS)
    flags = ["--served-model-name", "caller", "--reasoning-parser", "qwen3", "--enable-auto-tool-choice"]
    with serve(model, [*flags, "--tool-call-parser", "qwen3_coder"], demo_cache_dir, tmp_path_factory) as handle:
        yield openai.OpenAI(base_url=f"{handle.url}/v1", api_key="x", max_retries=0, timeout=120)


def streamed(stream) -> dict:
    """A streamed choice put back together: reasoning, content, tool calls (by index), finish."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None, "chunks": 0}
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            out["chunks"] += 1
            out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
            out["content"] += delta.content or ""
            for call in delta.tool_calls or []:
                entry = out["calls"].setdefault(call.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = call.id or entry["id"]
                if call.function is not None:
                    entry["name"] = call.function.name or entry["name"]
                    entry["arguments"] += call.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out


# --- reasoning -------------------------------------------------------------------------------------


def test_thinking_on_splits_reasoning_from_content(thinker):
    reply = thinker.chat.completions.create(model="thinker", messages=ASK, max_tokens=20, temperature=0)
    message = reply.choices[0].message
    assert message.reasoning_content == "The relic is bronze" and message.content == " jade."
    assert message.model_extra["reasoning"] == "The relic is bronze"  # vLLM's newer name too
    assert reply.choices[0].finish_reason == "stop"
    parts = streamed(thinker.chat.completions.create(model="thinker", messages=ASK, max_tokens=20, stream=True))
    assert (parts["reasoning"], parts["content"], parts["finish"]) == ("The relic is bronze", " jade.", "stop")


def test_include_reasoning_false_leaves_the_reasoning_out(thinker):
    """vLLM's include_reasoning: false: the model still thinks (the usage counts those tokens), the answer is
    the content alone, whole and streamed."""
    extra = {"include_reasoning": False}
    reply = thinker.chat.completions.create(model="thinker", messages=ASK, max_tokens=20, extra_body=extra)
    message = reply.choices[0].message
    assert message.content == " jade." and message.reasoning_content is None
    assert message.model_extra["reasoning"] is None
    assert reply.usage.completion_tokens == len(THINKER) - 1  # all but <|im_end|>, the reasoning included
    parts = streamed(
        thinker.chat.completions.create(model="thinker", messages=ASK, max_tokens=20, stream=True, extra_body=extra)
    )
    assert (parts["reasoning"], parts["content"], parts["finish"]) == ("", " jade.", "stop")


def test_thinking_off_is_all_content(thinker):
    kwargs = dict(model="thinker", messages=ASK, max_tokens=20, extra_body={"chat_template_kwargs": {
        "enable_thinking": False}})  # fmt: skip
    message = thinker.chat.completions.create(**kwargs).choices[0].message
    assert message.content == "The relic is bronze</think> jade." and message.reasoning_content is None
    parts = streamed(thinker.chat.completions.create(**kwargs, stream=True))
    assert parts["reasoning"] == "" and parts["content"] == "The relic is bronze</think> jade."


def test_structured_output_constrains_the_answer_not_the_reasoning(thinker):
    schema = {"type": "object", "properties": {"material": {"enum": ["bronze", "jade"]}}, "required": ["material"],
              "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "relic", "schema": schema}}
    for stream in (False, True):
        kwargs = dict(model="thinker", messages=ASK, max_tokens=40, temperature=0, response_format=fmt)
        if stream:
            parts = streamed(thinker.chat.completions.create(**kwargs, stream=True))
            reasoning, content = parts["reasoning"], parts["content"]
        else:
            message = thinker.chat.completions.create(**kwargs).choices[0].message
            reasoning, content = message.reasoning_content, message.content
        assert reasoning == "The relic is bronze"  # free: the script, untouched by the grammar
        jsonschema.validate(json.loads(content), schema)  # the answer: forced into the schema


def test_default_chat_template_kwargs_turn_thinking_off(demo_dir, demo_cache_dir, tmp_path_factory):
    model = write_scripted_model(demo_dir, tmp_path_factory.mktemp("thinker-off") / "m", THINKER)
    flags = ["--reasoning-parser", "qwen3", "--default-chat-template-kwargs", '{"enable_thinking": false}']
    with serve(model, flags, demo_cache_dir, tmp_path_factory) as handle:
        client = openai.OpenAI(base_url=f"{handle.url}/v1", api_key="x", max_retries=0, timeout=120)
        message = client.chat.completions.create(model=str(model), messages=ASK, max_tokens=20).choices[0].message
        assert message.content == "The relic is bronze</think> jade." and message.reasoning_content is None
        on = {"chat_template_kwargs": {"enable_thinking": True}}  # a request's own value wins
        message = client.chat.completions.create(model=str(model), messages=ASK, max_tokens=20, extra_body=on)
        assert message.choices[0].message.reasoning_content == "The relic is bronze"


# --- tool calls ------------------------------------------------------------------------------------


def test_auto_tool_call_non_streaming_and_streaming(caller):
    reply = caller.chat.completions.create(model="caller", messages=ASK, tools=[FIND_RELIC], max_tokens=30)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "find_relic" and json.loads(call.function.arguments) == {"site": "tomb"}
    parts = streamed(caller.chat.completions.create(model="caller", messages=ASK, tools=[FIND_RELIC], stream=True))
    assert parts["finish"] == "tool_calls" and parts["content"] == "" and list(parts["calls"]) == [0]
    streamed_call = parts["calls"][0]
    assert streamed_call["name"] == "find_relic" and streamed_call["id"].startswith("call_")
    assert json.loads(streamed_call["arguments"]) == {"site": "tomb"}


def test_tool_choice_none_leaves_the_text_alone(caller):
    reply = caller.chat.completions.create(
        model="caller", messages=ASK, tools=[FIND_RELIC], tool_choice="none", max_tokens=30
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content.startswith("<tool_call><function=find_relic>")


def test_history_with_tool_calls_and_results_renders_and_answers(caller):
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "find_relic", "arguments": '{"site": "tomb"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "north chamber"},
        {"role": "user", "content": "And now?"},
    ]  # fmt: skip
    reply = caller.chat.completions.create(model="caller", messages=history, tools=[FIND_RELIC], max_tokens=30)
    assert reply.choices[0].finish_reason == "tool_calls"
    bad = [*history[:1], {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f",
            "arguments": "{not json"}}]}]  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="not valid JSON"):
        caller.chat.completions.create(model="caller", messages=bad, max_tokens=5)


def test_the_template_renders_tools_calls_and_results(demo_dir):
    tok = load_tokenizer(demo_dir)
    messages = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "find_relic", "arguments": {"site": "tomb"}}}]},
        {"role": "tool", "content": "north chamber"},
    ]  # fmt: skip
    text = tok.decode(chat_prompt(tok, messages, tools=[FIND_RELIC]))
    assert "<tools>" in text and '"name": "find_relic"' in text
    assert "<tool_call>\n<function=find_relic>\n<parameter=site>\ntomb\n</parameter>" in text
    assert "<tool_response>\nnorth chamber\n</tool_response>" in text


@pytest.mark.parametrize("parser", ["qwen3_coder", "hermes"])
def test_required_and_named_tool_choice_are_enforced_by_the_grammar(demo_dir, demo_cache_dir, tmp_path_factory, parser):
    """The random demo model under the grammar: every call is well formed, names a given function and
    its arguments validate against that function's schema; finish_reason "tool_calls"."""
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", parser, "--max-num-seqs", "8"]
    with serve(demo_dir, flags, demo_cache_dir, tmp_path_factory) as handle:
        client = openai.OpenAI(base_url=f"{handle.url}/v1", api_key="x", max_retries=0, timeout=120)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (FIND_RELIC, COUNT)}
        choices = [
            ("required", None),
            ({"type": "function", "function": {"name": "count_chambers"}}, "count_chambers"),
        ]
        for tool_choice, only in choices:
            for seed in range(3):
                reply = client.chat.completions.create(
                    model=str(demo_dir), messages=ASK, tools=[COUNT, FIND_RELIC] if only else [COUNT],
                    tool_choice=tool_choice, max_tokens=200, temperature=1.0, seed=seed,
                    parallel_tool_calls=False,  # one call: a random model would otherwise call on and on
                )  # fmt: skip
                choice = reply.choices[0]
                assert choice.finish_reason == "tool_calls", (parser, tool_choice, choice)
                assert choice.message.tool_calls
                for call in choice.message.tool_calls:
                    assert call.function.name == (only or "count_chambers")
                    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            client.chat.completions.create(
                model=str(demo_dir), messages=ASK, tools=[COUNT], max_tokens=5,
                tool_choice={"type": "function", "function": {"name": "nope"}},
            )  # fmt: skip


# An agent loop: the assistant turn that called a tool, sent back with its reasoning (Qwen3.6 is trained
# to read it there: its template shows the reasoning of the turns after the last user message).
AGENT_REASONING = "The site list names the tomb first."
CALL_1 = {"id": "call_1", "type": "function", "function": {"name": "find_relic", "arguments": '{"site": "tomb"}'}}


def _agent_turns(**reasoning) -> list[dict]:
    return [*ASK, {"role": "assistant", "content": None, "tool_calls": [CALL_1], **reasoning},
            {"role": "tool", "tool_call_id": "call_1", "content": "north chamber"}]  # fmt: skip


def _tokenize(client: openai.OpenAI, body: dict) -> httpx.Response:
    return httpx.post(str(client.base_url).removesuffix("/v1/") + "/tokenize", json=body, timeout=30)


def _rendered(client: openai.OpenAI, body: dict) -> str:
    """The prompt the server renders for a chat body, as text (its model's own tokenizer decodes it)."""
    tokens = _tokenize(client, body)
    assert tokens.status_code == 200, tokens.text
    url = str(client.base_url).removesuffix("/v1/") + "/detokenize"
    return httpx.post(url, json={"tokens": tokens.json()["tokens"]}, timeout=30).json()["prompt"]


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_an_agent_turns_reasoning_is_in_its_think_block(caller, demo_dir, field):
    """`reasoning` (vLLM >= 0.20's name) or `reasoning_content` (what hylora answers, and what clients
    send back) on an earlier assistant turn: the prompt is the chat template's with that reasoning,
    not the empty think block it had when hylora dropped the field."""
    got = _rendered(caller, {"messages": _agent_turns(**{field: AGENT_REASONING}), "tools": [FIND_RELIC]})
    as_template = _agent_turns(reasoning_content=AGENT_REASONING)
    as_template[1]["tool_calls"] = [{**CALL_1, "function": {"name": "find_relic", "arguments": {"site": "tomb"}}}]
    assert got == render_chat(load_tokenizer(demo_dir), as_template, tools=[FIND_RELIC])
    assert f"<|im_start|>assistant\n<think>\n{AGENT_REASONING}\n</think>\n\n\n<tool_call>" in got
    without = _rendered(caller, {"messages": _agent_turns(), "tools": [FIND_RELIC]})
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\n\n<tool_call>" in without
    reply = caller.chat.completions.create(
        model="caller", messages=_agent_turns(**{field: AGENT_REASONING}), tools=[FIND_RELIC], max_tokens=30
    )
    counted = _tokenize(caller, {"messages": _agent_turns(**{field: AGENT_REASONING}), "tools": [FIND_RELIC]})
    assert reply.usage.prompt_tokens == counted.json()["count"] and reply.choices[0].finish_reason == "tool_calls"


def test_an_answer_sent_back_keeps_its_reasoning_where_the_template_asks(thinker):
    """The message a thinking answer gives (reasoning and reasoning_content alike) goes back as history
    unchanged: its reasoning is dropped before a later user message, as Qwen's template does, and kept
    with chat_template_kwargs {"preserve_thinking": true}."""
    answer = thinker.chat.completions.create(model="thinker", messages=ASK, max_tokens=20).choices[0].message
    sent_back = answer.model_dump(exclude_none=True)
    assert sent_back["reasoning_content"] == sent_back["reasoning"] == "The relic is bronze"
    history = [*ASK, sent_back, {"role": "user", "content": "Why jade?"}]
    dropped = _rendered(thinker, {"messages": history})
    kept = _rendered(thinker, {"messages": history, "chat_template_kwargs": {"preserve_thinking": True}})
    assert "The relic is bronze" not in dropped and "<|im_start|>assistant\n jade." in dropped
    assert "<|im_start|>assistant\n<think>\nThe relic is bronze\n</think>\n\n jade." in kept


def test_two_different_reasonings_on_one_turn_are_a_400_and_serving_goes_on(caller):
    turns = _agent_turns(reasoning=AGENT_REASONING, reasoning_content="Something else.")
    with pytest.raises(openai.BadRequestError, match="reasoning and reasoning_content") as refused:
        caller.chat.completions.create(model="caller", messages=turns, max_tokens=5)
    assert refused.value.body["param"].startswith("messages.1")
    huge = _agent_turns(reasoning="x" * 2_000_000)  # counted with the prompt's characters before tokenising
    with pytest.raises(openai.BadRequestError, match="characters"):
        caller.chat.completions.create(model="caller", messages=huge, max_tokens=5)
    assert caller.chat.completions.create(model="caller", messages=ASK, max_tokens=30).choices[0].finish_reason
